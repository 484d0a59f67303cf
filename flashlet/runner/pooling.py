"""Embedding requests: a request whose SamplingParams.pooling is "last" or "mean" runs its
prompt through the engine like any other (paged KV, chunked prefill, batched with the rest),
and the final hidden states (after the final norm) of its prompt tokens are pooled, normalised
to unit length and put in its final output (`RequestOutput.embedding`). It then ends after one
token, whose logits nobody reads.

"last" pools the last prompt token's state (causal models see the whole prompt there: the
Qwen3-Embedding configs' pooling); "mean" averages every prompt token's, summed chunk by chunk.
A mean needs every token computed here, so the scheduler gives it no cached prefix."""

from __future__ import annotations

import torch


class Pooler:
    """The engine's embedding requests in flight: their running sums, and the vectors of those
    whose prompt is done, until their final output carries them."""

    def __init__(self):
        self.modes: dict[int, str] = {}  # request id -> "last" / "mean"
        self._sums: dict[int, torch.Tensor] = {}  # mean: the prompt rows pooled so far
        self._vectors: dict[int, torch.Tensor] = {}  # pooled and normalised, on the device

    def add(self, request_id: int, mode: str) -> None:
        self.modes[request_id] = mode

    def wants(self, sched) -> bool:
        """Does this step compute prompt tokens of an embedding request (cheap when none)."""
        return bool(self.modes) and any(req.request_id in self.modes for req, _ in sched.scheduled)

    def pool(self, sched, hidden: torch.Tensor) -> None:
        """Take the step's hidden states [T, hidden] of its embedding requests' rows (each
        scheduled request's tokens are contiguous, in schedule order)."""
        start = 0
        for req, n in sched.scheduled:
            mode = self.modes.get(req.request_id)
            if mode is not None:
                self._pool_rows(req, mode, hidden[start:start + n].float())
            start += n

    def _pool_rows(self, req, mode: str, rows: torch.Tensor) -> None:
        rid = req.request_id
        prompt_done = req.num_computed_tokens + rows.shape[0] == req.num_prompt_tokens
        if mode == "mean":
            if req.num_computed_tokens == 0:  # a first chunk, or a recompute after preemption
                self._sums.pop(rid, None)
            total = rows.sum(0) if rid not in self._sums else self._sums[rid] + rows.sum(0)
            self._sums[rid] = total
            vector = total / req.num_prompt_tokens
        else:
            vector = rows[-1]
        if prompt_done:
            self._sums.pop(rid, None)
            self._vectors[rid] = torch.nn.functional.normalize(vector, dim=0)

    def attach(self, outputs) -> None:
        """Give each finished embedding request's output its vector (a list of floats)."""
        for out in outputs:
            if out.finished and out.request_id in self.modes:
                vector = self._vectors.get(out.request_id)
                if vector is not None and out.finish_reason not in ("abort", "error"):
                    out.embedding = vector.cpu().tolist()
                self.drop(out.request_id)

    def drop(self, request_id: int) -> None:
        self.modes.pop(request_id, None)
        self._sums.pop(request_id, None)
        self._vectors.pop(request_id, None)
