"""Small Triton kernels for the per-token operations: RMSNorm, RoPE and the SwiGLU activation
silu(gate) * up. In PyTorch each of them is a chain of elementwise ops, each one a kernel launch
and a round trip through memory; here each is one kernel that reads its inputs once and writes
its output once, computing in fp32 in between.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, chosen by importing
torchlet before triton): the same kernel code, executed with NumPy, slowly, so tests can run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, hidden_size, eps, BLOCK: tl.constexpr):
    """One program per token: out = weight * x / sqrt(mean(x^2) + eps)."""
    row_start = tl.program_id(0).to(tl.int64) * hidden_size
    cols = tl.arange(0, BLOCK)  # BLOCK >= hidden_size, a power of two: mask the tail
    mask = cols < hidden_size
    x = tl.load(x_ptr + row_start + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row_start + cols, weight * normed, mask=mask)


@triton.jit
def rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    half_dim,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token: rotate the pairs (x[i], x[i + half_dim]) of all its heads."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    col_mask = cols < half_dim
    mask = (heads < num_heads) & col_mask  # [BLOCK_HEADS, BLOCK_HALF]
    cos = tl.load(cos_ptr + token * half_dim + cols, mask=col_mask, other=0.0)  # fp32
    sin = tl.load(sin_ptr + token * half_dim + cols, mask=col_mask, other=0.0)
    first_half = token * num_heads * 2 * half_dim + heads * 2 * half_dim + cols
    x1 = tl.load(x_ptr + first_half, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first_half + half_dim, mask=mask, other=0.0).to(tl.float32)
    out_type = out_ptr.dtype.element_ty
    tl.store(out_ptr + first_half, (x1 * cos - x2 * sin).to(out_type), mask=mask)
    tl.store(out_ptr + first_half + half_dim, (x2 * cos + x1 * sin).to(out_type), mask=mask)


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, num_elements, BLOCK: tl.constexpr):
    """One program per BLOCK elements: out = silu(gate) * up = gate * sigmoid(gate) * up."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + offsets, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden_size]; weight: [hidden_size] -> [num_tokens, hidden_size]
    check_triton_can_run(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    hidden_size = x.shape[-1]
    block = triton.next_power_of_2(hidden_size)
    rms_norm_kernel[(x.numel() // hidden_size,)](x, weight, out, hidden_size, eps, BLOCK=block)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim // 2] fp32
    check_triton_can_run(x)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    num_tokens, num_heads, head_dim = x.shape
    half_dim = head_dim // 2
    rope_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        out,
        num_heads,
        half_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half_dim),
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    # gate, up: [num_tokens, intermediate_size] -> silu(gate) * up, same shape
    check_triton_can_run(gate)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    silu_mul_kernel[(triton.cdiv(gate.numel(), block),)](gate, up, out, gate.numel(), BLOCK=block)
    return out


def triton_interpreter_active() -> bool:
    """True when Triton's CPU interpreter was selected before triton was imported: then both
    our kernels and Triton's own library functions (tl.sum, ...) are interpreted."""
    return isinstance(rms_norm_kernel, InterpretedFunction) and isinstance(
        tl.sum, InterpretedFunction
    )


def check_triton_can_run(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not triton_interpreter_active():
        raise RuntimeError(
            f"Triton kernels need a CUDA tensor (got one on {x.device}); on a CPU they run in "
            "Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is first "
            "imported (importing torchlet first does it when there is no GPU)"
        )
