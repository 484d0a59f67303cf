"""Data-parallel routing: which engine core gets a request.

Each core has its own radix prefix cache, so a request runs fastest on the core that already
holds the longest prefix of its prompt. The API process cannot see the cores' caches; it keeps
an approximate index of what it routed to each: the page-aligned prefixes of every prompt sent
there, as a chain of hashes (page i's key hashes page i-1's key with page i's tokens, so a key
stands for the whole prefix: a path in a token trie), bounded per core with LRU eviction, as
the cores' caches evict too.

The rule: send the request where it would finish first, in prefill tokens. A core's wait is
the prompt tokens routed there that have not produced their first token yet (queued and
running prefill) plus `request_cost_tokens` for each request in flight there (each running
request lengthens every step a newcomer shares with it); the request adds its own prompt less
the prefix that core holds. So a chat template's page or two is worth less than one request
fewer in flight, and the work spreads over the cores, while a long shared system prompt
(thousands of tokens it need not compute again) keeps its requests on the core that holds it
until that core's queue is longer than the prompt. Ties go to the core with fewer in flight,
then take turns (requests that arrive one after another on an idle server alternate instead of
all landing on the first core).
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


# What one request in flight adds to a core's wait, in prefill tokens: four pages, so a
# template-sized prefix never outweighs a request fewer in flight.
REQUEST_COST_TOKENS = 64


class PrefixRouter:
    def __init__(self, num_cores: int, page_size: int, max_pages_per_core: int = 1 << 18,
                 request_cost_tokens: int = REQUEST_COST_TOKENS):
        self.indexes = [PrefixIndex(page_size, max_pages_per_core) for _ in range(num_cores)]
        self.page_size = page_size
        self.request_cost_tokens = request_cost_tokens
        self.next_on_tie = 0  # the core that wins a full tie next (turns go round)

    def route(self, token_ids: Sequence[int], loads: Sequence[int],
              pending_tokens: Sequence[int] | None = None) -> int:
        """Pick a core for this prompt given each core's in-flight requests (and prompt tokens
        routed there not yet computed); remember it."""
        return self.route_request(token_ids, loads, pending_tokens)[0]

    def route_request(self, token_ids: Sequence[int], loads: Sequence[int],
                      pending_tokens: Sequence[int] | None = None) -> tuple[int, int]:
        """route(), and the prompt tokens the chosen core must compute (its cached prefix
        left out): the caller adds them to that core's pending tokens until the first token."""
        if len(self.indexes) == 1:
            return 0, len(token_ids)
        pending = pending_tokens if pending_tokens is not None else [0] * len(loads)
        keys = self.indexes[0].page_keys(token_ids)
        to_compute = [len(token_ids) - index.match(keys) * self.page_size
                      for index in self.indexes]
        finish = [pending[c] + self.request_cost_tokens * loads[c] + to_compute[c]
                  for c in range(len(loads))]
        n = len(loads)
        core = min(range(n), key=lambda c: (finish[c], loads[c], (c - self.next_on_tie) % n))
        self.next_on_tie = (core + 1) % n
        self.indexes[core].insert(keys)
        return core, to_compute[core]
