"""RMSNorm, and residual add fused with RMSNorm.

Work. Per row of x [T, H]: with the optional residual, s = x + residual (rounded to x's dtype,
and returned as the new residual); then y = weight * to_dtype(s * rsqrt(mean(s^2) + eps)),
the mean reduced in fp32. This is `TorchOps.rms_norm` / `add_rms_norm` exactly (the output
dtype is torch's promotion of x's and weight's dtypes, as `weight * x` gives).

Bytes (e = element size): plain   read T*H*e + H*e_w, write T*H*e_out
                          fused   read 2*T*H*e + H*e_w, write T*H*e_out + T*H*e
FLOPs: about 4 * T * H (square, sum, scale, weight) plus T*H for the residual add.

Design: grid (T,), one program per row holding the whole row (BLOCK = next_pow2(H)) in
registers: one read of x (and residual), one write of each output. Rows up to 65536 wide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Y, RO,
    stride_x, stride_r, stride_y, stride_ro,
    H, eps,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RO + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, 0) / H
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    x2 = x.reshape(-1, hidden)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x, residual, weight, eps, out, residual_out):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if hidden > 65536:
        raise ValueError(f"rows wider than 65536 are not supported, got {hidden}")
    x2 = _as_rows(x, hidden)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = out if out is not None else torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y2 = y.view(-1, hidden)
    if residual is not None:
        r2 = _as_rows(residual, hidden)
        ro = residual_out if residual_out is not None else torch.empty_like(x)
        ro2 = ro.view(-1, hidden)
    else:
        r2 = ro2 = ro = x2
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight.contiguous(), y2, ro2,
            x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0),
            hidden, eps,
            BLOCK_H=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=4 if block <= 2048 else (8 if block <= 8192 else 16),
        )
    return y, ro


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., H] -> RMSNorm(x) * weight. `out` (contiguous, x's shape) receives it if given."""
    y, _ = _launch(x, None, weight, eps, out, None)
    return y


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) -> (RMSNorm of the sum, the sum). Inputs are not modified (pass
    residual_out=residual to update the residual in place). residual None: (rms_norm(x), x)."""
    if residual is None:
        return rms_norm(x, weight, eps, out=out), x
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    return _launch(x, residual, weight, eps, out, residual_out)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch (the `TorchOps.rms_norm` math)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x, residual, weight, eps):
    """Plain PyTorch (the `TorchOps.add_rms_norm` math)."""
    if residual is not None:
        x = x + residual
    return rms_norm_reference(x, weight, eps), x
