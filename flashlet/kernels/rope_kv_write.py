"""Rotate-half RoPE on Q and K fused with the K/V write into the paged pool.

Work. For each token t (position p = positions[t]) and every head, split the head vector in
halves x1, x2 and, with cos, sin = cos_sin_cache[p] (cache row = cos | sin, D/2 each):
    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
Rotated Q goes to q_out; rotated K goes to k_out (optional) and, with V, into the pool
`k_cache/v_cache [pages, page_size, Hkv, D]` at flat slot s = slot_mapping[t]
(page s // page_size, row s % page_size). A negative slot skips the write (padding rows).
With no cos_sin_cache the kernel is a plain K/V write. An fp8 (e4m3) pool stores
x / scale saturated to +-448 (`KVPool.write`'s rule), rounded from the rotated K in its dtype.
With no cos_sin_cache the kernel is a plain K/V write. With q_norm / k_norm weights (Qwen3) each
q and k head vector is first RMS-normalised over head_dim and scaled (`QKNorm`), rounded as
`TorchOps.rms_norm` rounds (normalised to the input dtype, times the weight, rounded again), so
the per-head norms cost no kernel of their own.

Bytes (e = element size, T tokens, c = cache element size):
    read  Q, K, V:        T * (Hq + 2 * Hkv) * D * e
    read  cos/sin, pos:   T * (D * c + 8 + 8)
    write Q', K' (opt.):  T * (Hq + Hkv) * D * e
    write pool K, V:      T * 2 * Hkv * D * e
FLOPs: 6 * T * (Hq + Hkv) * D / 2 * 2 = 6 * T * (Hq + Hkv) * D  (3 mul/add per output value).

Design: grid (T,), one program per token holding all its heads ([H_pad, D/2] tiles), so the
cos/sin row is loaded once per token. Numerics follow `TorchOps.rope`: cos and sin are read
from the fp32 table as they are, the rotation runs in fp32 and is rounded once (transformers
rounds cos/sin to bf16 first: measurably more error, `scripts/fidelity.py --diagnose`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlet.kvcache.kv_pool import quantize_fp8
from flashlet.models.ops import QKNorm, TorchOps

FP8_MAX: tl.constexpr = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)


@triton.jit
def _to_cache(x, inv_scale, C, CACHE_FP8: tl.constexpr):
    """Rows x as the cache C stores them: fp8 scaled and saturated, else cast."""
    if CACHE_FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    return x.to(C.dtype.element_ty)


@triton.jit
def _rms_norm_halves(x1, x2, W, i, i_mask, eps, HALF: tl.constexpr):
    """Per-head RMSNorm of [H, D] rows held as halves [H, D/2] x2 -> the halves, in x's dtype."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(W + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    y1 = w1 * (x1f * rstd).to(x1.dtype).to(tl.float32)
    y2 = w2 * (x2f * rstd).to(x2.dtype).to(tl.float32)
    return y1.to(x1.dtype), y2.to(x2.dtype)


