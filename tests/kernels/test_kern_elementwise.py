"""RoPE + K/V write, RMSNorm, fused add + RMSNorm, SiLU-and-mul, and TritonOps vs TorchOps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlet.kernels.ops import TritonOps
from flashlet.kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from flashlet.kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference
from flashlet.kernels.silu_mul import silu_and_mul, silu_and_mul_reference
from flashlet.models.ops import TorchOps

NAN = float("nan")


def _randn(*shape, seed=0, dtype=torch.float32, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


# ---------------------------------------------------------------- RoPE + K/V write


def _rope_case(kh, num_tokens, hq, hkv, head_dim, page_size, seed=0):
    dev = kh.device
    qkv = _randn(num_tokens, hq + 2 * hkv, head_dim, seed=seed, device=dev)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)  # non-contiguous views, as a fused QKV projection gives
    g = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 64, (num_tokens,), generator=g).to(dev)
    num_pages = -(-num_tokens // page_size) + 2
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens].to(dev)
    if num_tokens > 2:
        slots[1] = -1  # a padding row: no write
    k_cache = _randn(num_pages, page_size, hkv, head_dim, seed=seed + 2, device=dev)
    v_cache = _randn(num_pages, page_size, hkv, head_dim, seed=seed + 3, device=dev)
    return q, k, v, positions, kh.cos_sin_cache(64, head_dim), k_cache, v_cache, slots


@pytest.mark.parametrize(
    "num_tokens,hq,hkv,head_dim,page_size",
    [(7, 14, 2, 64, 16), (5, 9, 3, 64, 1), (1, 4, 4, 32, 8), (9, 7, 1, 24, 8)],  # 24: a half of 12, padded
)
def test_rope_kv_write_matches_reference(kh, num_tokens, hq, hkv, head_dim, page_size):
    q, k, v, pos, cs, kc, vc, slots = _rope_case(kh, num_tokens, hq, hkv, head_dim, page_size)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_out = torch.full((num_tokens, hq, head_dim), NAN, device=kh.device)
    k_out = torch.full((num_tokens, hkv, head_dim), NAN, device=kh.device)
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = rope_kv_write(q, k, v, pos, cs, kc, vc, slots, q_out=q_out, k_out=k_out)
    want_q, want_k = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slots)
    assert got_q is q_out and got_k is k_out
    assert not torch.isnan(q_out).any() and not torch.isnan(k_out).any()
    assert kh.rel_err(q_out, want_q) < 1e-5
    assert kh.rel_err(k_out, want_k) < 1e-5
    assert kh.rel_err(kc, kc_ref) < 1e-5  # written slots match, the others (and slot -1) untouched
    assert torch.equal(vc, vc_ref)
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # inputs not modified


def test_rope_in_place_and_write_only(kh):
    q, k, v, pos, cs, kc, vc, slots = _rope_case(kh, 6, 14, 2, 64, 16, seed=5)
    q, k = q.contiguous(), k.contiguous()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want_q, want_k = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slots)
    got_q, got_k = rope_kv_write(q, k, v, pos, cs, kc, vc, slots, q_out=q, k_out=k)  # rotate in place
    assert got_q is q and got_k is k
    assert kh.rel_err(q, want_q) < 1e-5 and kh.rel_err(k, want_k) < 1e-5
    assert kh.rel_err(kc, kc_ref) < 1e-5 and torch.equal(vc, vc_ref)

    # No cos/sin cache: a plain K/V write, q untouched.
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    kc2_ref, vc2_ref = kc2.clone(), vc2.clone()
    rope_kv_write(None, k, v, None, None, kc2, vc2, slots)
    rope_kv_write_reference(None, k, v, None, None, kc2_ref, vc2_ref, slots)
    assert torch.equal(kc2, kc2_ref) and torch.equal(vc2, vc2_ref)
    assert kc2.abs().sum() > 0


def test_rope_without_k_out(kh):
    q, k, v, pos, cs, kc, vc, slots = _rope_case(kh, 4, 7, 1, 32, 8, seed=9)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want_q, _ = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slots)
    got_q, got_k = rope_kv_write(q, k, v, pos, cs, kc, vc, slots, return_k=False)
    assert got_k is None
    assert kh.rel_err(got_q, want_q) < 1e-5 and kh.rel_err(kc, kc_ref) < 1e-5


def test_pool_write_rope_is_the_same_on_the_kernel_and_in_pytorch(kh):
    """KVPool.write_rope, the one place K/V enter the pool: the Triton kernel against PyTorch
    ops on a strided q/k/v (a fused QKV projection's views), layer 1 of a two-layer pool."""
    from flashlet.kvcache.kv_pool import KVPool

    q, k, v, pos, cs, _, _, slots = _rope_case(kh, 7, 14, 2, 64, 4, seed=3)
    slots = slots.clamp_min(0).unique()[:3]  # distinct slots, no padding row
    q, k, v, pos = q[:3], k[:3], v[:3], pos[:3]
    pools = [KVPool(2, 8, 4, 2, 64, torch.float32, kh.device, fused_rope=f) for f in (False, True)]
    rotated = [pool.write_rope(1, q, k, v, pos, cs, slots) for pool in pools]
    assert kh.rel_err(rotated[1], rotated[0]) < 1e-5
    assert kh.rel_err(pools[1].k_cache, pools[0].k_cache) < 1e-5
    assert torch.equal(pools[1].v_cache, pools[0].v_cache)
    assert pools[0].k_cache[0].abs().sum() == 0 and pools[0].k_cache[1].abs().sum() > 0
    want_q, want_k = TorchOps.rope(q, k, pos, cs)
    assert torch.equal(rotated[0], want_q)
    assert torch.equal(pools[0].k_cache[1].view(-1, 2, 64)[slots], want_k)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("rows,hidden", [(1, 40), (5, 64), (3, 896)])
def test_rms_norm_matches_reference(kh, rows, hidden):
    x = _randn(rows, hidden, seed=1, device=kh.device) * 3
    w = _randn(hidden, seed=2, device=kh.device)
    out = torch.full_like(x, NAN)
    got = rms_norm(x, w, 1e-6, out=out)
    assert got is out and not torch.isnan(out).any()
    assert kh.rel_err(out, rms_norm_reference(x, w, 1e-6)) < 1e-5


@pytest.mark.parametrize("rows,hidden", [(1, 40), (4, 576), (2, 896)])
def test_add_rms_norm_matches_reference(kh, rows, hidden):
    x = _randn(rows, hidden, seed=3, device=kh.device)
    r = _randn(rows, hidden, seed=4, device=kh.device) * 5
    w = _randn(hidden, seed=5, device=kh.device)
    x_in, r_in = x.clone(), r.clone()
    out, res = torch.full_like(x, NAN), torch.full_like(x, NAN)
    got, got_res = add_rms_norm(x, r, w, 1e-5, out=out, residual_out=res)
    want, want_res = add_rms_norm_reference(x, r, w, 1e-5)
    assert got is out and got_res is res
    assert not torch.isnan(out).any() and not torch.isnan(res).any()
    assert kh.rel_err(out, want) < 1e-5 and torch.equal(res, want_res)
    assert torch.equal(x, x_in) and torch.equal(r, r_in)


def test_add_rms_norm_without_residual_and_3d(kh):
    x = _randn(2, 3, 32, seed=6, device=kh.device)
    w = _randn(32, seed=7, device=kh.device)
    y, res = add_rms_norm(x, None, w, 1e-6)
    assert res is x
    assert y.shape == x.shape and kh.rel_err(y, rms_norm_reference(x, w, 1e-6)) < 1e-5


def test_rms_norm_output_dtype_follows_torch_promotion(kh):
    x = _randn(2, 32, seed=8, device=kh.device).to(torch.bfloat16)
    w = _randn(32, seed=9, device=kh.device)  # fp32 weight
    assert rms_norm(x, w, 1e-6).dtype == rms_norm_reference(x, w, 1e-6).dtype == torch.float32


# ---------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("rows,inter", [(1, 24), (3, 37), (2, 1100)])  # 1100: two column blocks
def test_silu_mul_matches_reference(kh, rows, inter):
    x = _randn(rows, 2 * inter, seed=10, device=kh.device) * 4
    out = torch.full((rows, inter), NAN, device=kh.device)
    got = silu_and_mul(x, out=out)
    assert got is out and not torch.isnan(out).any()
    assert kh.rel_err(out, silu_and_mul_reference(x)) < 1e-5


# ---------------------------------------------------------------- TritonOps vs TorchOps


@settings(max_examples=5, deadline=None, derandomize=True)
@given(tokens=st.integers(1, 6), hidden=st.sampled_from([16, 40, 96]), seed=st.integers(0, 100))
def test_triton_ops_match_torch_ops(kh, tokens, hidden, seed):
    dev = kh.device
    x = _randn(tokens, hidden, seed=seed, device=dev)
    r = _randn(tokens, hidden, seed=seed + 1, device=dev)
    w = _randn(hidden, seed=seed + 2, device=dev)
    assert kh.rel_err(TritonOps.rms_norm(x, w, 1e-6), TorchOps.rms_norm(x, w, 1e-6)) < 1e-5
    (a, b), (c, d) = TritonOps.add_rms_norm(x, r, w, 1e-6), TorchOps.add_rms_norm(x, r, w, 1e-6)
    assert kh.rel_err(a, c) < 1e-5 and torch.equal(b, d)
    assert kh.rel_err(TritonOps.silu_and_mul(x), TorchOps.silu_and_mul(x)) < 1e-5

    q = _randn(tokens, 7, 32, seed=seed + 3, device=dev)
    k = _randn(tokens, 1, 32, seed=seed + 4, device=dev)
    pos = torch.arange(tokens, device=dev) * 3
    cs = kh.cos_sin_cache(32, 32)
    (q1, k1), (q2, k2) = TritonOps.rope(q, k, pos, cs), TorchOps.rope(q, k, pos, cs)
    assert kh.rel_err(q1, q2) < 1e-5 and kh.rel_err(k1, k2) < 1e-5


def test_triton_ops_interface_matches_torch_ops():
    import inspect

    assert TritonOps.name == "triton"
    for name in ("linear", "rms_norm", "add_rms_norm", "silu_and_mul", "rope"):
        assert list(inspect.signature(getattr(TritonOps, name)).parameters) == list(
            inspect.signature(getattr(TorchOps, name)).parameters
        ), name
