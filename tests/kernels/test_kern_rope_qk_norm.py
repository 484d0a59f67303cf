"""Qwen3's per-head q/k RMSNorm folded into the RoPE + K/V write kernel (`rope_kv_write(qk_norm=)`),
against the model's own sequence: `QKNorm.apply` (TorchOps.rms_norm per head), `TorchOps.rope`,
the pool write (`rope_kv_write_reference`). On the CPU the kernel runs in the interpreter."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference
from flashlet.kvcache.kv_pool import KVPool
from flashlet.models.ops import QKNorm

NAN = float("nan")


def _case(kh, num_tokens, hq, hkv, head_dim, page_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Scales far from 1, so a missing or misplaced norm changes every value.
    qkv = (torch.randn(num_tokens, hq + 2 * hkv, head_dim, generator=g) * 3 + 0.5).to(dtype).to(kh.device)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)  # strided views, as the fused QKV projection gives
    norm = QKNorm((torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(kh.device),
                  (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(kh.device), 1e-6)
    positions = torch.randint(0, 64, (num_tokens,), generator=g).to(kh.device)
    num_pages = -(-num_tokens // page_size) + 2
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens].to(kh.device)
    if num_tokens > 2:
        slots[1] = -1  # a padding row: no write
    caches = [torch.zeros(num_pages, page_size, hkv, head_dim, dtype=dtype, device=kh.device) for _ in range(2)]
    return q, k, v, positions, kh.cos_sin_cache(64, head_dim), *caches, slots, norm


@pytest.mark.parametrize("num_tokens,hq,hkv,head_dim,page_size,dtype", [
    (5, 16, 8, 128, 16, torch.float32),    # Qwen3-0.6B's heads
    (3, 16, 8, 128, 16, torch.bfloat16),
    (4, 7, 1, 24, 8, torch.float32),       # a half of 12, padded; a group of 7
])
def test_qk_norm_rope_kv_write_matches_the_model_sequence(kh, num_tokens, hq, hkv, head_dim, page_size, dtype):
    q, k, v, pos, cs, kc, vc, slots, norm = _case(kh, num_tokens, hq, hkv, head_dim, page_size, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_out = torch.full(q.shape, NAN, dtype=dtype, device=kh.device)
    got_q, got_k = rope_kv_write(q, k, v, pos, cs, kc, vc, slots, q_out=q_out, qk_norm=norm)
    want_q, want_k = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slots, qk_norm=norm)
    # bf16: three roundings (norm, weight, rotation), each may land an ulp apart from a different
    # rstd summation order; the interpreter's casts truncate, so it is looser on the CPU.
    tol = 1e-5 if dtype == torch.float32 else 1e-2 if kh.device == "cuda" else 3e-2
    assert got_q is q_out and not torch.isnan(q_out).any()
    assert kh.rel_err(got_q, want_q) < tol and kh.rel_err(got_k, want_k) < tol
    assert kh.rel_err(kc, kc_ref) < tol and torch.equal(vc, vc_ref)  # V is not normalised
    plain_q, _ = rope_kv_write_reference(q, k, v, pos, cs, kc_ref.clone(), vc_ref.clone(), slots)
    assert kh.rel_err(got_q, plain_q) > 0.1  # the norm did something


def test_qk_norm_rejects_what_it_cannot_apply(kh):
    q, k, v, pos, cs, kc, vc, slots, norm = _case(kh, 2, 4, 2, 32, 8, torch.float32)
    with pytest.raises(ValueError, match=r"qk_norm weights must be \[32\]"):
        rope_kv_write(q, k, v, pos, cs, kc, vc, slots, qk_norm=norm._replace(k_weight=norm.k_weight[:16]))
    with pytest.raises(ValueError, match="qk_norm is applied before RoPE: it needs cos_sin_cache"):
        rope_kv_write(q, k, v, pos, None, kc, vc, slots, qk_norm=norm)


@pytest.mark.parametrize("fused_rope", [True, False], ids=["kernel", "torch-ops"])
def test_pool_write_rope_applies_the_norms_either_way(kh, fused_rope):
    """KVPool.write_rope(qk_norm=): the kernel, or the PyTorch ops off CUDA, the same result."""
    q, k, v, pos, cs, _, _, slots, norm = _case(kh, 4, 8, 2, 32, 8, torch.float32, seed=3)
    slots = slots.clamp(min=0)
    pool = KVPool(1, 3, 8, 2, 32, torch.float32, kh.device, fused_rope=fused_rope)
    got = pool.write_rope(0, q, k, v, pos, cs, slots, norm)
    kc, vc = torch.zeros_like(pool.k_cache[0]), torch.zeros_like(pool.v_cache[0])
    want, _ = rope_kv_write_reference(q, k, v, pos, cs, kc, vc, slots, qk_norm=norm)
    assert kh.rel_err(got, want) < 1e-5 and kh.rel_err(pool.k_cache[0], kc) < 1e-5