@triton.jit
def _rope_kv_write_kernel(
    Q, K, V, QO, KO, Pos, CosSin, KC, VC, Slots, k_inv_scale, v_inv_scale, QW, KW, norm_eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    WRITE_K_OUT: tl.constexpr,
    WRITE_KV: tl.constexpr,
    CACHE_FP8: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_mask = i < HALF
    hk = tl.arange(0, HKV_PAD)
    hk_mask = (hk < NUM_KV_HEADS)[:, None] & i_mask[None, :]
    k_ptrs = K + t * stride_kt + hk[:, None] * stride_kh + i[None, :]
    k1 = tl.load(k_ptrs, mask=hk_mask, other=0.0)
    k2 = tl.load(k_ptrs + HALF, mask=hk_mask, other=0.0)

    if APPLY_ROPE:
        pos = tl.load(Pos + t).to(tl.int64)
        cs = CosSin + pos * stride_cs
        cos = tl.load(cs + i, mask=i_mask, other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF + i, mask=i_mask, other=0.0).to(tl.float32)
        cos = cos[None, :]
        sin = sin[None, :]

        hq = tl.arange(0, HQ_PAD)
        hq_mask = (hq < NUM_Q_HEADS)[:, None] & i_mask[None, :]
        q_ptrs = Q + t * stride_qt + hq[:, None] * stride_qh + i[None, :]
        q1 = tl.load(q_ptrs, mask=hq_mask, other=0.0)
        q2 = tl.load(q_ptrs + HALF, mask=hq_mask, other=0.0)
        if QK_NORM:
            q1, q2 = _rms_norm_halves(q1, q2, QW, i, i_mask, norm_eps, HALF)
            k1, k2 = _rms_norm_halves(k1, k2, KW, i, i_mask, norm_eps, HALF)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        qo_ptrs = QO + t * stride_qot + hq[:, None] * stride_qoh + i[None, :]
        tl.store(qo_ptrs, (q1 * cos - q2 * sin).to(QO.dtype.element_ty), mask=hq_mask)
        tl.store(qo_ptrs + HALF, (q2 * cos + q1 * sin).to(QO.dtype.element_ty), mask=hq_mask)

        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        k1 = (k1f * cos - k2f * sin).to(K.dtype.element_ty)
        k2 = (k2f * cos + k1f * sin).to(K.dtype.element_ty)
        if WRITE_K_OUT:
            ko_ptrs = KO + t * stride_kot + hk[:, None] * stride_koh + i[None, :]
            tl.store(ko_ptrs, k1.to(KO.dtype.element_ty), mask=hk_mask)
            tl.store(ko_ptrs + HALF, k2.to(KO.dtype.element_ty), mask=hk_mask)

    if WRITE_KV:
        slot = tl.load(Slots + t).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE_SIZE
            row = slot % PAGE_SIZE
            kc_ptrs = KC + page * stride_kcp + row * stride_kct + hk[:, None] * stride_kch + i[None, :]
            tl.store(kc_ptrs, _to_cache(k1, k_inv_scale, KC, CACHE_FP8), mask=hk_mask)
            tl.store(kc_ptrs + HALF, _to_cache(k2, k_inv_scale, KC, CACHE_FP8), mask=hk_mask)
            v_ptrs = V + t * stride_vt + hk[:, None] * stride_vh + i[None, :]
            v1 = tl.load(v_ptrs, mask=hk_mask, other=0.0)
            v2 = tl.load(v_ptrs + HALF, mask=hk_mask, other=0.0)
            vc_ptrs = VC + page * stride_vcp + row * stride_vct + hk[:, None] * stride_vch + i[None, :]
            tl.store(vc_ptrs, _to_cache(v1, v_inv_scale, VC, CACHE_FP8), mask=hk_mask)
            tl.store(vc_ptrs + HALF, _to_cache(v2, v_inv_scale, VC, CACHE_FP8), mask=hk_mask)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_kv_write(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor | None,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    return_k: bool = True,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """RoPE q [T, Hq, D] and k [T, Hkv, D] at positions [T]; write K', V into one layer's pool.

    - cos_sin_cache None: no rotation; only the K/V write (q may be None).
    - k_cache None: no write; only the rotation (v may be None).
    - q_out / k_out: where the rotated tensors go (new tensors when None; pass q itself to
      rotate in place). return_k False skips writing K' outside the pool (k_out is None then).
    - kv_scales: (k_scale, v_scale) of an fp8 (e4m3) pool, which stores x / scale saturated.
    - qk_norm: Qwen3's per-head RMSNorm of q and k before RoPE (weights [D] each).
    Returns (q', k'), or (q, k) unchanged without a cache."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    apply_rope = cos_sin_cache is not None
    write_kv = k_cache is not None
    if qk_norm is not None and not apply_rope:
        raise ValueError("qk_norm is applied before RoPE: it needs cos_sin_cache")
    if not apply_rope and not write_kv:
        return q, k
    k = _rows_contiguous(k)
    if apply_rope:
        if q is None or positions is None:
            raise ValueError("RoPE needs q and positions")
        if cos_sin_cache.shape[-1] != head_dim:
            raise ValueError(f"cos_sin_cache has {cos_sin_cache.shape[-1]} columns, head_dim is {head_dim}")
        norm_shapes = (qk_norm.q_weight.shape, qk_norm.k_weight.shape) if qk_norm is not None else None
        if norm_shapes is not None and norm_shapes != ((head_dim,), (head_dim,)):
            raise ValueError(f"qk_norm weights must be [{head_dim}], got {tuple(qk_norm.q_weight.shape)} "
                             f"and {tuple(qk_norm.k_weight.shape)}")
        q = _rows_contiguous(q)
        cos_sin_cache = _rows_contiguous(cos_sin_cache)
        if q_out is None:
            q_out = torch.empty_like(q)
        if return_k and k_out is None:
            k_out = torch.empty_like(k)
    if write_kv:
        if v is None or slot_mapping is None or v_cache is None:
            raise ValueError("the K/V write needs v, v_cache and slot_mapping")
        v = _rows_contiguous(v)
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("k/v cache rows must be contiguous in head_dim")
        page_size = k_cache.shape[1]
        if k_cache.dtype != v_cache.dtype:
            raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}: one dtype")
    else:
        page_size = 1
    if num_tokens == 0:
        return (q_out, k_out) if apply_rope else (q, k)
    num_q_heads = q.shape[1] if apply_rope else 1
    dummy = k
    qq = q if apply_rope else dummy
    qo = q_out if apply_rope else dummy
    ko = k_out if (apply_rope and return_k) else dummy
    vv = v if write_kv else dummy
    kc = k_cache if write_kv else dummy
    vc = v_cache if write_kv else dummy
    cs = cos_sin_cache if apply_rope else dummy
    pos = positions if apply_rope else dummy
    slots = slot_mapping if write_kv else dummy
    qw, kw = (qk_norm.q_weight, qk_norm.k_weight) if qk_norm is not None else (dummy, dummy)

    _rope_kv_write_kernel[(num_tokens,)](
        qq, k, vv, qo, ko, pos, cs, kc, vc, slots, 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        qw, kw, qk_norm.eps if qk_norm is not None else 0.0,
        qq.stride(0), qq.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        cs.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HQ_PAD=_pow2(num_q_heads),
        HKV_PAD=_pow2(num_kv_heads),
        HALF=head_dim // 2,
        HALF_PAD=_pow2(head_dim // 2),
        PAGE_SIZE=page_size,
        APPLY_ROPE=apply_rope,
        WRITE_K_OUT=apply_rope and return_k,
        WRITE_KV=write_kv,
        CACHE_FP8=write_kv and k_cache.dtype == torch.float8_e4m3fn,
        QK_NORM=qk_norm is not None,
        num_warps=1 if (num_q_heads + num_kv_heads) * head_dim <= 2048 else 4,
    )
    if apply_rope:
        return q_out, (k_out if return_k else None)
    return q, k


def rope_kv_write_reference(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                            kv_scales=(1.0, 1.0), qk_norm=None):
    """Plain PyTorch: the model's per-head norms (`QKNorm.apply`), `TorchOps.rope`, then
    `index_copy_` of K', V into the pool (rows with a negative slot skipped; an fp8 pool's rows
    quantized as `KVPool.write` does). Returns (q', k'); the caches are updated in place."""
    if qk_norm is not None:
        q, k = qk_norm.apply(q, k)
    if cos_sin_cache is not None:
        q, k = TorchOps.rope(q, k, positions, cos_sin_cache)
    if k_cache is not None:
        keep = slot_mapping >= 0
        flat = (-1,) + tuple(k_cache.shape[2:])
        k_rows, v_rows = k[keep].to(k_cache.dtype), v[keep].to(v_cache.dtype)
        k_view, v_view = k_cache.view(flat), v_cache.view(flat)
        if k_cache.dtype == torch.float8_e4m3fn:
            k_rows = quantize_fp8(k[keep], kv_scales[0], k_cache.dtype).view(torch.uint8)
            v_rows = quantize_fp8(v[keep], kv_scales[1], v_cache.dtype).view(torch.uint8)
            k_view, v_view = k_view.view(torch.uint8), v_view.view(torch.uint8)
        k_view.index_copy_(0, slot_mapping[keep], k_rows)
        v_view.index_copy_(0, slot_mapping[keep], v_rows)
    return q, k
