"""Who runs next. Requests move waiting -> running -> finished; the scheduler keeps one list per
state and moves requests between them."""

from __future__ import annotations

from collections import deque

from .request import Request, RequestStatus


class Scheduler:
    def __init__(self):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def admit_all(self) -> list[Request]:
        """Every waiting request starts running (this version makes room for all of them)."""
        admitted = list(self.waiting)
        self.waiting.clear()
        for request in admitted:
            request.status = RequestStatus.RUNNING
        self.running.extend(admitted)
        return admitted

    def retire_finished(self) -> None:
        """Requests that finished during the last step leave the running list."""
        self.finished.extend(r for r in self.running if r.status is RequestStatus.FINISHED)
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
