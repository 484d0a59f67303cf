"""flashlet/text/pretoken_cache.py: a text encoded from cached pre-token ids gives exactly the
Rust encode's ids, on every tokenizer shape it accepts; texts and tokenizers it cannot tell
are refused (None) and encode as before. And the server's TextEncoder uses it."""

from __future__ import annotations

import copy
import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer

import flashlet.text.pretoken_cache as cache_module
from flashlet.text.pieces import SPLIT_REGEXES
from flashlet.text.pretoken_cache import PreTokenCache
from flashlet.text.tokenizing import TextEncoder, chat_ids, encode_text, rust_tokenizer

# Every kind of ASCII pre-token bound: contractions in both cases, digit runs (Llama 3 groups
# three), punctuation runs, runs of spaces, tabs and line ends before words and at the end.
_ATOMS = (list("abcdefghijklmnopqrstuvwxyzABCSTXYZ0123456789 ,.;:!?'\"()-/<>|_~") +
          [" ", "  ", "   ", "\n", "\t", "\r\n", "\r", "'s", "'S", "'ll", "'LL", "'Re", " the",
           " 42", "1234567", "\n\n ", " \n", "\t ", "<|im_end", "|>", "...", "--"])


def _ascii_texts(count: int, seed: int = 0, longest: int = 400) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_ATOMS) for _ in range(rng.randint(1, longest)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    from flashlet.models.weights import load_tokenizer

    return load_tokenizer(demo_model_dir)


@pytest.fixture(scope="module")
def spec(tok) -> dict:
    return json.loads(rust_tokenizer(tok).to_str())


def _rust_with(spec: dict, **parts) -> Tokenizer:
    return Tokenizer.from_str(json.dumps({**spec, **parts}))


def _check_matches_rust(rust, texts) -> int:
    """Each text's cached ids against Rust's, with and without special tokens, the cache warm
    and cold; returns how many texts the cache told."""
    cache = PreTokenCache.of(rust)
    assert cache is not None
    told = 0
    for text in texts:
        for add_special_tokens in (False, True):
            whole = rust.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            for fresh in (cache.like(rust), cache):  # every word missing; then mostly known
                ids = fresh.encode(text, add_special_tokens)
                assert ids is None or ids == whole, repr(text)
                told += ids is not None
    return told


def test_byte_level_cache_gives_the_rust_ids(tok):
    # 600 texts of up to 400 atoms: each atom ~1,300 times, each pair of atoms ~16 times
    texts = _ascii_texts(600)
    assert _check_matches_rust(rust_tokenizer(tok), texts) >= 0.8 * 4 * len(texts)


@pytest.mark.parametrize("regex", SPLIT_REGEXES, ids=["llama3", "qwen2"])
def test_split_regex_cache_gives_the_rust_ids(spec, regex):
    split = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    texts = _ascii_texts(400, seed=1)
    assert _check_matches_rust(_rust_with(spec, pre_tokenizer=split), texts) >= 0.8 * 4 * 400


def test_a_bos_template_is_put_around_the_cached_ids(spec):
    bos = {"type": "TemplateProcessing",
           "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}],
           "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                "tokens": ["<|endoftext|>"]}}}
    rust = _rust_with(spec, post_processor=bos)
    assert PreTokenCache.of(rust).prefix == [0]
    assert _check_matches_rust(rust, _ascii_texts(100, seed=2)) >= 0.8 * 4 * 100


def test_added_tokens_allowed_are_cut_out_as_rust_does(tok):
    """A chat template's text: its special-token strings are those tokens (Rust's
    encode_special_tokens off), between plain text, each other, spaces and line ends."""
    rust = copy.deepcopy(rust_tokenizer(tok))
    rust.encode_special_tokens = False
    cache = PreTokenCache.of(rust)
    rng = random.Random(4)
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>",
                "<|im_start|>user\n", "\n<|im_end|>\n", "<|im_end"]
    for _ in range(600):
        text = "".join(rng.choice(_ATOMS + specials) for _ in range(rng.randint(1, 200)))
        for add_special_tokens in (False, True):
            ids = cache.encode(text, add_special_tokens, allow_special=True)
            whole = rust.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            assert ids == whole, repr(text)
    assert cache.encode("a <|im_end|> b", True) is None  # not allowed: refused, not guessed


def test_normalized_added_tokens_are_cut_out_after_the_others(spec):
    """Rust cuts the added tokens it does not normalize out of the whole text first, then the
    normalized ones out of what is left: "a<|" (normalized) loses to "<|im_end|>" after it."""
    rust = _rust_with(spec)
    rust.add_tokens([AddedToken("a<|", normalized=True, special=False)])
    rust.encode_special_tokens = False
    cache = PreTokenCache.of(rust)
    for text in ["a<|im_end|>", "xa<|y", "<|im_end|>a<|", "a<|a<|im_start|>a<|"]:
        whole = rust.encode_batch_fast([text], add_special_tokens=False)[0].ids
        assert cache.encode(text, False, allow_special=True) == whole, repr(text)


@pytest.mark.parametrize("token", ["\u2488", "\u2474"])  # NFKC: "1.", "(1)"
def test_a_token_made_ascii_by_the_normalizer_is_found_as_rust_finds_it(spec, token):
    rust = _rust_with(spec, normalizer={"type": "NFKC"})
    rust.add_tokens([AddedToken(token, normalized=True, special=False)])
    rust.encode_special_tokens = False
    cache = PreTokenCache.of(rust)
    for text in ["step 1. then (1) and 2.", "x1.y (1)", "no number"]:
        whole = rust.encode_batch_fast([text], add_special_tokens=False)[0].ids
        assert cache.encode(text, False, allow_special=True) == whole, repr(text)
        assert cache.encode(text, False) in (None, whole), repr(text)


def test_texts_it_cannot_tell_are_refused(tok):
    cache = PreTokenCache.of(rust_tokenizer(tok))
    for text in ["caf\u00e9", "a\u00a0b", "x\x0by", "bell\x07", "end <|im_end|> of it",
                 "<|endoftext|>", "\u65e5\u672c"]:
        assert cache.encode(text, True) is None, repr(text)
    assert cache.encode("a <|im_end and |> apart", True) is not None  # only whole strings


@pytest.mark.parametrize("parts", [
    {"normalizer": {"type": "Lowercase"}},  # changes ASCII
    {"normalizer": {"type": "Prepend", "prepend": "\u2581"}},
    {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True}},
    {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"\w+ \w+|\s"},
                       "behavior": "Isolated", "invert": False}},  # a regex it does not know
    {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                       "use_regex": False}},  # no pre-token bounds at all
])
def test_tokenizers_it_cannot_follow_get_no_cache(spec, parts):
    assert PreTokenCache.of(_rust_with(spec, **parts)) is None


