"""Incremental detokenizing with stop strings: token ids in, text safe to emit out.

Stand-in written on branch `serve` against the API the `core` branch provides; on merge, the
`core` version replaces this file.
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    """Decodes a two-offset window (as Hugging Face's TGI does) so that tokenizers which merge
    spaces across tokens give the same text as decoding everything at once; cuts stop strings
    and holds back a tail that could still grow into one."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_sent = 0
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add tokens; returns (new text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        for token in token_ids:
            self.token_ids.append(token)
            self._decode_tail()
        if self.stop:
            found = [i for i in (self.text.find(s, max(self._num_sent - self._holdback, 0))
                                 for s in self.stop) if i >= 0]
            if found:
                self.text = self.text[: min(found)]
                self.stopped = True
                return self._emit(0), True
        return self._emit(self._holdback), False

    def finish(self) -> str:
        """The held-back tail, at the end of a request not stopped by a stop string."""
        return self._emit(0)

    def _decode_tail(self) -> None:
        ids, end = self.token_ids, len(self.token_ids)
        decode = self.tokenizer.decode
        prefix = decode(ids[self._prefix_offset : self._read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(ids[self._prefix_offset : end], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # not a partial UTF-8 char
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, end

    def _emit(self, keep: int) -> str:
        end = max(len(self.text) - keep, 0)
        if end <= self._num_sent:
            return ""
        new, self._num_sent = self.text[self._num_sent : end], end
        return new
