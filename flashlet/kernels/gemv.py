"""GEMV: one token's linear layer, y = W x (+ b), for the single-stream decode step.

Work. x [1, K], W [N, K] (nn.Linear's layout), optional bias [N] -> y [1, N]; products summed
in fp32, rounded once to the output dtype (as cuBLAS does for bf16).

Bytes (e = element size): read N * K * e of weights (all that matters: x is K * e), write N * e.
FLOPs: 2 * N * K.

Why. At batch 1 a decode step is a chain of matrix-vector products whose weights are read
once; each should run at the memory bandwidth. cuBLAS reaches about a third of it on these
small, skinny shapes (../shared/notes/gpu.md: the 97 matmuls of Qwen2.5-0.5B replayed alone
take 0.66 ms for 0.99 GB). Here each program owns BLOCK_N whole rows of W: it streams them in
BLOCK_K-wide tiles, multiplies by the matching slice of x and accumulates a [BLOCK_N, BLOCK_K]
fp32 tile, reduced once at the end. BLOCK_N is picked so the grid has a few programs per SM
(rows of one program are contiguous, so every load is a full coalesced row segment).

Measured (H200, bf16, BENCHMARKS.md): 0.35x to 0.86x of cuBLAS at the four Qwen2.5-0.5B shapes,
and 609 against 913 tok/s end to end. This one-pass design loses: a program keeps too few bytes
in flight to hide the memory latency, and the K = 4864 down projection has only 224 programs
with no split-K. So the engine uses it only when asked (`EngineConfig(gemv=True)`); it stays
as the measured first attempt, and the baseline a better GEMV has to beat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_w,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(X + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_mask)


def block_n_for(n: int, num_sms: int) -> int:
    """Rows per program: about four programs per SM, between 4 and 64 rows, a power of two."""
    target = max(1, n // (4 * num_sms))
    return max(4, min(64, 1 << (target.bit_length() - 1)))


_NUM_SMS: dict[torch.device, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small grid
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         *, block_k: int = 128) -> torch.Tensor:
    """x [1, K] (or [K]), weight [N, K], bias [N] or None -> x @ weight.T + bias, [1, N]."""
    K = x.shape[-1]
    N = weight.shape[0]
    if x.numel() != K:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    if weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's {K} columns")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x = x.reshape(K).contiguous()
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    block_n = block_n_for(N, _num_sms(x.device))
    block_k = min(block_k, triton.next_power_of_2(K))
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: `F.linear` (cuBLAS on CUDA)."""
    return F.linear(x.reshape(1, -1), weight, bias)
