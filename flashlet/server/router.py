"""Data-parallel routing: which engine core gets a request.

Each core has its own radix prefix cache, so a request runs fastest on the core that already
holds the longest prefix of its prompt. The API process cannot see the cores' caches; it keeps
an approximate index of what it routed to each: the page-aligned prefixes of every prompt sent
there, as a chain of hashes (page i's key hashes page i-1's key with page i's tokens, so a key
stands for the whole prefix: a path in a token trie), bounded per core with LRU eviction, as
the cores' caches evict too. The rule is SGLang's router's: when the cores are unbalanced
(in-flight requests differ by more than `balance_abs` and the busiest has more than
`balance_rel` times the least busy's) send to the least loaded; otherwise to the core with the
longest cached prefix, or the least loaded if none holds any.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class PrefixIndex:
    """The page-aligned prompt prefixes routed to one core (approximate, LRU-bounded)."""

    def __init__(self, page_size: int, max_pages: int):
        self.page_size = page_size
        self.max_pages = max_pages
        self.keys: OrderedDict[int, None] = OrderedDict()

    def page_keys(self, token_ids: Sequence[int]) -> list[int]:
        keys, key, ps = [], 0, self.page_size
        for start in range(0, len(token_ids) - ps + 1, ps):
            key = hash((key, tuple(token_ids[start : start + ps])))
            keys.append(key)
        return keys

    def match(self, keys: list[int]) -> int:
        """How many leading pages of the prefix are here."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for key in keys:  # refreshed (most recently used) or added
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.max_pages:
            self.keys.popitem(last=False)


class PrefixRouter:
    def __init__(self, num_cores: int, page_size: int, max_pages_per_core: int = 1 << 18,
                 balance_abs: int = 32, balance_rel: float = 1.5):
        self.indexes = [PrefixIndex(page_size, max_pages_per_core) for _ in range(num_cores)]
        self.balance_abs, self.balance_rel = balance_abs, balance_rel

    def route(self, token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """Pick a core for this prompt given each core's in-flight requests; remember it."""
        if len(self.indexes) == 1:
            return 0
        keys = self.indexes[0].page_keys(token_ids)
        least = min(range(len(loads)), key=lambda c: loads[c])
        if self.unbalanced(loads):
            core = least
        else:
            matched = [index.match(keys) for index in self.indexes]
            best = max(matched)
            core = least if best == 0 else min(
                (c for c in range(len(loads)) if matched[c] == best), key=lambda c: loads[c])
        self.indexes[core].insert(keys)
        return core

    def unbalanced(self, loads: Sequence[int]) -> bool:
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo
