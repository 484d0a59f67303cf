"""`TritonOps`: the model's elementwise operations on the Triton kernels of this package.

Same methods and signatures as `flashlet.models.ops.TorchOps`, swapped in by name ("triton").
Every method returns new tensors and leaves its inputs untouched, as TorchOps does. (RoPE fused
with the K/V write is the KV pool's: `KVPool.write_rope`.) Inputs must be CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from flashlet.kernels import rmsnorm as _rmsnorm
from flashlet.kernels.rope_kv_write import rope_kv_write
from flashlet.kernels.silu_mul import silu_and_mul as _silu_and_mul
from flashlet.models.ops import TorchOps


class TritonOps:
    name = "triton"

    linear = staticmethod(TorchOps.linear)  # cuBLAS

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] -> RMSNorm(x) * weight, reduced in fp32 (one fused kernel)."""
        return _rmsnorm.rms_norm(x, weight, eps)

    @classmethod
    def add_rms_norm(cls, x, residual, weight, eps):
        """(x + residual) -> (RMSNorm of the sum, the sum as the new residual), one kernel."""
        return _rmsnorm.add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        return _silu_and_mul(gate_up)

    @staticmethod
    def rope(q, k, positions, cos_sin_cache):
        """Rotate-half RoPE. q [T, Hq, D], k [T, Hkv, D]; cos_sin_cache [max_pos, D] (cos | sin).
        Returns new (q, k); one kernel rotates both."""
        q_out, k_out = rope_kv_write(q, k, None, positions, cos_sin_cache, None, None, None)
        return q_out, k_out

