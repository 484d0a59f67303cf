"""The model's elementwise operations in plain PyTorch. A fused implementation (Triton kernels
in `flashlet/kernels/`) provides the same methods and is swapped in by name."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from flashlet.models.quantization import QuantizedWeight
from flashlet.models.quantization import linear as quantized_linear


class TorchOps:
    name = "torch"

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ weight [N, K].T (+ bias) -> [T, N]; an fp8 weight goes to its own matmul."""
        if isinstance(weight, QuantizedWeight):
            return quantized_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] -> RMSNorm(x) * weight, reduced in fp32 as Hugging Face does."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x, residual, weight, eps):
        """(x + residual) -> (RMSNorm of the sum, the sum as the new residual)."""
        if residual is not None:
            x = x + residual
        return cls.rms_norm(x, weight, eps), x

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope(q, k, positions, cos_sin_cache):
        """Rotate-half RoPE. q [T, Hq, D], k [T, Hkv, D]; cos_sin_cache [max_pos, D] (cos | sin).

        Computed in fp32 (or wider) with the table as it is, and rounded once to q's dtype:
        transformers rounds cos/sin to bf16 and each product and sum too, which in bf16 adds
        about half again to RoPE's error (`scripts/fidelity.py --diagnose`); in fp32 the two
        are the same operations."""
        wide = torch.promote_types(q.dtype, torch.float32)
        cos, sin = cos_sin_cache[positions].to(wide).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q.to(wide), cos, sin).to(q.dtype), _rotate(k.to(wide), cos, sin).to(k.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class QKNorm(NamedTuple):
    """Qwen3's per-head RMSNorm of q and k before RoPE: the weights [head_dim] and eps."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> each head vector normalised (`TorchOps.rms_norm`)."""
        return _norm_heads(q, self.q_weight, self.eps), _norm_heads(k, self.k_weight, self.eps)


def _norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return TorchOps.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
