"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 is exact greedy (argmax)
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None  # a fixed seed reproduces sampled output
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: InitVar[int | None] = None  # vLLM's name for max_new_tokens (either, not both)

    def __post_init__(self, max_tokens: int | None):
        if max_tokens is not None:
            if self.max_new_tokens not in (max_tokens, _DEFAULT_MAX_NEW_TOKENS):
                raise ValueError(f"max_tokens ({max_tokens!r}) and max_new_tokens "
                                 f"({self.max_new_tokens!r}) disagree: give one of them")
            self.max_new_tokens = max_tokens
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


_DEFAULT_MAX_NEW_TOKENS = SamplingParams.max_new_tokens
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens,
                                     doc="vLLM's name for max_new_tokens")


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.is_greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def sample_one(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """logits [vocab] fp32 -> a 0-d token tensor, with temperature, top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False  # the most likely token always stays, however small top_p is
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
