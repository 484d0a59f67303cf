"""Who runs next. Requests move waiting -> running -> finished. Running requests sit in numbered
decode slots, at most `max_batch_size` of them: a request keeps its slot from admission to
retirement, and the slot number is both its row in every decode batch and its KV cache row."""

from __future__ import annotations

from collections import deque

from .request import Request, RequestStatus


class Scheduler:
    def __init__(self, max_batch_size: int):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.slots: list[Request | None] = [None] * max_batch_size  # who sits in each slot

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Waiting requests start running, first come first served, while a slot is empty."""
        admitted = []
        while self.waiting and None in self.slots:
            request = self.waiting.popleft()
            request.slot = self.slots.index(None)
            self.slots[request.slot] = request
            request.status = RequestStatus.RUNNING
            admitted.append(request)
        self.running.extend(admitted)
        return admitted

    def retire_finished(self) -> None:
        """Requests that finished during the last step leave and empty their slot."""
        for request in [r for r in self.running if r.status is RequestStatus.FINISHED]:
            self.running.remove(request)
            self.slots[request.slot] = None
            request.slot = None
            self.finished.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
