"""The split-KV form of the ragged prefill kernel (num_splits > 1) against its PyTorch reference:
long-context chunks, mixed steps with decodes, contexts shorter than a split, padded steps, fp8
pools (tiny shapes, small splits, so the interpreter runs each case in seconds); and how
TritonBackend configures it (off by default, $FLASHLET_PREFILL_SPLITS, one scratch)."""

from __future__ import annotations

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.attention import triton_backend
from flashlet.attention.torch_ref import TorchBackend
from flashlet.attention.triton_backend import TritonBackend
from flashlet.kernels import prefill_attention as pa
from flashlet.kernels import tuning
from flashlet.kernels.prefill_attention import prefill_attention, prefill_attention_reference, split_scratch
from flashlet.kvcache.kv_pool import KVPool
from tests.conftest import run_to_completion

NAN = float("nan")


def _run(kh, *, kv_lens, q_lens, num_splits, min_split_tokens, group=3, num_kv_heads=1, head_dim=16,
         pad_tokens=0, block_m=16, block_n=16, fp8=False, seed=0):
    """One launch over a step of (kv_len, q_len) sequences (q_len 0: padding or no rows) plus
    pad_tokens rows of no sequence. Real rows must match the reference, the others stay NaN.
    Returns the scratch, poisoned with NaN before the launch."""
    paged = kh.make_paged(kv_lens, 16, num_kv_heads, head_dim, seed=seed)
    k_cache, v_cache = paged["k_cache"], paged["v_cache"]
    k_scale, v_scale = 1.0, 1.0
    if fp8:
        k_scale, v_scale = 0.5, 0.25
        k_cache = (k_cache / k_scale).to(torch.float8_e4m3fn)
        v_cache = (v_cache / v_scale).to(torch.float8_e4m3fn)
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    real = qo[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(real + pad_tokens, group * num_kv_heads, head_dim, generator=gen).to(kh.device)
    tables = (k_cache, v_cache, torch.tensor(qo, dtype=torch.int32, device=kh.device), paged["kv_indptr"],
              paged["kv_indices"], paged["kv_lens"], head_dim**-0.5)
    scratch = split_scratch(num_splits, q.shape[0], q.shape[1], head_dim, kh.device)
    for t in scratch:
        t.fill_(NAN)
    out = torch.full_like(q, NAN)
    prefill_attention(q, *tables, out=out, block_m=block_m, block_n=block_n, num_splits=num_splits,
                      min_split_tokens=min_split_tokens, scratch=scratch, k_scale=k_scale, v_scale=v_scale)
    assert not torch.isnan(out[:real]).any(), "a real row was not written"
    assert torch.isnan(out[real:]).all(), "a row of no sequence was written"
    if real:
        want = prefill_attention_reference(q[:real], *tables, k_scale=k_scale, v_scale=v_scale)
        assert kh.rel_err(out[:real], want) < 1e-5
    return scratch


def _wrote_partials(scratch) -> bool:
    return not torch.isnan(scratch[1]).all()


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_long_context_chunk(kh, num_splits):
    """A chunk late in a long sequence: every tile splits its keys (8: more splits than 32-key
    shares of some tiles' keys, so those tiles use fewer)."""
    scratch = _run(kh, kv_lens=[200], q_lens=[12], num_splits=num_splits, min_split_tokens=32)
    assert _wrote_partials(scratch)


def test_split_mixed_chunk_and_decodes(kh):
    """A chunk beside decodes of long and short contexts, two KV heads (GQA packing per head)."""
    scratch = _run(kh, kv_lens=[150, 180, 20, 97], q_lens=[10, 1, 1, 1], num_splits=4, min_split_tokens=32,
                   num_kv_heads=2)
    assert _wrote_partials(scratch)


def test_split_short_contexts_use_one_split(kh):
    """Contexts under two splits' worth: one split each, written straight to out, no partial
    (the extra split programs exit at once)."""
    scratch = _run(kh, kv_lens=[60, 30, 9], q_lens=[20, 1, 9], num_splits=4, min_split_tokens=32)
    assert not _wrote_partials(scratch)


def test_split_first_chunk_of_a_prompt(kh):
    """A whole prompt in one chunk: early tiles see fewer full blocks than late ones (each tile's
    own split count), the first tile none at all."""
    _run(kh, kv_lens=[96], q_lens=[96], num_splits=4, min_split_tokens=16, group=1)


def test_split_padded_step(kh):
    """A graph-padded step: padding sequences (q_len 0) in the middle and at the end, a sequence
    with no rows this step, rows past the last sequence's untouched."""
    _run(kh, kv_lens=[170, 0, 130, 40, 0], q_lens=[6, 0, 1, 0, 0], num_splits=4, min_split_tokens=32,
         pad_tokens=7)


def test_split_fp8_pool(kh):
    _run(kh, kv_lens=[160, 120], q_lens=[8, 1], num_splits=4, min_split_tokens=32, fp8=True, block_n=32)


def test_split_head_dim_64_and_128(kh):
    for head_dim in (64, 128):
        _run(kh, kv_lens=[130, 70], q_lens=[3, 1], num_splits=2, min_split_tokens=32, head_dim=head_dim,
             group=2, seed=head_dim)


def test_split_allocates_its_scratch_when_not_given(kh):
    paged = kh.make_paged([120], 16, 1, 16)
    q = torch.randn(5, 2, 16, device=kh.device)
    tables = (paged["k_cache"], paged["v_cache"], torch.tensor([0, 5], dtype=torch.int32, device=kh.device),
              paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.25)
    out = prefill_attention(q, *tables, block_m=16, block_n=16, num_splits=3, min_split_tokens=16)
    assert kh.rel_err(out, prefill_attention_reference(q, *tables)) < 1e-5


def test_split_rejects_bad_arguments(kh):
    paged = kh.make_paged([40], 16, 1, 16)
    q = torch.randn(4, 2, 16, device=kh.device)
    tables = (paged["k_cache"], paged["v_cache"], torch.tensor([0, 4], dtype=torch.int32, device=kh.device),
              paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.25)
    with pytest.raises(ValueError, match="num_splits"):
        prefill_attention(q, *tables, num_splits=0)
    with pytest.raises(ValueError, match="split scratch"):
        prefill_attention(q, *tables, num_splits=4, scratch=split_scratch(2, 4, 2, 16, kh.device))
    with pytest.raises(ValueError, match="split scratch"):
        prefill_attention(q, *tables, num_splits=2, scratch=split_scratch(2, 3, 2, 16, kh.device))


# ---- TritonBackend: the config, the env switch, the scratch --------------------------------
BACKEND = dict(num_sms=4, min_split_tokens=16, decode_block_n=16, prefill_block_m=32, prefill_block_n=16)


def _pool(kh, head_dim=16):
    pool = KVPool(2, 64, 8, 2, head_dim, torch.float32, kh.device)
    g = torch.Generator().manual_seed(0)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    return pool


def _spy(monkeypatch) -> list:
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return prefill_attention(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "prefill_attention", spy)
    return calls


def _step_against_torch(kh, pool, tri, seqs):
    meta, _ = kh.make_step(pool, seqs)
    ref = TorchBackend(pool, 6, batched_decode=False)
    ref.plan(meta)
    tri.plan(meta)
    g = torch.Generator().manual_seed(1)
    for layer in range(pool.num_layers):
        q, k, v = (torch.randn(meta.num_tokens, h, pool.head_dim, generator=g).to(kh.device) for h in (6, 2, 2))
        assert kh.rel_err(tri.run(layer, q, k, v), ref.run(layer, q, k, v)) < 1e-5


def test_backend_splits_a_mixed_step_into_its_one_scratch(kh, monkeypatch):
    calls = _spy(monkeypatch)
    pool = _pool(kh)
    tri = TritonBackend(pool, 6, **BACKEND, prefill_num_splits=4, prefill_min_split_tokens=16,
                        prefill_split_min_context=150)
    # splits x rows of the long bucket's config, the most of either bucket (the short one's: 4 x 256)
    assert tri._prefill_scratch[0].shape == (4 * tuning.PREFILL_SPLIT_MAX_TOKENS, 6, 16)
    _step_against_torch(kh, pool, tri, [(150, 9), (120, 1), (30, 1)])
    assert [c["num_splits"] for c in calls] == [4, 4]
    step_scratch = calls[0]["scratch"]
    assert all(c["scratch"] is step_scratch for c in calls)  # one view a step, every layer
    assert step_scratch[0].shape == (4, tri.prefill_config(9).split_max_tokens, 6, 16)  # a short chunk's step
    assert all(v.data_ptr() == t.data_ptr() for v, t in zip(step_scratch, tri._prefill_scratch))


def test_short_chunks_split_more_ways_in_the_same_scratch(kh, monkeypatch):
    """A step of decodes and short chunks (the short bucket: one tile a KV head) beside a long
    context splits 32 ways at head_dim 16 (16 at 128), over at most the rows the one scratch holds
    at that split count; its partials land in the scratch's first splits x rows."""
    monkeypatch.delenv(triton_backend.PREFILL_SPLITS_ENV, raising=False)
    calls = _spy(monkeypatch)
    pool = _pool(kh)
    tri = TritonBackend(pool, 6, **BACKEND, prefill_min_split_tokens=16, prefill_split_min_context=150)
    short = tri.prefill_config(9)
    assert (short.num_splits, short.split_max_tokens) == (32, tuning.PREFILL_SPLIT_SCRATCH_ROWS // 32)
    assert tri._prefill_scratch[0].shape == (tuning.PREFILL_SPLIT_SCRATCH_ROWS, 6, 16)
    for t in tri._prefill_scratch:
        t.fill_(NAN)
    _step_against_torch(kh, pool, tri, [(300, 9), (120, 1), (30, 1)])
    assert [c["num_splits"] for c in calls] == [32, 32]
    acc = calls[0]["scratch"][0]
    assert acc.shape == (32, short.split_max_tokens, 6, 16)
    assert not torch.isnan(acc[1, :11]).all()  # the long sequence's rows wrote a second split
    assert torch.isnan(tri._prefill_scratch[0][32 * short.split_max_tokens:]).all()  # past the view
    assert tri.prefill_splits(9, short.split_max_tokens + 1, 300) == 1  # more rows: unsplit
    wide = tuning.default_prefill(128, 2, tuning.PREFILL_QLEN_BUCKETS[0])
    assert (wide.num_splits, wide.num_splits * wide.split_max_tokens) == (16, tuning.PREFILL_SPLIT_SCRATCH_ROWS)


def test_backend_runs_a_step_past_the_token_limit_unsplit(kh, monkeypatch):
    calls = _spy(monkeypatch)
    pool = _pool(kh)
    tri = TritonBackend(pool, 6, **BACKEND, prefill_num_splits=4, prefill_min_split_tokens=16,
                        prefill_split_max_tokens=8, prefill_split_min_context=1)
    assert tri._prefill_scratch[0].shape[0] == 4 * 8  # every bucket's rows capped at 8
    _step_against_torch(kh, pool, tri, [(100, 9), (60, 1)])  # 10 rows > 8
    assert [(c["num_splits"], c["scratch"]) for c in calls] == [(1, None), (1, None)]


def test_long_chunks_split_past_the_smallest_context_and_the_environment_sets_it(kh, monkeypatch):
    pool = _pool(kh)  # 64 pages of 8: sequences up to 512 tokens
    monkeypatch.delenv(triton_backend.PREFILL_SPLITS_ENV, raising=False)
    default = TritonBackend(pool, 6, **BACKEND)
    assert (default.prefill_config(500).num_splits, default.prefill_config(9).num_splits) == (8, 32)
    assert default.prefill_split_min_context == tuning.PREFILL_SPLIT_MIN_CONTEXT > 512
    assert default._prefill_scratch is None  # no sequence reaches the smallest context
    reach = TritonBackend(pool, 6, **BACKEND, prefill_split_min_context=300)
    assert reach._prefill_scratch[0].shape == (tuning.PREFILL_SPLIT_SCRATCH_ROWS, 6, 16)
    steps = [(500, 600, 299), (500, 600, 300), (9, 600, 300), (9, 200, 300),
             (500, tuning.PREFILL_SPLIT_MAX_TOKENS + 1, 512)]  # (longest chunk, rows, longest KV)
    assert [reach.prefill_splits(*step) for step in steps] == [1, 8, 1, 32, 1]
    assert reach.warm_contexts(600, 500) == (0, 300) and reach.warm_contexts(600, 9) == (0,)
    assert reach.warm_contexts(200, 9) == (0, 300)
    monkeypatch.setenv(triton_backend.PREFILL_SPLITS_ENV, "4,512,256,100")
    on = TritonBackend(pool, 6, **BACKEND)
    cfg = on.prefill_config(500)
    assert (cfg.num_splits, cfg.min_split_tokens, cfg.split_max_tokens,
            on.prefill_split_min_context) == (4, 512, 256, 100)
    assert on.prefill_config(9).split_max_tokens == 256  # every bucket's
    assert on._prefill_scratch[0].shape == (4 * 256, 6, 16)
    assert on.prefill_variant(500) != default.prefill_variant(500)  # mixed graphs keyed apart
    monkeypatch.setenv(triton_backend.PREFILL_SPLITS_ENV, "1")  # off
    assert TritonBackend(pool, 6, **BACKEND, prefill_split_min_context=1)._prefill_scratch is None
    assert TritonBackend(pool, 6, **BACKEND, prefill_num_splits=2).prefill_config(500).num_splits == 2
    for bad in ("0", "4,x", "1,2,3,4,5", "-2"):
        monkeypatch.setenv(triton_backend.PREFILL_SPLITS_ENV, bad)
        with pytest.raises(ValueError, match=triton_backend.PREFILL_SPLITS_ENV):
            TritonBackend(pool, 6, **BACKEND)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine through the interpreter; on a GPU "
                    "tests/gpu/test_gpu_mixed_graphs.py runs the engine with splits")
def test_engine_with_split_prefill_gives_the_oracles_tokens(tiny_qwen2, monkeypatch):
    """$FLASHLET_PREFILL_SPLITS through the engine: a prompt chunked beside another's decodes,
    its later chunks split (partials written), greedy tokens as the torch backend's."""
    cfg = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                       max_num_pages=64)
    # 250 tokens: 4 chunks, the last at 192+ keys (3 full 64-key blocks: 3 splits of 16+ keys)
    prompts = [[3, 5, 7, 9, 11] * 50, [2, 4, 6, 8]]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    tokens = []
    for backend, splits in (("torch", None), ("triton", "4,16,1024,100")):
        if splits:
            monkeypatch.setenv(triton_backend.PREFILL_SPLITS_ENV, splits)
        engine = Engine(cfg.replace(backend=backend))
        if splits:
            scratch = engine.runner.backend._prefill_scratch
            for t in scratch:
                t.fill_(NAN)
        tokens.append([o.token_ids for o in run_to_completion(engine, prompts, params)])
    assert _wrote_partials(scratch)
    assert tokens[0] == tokens[1]


def test_split_launches_keep_two_programs_an_sm():
    """8 warps: a 128-register cap (two programs in 64K registers); 4 warps: none needed (255)."""
    assert pa.split_launch_limits(8) == {"maxnreg": 128}
    assert pa.split_launch_limits(4) == {} and pa.split_launch_limits(2) == {}
