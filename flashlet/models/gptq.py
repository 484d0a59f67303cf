"""GPTQ rounding into the engine's per-row fp8 format, and the calibration that feeds it.

`gptq_rows` chooses each e4m3 code of a weight by GPTQ's error-compensating rounding (Frantar et
al. 2022) instead of rounding to nearest: the codes and scales keep `quantize_rows`' format (one
fp32 scale a row), so a checkpoint of them loads unchanged, with no cost at load;
`gptq_rows_searched` also picks each row's scale from a few candidates. `gptq_model` drives it
over a model: each decoder layer in turn runs the
calibration sequences (from the float model's own activations), sums X^T X of each linear's
input (fused QKV, O, fused gate-up, down: the engine's modules), rounds that layer's weights
and drops its Hessians. `python -m flashlet.quantize` writes the result as an FP8 checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashlet.models.model import CausalLM
from flashlet.models.ops import TorchOps
from flashlet.models.quantization import (FP8, FP8_MAX, MIN_SCALE, QUANTIZED_PROJECTIONS,
                                          QuantizedWeight, keep_better_rows, scale_fractions,
                                          swap_weight)


def gptq_rows(w, hessian, damp=0.01, act_order=True, block=128, scale=None):
    """w [N, K], hessian [K, K] = X^T X of the layer's calibration inputs -> (codes [N, K] e4m3,
    scale [N] fp32): the same per-row format as `quantize_rows` (by default scale = amax|row| /
    448 of the original row; `scale` [N] gives another), but the columns are rounded one at a
    time (in descending diag(H) order with `act_order`) and each column's rounding error is
    spread over the columns not yet rounded through the inverse Hessian, so that X W^T rather
    than W is kept (GPTQ, Frantar et al. 2022: the error of column j, divided by U[j, j], moves
    the rest by U[j, j+1:] where U is the upper Cholesky factor of H^-1; done in blocks of
    `block` columns, the rest updated once a block). `damp` adds that fraction of diag(H)'s mean
    to the diagonal."""
    w = w.float().clone()
    n, k = w.shape
    device = w.device
    if scale is None:
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    scale = scale.to(device=device, dtype=torch.float32)
    h = hessian.to(device).double().clone()
    dead = h.diagonal() == 0  # an input that never fires: its column does not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(k, device=device)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * h.diagonal().mean() * torch.eye(k, dtype=h.dtype, device=device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    codes = torch.empty_like(w)  # the e4m3 values as fp32 (exact), cast once at the end
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err = w[:, b0:b1], torch.empty(n, b1 - b0, device=device)
        for j in range(b1 - b0):
            c = (wb[:, j] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
            codes[:, b0 + j] = c
            err[:, j] = (wb[:, j] - c * scale) / u[b0 + j, b0 + j]
            wb[:, j + 1:] -= err[:, j:j + 1] * u[b0 + j, b0 + j + 1:b1]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return codes[:, torch.argsort(perm)].to(FP8), scale


def gptq_rows_searched(w, hessian, damp=0.01, act_order=True, candidates=8):
    """`gptq_rows` under each scale of `scale_fractions(candidates)`, each row keeping the codes
    and scale of least output error on the calibration inputs, e^T H e with e = its dequantized
    row minus its float one (GPTQ's own objective: the rows are independent given the scales).
    candidates=1 is plain `gptq_rows`. The e4m3 rounding error of a row's values depends on
    where they fall in the grid, so moving the grid by a fraction of a step lets each row pick
    its luckiest alignment: measured on SmolLM2, 8 candidates took GPTQ's argmax-agreement loss
    against bf16 from -3.05 to -2.03 points (BENCHMARKS.md's fp8 fidelity row), at 8x the
    rounding time."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    h = hessian.to(w.device).float()
    best = None
    for f in scale_fractions(candidates):
        codes, scale = gptq_rows(w, hessian, damp, act_order,
                                 scale=(amax / (FP8_MAX * f)).clamp(min=MIN_SCALE))
        err = codes.float() * scale[:, None] - w
        loss = ((err @ h) * err).sum(dim=1)  # [N]: each row's e^T H e
        best = keep_better_rows(best, codes, scale, loss)
    return best[0], best[1]


class DenseAttention:
    """Causal attention over one whole sequence (no KV pool): what calibration runs."""

    def run_rope(self, layer_idx, q, k, v, positions, cos_sin, qk_norm=None):
        # q: [T, Hq, D], k, v: [T, Hkv, D]
        if qk_norm is not None:
            q, k = qk_norm.apply(q, k)
        q, k = TorchOps.rope(q, k, positions, cos_sin)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)


class HessianOps(TorchOps):
    """TorchOps whose `linear` also sums X^T X (fp32) of the rows each given weight sees."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.names = {id(w): name for name, w in weights.items()}
        self.sums = {name: torch.zeros(w.shape[1], w.shape[1], device=w.device)
                     for name, w in weights.items()}
        self.rows = dict.fromkeys(weights, 0)

    def linear(self, x, weight, bias=None):
        name = self.names.get(id(weight))
        if name is not None:
            xs = x.float()
            self.sums[name].addmm_(xs.T, xs)
            self.rows[name] += xs.shape[0]
        return TorchOps.linear(x, weight, bias)

    def hessian(self, name: str) -> torch.Tensor:
        """The mean X^T X of `name`'s input rows [K, K]."""
        return self.sums[name] / max(self.rows[name], 1)


@torch.inference_mode()
def gptq_model(model: CausalLM, seqs: list[list[int]], damp: float = 0.01, act_order: bool = True,
               scale_candidates: int = 8, on_layer: Callable[[int], None] | None = None) -> None:
    """Round every decoder layer's linear weights in place into `QuantizedWeight`s by GPTQ
    (`gptq_rows_searched`: each row's scale the best of `scale_candidates`), on the Hessians of
    their inputs over the token sequences `seqs`. Each layer's inputs are the float model's own (the lab measured calibrating through the already-rounded layers, GPTQ's
    sequential order, no better on SmolLM2); one layer's Hessians are held at a time."""
    if model.tp is not None:
        raise ValueError("GPTQ calibrates a whole model, not a tensor-parallel slice")
    if not seqs or not all(seqs):
        raise ValueError("GPTQ needs at least one non-empty calibration sequence")
    attn, device = DenseAttention(), model.embed_tokens.weight.device
    states = []  # each sequence's (hidden, residual, positions) entering the next layer
    for s in seqs:
        ids = torch.tensor(s, device=device)
        states.append((model.embed_tokens(ids), None, torch.arange(len(s), device=device)))
    for i, layer in enumerate(model.layers):
        weights = {p: getattr(layer, p).weight for p in QUANTIZED_PROJECTIONS}
        if any(isinstance(w, QuantizedWeight) for w in weights.values()):
            raise ValueError("GPTQ rounds float weights: this model is already quantized")
        ops = HessianOps(weights)
        states = [(*layer(x, r, pos, model.cos_sin_cache, i, attn, ops), pos)
                  for x, r, pos in states]
        for p, w in weights.items():
            codes, scale = gptq_rows_searched(w, ops.hessian(p), damp, act_order,
                                              scale_candidates)  # on the model's device
            swap_weight(getattr(layer, p), QuantizedWeight(codes, scale))
        del ops
        if on_layer is not None:
            on_layer(i)


def calibration_sequences(tokens: list[int], seq_len: int = 1024) -> list[list[int]]:
    """A calibration token stream cut into sequences of at most `seq_len` tokens."""
    return [tokens[i:i + seq_len] for i in range(0, len(tokens), seq_len)]
