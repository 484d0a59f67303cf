"""Encoding a plain ASCII text from cached pre-token ids, to exactly the ids of the Rust encode.

A byte-level BPE tokenizer splits text into pre-tokens with a regex and encodes each one on its
own: a text's ids are its pre-tokens' ids side by side. The tokenizers library spends most of an
encode call on its bookkeeping (offsets, alignments, the Encoding it builds: ~1.3 us a token on
a 400-word prompt), not on BPE, which it caches; a server's prompts repeat most of their words.
`PreTokenCache` splits a text with Python's `re` and looks each pre-token's ids up in a dict,
encoding the ones it has not seen in one Rust batch call: a word alone costs more there (~13
us) than inside a text (~1-8 us), so a text of mostly unseen words is slower than the Rust
encode (~1.4x for English text on an empty cache, ~1.7x for random letters) until its words
are kept (a stream of English text gains after a few thousand words).

It answers only where that is exactly the Rust result: texts of printable ASCII, tab, newline
and carriage return (where Python's character classes and Oniguruma's agree) that hold none of
the tokenizer's added-token strings, or (a chat template's text) hold them as those tokens,
cut out as Rust cuts them where no added token strips spaces or needs a whole word; on tokenizers
whose normalizer leaves ASCII alone, whose pre-tokenizer is one of the known regexes (GPT-2's,
Llama 3's, Qwen2's) and whose post-processor puts fixed ids around a text; `of` also checks a
sample. Anything else returns None and the caller encodes as before.

A text of words and single spaces (no other whitespace, none at either end: a one-line prompt)
splits into pre-tokens that never cross a space (in every known regex a pre-token holds a
space only as its first character, or in a run of whitespace that such a text never has), so
its ids are each space-separated word's ids (with its space) side by side: those are cached
too, and `str.split` stands in for the regex (a third of a 400-word prompt's encode).
"""

from __future__ import annotations

import re

from flashlet.text.pieces import (GPT2_REGEX, SPLIT_REGEXES, normalizer_types,
                                  pre_token_regex, tokenizer_spec)

# Each known Unicode pre-token regex, over the ASCII characters the cache accepts: \p{L} is
# A-Za-z, \p{N} is 0-9, \s is tab, newline, carriage return and space.
_WS, _NOT_WS = r"[\t\n\r ]", r"[^\t\n\r ]"
_GPT2_ASCII = (r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\t\n\r A-Za-z0-9]+"
               rf"|{_WS}+(?!{_NOT_WS})|{_WS}+")
_ASCII_TWINS = {GPT2_REGEX: _GPT2_ASCII, **{
    unicode: (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|" + digits +
              rf"| ?[^\t\n\r A-Za-z0-9]+[\r\n]*|{_WS}*[\r\n]+|{_WS}+(?!{_NOT_WS})|{_WS}+")
    for unicode, digits in zip(SPLIT_REGEXES, (r"[0-9]{1,3}", r"[0-9]"))}}
_ASCII_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")  # no ASCII character changes under these
_OUTSIDE = re.compile(r"[^\t\n\r -~]").search  # finds a character the cache does not accept
MAX_ENTRIES = 1 << 16  # pre-tokens kept; the cache starts over when full
MAX_WORD_CHARS = 32  # longer pre-tokens (a run of spaces, a long number) are not kept
_SAMPLE = ("The cat's 12,345 dogs--and\tthe 3.5kg  bird?\nYes! NAIVE cafe, I'LL x=y+1; (see "
           "below)   end.\r\n\r\n  Another line  with   spaces,\t\t'quotes' and 1234567 too. ")


