"""The speculative-decoding interface the engine and its proposers share: the configuration (vLLM's
JSON shape) and the Proposer protocol. The engine side (verification inside continuous batching,
the ngram proposer) implements it in speculative.py; the draft-model proposer in spec_draft.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from flashlet.request import Request


@dataclass(frozen=True)
class SpeculativeConfig:
    """From vLLM-style JSON, e.g. {"model": PATH, "num_speculative_tokens": 4}."""

    method: str  # "ngram" | "draft"
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        """Up to k proposed tokens per request, in order."""

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        """After verification: how many proposals were kept (the target then appended one more
        token of its own)."""

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted: drop what the proposer holds for it."""
