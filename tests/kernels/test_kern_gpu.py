"""The kernels and TritonBackend at real shapes on a GPU (bf16), CUDA-graph capture of a decode
step, and a short benchmark sweep. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from flashlet.attention.torch_ref import TorchBackend
from flashlet.attention.triton_backend import TritonBackend
from flashlet.kernels.decode_attention import (choose_num_splits, decode_attention, decode_attention_one_launch,
                                               decode_attention_reference, pdl_supported)
from flashlet.kernels.embedding import gather_rows
from flashlet.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from flashlet.kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from flashlet.kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference
from flashlet.kernels.silu_mul import silu_and_mul, silu_and_mul_reference
from flashlet.kvcache.kv_pool import KVPool
from flashlet.runner.batch import StepBuffers, StepRow, build_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
BF16 = torch.bfloat16
NAN = float("nan")
MODELS = {"qwen2.5-0.5b": (14, 2), "smollm2": (9, 3)}  # (q heads, kv heads); head_dim 64, page 16


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _randn(*shape, seed=0, dtype=BF16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("splits", ["auto", 1])
def test_decode_bf16(kh, model, splits):
    hq, hkv = MODELS[model]
    kv_lens = [1, 15, 16, 17, 300, 1000, 2049, 4096]
    paged = kh.make_paged(kv_lens, 16, hkv, 64, dtype=BF16, device=DEV)
    q = _randn(len(kv_lens), hq, 64, seed=1)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.125)
    s = choose_num_splits(len(kv_lens), hkv, _sms(), 64) if splits == "auto" else 1
    out = torch.full_like(q, NAN)
    decode_attention(*args, out=out, num_splits=s)
    assert not torch.isnan(out).any()
    assert kh.rel_err(out, decode_attention_reference(*args)) < 1e-2


def test_decode_fp32_gpu(kh):
    kv_lens = [1, 17, 999, 4096]
    paged = kh.make_paged(kv_lens, 16, 2, 64, dtype=torch.float32, device=DEV)
    q = _randn(len(kv_lens), 14, 64, seed=2, dtype=torch.float32)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.125)
    for s in (1, 16):
        out = decode_attention(*args, num_splits=s)
        assert kh.rel_err(out, decode_attention_reference(*args)) < 1e-4  # IEEE dots; GPU exp2 is approximate


@pytest.mark.parametrize("model", list(MODELS))
def test_prefill_mixed_bf16(kh, model):
    hq, hkv = MODELS[model]
    kv_lens = [4096, 1000, 600, 1, 77, 2048]
    q_lens = [512, 1, 600, 1, 13, 1]
    paged = kh.make_paged(kv_lens, 16, hkv, 64, dtype=BF16, device=DEV)
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    q = _randn(qo[-1], hq, 64, seed=3)
    qo_t = torch.tensor(qo, dtype=torch.int32, device=DEV)
    args = (q, paged["k_cache"], paged["v_cache"], qo_t, paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.125)
    out = torch.full_like(q, NAN)
    prefill_attention(*args, out=out)
    assert not torch.isnan(out).any()
    assert kh.rel_err(out, prefill_attention_reference(*args)) < 1e-2


def test_elementwise_bf16(kh):
    t, hidden, inter = 300, 896, 4864
    x, r, w = _randn(t, hidden, seed=4), _randn(t, hidden, seed=5), _randn(hidden, seed=6)
    assert kh.rel_err(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)) < 1e-2
    (a, b), (ra, rb) = add_rms_norm(x, r, w, 1e-6), add_rms_norm_reference(x, r, w, 1e-6)
    assert kh.rel_err(a, ra) < 1e-2 and torch.equal(b, rb)
    gu = _randn(t, 2 * inter, seed=7)
    assert kh.rel_err(silu_and_mul(gu), silu_and_mul_reference(gu)) < 1e-2

    qkv = _randn(t, 18, 64, seed=8)
    q, k, v = qkv.split([14, 2, 2], dim=1)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    cs = kh.cos_sin_cache(4096, 64, base=1e6, device=DEV)
    kc, vc = torch.zeros(40, 16, 2, 64, dtype=BF16, device=DEV), torch.zeros(40, 16, 2, 64, dtype=BF16, device=DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.randperm(640, device=DEV)[:t]
    (q1, k1), (q2, k2) = rope_kv_write(q, k, v, pos, cs, kc, vc, slots), rope_kv_write_reference(
        q, k, v, pos, cs, kc_ref, vc_ref, slots
    )
    assert kh.rel_err(q1, q2) < 1e-2 and kh.rel_err(k1, k2) < 1e-2
    assert kh.rel_err(kc, kc_ref) < 1e-2 and torch.equal(vc, vc_ref)


def test_rope_kv_write_bf16_rounds_once():
    """At Llama-3.2-1B's llama3 table (theta 500000): the fused kernel's rotated q and pooled k
    are the fp32 rotation with the fp32 cos/sin rounded once (as TorchOps.rope): within a hair
    of the rounding floor against the fp64 rotation (FMA contraction may flip a last bit)."""
    from flashlet.models.weights import preset_config_path
    from flashlet.models.model import ModelConfig, rope_cache
    from flashlet.models.ops import TorchOps

    cfg = ModelConfig.from_file(preset_config_path("llama-3.2-1b"))
    table = rope_cache(cfg)[:8320].to(DEV)
    pos = torch.cat([torch.arange(0, 320), torch.arange(8000, 8320)]).to(DEV)
    q, k, v = _randn(640, 32, 64, seed=11), _randn(640, 8, 64, seed=12), _randn(640, 8, 64, seed=13)
    kc, vc = torch.zeros(40, 16, 8, 64, dtype=BF16, device=DEV), torch.zeros(40, 16, 8, 64, dtype=BF16, device=DEV)
    got_q, got_k = rope_kv_write(q, k, v, pos, table, kc, vc, torch.arange(640, device=DEV))
    exact_q, exact_k = TorchOps.rope(q.double(), k.double(), pos, table.double())

    def rms_rel(x, ref):
        return ((x.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).pow(2).mean().sqrt().item()

    for got, exact in ((got_q, exact_q), (got_k, exact_k), (kc.view(640, 8, 64), exact_k)):
        assert rms_rel(got, exact) < 1.02 * rms_rel(exact.to(BF16), exact)
    want_q, _ = TorchOps.rope(q, k, pos, table)
    assert (got_q != want_q).float().mean() < 1e-3


def _bf16_pool(layers=2, pages=1400, seed=0):
    pool = KVPool(layers, pages, 16, 2, 64, BF16, DEV)
    pool.k_cache.copy_(_randn(*pool.k_cache.shape, seed=seed))
    pool.v_cache.copy_(_randn(*pool.v_cache.shape, seed=seed + 1))
    return pool


@pytest.mark.parametrize(
    "seqs,shared",
    [
        ([(4096, 1), (1, 1), (1500, 1), (17, 1), (4000, 1)], {4: (0, 100)}),  # pure decode
        ([(4096, 512), (300, 1), (2000, 1), (64, 64), (1024, 1)], {2: (0, 50)}),  # mixed step
    ],
)
def test_backend_matches_torch_bf16(kh, seqs, shared):
    pool = _bf16_pool()
    meta, _ = kh.make_step(pool, seqs, shared_prefix_pages=shared, device=DEV)
    ref, tri = TorchBackend(pool, 14), TritonBackend(pool, 14)
    ref.plan(meta)
    tri.plan(meta)
    for layer in range(2):
        q = _randn(meta.num_tokens, 14, 64, seed=10 + layer)
        k = _randn(meta.num_tokens, 2, 64, seed=20 + layer)
        v = _randn(meta.num_tokens, 2, 64, seed=30 + layer)
        want = ref.run(layer, q, k, v)
        got = tri.run(layer, q, k, v)
        assert not torch.isnan(got).any()
        assert kh.rel_err(got, want) < 1e-2


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launch"])
def test_plan_allocates_nothing_and_run_does_not_sync(kh, one_launch):
    pool = _bf16_pool(layers=1)
    meta, _ = kh.make_step(pool, [(2000, 1), (5, 1), (700, 1)], device=DEV)
    tri = TritonBackend(pool, 14, one_launch_decode=one_launch)
    q, k, v = _randn(3, 14, 64, seed=1), _randn(3, 2, 64, seed=2), _randn(3, 2, 64, seed=3)
    tri.plan(meta)
    tri.run(0, q, k, v)  # compile outside the checks
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tri.plan(meta)
    assert torch.cuda.memory_allocated() == before
    torch.cuda.set_sync_debug_mode("error")
    try:
        tri.run(0, q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launch"])
def test_decode_step_replays_in_a_cuda_graph(kh, one_launch):
    """Capture run() for a batch of 4 decodes once; replay it with other KV lengths, each step
    loaded into the same step buffers (as the model runner does). One launch: the per-op form
    of up to 16 rows when asked for (PDL on sm_90+); two: the default."""
    batch, max_pages, hq = 4, 256, 14
    pool = _bf16_pool(layers=1, pages=batch * max_pages + 4)
    pages = [pool.allocator.allocate(max_pages) for _ in range(batch)]
    buffers = StepBuffers(batch, batch, batch * max_pages, DEV)

    def load(lens):  # one decode row per sequence, at its last position
        rows = [StepRow([0], n - 1, pages[b]) for b, n in enumerate(lens)]
        return buffers.load(build_layout(rows, 16))[1]

    q, k, v = _randn(batch, hq, 64, seed=1), _randn(batch, 2, 64, seed=2), _randn(batch, 2, 64, seed=3)
    tri = TritonBackend(pool, hq, one_launch_decode=one_launch)
    tri.plan(load([100, 1, 37, 2000]))
    assert tri._decode_one_launch == one_launch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            tri.run(0, q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.run(0, q, k, v)

    for seed, lens in enumerate(([100, 1, 37, 2000], [101, 4096, 38, 2001], [5, 3000, 1, 16])):
        meta = load(lens)
        q.copy_(_randn(batch, hq, 64, seed=40 + seed))
        k.copy_(_randn(batch, 2, 64, seed=50 + seed))
        v.copy_(_randn(batch, 2, 64, seed=60 + seed))
        tri.plan(meta)
        graph.replay()
        ref = TorchBackend(pool, hq)
        ref.plan(meta)
        want = ref.run(0, q, k, v)
        assert kh.rel_err(out, want) < 1e-2, lens
    torch.cuda.synchronize()
    assert not tri._merge_counts.any()


# ---- the fused decode path's one-launch attention and embedding gather (fused-decode-tests) ----


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("splits", [1, 16, 64])
def test_one_launch_bf16_at_batch_one(kh, pdl, splits):
    """Qwen2.5-0.5B's group at the fused path's shape (one sequence), contexts from 1 to 4096
    tokens: against the reference, with poisoned output and partials; 30 launches over the
    same scratch give the same bits each time and leave every merge counter at 0 (a race in
    the last-program merge would show as a differing launch or a stuck counter)."""
    if pdl and not pdl_supported(DEV):
        pytest.skip("PDL needs sm_90+")
    for kv_len in (1, 33, 64, 65, 256, 257, 288, 1000, 4096):
        paged = kh.make_paged([kv_len], 16, 2, 64, dtype=BF16, device=DEV, seed=kv_len)
        q = _randn(1, 14, 64, seed=kv_len)
        args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"],
                0.125)
        scratch = dict(mid_o=torch.full((splits, 14, 64), NAN, device=DEV),
                       mid_lse=torch.full((splits, 14), NAN, device=DEV),
                       merge_counts=torch.zeros(2, dtype=torch.int32, device=DEV))
        want = decode_attention_reference(*args)
        first = None
        for _ in range(30):
            out = torch.full_like(q, NAN)
            decode_attention_one_launch(*args, out=out, num_splits=splits, min_split_tokens=256, pdl=pdl, **scratch)
            if first is None:
                first = out
                assert not torch.isnan(out).any(), kv_len
                assert kh.rel_err(out, want) < 1e-2, kv_len
            assert torch.equal(out, first), kv_len
        torch.cuda.synchronize()
        assert not scratch["merge_counts"].any(), kv_len


@pytest.mark.parametrize("pdl", [False, True])
def test_one_launch_replays_in_a_cuda_graph(kh, pdl):
    """TritonBackend.attend_one_launch for one sequence, captured once, replayed over contexts
    that use 1, 2 and 16 splits (the split count comes from kv_lens on the device)."""
    if pdl and not pdl_supported(DEV):
        pytest.skip("PDL needs sm_90+")
    max_pages, hq = 256, 14
    pool = _bf16_pool(layers=1, pages=max_pages + 4)
    pages = pool.allocator.allocate(max_pages)
    buffers = StepBuffers(1, 1, max_pages, DEV)

    def load(n):
        return buffers.load(build_layout([StepRow([0], n - 1, pages)], 16))[1]

    q, k, v = _randn(1, hq, 64, seed=1), _randn(1, 2, 64, seed=2), _randn(1, 2, 64, seed=3)
    tri = TritonBackend(pool, hq)
    tri.plan(load(100))
    pool.write(0, k, v, tri.meta.slot_mapping)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            tri.attend_one_launch(0, q, pdl=pdl)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.attend_one_launch(0, q, pdl=pdl)
    for seed, n in enumerate((100, 300, 4096, 1, 257)):
        meta = load(n)
        q.copy_(_randn(1, hq, 64, seed=40 + seed))
        tri.plan(meta)
        pool.write(0, _randn(1, 2, 64, seed=50 + seed), _randn(1, 2, 64, seed=60 + seed), meta.slot_mapping)
        graph.replay()
        ref = TorchBackend(pool, hq)
        ref.plan(meta)
        assert kh.rel_err(out, ref.attend(0, q)) < 1e-2, n
    torch.cuda.synchronize()
    assert not tri._merge_counts.any()


@pytest.mark.parametrize("pdl", [False, True])
def test_gather_rows_bf16(pdl):
    if pdl and not pdl_supported(DEV):
        pytest.skip("PDL needs sm_90+")
    weight = _randn(151936, 896, seed=3)
    ids = torch.tensor([151935], device=DEV)
    out = torch.full((1, 896), NAN, device=DEV, dtype=BF16)
    gather_rows(weight, ids, out, pdl=pdl)
    assert torch.equal(out, weight[151935:])


def test_bench_sweep_on_gpu():
    from flashlet.kernels.bench import KERNELS, run_kernel_sweep

    rows = run_kernel_sweep("cuda", batches=(1, 4), contexts=(128, 1024), repeats=3)
    assert {r["kernel"] for r in rows} == set(KERNELS)
    assert rows[0]["copy_gbps"] > 100
    for r in rows:
        assert r["triton_us"] > 0 and r["reference_us"] > 0, r
        assert r["max_rel_err_vs_reference"] < 2e-2, r
