"""Who runs next. Requests move waiting -> running -> finished. At most `max_batch_size` run at
once, one per KV cache row: a waiting request is admitted as soon as a row is free, and a
finished one gives its row back at once."""

from __future__ import annotations

from collections import deque

from .request import Request, RequestStatus


class Scheduler:
    def __init__(self, max_batch_size: int):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.free_rows: list[int] = list(range(max_batch_size))  # KV cache rows nobody owns

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Waiting requests start running, first come first served, while cache rows are free."""
        admitted = []
        while self.waiting and self.free_rows:
            request = self.waiting.popleft()
            request.cache_row = self.free_rows.pop(0)
            request.status = RequestStatus.RUNNING
            admitted.append(request)
        self.running.extend(admitted)
        return admitted

    def retire_finished(self) -> None:
        """Requests that finished during the last step leave and give their cache row back."""
        for request in [r for r in self.running if r.status is RequestStatus.FINISHED]:
            self.running.remove(request)
            self.free_rows.append(request.cache_row)
            request.cache_row = None
            self.finished.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
