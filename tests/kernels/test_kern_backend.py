"""TritonBackend against TorchBackend (the dense oracle) on ragged steps, fp32, tiny shapes."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlet.attention import triton_backend
from flashlet.attention.base import AttentionBackend
from flashlet.attention.torch_ref import TorchBackend
from flashlet.attention.triton_backend import TritonBackend
from flashlet.kernels import tuning
from flashlet.kernels.decode_attention import decode_attention
from flashlet.kvcache.kv_pool import KVPool
from flashlet.models.ops import TorchOps

SMALL = dict(num_sms=4, min_split_tokens=16, decode_block_n=16, prefill_block_m=32, prefill_block_n=16)


def _pool(kh, *, layers=2, pages=64, page_size=8, num_kv_heads=2, head_dim=16, seed=0, fused_rope=None):
    pool = KVPool(layers, pages, page_size, num_kv_heads, head_dim, torch.float32, kh.device,
                  fused_rope=fused_rope)
    g = torch.Generator().manual_seed(seed)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))  # stands for earlier steps' K/V
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    return pool


def _compare(kh, pool, num_q_heads, seqs, *, shared=None, seed=0, **kwargs):
    meta, _ = kh.make_step(pool, seqs, shared_prefix_pages=shared)
    ref, tri = TorchBackend(pool, num_q_heads, batched_decode=False), TritonBackend(pool, num_q_heads, **{**SMALL, **kwargs})
    ref.plan(meta)
    tri.plan(meta)
    g = torch.Generator().manual_seed(seed)
    t, hkv, d = meta.num_tokens, pool.num_kv_heads, pool.head_dim
    for layer in range(pool.num_layers):
        q = torch.randn(t, num_q_heads, d, generator=g).to(kh.device)
        k = torch.randn(t, hkv, d, generator=g).to(kh.device)
        v = torch.randn(t, hkv, d, generator=g).to(kh.device)
        want = ref.run(layer, q, k, v)
        got = tri.run(layer, q, k, v)  # writes the same K/V again, then attends
        assert got.shape == want.shape
        assert not torch.isnan(got).any()
        assert kh.rel_err(got, want) < 1e-5, f"layer {layer}"
    return tri, meta


def test_mixed_step_with_shared_prefix(kh):
    """A prefill chunk, two decodes (one sharing the chunk's prefix pages) and a fresh prompt."""
    pool = _pool(kh)
    tri, meta = _compare(kh, pool, 14, [(40, 12), (9, 1), (17, 1), (8, 8)], shared={2: (0, 2)})
    assert not meta.is_pure_decode


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launch"])
@pytest.mark.parametrize("group,num_sms", [(3, 4), (7, 64), (1, 4), (8, 16)])
def test_pure_decode_with_split_kv(kh, group, num_sms, one_launch):
    pool = _pool(kh, num_kv_heads=2 if group < 8 else 1)
    hq = group * pool.num_kv_heads
    tri, meta = _compare(kh, pool, hq, [(40, 1), (1, 1), (33, 1)], shared={2: (0, 3)}, num_sms=num_sms,
                         one_launch_decode=one_launch)
    assert meta.is_pure_decode and tri._num_splits > 1 and tri._decode_one_launch == one_launch


def test_pure_decode_above_max_batch_runs_unsplit(kh):
    pool = _pool(kh)
    tri, _ = _compare(kh, pool, 6, [(20, 1), (5, 1), (31, 1)], max_batch_size=2)
    assert tri._num_splits == 1


def test_a_decode_plan_is_its_batch_sizes_variant_each_time(kh):
    """plan keeps each batch size's decode_variant (a speculating stream plans one shape
    every step): alternating sizes, every plan holds that size's variant, as computed anew."""
    pool = _pool(kh, pages=64)
    for one_launch in (True, False):
        tri = TritonBackend(pool, 6, num_sms=4, one_launch_decode=one_launch)
        steps = {n: kh.make_step(pool, [(3 + i, 1) for i in range(n)])[0] for n in (1, 2, 4)}
        fresh = {n: TritonBackend(pool, 6, num_sms=4, one_launch_decode=one_launch).decode_variant(n)
                 for n in steps}
        assert len(set(fresh.values())) >= 2  # sizes of their own variants
        for n in (2, 1, 4, 2, 4, 1):
            tri.plan(steps[n])
            assert (tri._decode_cfg, tri._num_splits) == fresh[n][:2] and tri._decode_one_launch == one_launch


def test_page_size_one_and_sixteen(kh):
    for ps, seqs in ((1, [(9, 3), (4, 1)]), (16, [(33, 17), (16, 1), (1, 1)])):
        pool = _pool(kh, page_size=ps, pages=64)
        _compare(kh, pool, 6, seqs)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    group=st.sampled_from([1, 3, 7, 8]),
    page_size=st.sampled_from([1, 8, 16]),
    seqs=st.lists(
        st.tuples(st.integers(1, 40), st.sampled_from(["decode", "chunk", "prompt"]), st.integers(1, 40)),
        min_size=1,
        max_size=4,
    ),
    share=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_ragged_steps(kh, group, page_size, seqs, share, seed):
    steps = []
    for kv_len, kind, q in seqs:
        q_len = 1 if kind == "decode" else kv_len if kind == "prompt" else min(q, kv_len)
        steps.append((kv_len, q_len))
    shared = None
    if share and len(steps) >= 2:
        n = min(steps[0][0] - steps[0][1], steps[1][0] - steps[1][1]) // page_size
        if n > 0:
            shared = {1: (0, n)}
    hkv = 2 if group < 8 else 1
    pool = _pool(kh, page_size=page_size, pages=200 // page_size * 2 + 8, num_kv_heads=hkv, seed=seed)
    _compare(kh, pool, group * hkv, steps, shared=shared, seed=seed)


@pytest.mark.parametrize("fused", [False, True], ids=["torch-write", "triton-write"])
def test_run_rope_matches_rope_then_run(kh, fused):
    """The model's path (the pool rotates and writes K/V, then attention) against RoPE in
    PyTorch followed by run() on the oracle, with the pool's PyTorch and Triton writes."""
    pool = _pool(kh, head_dim=32, fused_rope=fused)
    meta, _ = kh.make_step(pool, [(20, 6), (11, 1)])
    cs = kh.cos_sin_cache(64, 32)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(meta.num_tokens, 14, 32, generator=g).to(kh.device)
    k = torch.randn(meta.num_tokens, 2, 32, generator=g).to(kh.device)
    v = torch.randn(meta.num_tokens, 2, 32, generator=g).to(kh.device)
    ref, tri = TorchBackend(pool, 14, batched_decode=False), TritonBackend(pool, 14, **SMALL)
    ref.plan(meta)
    tri.plan(meta)
    qr, kr = TorchOps.rope(q, k, meta.positions, cs)
    want = ref.run(0, qr, kr, v)
    k_after, v_after = pool.k_cache.clone(), pool.v_cache.clone()  # the pool as the oracle left it
    pool.k_cache[0].view(-1, 2, 32)[meta.slot_mapping] = float("nan")  # run_rope must rewrite these
    pool.v_cache[0].view(-1, 2, 32)[meta.slot_mapping] = float("nan")
    got = tri.run_rope(0, q, k, v, meta.positions, cs)
    assert kh.rel_err(got, want) < 1e-5
    assert kh.rel_err(pool.k_cache, k_after) < 1e-5 and torch.equal(pool.v_cache, v_after)


def test_decode_rows_past_the_batch_are_zero(kh):
    pool = _pool(kh)
    meta, _ = kh.make_step(pool, [(12, 1), (3, 1)])
    tri = TritonBackend(pool, 6, **SMALL)
    tri.plan(meta)
    q = torch.randn(4, 6, 16).to(kh.device)  # two padding rows
    out = tri._attend(0, q)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    ref = TorchBackend(pool, 6, batched_decode=False)
    ref.plan(meta)
    assert kh.rel_err(out[:2], ref._attend(0, q[:2])) < 1e-5


def test_split_scratch_is_sized_for_every_batch(kh):
    pool = _pool(kh, pages=256)
    tri = TritonBackend(pool, 14, num_sms=132, max_batch_size=64, min_split_tokens=16)
    for b in range(1, 65):
        assert tri._mid_o.shape[0] >= b * tri._splits_for(b)
        assert tri._mid_lse.shape[0] >= b * tri._splits_for(b)
    assert tri._splits_for(65) == 1
    # Long sequences are capped by max_pages_per_seq: 4 pages of 8 tokens, 16 per split -> 2 splits.
    tri = TritonBackend(pool, 14, num_sms=132, max_pages_per_seq=4, min_split_tokens=16)
    assert tri.max_kv_splits == 2 and tri._splits_for(1) == 2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_launch_blocks_hold_a_whole_split_at_small_head_dims(kh, head_dim):
    """At head_dim <= 64 a block is the whole smallest split (all of it loaded before the PDL
    wait), on 8 warps; at 128 the decode config's blocks stay (a 128-key block spills); a fixed
    decode_block_n wins over both. test_kern_decode lowers these tiles for sm_90a. Group 5: no
    ONE_LAUNCH_TABLE entry at either head_dim, so the derived config runs."""
    pool = _pool(kh, pages=256, head_dim=head_dim)
    assert not [key for key in tuning.ONE_LAUNCH_TABLE if key[1] == 5]
    cfg, _ = TritonBackend(pool, 10, num_sms=132).one_launch_config(1)
    if head_dim == 64:
        assert (cfg.block_n, cfg.num_warps) == (cfg.min_split_tokens, 8) == (256, 8)
    else:
        assert (cfg.block_n, cfg.num_warps) == (32, 4)
    fixed, _ = TritonBackend(pool, 10, num_sms=132, decode_block_n=16).one_launch_config(1)
    assert fixed.block_n == 16


def test_backend_interface(kh):
    assert TritonBackend.name == "triton" and issubclass(TritonBackend, AttentionBackend)
    params = list(inspect.signature(TritonBackend.__init__).parameters)
    assert params[:4] == ["self", "kv_pool", "num_q_heads", "scale"]
    pool = _pool(kh)
    assert TritonBackend(pool, 6).scale == pytest.approx(16**-0.5)
    with pytest.raises(ValueError, match="KV heads"):
        TritonBackend(pool, 5)


def _fp8_pool(kh, pages=256, head_dim=64):
    return KVPool(2, pages, 16, 2, head_dim, torch.float32, kh.device, cache_dtype=torch.float8_e4m3fn)


def test_batched_decode_config_is_measured_per_kv_dtype(kh, monkeypatch):
    """An fp8 pool's two-launch decode takes the fp8 row of BATCHED_DECODE_TABLE (tile, splits,
    prefetch); a pool of the model's dtype takes its own row; the one-launch decode reads neither."""
    fp8 = tuning.DecodeConfig(block_n=128, num_warps=2, num_stages=3, num_splits=4, prefetch="pages")
    model = tuning.DecodeConfig(block_n=32, num_warps=1, num_stages=2, num_splits=1)
    monkeypatch.setitem(tuning.BATCHED_DECODE_TABLE, (64, 7, "fp8", 256), fp8)
    monkeypatch.setitem(tuning.BATCHED_DECODE_TABLE, (64, 7, "model", 256), model)
    fp8_backend = TritonBackend(_fp8_pool(kh), 14, num_sms=132, max_batch_size=256)
    assert fp8_backend.decode_variant(128) == (fp8, 4)
    monkeypatch.delitem(tuning.BATCHED_DECODE_TABLE, (64, 7, "fp8", 64), raising=False)
    default = tuning.default_decode(64, 7, 64)  # a bucket without a row: the defaults
    assert fp8_backend.decode_variant(64) == (default, tuning.num_splits(64, 2, 132, default.waves, 64))
    model_backend = TritonBackend(_pool(kh, pages=256, head_dim=64), 14, num_sms=132, max_batch_size=256)
    assert model_backend.decode_variant(128) == (model, 1)
    cfg, _ = model_backend.one_launch_config(128)
    assert isinstance(cfg, tuning.OneLaunchConfig) and cfg.num_stages == tuning.default_decode(64, 7, 256).num_stages
    # The scratch holds every batch's splits, of either decode form.
    for b in (1, 100, 128, 256):
        assert fp8_backend._mid_o.shape[0] >= b * max(fp8_backend._splits_for(b), fp8_backend.one_launch_config(b)[1])
    with pytest.raises(ValueError, match="kv"):
        tuning.batched_decode_config(64, 7, 128, "fp16")


def test_a_measured_split_count_is_capped_like_the_computed_one():
    cfg = tuning.DecodeConfig(num_splits=8)
    assert tuning.config_splits(cfg, 128, 2, 132, max_splits=64) == 8
    assert tuning.config_splits(cfg, 128, 2, 132, max_splits=6) == 4  # rounded down to a power of two
    assert tuning.config_splits(tuning.DecodeConfig(waves=2), 128, 2, 132, 64) == tuning.num_splits(128, 2, 132, 2, 64)


def test_fp8_pool_decode_step_runs_the_table_config(kh, monkeypatch):
    """The backend passes the table's prefetch and split count to the kernel: an fp8 pool's
    pure-decode step against the torch oracle with the prefetched, 4-split config."""
    monkeypatch.setitem(tuning.BATCHED_DECODE_TABLE, (16, 3, "fp8", 4),
                        tuning.DecodeConfig(block_n=16, num_warps=1, num_stages=1, min_split_tokens=16,
                                            num_splits=4, prefetch="blocks"))
    tri, ref, q = _fp32_step(kh, torch.float8_e4m3fn)
    assert tri.decode_variant(3)[1] == 4
    assert kh.rel_err(tri._attend(0, q), ref._attend(0, q)) < 1e-5


def _fp32_step(kh, cache_dtype=None):
    """An fp32 model's decode step (group 3) of three sequences over a two-KV-head pool of
    cache_dtype (None: fp32): (TritonBackend, TorchBackend, q), planned."""
    pool = KVPool(2, 64, 8, 2, 16, torch.float32, kh.device, cache_dtype=cache_dtype)
    g = torch.Generator().manual_seed(0)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g).to(pool.k_cache.dtype))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g).to(pool.v_cache.dtype))
    meta, _ = kh.make_step(pool, [(40, 1), (70, 1), (5, 1)])
    tri = TritonBackend(pool, 6, num_sms=4, one_launch_decode=False)  # the tables' form
    ref = TorchBackend(pool, 6, batched_decode=False)
    tri.plan(meta)
    ref.plan(meta)
    return tri, ref, torch.randn(3, 6, 16, generator=g).to(kh.device)


