"""IncrementalDetokenizer against the obvious reference: decode everything at once, cut at the
first stop string. A byte-level toy tokenizer makes partial UTF-8 characters and merges easy to
provoke; the demo model's real tokenizer checks the BPE space handling."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashlet.text.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one byte; decode joins the bytes (invalid UTF-8 becomes U+FFFD, like HF)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def reference(tokenizer, ids, stop=(), include_stop=False):
    """The whole text, cut at the stop string that completes first (the smallest end; of two
    ending together, the one that starts first): before it, or after it with include_stop."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    found = [(i + len(s), i) for i, s in ((text.find(s), s) for s in stop) if i >= 0]
    if not found:
        return text, False
    end, at = min(found)
    return text[: end if include_stop else at], True


def run(detok, ids, chunk_sizes):
    """Push ids in chunks; returns (every emitted piece joined, stopped)."""
    pieces, stopped, i = [], False, 0
    for n in chunk_sizes:
        if i >= len(ids):
            break
        new, stopped = detok.push(ids[i : i + n])
        pieces.append(new)
        i += n
        if stopped:
            break
    if not stopped:
        pieces.append(detok.finish())
        stopped = detok.stopped  # a stop string in the text of tokens that ended mid-character
    return "".join(pieces), stopped


def test_streamed_text_equals_one_decode_with_partial_utf8_characters():
    tok = ByteTokenizer()
    ids = tok.encode("héllo → wörld ✓ 你好")
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t])[0] for t in ids]
    assert all("\ufffd" not in p for p in pieces)  # a partial character is never emitted
    assert "".join(pieces) + detok.finish() == detok.text == tok.decode(ids)


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_and_holdback_match_the_reference(seed, include_stop):
    rng = random.Random(seed)
    tok = ByteTokenizer()
    text = "".join(rng.choice("ab c→") for _ in range(rng.randint(1, 40)))
    stop = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(0, 3))]
    ids = tok.encode(text)
    chunks = [rng.randint(1, 4) for _ in range(len(ids))]
    detok = IncrementalDetokenizer(tok, stop, include_stop=include_stop)
    emitted, stopped = run(detok, ids, chunks)
    want, want_stopped = reference(tok, ids, stop, include_stop)
    assert (emitted, stopped) == (want, want_stopped)
    assert detok.text == want


def test_a_tail_that_may_become_a_stop_string_is_held_back():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    assert detok.push(tok.encode("abcST")) == ("ab", False)  # "cST" could still become STOP
    assert detok.push(tok.encode("x")) == ("c", False)  # the last len("STOP") - 1 wait
    assert detok.finish() == "STx"
    assert detok.text == "abcSTx"


def test_stop_string_cuts_the_text_and_drops_the_held_tail():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["END", "xyz"])
    assert detok.push(tok.encode("hello E")) == ("hello", False)
    assert detok.push(tok.encode("ND and more")) == (" ", True)
    assert detok.text == "hello "
    assert detok.push(tok.encode("later")) == ("", True)  # stopped: nothing more


def test_the_earliest_stop_string_wins():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["stop", "ong"])
    text, stopped = detok.push(tok.encode("a long stop"))
    assert stopped and text == detok.text == "a l"


def test_a_request_cut_off_inside_a_character_ends_with_one_decodes_text():
    """Tokens that end inside a UTF-8 character (max_tokens reached mid-character) are held
    while more may come; at the end their text is one decode's (U+FFFD), and a stop string
    in it still cuts the text."""
    tok = ByteTokenizer()
    ids = tok.encode("hé")[:-1]  # "h" and the first byte of "é"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ("h", False) and detok.push(ids[1:]) == ("", False)
    assert detok.finish() == "\ufffd" and detok.text == tok.decode(ids) == "h\ufffd"
    detok = IncrementalDetokenizer(tok, stop=["h\ufffd"], include_stop=False)
    assert detok.push(ids) == ("", False)  # "h" may begin the stop string: held back
    assert detok.finish() == "" and detok.stopped and detok.text == ""


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_real_tokenizer_any_tokens_and_stops_match_the_reference(demo_llm, data):
    """Any token ids of the demo vocabulary (byte tokens that split characters, special
    tokens), pushed in chunks of 1-4, with stop strings cut from the text itself: what is
    emitted is the reference's (one decode, cut at the first stop string to complete)."""
    tok = demo_llm.tokenizer
    ids = data.draw(st.lists(st.one_of(st.integers(0, len(tok) - 1), st.integers(0, 300)),
                             min_size=1, max_size=24), label="ids")
    skip, include = data.draw(st.booleans(), label="skip"), data.draw(st.booleans(), label="include")
    text = tok.decode(ids, skip_special_tokens=skip)
    spans = st.tuples(st.integers(0, max(len(text) - 1, 0)), st.integers(1, 4))
    stop = [text[i:i + n] for i, n in data.draw(st.lists(spans, max_size=3), label="stops")]
    stop = [s for s in stop if s]
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)), label="chunks")

    class Decoder:  # the reference's decode, with this case's skip_special_tokens
        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip)

    detok = IncrementalDetokenizer(tok, stop, skip_special_tokens=skip, include_stop=include)
    assert run(detok, ids, chunks) == reference(Decoder(), ids, stop, include)