def test_bpe_dropout_gets_no_cache(spec):
    model = {**spec["model"], "dropout": 0.5}
    assert PreTokenCache.of(_rust_with(spec, model=model)) is None


def test_a_pre_token_of_no_ids_is_told(spec):
    """A vocabulary without "z" and no unknown token: Rust gives "z" no ids at all."""
    model = {**spec["model"], "byte_fallback": False, "unk_token": None,
             "vocab": {k: v for k, v in spec["model"]["vocab"].items() if "z" not in k},
             "merges": [m for m in spec["model"]["merges"] if "z" not in "".join(m)]}
    rust = _rust_with(spec, model=model)
    cache = PreTokenCache.of(rust)
    for text in ["z a", "z a z", "a zz b"]:
        assert cache.encode(text, False) == rust.encode_batch_fast([text])[0].ids, repr(text)


def test_a_full_cache_starts_over(tok, monkeypatch):
    monkeypatch.setattr(cache_module, "MAX_ENTRIES", 50)
    rust = rust_tokenizer(tok)
    cache = PreTokenCache.of(rust).like(rust)
    for text in _ascii_texts(40, seed=3, longest=60):
        whole = rust.encode_batch_fast([text], add_special_tokens=False)[0].ids
        assert cache.encode(text, False) == whole
        assert len(cache.ids) <= 50 + 60  # never more than one text's words past the bound


def test_text_encoder_encodes_from_the_cache(tok, monkeypatch):
    """The server's encoder: prompts and chat messages give what they gave before (the Rust
    encode), the plain ones told by the cache."""
    enc = TextEncoder(tok, limit_tokens=10**6)
    told = []
    real = PreTokenCache.encode

    def spy(self, text, *args):
        ids = real(self, text, *args)
        if ids is not None:
            told.append(text)
        return ids

    monkeypatch.setattr(PreTokenCache, "encode", spy)
    plain, other = "the quick brown fox jumps over it " * 80, "na\u00efve <|im_end|> text"
    for text in (plain, other):
        assert enc.encode(text) == encode_text(copy.deepcopy(tok), text)
        assert enc.encode(text, in_pieces=True) == encode_text(copy.deepcopy(tok), text)
    assert told == [plain, plain]
    for messages in ([{"role": "user", "content": plain}],  # the template's text: told
                     [{"role": "user", "content": plain}, {"role": "assistant", "content": other}]):
        assert enc.chat(messages) == chat_ids(copy.deepcopy(tok), messages)
    assert tok.apply_chat_template(messages[:1], tokenize=False,
                                   add_generation_prompt=True) in told
    enc.close()


def _one_line_texts(count: int, seed: int) -> list[str]:
    """Words of the atoms without whitespace, one space between them, none at either end."""
    rng = random.Random(seed)
    atoms = [a for a in _ATOMS if a.strip() == a and a]
    return [" ".join("".join(rng.choice(atoms) for _ in range(rng.randint(1, 4)))
                     for _ in range(rng.randint(1, 120))) for _ in range(count)]


@pytest.mark.parametrize("regex", [None, *SPLIT_REGEXES], ids=["gpt2", "llama3", "qwen2"])
def test_one_line_texts_word_by_word_give_the_rust_ids(spec, regex):
    """A one-line text is encoded from its space-separated words' cached ids (no regex): the
    same ids as Rust's, cold (every word new) and warm, for each known pre-token regex."""
    parts = {} if regex is None else {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}}
    rust = _rust_with(spec, **parts)
    texts = _one_line_texts(300, seed=5)
    # (all but those that hold an added token's string, "<|im_end" and "|>" side by side)
    assert _check_matches_rust(rust, texts) >= 0.9 * 4 * len(texts)
    cache = PreTokenCache.of(rust)
    told = [text for text in texts if cache.encode(text, False) is not None]
    assert cache.spaced_ids  # the words were kept, and the texts again come from them
    for text in told:
        whole = rust.encode_batch_fast([text], add_special_tokens=False)[0].ids
        assert cache._spaced_body(text) == whole, repr(text)
