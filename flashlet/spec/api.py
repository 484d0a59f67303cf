"""The speculative-decoding interface the engine and its proposers share: the configuration (vLLM's
JSON shape, parsed and checked) and the Proposer protocol. The engine side (verification inside
continuous batching, the n-gram proposer) is speculative.py; the draft-model proposer
draft.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Protocol, Sequence

from flashlet.core.request import Request

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative config: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1} or {"model": PATH,
    "num_speculative_tokens": 4} (method "draft")."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None  # speculate only while at most this many run

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method: unknown {self.method!r} "
                             f"(choose from {', '.join(METHODS)})")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) "
                             f"must be >= prompt_lookup_min ({self.prompt_lookup_min})")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_config model: the draft method needs a `model` (a "
                             "folder, hub id, .gguf file or preset of the draft)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config model: the ngram method takes no model")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON string or a dict (vLLM's keys) -> the config; None or "" -> None. Unknown keys
        and bad values raise ValueError naming the key."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, got "
                             f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config num_speculative_tokens is required")
        method = value.get("method", "draft" if value.get("model") else None)
        if method is None:
            raise ValueError("speculative_config method: give 'method' (ngram) or a 'model'")
        return cls(**{**value, "method": method})

    def replace(self, **changes) -> "SpeculativeConfig":
        return type(self)(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def _check_int(key: str, value, least: int) -> None:
    if type(value) is not int or value < least:
        raise ValueError(f"speculative_config {key} must be an integer >= {least}, got {value!r}")


class Proposer(Protocol):
    """Guesses the next tokens of decoding requests (their tokens all known)."""

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        """Up to k tokens per request (may be empty), in the requests' order."""
        ...

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        """After a verify step: how many of the request's proposals were kept."""
        ...

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted: drop what is kept for it."""
        ...

    def warm_up(self) -> None:
        """At engine start on CUDA: compile and capture what proposing needs."""
        ...