def test_bf16_model_over_an_fp8_pool_runs_the_v_pairs_path(kh, monkeypatch):
    """The engine's case for the measured fp8 rows: a bf16 model's q over an fp8 pool with the
    page ids carried ("pages"), so V is read as uint16 pairs and the dots run in fp16."""
    monkeypatch.setitem(tuning.BATCHED_DECODE_TABLE, (16, 7, "fp8", 4),
                        tuning.DecodeConfig(block_n=16, num_warps=4, num_stages=3, min_split_tokens=16,
                                            num_splits=2, prefetch="pages"))
    tri, ref, q = _bf16_step_over_an_fp8_pool(kh)
    assert tri.decode_variant(3)[0].prefetch == "pages"
    assert kh.rel_err(tri._attend(0, q).float(), ref._attend(0, q).float()) < 2e-2


def _bf16_step_over_an_fp8_pool(kh):
    """A bf16 model's decode step (group 7) over a scaled two-KV-head fp8 pool, its sequences
    ending mid-page, on a page and two splits long: (TritonBackend, TorchBackend, q), planned."""
    pool = KVPool(2, 64, 16, 2, 16, torch.bfloat16, kh.device, cache_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(0)
    pool.k_scales[0], pool.v_scales[0] = 0.05, 0.02
    pool.k_cache.copy_((torch.randn(pool.k_cache.shape, generator=g) * 20).to(torch.float8_e4m3fn))
    pool.v_cache.copy_((torch.randn(pool.v_cache.shape, generator=g) * 50).to(torch.float8_e4m3fn))
    meta, _ = kh.make_step(pool, [(47, 1), (16, 1), (70, 1)])
    tri = TritonBackend(pool, 14, num_sms=4, one_launch_decode=False)  # the tables' form
    ref = TorchBackend(pool, 14, batched_decode=False)
    tri.plan(meta)
    ref.plan(meta)
    return tri, ref, torch.randn(3, 14, 16, generator=g).bfloat16().to(kh.device)


def _spy_on_decode(monkeypatch) -> list:
    """The keyword arguments of each decode_attention call the backend makes, in order."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    return seen


def test_a_table_row_of_packed_kv_heads_reaches_the_kernel(kh, monkeypatch):
    """A row's kv_pack (KV heads a program) is passed to the kernel, lowered to what divides the
    pool's KV heads; the step matches the torch oracle."""
    monkeypatch.setitem(tuning.BATCHED_DECODE_TABLE, (16, 7, "fp8", 4),
                        tuning.DecodeConfig(block_n=16, num_warps=4, num_stages=3, min_split_tokens=16,
                                            num_splits=2, prefetch="pages", kv_pack=4))
    seen = _spy_on_decode(monkeypatch)
    tri, ref, q = _bf16_step_over_an_fp8_pool(kh)
    assert kh.rel_err(tri._attend(0, q).float(), ref._attend(0, q).float()) < 2e-2
    assert seen[-1]["kv_heads_per_program"] == 2  # 4 asked, the pool has 2 KV heads


def test_a_table_row_merging_in_the_kernel_gets_the_backends_counters(kh, monkeypatch):
    """merge_in_kernel: the backend passes its zeroed counters (no merge launch); the step
    matches the torch oracle and leaves them at zero for the next step (or graph replay)."""
    monkeypatch.setitem(tuning.BATCHED_DECODE_TABLE, (16, 3, "model", 4),
                        tuning.DecodeConfig(block_n=16, num_warps=1, num_stages=3, min_split_tokens=16,
                                            num_splits=4, prefetch="pages", kv_pack=2, merge_in_kernel=True))
    seen = _spy_on_decode(monkeypatch)
    tri, ref, q = _fp32_step(kh)
    for _ in range(2):
        assert kh.rel_err(tri._attend(0, q), ref._attend(0, q)) < 1e-5
        assert seen[-1]["merge_counts"] is tri._merge_counts and not tri._merge_counts.any()


def test_kv_pack_is_lowered_to_divide_the_kv_heads():
    cfg = tuning.DecodeConfig(kv_pack=4)
    assert [tuning.kv_pack_for(cfg, h) for h in (1, 2, 3, 4, 8, 6)] == [1, 2, 1, 4, 4, 2]
    assert tuning.kv_pack_for(tuning.DecodeConfig(kv_pack=3), 8) == 2  # a power of two
    # Splits aimed at by `waves` count programs of kv_pack heads.
    packed = tuning.DecodeConfig(waves=2, kv_pack=2)
    assert tuning.config_splits(packed, 32, 2, 132, 64) == tuning.num_splits(32, 1, 132, 2, 64)
