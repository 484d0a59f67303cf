"""SiLU-and-mul: the gated MLP's activation.

Work. gate_up [T, 2I] = (gate | up) -> silu(gate) * up [T, I], with silu(g) = g / (1 + e^-g)
computed in fp32 and rounded to the input dtype before the product (what `F.silu(gate) * up`
does in PyTorch, so bf16 results match TorchOps bit for bit up to the exp implementation).

Bytes (e = element size): read 2 * T * I * e, write T * I * e.
FLOPs: about 5 * T * I (negate/exp/add/divide for silu, one multiply), exp counted as one.

Design: grid (T, ceil(I / BLOCK)); each program reads BLOCK gate and BLOCK up values of one row
and writes BLOCK outputs. Purely bandwidth-bound; BLOCK = 1024 with 4 warps (8 values each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
    y = act.to(tl.float32) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I] (a new tensor unless `out` is given)."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"last dimension must be even, got {two_i}")
    inter = two_i // 2
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    y2 = out.view(-1, inter)
    rows = x2.shape[0]
    if rows and inter:
        block = min(block, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, y2, x2.stride(0), y2.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch (the `TorchOps.silu_and_mul` math)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
