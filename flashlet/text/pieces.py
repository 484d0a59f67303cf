"""Encoding one long text as pieces side by side, to exactly the ids of encoding it whole.

A server tokenizes each prompt before the engine can start on it: a 400-word prompt is the
largest part of a request's fixed cost at one stream, and a single Rust encode call runs on
one thread. A batch call runs its texts on the tokenizers library's own threads (with the GIL
released), so a long text cut into pieces is encoded faster wherever cores are idle, where
the cuts cannot change the ids.

Byte-level BPE tokenizers split text into pre-tokens with a regex first (GPT-2's, Llama 3's,
Qwen2's) and never merge across two pre-tokens. In each of those regexes a space followed by
a letter starts a new pre-token whenever the character before the space is not whitespace, so
a cut just before " " + an ASCII letter that follows a printable ASCII character is a cut
between pre-tokens: the pieces' ids, concatenated, are the whole text's. `PieceEncoder.of`
allows pieces only for a tokenizer of that kind (no normalizer that looks past one character,
a known pre-tokenizer, added tokens that hold no space and strip nothing) that also passes a
check on a sample text; any other tokenizer encodes whole.
"""

from __future__ import annotations

import itertools
import json
import math
import re

from tokenizers import Encoding

# Texts shorter than this are encoded whole: a second thread's start costs more than it saves.
MIN_PIECES_CHARS = 1024
PIECE_CHARS = 512  # about 100 tokens of English a piece
MAX_PIECES = 16
_CUT = re.compile(r"(?<=[!-~]) (?=[A-Za-z])")

# The pre-token regexes whose pre-tokens never span a cut: GPT-2's (what ByteLevel(use_regex=True)
# splits with), and the split regexes (Llama 3's; Qwen2's) used as
# Sequence[Split(regex), ByteLevel(use_regex=False)].
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SPLIT_REGEXES = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LOCAL_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD", "Lowercase")
_SAMPLE = ("The cat's 12,345 dogs\u2014and\tthe 3.5kg  bird?\nYes! naïve café, 日本語 text: "
           "x=y+1; (see below)  end.\n\nAnother line  with   spaces and 'quotes' too. ")


def text_pieces(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` cut at allowed points into pieces of about `piece_chars` (at most MAX_PIECES)."""
    count = min(MAX_PIECES, math.ceil(len(text) / piece_chars))
    if count < 2:
        return [text]
    size = len(text) // count
    cuts, pos = [], size
    while pos < len(text) and len(cuts) < count - 1:
        match = _CUT.search(text, pos)
        if match is None:
            break
        cuts.append(match.start())
        pos = match.start() + size
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


class PieceEncoder:
    """Encodes a text in pieces with one batch call (`rust`: a tokenizers.Tokenizer)."""

    def __init__(self, rust, post_processes: bool):
        self.rust = rust
        self.post_processes = post_processes  # its post-processor adds tokens (a BOS)

    @classmethod
    def of(cls, rust) -> "PieceEncoder | None":
        """A PieceEncoder for this tokenizer, or None where pieces could change its ids."""
        spec = tokenizer_spec(rust)
        if spec is None or not _cuts_are_pre_token_bounds(spec):
            return None
        plain = rust.encode_batch_fast([_SAMPLE], add_special_tokens=False)[0].ids
        special = rust.encode_batch_fast([_SAMPLE], add_special_tokens=True)[0].ids
        encoder = cls(rust, special != plain)
        for add_special_tokens, whole in ((False, plain), (True, special)):
            if encoder.encode(_SAMPLE, add_special_tokens, piece_chars=8) != whole:
                return None
        return encoder

    def encode(self, text: str, add_special_tokens: bool,
               piece_chars: int = PIECE_CHARS) -> list[int]:
        """The ids of `text` (the tokenizer's encode_special_tokens flag set by the caller)."""
        pieces = text_pieces(text, piece_chars)
        encodings = self.rust.encode_batch_fast(pieces, add_special_tokens=False)
        if add_special_tokens and self.post_processes:
            merged = Encoding.merge(encodings, growing_offsets=False)
            return self.rust.post_process(merged, None, True).ids
        return list(itertools.chain.from_iterable(e.ids for e in encodings))


def tokenizer_spec(rust) -> dict | None:
    """The tokenizer's parts as its tokenizer.json says them, or None (no tokenizer, or one that
    cannot say what it is: its caller encodes as before)."""
    try:
        return json.loads(rust.to_str()) if rust is not None else None
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say what it is encodes as before
        return None


def normalizer_types(spec: dict) -> list[str]:
    """The types of the normalizer's steps (a Sequence's, or the one), in order."""
    normalizer = spec.get("normalizer")
    steps = (normalizer.get("normalizers", []) if normalizer and normalizer["type"] == "Sequence"
             else [normalizer] if normalizer else [])
    return [step["type"] for step in steps]


def pre_token_regex(spec: dict) -> tuple[str, bool] | None:
    """The known regex this tokenizer splits pre-tokens with (GPT2_REGEX or one of
    SPLIT_REGEXES) and whether its ByteLevel puts a space before a text (add_prefix_space), or
    None for any other pre-tokenizer."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return ((GPT2_REGEX, bool(pre.get("add_prefix_space"))) if pre.get("use_regex", True)
                else None)
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(parts) != 2:
        return None
    split, byte_level = parts
    regex = split.get("pattern", {}).get("Regex")
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated"
            or split.get("invert") or regex not in SPLIT_REGEXES
            or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)):
        return None
    return regex, bool(byte_level.get("add_prefix_space"))


def _cuts_are_pre_token_bounds(spec: dict) -> bool:
    """Whether the tokenizer's parts keep a cut before " " + an ASCII letter a pre-token bound
    (a space put before the text changes only the first piece, as it does the whole text)."""
    if any(step not in _LOCAL_NORMALIZERS for step in normalizer_types(spec)):
        return False
    if any(" " in t["content"] or t.get("lstrip") or t.get("rstrip")
           for t in spec.get("added_tokens", [])):
        return False
    return pre_token_regex(spec) is not None
