"""Embedding rows gathered by token id, optionally with Programmatic Dependent Launch.

The fused decode path (flashlet/runner/fused_decode.py) starts every step with this gather; with PDL
the kernel lets its dependent (layer 0's QKV GEMV) launch at once, so that GEMV's weight loads
overlap the gather instead of waiting for its end. `torch.index_select` does the same work but
cannot take part in PDL.

Work: out[i] = weight[ids[i]] for i < T; bytes 2 * T * H * e (a row read, a row written).
Grid (T, cdiv(H, BLOCK)): one program copies one BLOCK-wide piece of one row. Ids outside
[0, vocab) are the caller's error (as for index_select on the GPU, which asserts); here they
are clamped into the table so that a bad id reads a wrong row instead of faulting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlet.kernels import pdl
from flashlet.kernels.pdl import pdl_supported


@triton.jit
def _gather_rows_kernel(Ids, W, Out, hidden, vocab, stride_w, stride_o, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.launch_dependents()
        pdl.wait()  # ids and out may belong to the previous kernel
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    row = tl.load(Ids + i).to(tl.int64)
    row = tl.minimum(tl.maximum(row, 0), vocab - 1)
    x = tl.load(W + row * stride_w + cols, mask=mask)
    tl.store(Out + i * stride_o + cols, x, mask=mask)


def gather_rows(weight: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, *, pdl: bool = False,
                block: int = 1024) -> torch.Tensor:
    """out[i] = weight[ids[i]]: weight [V, H], ids [T] integer, out [T, H] (rows contiguous).
    pdl: launch with Programmatic Dependent Launch (CUDA sm_90+ only)."""
    if weight.dim() != 2 or out.dim() != 2 or ids.dim() != 1 or out.shape != (ids.shape[0], weight.shape[1]):
        raise ValueError(f"gather_rows: weight {tuple(weight.shape)}, ids {tuple(ids.shape)}, "
                         f"out {tuple(out.shape)} do not fit")
    if weight.stride(1) != 1 or out.stride(1) != 1 or out.dtype != weight.dtype:
        raise ValueError("gather_rows: weight and out need contiguous rows of one dtype")
    if pdl and not pdl_supported(out.device):
        raise ValueError(f"Programmatic Dependent Launch needs a CUDA device of sm_90 or newer ({out.device})")
    if ids.shape[0] == 0:
        return out
    hidden = weight.shape[1]
    block = min(block, triton.next_power_of_2(hidden))
    _gather_rows_kernel[(ids.shape[0], triton.cdiv(hidden, block))](
        ids, weight, out, hidden, weight.shape[0], weight.stride(0), out.stride(0),
        BLOCK=block, USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return out