def test_real_tokenizer_streaming_equals_one_decode(demo_llm):
    tok = demo_llm.tokenizer
    ids = tok.encode(" Hello,  world! It's   a fine day — isn't it? 12 345")
    detok = IncrementalDetokenizer(tok)
    emitted = "".join(detok.push([t])[0] for t in ids) + detok.finish()
    assert emitted == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped_unless_asked_for(demo_llm):
    tok = demo_llm.tokenizer
    ids = tok.encode("Hi") + [tok.eos_token_id]
    skipped = IncrementalDetokenizer(tok)
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    for d in (skipped, kept):
        d.push(ids)
        d.finish()
    assert skipped.text == "Hi" and kept.text == "Hi" + tok.eos_token


def test_the_rust_decoder_gives_what_the_tokenizer_decode_gives(demo_llm):
    from flashlet.text.detokenizer import rust_decoder

    tok = demo_llm.tokenizer
    backend = rust_decoder(tok)
    assert backend is not None  # SmolLM2's fast tokenizer: the fast path is the one tested
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert backend.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip), ids


REAL_TEXT = " Héllo,  wörld! 日本語のテキスト — isn't it? 12 345 🎉🎉 naïve café"


@pytest.mark.parametrize("seed", range(4))
def test_the_rust_stream_gives_one_decode_in_any_chunks(demo_llm, seed):
    """The DecodeStream path (multi-byte characters split over tokens, tokens pushed in chunks
    of any size) gives what one decode gives."""
    tok = demo_llm.tokenizer
    ids = tok.encode(REAL_TEXT, add_special_tokens=False)
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tok)
    text, _ = run(detok, ids, [rng.randint(1, 4) for _ in ids])
    assert detok._stream is not None  # the Rust stream did the work, start to end
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_the_python_window_takes_over_if_the_rust_stream_fails(demo_llm):
    tok = demo_llm.tokenizer
    ids = tok.encode(REAL_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    stream, calls = detok._stream, []

    class FailingLater:
        def step(self, backend, token_ids):
            calls.append(token_ids)
            if len(calls) > len(ids) // 2:
                raise Exception("DecodeStream: prefix mismatch")
            return stream.step(backend, token_ids)

    detok._stream = FailingLater()
    text, _ = run(detok, ids, [1] * len(ids))
    assert detok._stream is None and len(calls) == len(ids) // 2 + 1
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_the_stop_string_that_completes_first_wins_in_any_chunks():
    """"abcd" with stops "abcd" and "bc": "bc" is whole first, however the bytes arrive (the
    earliest-starting rule gave "" in one push and "a" byte by byte)."""
    tok = ByteTokenizer()
    for include_stop, want in ((False, "a"), (True, "abc")):
        for chunks in ([4], [1, 1, 1, 1], [2, 2], [3, 1]):
            detok = IncrementalDetokenizer(tok, stop=["abcd", "bc"], include_stop=include_stop)
            assert run(detok, tok.encode("abcd"), chunks) == (want, True), chunks
    detok = IncrementalDetokenizer(tok, stop=["END", "xEND"], include_stop=True)
    assert detok.push(tok.encode("hello xEND more")) == ("hello xEND", True)  # ending together: the first start


def test_llm_generate_keeps_the_stop_string_and_special_tokens_when_asked(demo_llm):
    """SamplingParams' include_stop_str_in_output and skip_special_tokens (vLLM's) through
    LLM.generate: the same tokens, the text made as asked."""
    from flashlet import SamplingParams

    prompt = demo_llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    plain = demo_llm.generate([prompt], SamplingParams(max_new_tokens=24))[0]
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in demo_llm.engine.eos_token_ids, plain.text
    kept = demo_llm.generate([prompt], SamplingParams(max_new_tokens=24, skip_special_tokens=False))[0]
    assert kept.token_ids == plain.token_ids
    assert kept.text == plain.text + demo_llm.tokenizer.decode(plain.token_ids[-1:])  # the EOS's text
    word = plain.text.split()[1]  # a stop string inside the reply
    cut = demo_llm.generate([prompt], SamplingParams(max_new_tokens=24, stop=[word]))[0]
    with_stop = demo_llm.generate([prompt], SamplingParams(max_new_tokens=24, stop=[word],
                                                           include_stop_str_in_output=True))[0]
    assert with_stop.text == cut.text + word and with_stop.finish_reason == "stop"
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=1).validate()
