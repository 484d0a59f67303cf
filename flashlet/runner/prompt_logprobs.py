"""Prompt logprobs: each prompt token's log-probability given the tokens before it, computed in
the prefill pass that computes the prompt (chunk by chunk under chunked prefill).

The logits at position i score prompt token i + 1, so a chunk of positions [a, a + n) scores
tokens a + 1 .. min(a + n, P - 1) (P prompt tokens; the last position's logits are the first
output token's, which the sampler handles). The step's rows that score are picked here
(`PromptScoring.of`), apart from the sampled rows; the runner returns their final hidden
states (`ModelRunner.forward_hidden`), and `compute` runs the LM head on them alone, a
block at a time, log-softmax in fp32 and the top k, copied to the host without waiting. Steps
with no such row pay nothing. Once the step's tokens are read, `deliver` appends each request's
new entries before the scheduler writes its outputs. A request takes no cached prefix until its
prompt is scored (scheduler.py), and after a preemption a token scored already is not scored
again (one in flight then is delivered once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashlet.core.sampling import TokenLogprob
from flashlet.runner.sampler import _to_host  # pinned, non-blocking (read after the step's tokens)

# Rows whose logits are materialised at once: the vocabulary times this many fp32 values
# (Qwen2.5's 151,936 x 512 x 4 bytes = 311 MB) bounds the extra memory a long prompt needs.
ROWS_PER_BLOCK = 512


@dataclass
class _Span:
    """One request's scored tokens in a step: prompt tokens first .. first + count - 1."""

    req: object
    first: int  # index of the first prompt token scored
    count: int
    k: int  # its top alternatives


class PromptScoring:
    """The rows of one step that score prompt tokens, and (after `compute`) their results."""

    def __init__(self, spans: list[_Span], rows: list[int], targets: list[int]):
        self.spans = spans
        self.rows = rows  # flat token rows of the step, in span order
        self.targets = targets  # the prompt token each row scores
        self._host: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, scheduled) -> "PromptScoring | None":
        """The scoring rows of a step's (request, new tokens) list, read before the step is
        launched (num_computed_tokens is still the chunk's start); None if no row scores."""
        spans, rows, targets, offset = [], [], [], 0
        for req, n in scheduled:
            scored = req.prompt_logprobs
            if scored is not None:
                start = req.num_computed_tokens
                first = max(len(scored), start + 1)
                last = min(start + n, req.num_prompt_tokens - 1)
                if first <= last:
                    spans.append(_Span(req, first, last - first + 1, req.params.prompt_logprobs))
                    rows += range(offset + first - 1 - start, offset + last - start)
                    targets += req.prompt_token_ids[first : last + 1]
            offset += n
        return cls(spans, rows, targets) if spans else None

    def row_tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.rows, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def compute(self, model, hidden: torch.Tensor) -> None:
        """hidden [len(rows), hidden] -> chosen logprobs, ranks and top k, staged to the host."""
        k = max(max(s.k for s in self.spans), 1)
        targets = torch.tensor(self.targets, dtype=torch.int64, device=hidden.device)
        parts = [[], [], [], []]
        for lo in range(0, hidden.shape[0], ROWS_PER_BLOCK):
            logprobs = torch.log_softmax(model.compute_logits(hidden[lo : lo + ROWS_PER_BLOCK])
                                         .float(), dim=-1)
            chosen = logprobs.gather(1, targets[lo : lo + ROWS_PER_BLOCK, None])
            rank = (logprobs > chosen).sum(dim=1) + 1
            top_values, top_ids = logprobs.topk(k, dim=-1)
            for part, t in zip(parts, (chosen[:, 0], rank, top_ids, top_values)):
                part.append(t)
        self._host = [_to_host(torch.cat(p)) for p in parts]

    def deliver(self) -> None:
        """Append each request's scored tokens to its prompt_logprobs (after the step's tokens
        were read: the host copies are done)."""
        chosen, rank, top_ids, top_values = (t.tolist() for t in self._host)
        j = 0
        for span in self.spans:
            scored = span.req.prompt_logprobs
            for t in range(span.first, span.first + span.count):
                if t == len(scored):  # in order; a repeat after a preemption is skipped
                    scored.append(TokenLogprob(
                        self.targets[j], chosen[j],
                        list(zip(top_ids[j][: span.k], top_values[j][: span.k])), rank[j]))
                j += 1

