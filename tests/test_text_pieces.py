"""flashlet/text/pieces.py: a long text encoded as pieces side by side gives exactly the ids of
encoding it whole, on the tokenizers that allow it; the others encode whole. And the server's
TextEncoder keeps a long text on the event loop only while that loop serves nothing else."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import threading

import pytest
from tokenizers import Tokenizer

import flashlet.text.pieces as pieces_module
from flashlet.text.pieces import PieceEncoder, text_pieces
from flashlet.text.tokenizing import (IDLE_INLINE_MAX_CHARS, INLINE_MAX_CHARS, TextEncoder,
                                     encode_text, rust_tokenizer)


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    from flashlet.models.weights import load_tokenizer

    return load_tokenizer(demo_model_dir)


def _random_texts(count: int, seed: int = 0) -> list[str]:
    """Texts of every kind of character a cut could meet: punctuation, digits, runs of spaces,
    tabs, newlines, non-ASCII letters and spaces, contractions, special-token strings."""
    rng = random.Random(seed)
    atoms = (list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 ,.;:!?'\"()-/") +
             [" ", "  ", "\n", "\t", "\r\n", "\u00e9", "\u65e5\u672c", "\u2014", "\u00a0",
              "'s", "'ll", " the", " 42", "<|im_end|>", "<|endoftext|>", "\U0001f600"])
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(300, 2500)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def spec(tok) -> dict:
    return json.loads(rust_tokenizer(tok).to_str())


def _with(tok, spec: dict, **parts):
    """A copy of the tokenizer with parts of its tokenizer.json replaced."""
    other = copy.copy(tok)  # the Rust tokenizer is replaced, not shared
    other._tokenizer = Tokenizer.from_str(json.dumps({**spec, **parts}))
    return other


def _check_pieces_match_whole(tok, texts) -> int:
    """Each text's ids in pieces against whole, every flag combination; pieces encoded."""
    pieces = PieceEncoder.of(rust_tokenizer(tok))
    assert pieces is not None
    cut = 0
    for text in texts:
        cut += len(text_pieces(text, 64)) > 1
        for allow_special in (False, True):
            for add_special_tokens in (False, True):
                whole = encode_text(tok, text, allow_special=allow_special,
                                    add_special_tokens=add_special_tokens)
                pieces.rust.encode_special_tokens = not allow_special
                assert pieces.encode(text, add_special_tokens, piece_chars=64) == whole, text
    return cut


def test_pieces_are_cut_only_before_a_space_and_a_letter():
    text = "x" * 100 + " word, 12 34  more\ttext (yes) and a final stretch of words here" * 30
    parts = text_pieces(text, 40)
    assert len(parts) > 1 and "".join(parts) == text
    for part in parts[1:]:
        assert part[0] == " " and part[1].isascii() and part[1].isalpha()
    assert text_pieces("short", 40) == ["short"]


def test_byte_level_pieces_give_the_whole_texts_ids(tok):
    assert _check_pieces_match_whole(tok, _random_texts(40)) == 40  # each was cut somewhere


def test_a_bos_template_is_added_once_around_the_pieces(tok, spec):
    bos = {"type": "TemplateProcessing",
           "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
           "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                "tokens": ["<|endoftext|>"]}}}
    with_bos = _with(tok, spec, post_processor=bos)
    assert PieceEncoder.of(rust_tokenizer(with_bos)).post_processes
    _check_pieces_match_whole(with_bos, _random_texts(10, seed=1))


@pytest.mark.parametrize("regex", pieces_module.SPLIT_REGEXES, ids=["llama3", "qwen2"])
def test_split_regex_pieces_give_the_whole_texts_ids(tok, spec, regex):
    split = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    _check_pieces_match_whole(_with(tok, spec, pre_tokenizer=split), _random_texts(20, seed=2))


@pytest.mark.parametrize("parts", [
    {"normalizer": {"type": "Prepend", "prepend": "\u2581"}},  # SentencePiece-style BPE
    {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"\w+ \w+|\s"},
                       "behavior": "Isolated", "invert": False}},  # spans a cut
    {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                       "use_regex": False}},  # no pre-token bounds at all
])
def test_tokenizers_whose_pieces_could_differ_encode_whole(tok, spec, parts):
    other = _with(tok, spec, **parts)
    assert PieceEncoder.of(rust_tokenizer(other)) is None
    enc = TextEncoder(other, limit_tokens=10**6)
    text = _random_texts(1, seed=3)[0]
    assert not enc.encodes_pieces and enc.encode(text) == encode_text(other, text)
    enc.close()


def test_text_encoder_encodes_a_long_text_in_pieces(tok, monkeypatch):
    enc = TextEncoder(tok, limit_tokens=10**6)
    calls = []
    real = PieceEncoder.encode
    monkeypatch.setattr(PieceEncoder, "encode",
                        lambda self, text, *a, **k: calls.append(text) or real(self, text, *a, **k))
    # (non-ASCII: plain ASCII texts are told by the pre-token cache first, pretoken_cache.py)
    long_text, short_text = "the quick brown caf\u00e9 jumps " * 100, "the quick brown fox"
    assert enc.encode(long_text) == enc.encode(long_text, in_pieces=True) == encode_text(
        tok, long_text)
    assert enc.encode(short_text, in_pieces=True) == encode_text(tok, short_text)
    messages = [{"role": "user", "content": long_text}]
    assert enc.chat(messages, in_pieces=True) == encode_text(tok, tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), allow_special=True,
        add_special_tokens=False)
    assert len(calls) == 2 and calls[0] == long_text  # in pieces when asked, short ones whole
    enc.close()


def test_a_long_text_stays_on_the_loop_only_when_it_serves_nothing_else(tok, monkeypatch):
    """`alone`: encoded on the calling thread, in pieces; else (past INLINE_MAX_CHARS) whole,
    on the pool (its threads' names)."""
    enc = TextEncoder(tok, limit_tokens=10**6)
    threads, in_pieces = [], []
    real_encode = PieceEncoder.encode
    monkeypatch.setattr(PieceEncoder, "encode", lambda self, *a, **k: in_pieces.append(
        threading.current_thread().name) or real_encode(self, *a, **k))
    for name in ("encode", "chat"):
        real = getattr(enc, name)
        setattr(enc, name, lambda *a, _real=real, **k: threads.append(
            threading.current_thread().name) or _real(*a, **k))
    text = "the quick brown caf\u00e9 jumps " * 400  # past INLINE_MAX_CHARS (not ASCII: see above)
    assert INLINE_MAX_CHARS < len(text) <= IDLE_INLINE_MAX_CHARS
    messages = [{"role": "user", "content": text}]

    async def each_way():
        await enc.encode_async(text, alone=True)
        await enc.encode_async(text, alone=False)
        await enc.chat_async(messages, alone=True)
        await enc.chat_async(messages, alone=False)
        return threading.current_thread().name

    loop_thread = asyncio.run(each_way())
    enc.close()
    assert threads[0] == threads[2] == loop_thread
    assert threads[1].startswith("flashlet-tokenize") and threads[3].startswith("flashlet-tokenize")
    assert in_pieces == [loop_thread, loop_thread]