class PreTokenCache:
    """A text's ids from its pre-tokens' cached ids (`rust`: a tokenizers.Tokenizer; one
    cache per thread, as its tokenizer copy)."""

    def __init__(self, rust, pattern: str, added: dict[str, int], normalized: frozenset[str],
                 splits_added: bool, prefix: list[int], suffix: list[int]):
        self.rust = rust
        self.split = re.compile(pattern).findall
        self.added = added  # the added tokens' strings and ids
        self.normalized = normalized  # those of them matched after the normalizer
        # their first two characters: one `in` each rules most texts out (Llama 3's 256 all
        # start with "<|"), far cheaper than one regex of them all
        self.added_starts = tuple(sorted({a[:2] for a in added}))
        # ... and one search for any of their first characters rules out nearly every text:
        # the starts' scans took a fifth of a 400-word prompt's encode (SmolLM2's seven)
        firsts = "".join(sorted({re.escape(a[0]) for a in added if a}))
        self.added_first = re.compile(f"[{firsts}]").search if firsts else None
        # Where allowed (a chat template's text), added tokens are cut out as Rust does: first
        # the ones not normalized over the whole text, then the normalized ones in what is left
        # (two passes); in each the leftmost match, the longest there (none of them strips
        # spaces or needs a whole word).
        passes = [sorted((a for a in added if (a in normalized) == second), key=len,
                         reverse=True) for second in (False, True)]
        self.added_passes = ([re.compile(f"({'|'.join(map(re.escape, tokens))})").split
                              for tokens in passes if tokens] if splits_added else [])
        self.splits_added = splits_added
        self.prefix, self.suffix = prefix, suffix  # what add_special_tokens puts around it
        self.ids: dict[str, list[int]] = {}
        # a one-line text's words after a space (the key leaves the space out) -> the ids of
        # the space and the word
        self.spaced_ids: dict[str, list[int]] = {}

    @classmethod
    def of(cls, rust) -> "PreTokenCache | None":
        """A cache for this tokenizer, or None where it could give other ids than Rust's."""
        spec = tokenizer_spec(rust)
        pattern = None if spec is None else _ascii_pattern(spec)
        around = None if pattern is None else _around(rust)
        if around is None:
            return None
        tokens = spec.get("added_tokens", [])
        # each token's string as Rust finds it: a normalized one's after the normalizer (NFKC
        # makes some non-ASCII ones ASCII: "\u2488" is "1.")
        normalize = rust.normalizer.normalize_str if rust.normalizer is not None else str
        found = [(normalize(t["content"]) if t.get("normalized") else t["content"], t)
                 for t in tokens]
        added = {text: t["id"] for text, t in found if text.isascii()}
        normalized = frozenset(text for text, t in found if text.isascii() and t.get("normalized"))
        splits_added = not any(t.get("lstrip") or t.get("rstrip") or t.get("single_word")
                               for t in tokens)
        cache = cls(rust, pattern, added, normalized, splits_added, *around)
        return cache if cache._matches_rust() else None

    def _matches_rust(self) -> bool:
        """Whether it gives Rust's ids for a sample text, plain and (where allowed) with the
        added tokens in it; the Rust tokenizer's encode_special_tokens flag is left as found."""
        flag = self.rust.encode_special_tokens
        try:
            self.rust.encode_special_tokens = False
            samples = [(_SAMPLE, False)] + [(a.join([_SAMPLE, "x", " "]), True)
                                             for a in self.added if self.splits_added][:4]
            for text, allow_special in samples:
                for add_special_tokens in (False, True):
                    whole = self.rust.encode_batch_fast(
                        [text], add_special_tokens=add_special_tokens)[0].ids
                    if self.encode(text, add_special_tokens, allow_special) != whole:
                        return False
            return True
        finally:
            self.rust.encode_special_tokens = flag

    def like(self, rust) -> "PreTokenCache":
        """One like this (checked) over another copy of the same tokenizer, with its own ids."""
        return PreTokenCache(rust, self.split.__self__.pattern, self.added, self.normalized,
                             self.splits_added, self.prefix, self.suffix)

    def encode(self, text: str, add_special_tokens: bool,
               allow_special: bool = False) -> list[int] | None:
        """The ids of `text`, or None where the cache cannot tell them. `allow_special`: the
        added tokens' strings in it are those tokens (else a text holding one is refused)."""
        printable = text.isascii() and text.isprintable()  # (no tab or line end either)
        if not printable and (not text.isascii() or _OUTSIDE(text)):
            return None
        if not self._holds_added(text):
            body = (self._spaced_body(text) if printable and _one_line(text)
                    else self._body(text))
        elif allow_special and self.added_passes:
            body = self._body_with_added(text)
        else:
            return None
        if body is None:
            return None
        return self.prefix + body + self.suffix if add_special_tokens else body

    def _body(self, text: str) -> list[int] | None:
        """The ids of a text that holds no added token's string."""
        words = self.split(text)
        ids = self.ids
        body: list[int] = []
        try:
            for word in words:
                body += ids[word]
        except KeyError:
            return self._encode_missing(words)
        return body

    def _spaced_body(self, text: str) -> list[int] | None:
        """The ids of a text of words with one space between them (no other whitespace, none
        at either end) that holds no added token's string: each word's ids, the words after
        the first with their space, cached as a whole."""
        first, *words = text.split(" ")
        body = self._body(first)
        if body is None:
            return None
        spaced = self.spaced_ids
        try:
            for word in words:
                body += spaced[word]
        except KeyError:
            return self._spaced_missing(text, words)
        return body

    def _spaced_missing(self, text: str, words: list[str]) -> list[int] | None:
        """_spaced_body where some words are not cached: the regex's way (the pre-tokens not
        cached encoded by Rust in one call), then the words' ids kept from the pre-tokens'."""
        body = self._body(text)
        if body is not None:
            spaced = self.spaced_ids
            missing = [w for w in dict.fromkeys(words) if w not in spaced]
            if len(spaced) + len(missing) > MAX_ENTRIES:
                spaced.clear()
            for word in missing:
                if len(word) < MAX_WORD_CHARS:  # its pre-tokens are all cached now
                    ids = self._body(" " + word)
                    if ids is not None:
                        spaced[word] = ids
        return body

    def _body_with_added(self, text: str, pass_: int = 0) -> list[int] | None:
        """The ids of a text with the added tokens' strings in it taken as those tokens (those
        of the passes from `pass_` on)."""
        if pass_ == len(self.added_passes):
            return self._body(text)
        body: list[int] = []
        for i, part in enumerate(self.added_passes[pass_](text)):
            if i % 2:  # odd parts: an added token
                body.append(self.added[part])
            elif part:
                ids = self._body_with_added(part, pass_ + 1)
                if ids is None:
                    return None
                body += ids
        return body

    def _holds_added(self, text: str) -> bool:
        return (self.added_first is not None and self.added_first(text) is not None
                and any(start in text for start in self.added_starts)
                and any(added in text for added in self.added))

    def _encode_missing(self, words: list[str]) -> list[int] | None:
        """The words' ids, the ones not cached encoded by Rust in one call (and kept)."""
        missing = [w for w in dict.fromkeys(words) if w not in self.ids]
        if any(self.split(w) != [w] for w in missing):  # Rust would split it again alone
            return None
        fresh = dict(zip(missing, (e.ids for e in self.rust.encode_batch_fast(
            missing, add_special_tokens=False))))
        body: list[int] = []
        for word in words:
            body += fresh[word] if word in fresh else self.ids[word]  # (ids may be [])
        if len(self.ids) + len(fresh) > MAX_ENTRIES:
            self.ids.clear()
        self.ids.update((w, ids) for w, ids in fresh.items() if len(w) <= MAX_WORD_CHARS)
        return body


def _one_line(text: str) -> bool:
    """A printable text whose words are split by single spaces, none at either end."""
    return "  " not in text and text[:1] != " " and text[-1:] != " "


def _ascii_pattern(spec: dict) -> str | None:
    """The Python regex that splits ASCII text as this tokenizer does, or None."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return None
    if any(step not in _ASCII_NORMALIZERS for step in normalizer_types(spec)):
        return None
    found = pre_token_regex(spec)
    if found is None or found[1]:  # (a space put before the text: not followed)
        return None
    return _ASCII_TWINS[found[0]]


def _around(rust) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after any text (a BOS), or None where
    they are not the same around each text."""
    found = set()
    for text in (_SAMPLE, "Hello"):
        plain = rust.encode_batch_fast([text], add_special_tokens=False)[0].ids
        special = rust.encode_batch_fast([text], add_special_tokens=True)[0].ids
        extra = len(special) - len(plain)
        starts = [i for i in range(extra + 1) if special[i:i + len(plain)] == plain]
        if extra < 0 or len(starts) != 1:
            return None
        found.add((tuple(special[:starts[0]]), tuple(special[starts[0] + len(plain):])))
    if len(found) != 1:
        return None
    prefix, suffix = found.pop()
    return list(prefix), list(suffix)
