"""Who runs next. Requests move waiting -> running -> finished. Running requests sit in numbered
decode slots, at most `max_batch_size` of them, and their keys and values live in pages of the
paged KV cache: a request is admitted when a slot is empty and enough pages are free for it to
run to completion, takes pages as it grows, and gives slot and pages back when it finishes."""

from __future__ import annotations

from collections import deque

from .kv_cache import PagedKVCache
from .request import Request, RequestStatus


class Scheduler:
    def __init__(self, max_batch_size: int, kv_cache: PagedKVCache):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.slots: list[Request | None] = [None] * max_batch_size  # who sits in each slot
        self.kv_cache = kv_cache

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Waiting requests start running, first come first served, while one fits."""
        admitted = []
        while self.waiting and self.can_admit(self.waiting[0]):
            request = self.waiting.popleft()
            request.slot = self.slots.index(None)
            self.slots[request.slot] = request
            self.kv_cache.reserve(request.slot, len(request.prompt_ids))
            request.status = RequestStatus.RUNNING
            admitted.append(request)
            self.running.append(request)  # its pages to come count as promised from now on
        return admitted

    def can_admit(self, request: Request) -> bool:
        """An empty slot, and free pages for its longest possible sequence on top of the pages
        the running requests may still take (so that decoding never runs out of pages)."""
        promised = sum(self.kv_cache.pages_to_grow(r.slot, max_tokens(r)) for r in self.running)
        needed = self.kv_cache.pages_needed(max_tokens(request))
        return None in self.slots and promised + needed <= len(self.kv_cache.free_pages)

    def reserve_decode_pages(self) -> None:
        """Before a decode step: each running request's newest token needs a place in a page."""
        for request in self.running:
            self.kv_cache.reserve(request.slot, request.num_tokens)

    def retire_finished(self) -> None:
        """Requests that finished during the last step leave, empty their slot, free pages."""
        for request in [r for r in self.running if r.status is RequestStatus.FINISHED]:
            self.running.remove(request)
            self.kv_cache.release(request.slot)
            self.slots[request.slot] = None
            request.slot = None
            self.finished.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


def max_tokens(request: Request) -> int:
    return len(request.prompt_ids) + request.max_new_tokens
