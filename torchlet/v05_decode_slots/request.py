"""A generation request and its life cycle: WAITING -> RUNNING -> FINISHED."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestStatus(Enum):
    WAITING = "waiting"  # queued: its prompt has not run yet and it has no slot
    RUNNING = "running"  # prompt prefilled, sits in a decode slot, gets a token per decode step
    FINISHED = "finished"  # stopped (EOS or max_new_tokens): its output is final


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]  # generation stops after one of these (empty with ignore_eos)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "eos" or "length" once finished
    slot: int | None = None  # its decode slot: its row in every decode batch and in the KV cache

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token_id(self) -> int:
        """The token the next decode step feeds: the newest one, whose K/V is not cached yet."""
        return self.output_ids[-1]

    @property
    def last_position(self) -> int:
        return self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        """Record a generated token; finish on a stop token or at max_new_tokens."""
        self.output_ids.append(token_id)
        if token_id in self.stop_ids:
            self.finish("eos")
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
