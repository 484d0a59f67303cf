"""Engine-start warm-up and the kernel tuning tables: a finite, enumerable set of kernel variants,
warm-up that leaves the engine exactly as it found it, `--backend auto`'s choice."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.attention import create_backend, resolve_backend
from flashlet.attention.triton_backend import TritonBackend
from flashlet.core.warmup import (chunk_contexts, chunk_lengths, eager_chunk_steps, count_triton_compiles, decode_sizes, mixed_graph_steps,
                             representatives, warm_up)
from flashlet.kernels import tuning
from flashlet.kvcache.kv_pool import KVPool
from flashlet.runner.model_runner import mixed_graph_buckets


def _pool(num_kv_heads=2, head_dim=64, pages=64):
    return KVPool(1, pages, 16, num_kv_heads, head_dim, torch.float32, "cpu")


# ---- tuning tables -----------------------------------------------------------------------
def test_bucket_is_the_smallest_that_holds_the_value():
    b = tuning.DECODE_BATCH_BUCKETS
    assert [tuning.bucket(n, b) for n in (1, 2, 4, 5, 16, 17, 64, 65, 256, 1000)] == \
        [1, 4, 4, 16, 16, 64, 64, 256, 256, 256]


def test_table_entries_win_over_defaults(monkeypatch):
    entry = tuning.DecodeConfig(block_n=128, num_warps=8, num_stages=3, min_split_tokens=256, waves=1)
    monkeypatch.setitem(tuning.DECODE_TABLE, (128, 6, 16), entry)
    assert tuning.decode_config(128, 6, 9) == entry  # 9 falls in bucket 16
    assert tuning.decode_config(128, 6, 17) == tuning.default_decode(128, 6, 64)
    assert tuning.decode_config(64, 7, 9) == tuning.default_decode(64, 7, 16)
    pentry = tuning.PrefillConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)
    monkeypatch.setitem(tuning.PREFILL_TABLE, (64, 8, tuning.PREFILL_QLEN_BUCKETS[-1]), pentry)
    assert tuning.prefill_config(64, 8, 2048) == pentry
    assert tuning.prefill_config(64, 8, 3) == tuning.default_prefill(64, 8, 16)


def test_defaults_are_valid_for_every_shape():
    for head_dim in (64, 128):
        for group in range(1, 9):
            for b in tuning.DECODE_BATCH_BUCKETS:
                c = tuning.default_decode(head_dim, group, b)
                assert c.block_n >= 16 and c.block_n & (c.block_n - 1) == 0 and c.waves >= 1
            for b in tuning.PREFILL_QLEN_BUCKETS:
                c = tuning.default_prefill(head_dim, group, b)
                assert min(c.block_m, c.block_n) >= 16


def test_num_splits_is_a_power_of_two_within_the_cap():
    for b in range(1, 300):
        s = tuning.num_splits(b, 2, 132, 2, 48)
        assert 1 <= s <= 32 and s & (s - 1) == 0
    assert tuning.num_splits(1, 2, 132, 4, 64) == 64 and tuning.num_splits(256, 8, 132, 2, 64) == 1


def test_auto_picks_torch_off_cuda_and_the_table_on_cuda(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu"), 64, 7)[0] == "torch"
    assert resolve_backend("triton", torch.device("cpu"), 64, 7) == ("triton", "asked for by name")
    assert type(create_backend("auto", _pool(), 4)).__name__ == "TorchBackend"
    monkeypatch.setitem(tuning.BACKEND_PREFERENCE, (64, 8, "prefill"), "flashinfer")
    assert tuning.preferred_backend(64, 8, flashinfer_ok=True)[0] == "flashinfer"
    assert tuning.preferred_backend(64, 8, flashinfer_ok=True, kind="decode")[0] == "triton"  # its own entry
    name, why = tuning.preferred_backend(64, 8, flashinfer_ok=False)
    assert name == "triton" and "not importable" in why
    with pytest.raises(ValueError, match="step kind"):
        tuning.preferred_backend(64, 8, flashinfer_ok=True, kind="mixed")
    assert tuning.preferred_backend(128, 3, flashinfer_ok=True)[0] == "flashinfer"  # default rule
    assert tuning.preferred_backend(64, 3, flashinfer_ok=True)[0] == "triton"


# ---- the variants are finite and warm-up reaches each -------------------------------------
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(64, 14, 2), (128, 12, 2), (64, 32, 4), (128, 16, 8)])
def test_warmup_steps_reach_every_kernel_variant(head_dim, num_q_heads, num_kv_heads):
    tri = TritonBackend(_pool(num_kv_heads, head_dim), num_q_heads, num_sms=132)
    chunks = chunk_lengths(tri, 2048)
    assert {tri.prefill_variant(n) for n in range(1, 2049)} == {tri.prefill_variant(n) for n in chunks}
    assert len(chunks) <= len(tuning.PREFILL_QLEN_BUCKETS)

    class EagerRunner:  # decode_sizes reads only these
        use_graphs, backend, decode_backend, graph_sizes = False, tri, tri, [1, 2, 4, 8, 16, 32, 64, 128, 256]

    sizes = decode_sizes(EagerRunner, 256)
    assert {tri.decode_variant(b) for b in range(1, 257)} == {tri.decode_variant(b) for b in sizes}
    EagerRunner.use_graphs = True  # with graphs: every captured size (each holds its variant)
    assert decode_sizes(EagerRunner, 256) == EagerRunner.graph_sizes
    # Graph sizes cover the variants too: every batch replays the graph of its padded size.
    padded = [next(s for s in EagerRunner.graph_sizes if s >= b) for b in range(1, 257)]
    assert {tri.decode_variant(p) for p in padded} <= {tri.decode_variant(s) for s in EagerRunner.graph_sizes}


def test_a_backend_with_one_variant_warms_up_with_one_step_of_each_kind():
    """The interface says which backends compile per shape: the others (the torch oracle here)
    answer None and the warm-up runs one prefill and one decode step."""
    torch_backend = create_backend("torch", _pool(), 4)
    assert torch_backend.decode_variant(7) is None and torch_backend.prefill_variant(9) is None
    assert chunk_lengths(torch_backend, 2048) == [16]

    class EagerRunner:
        use_graphs, backend, decode_backend = False, torch_backend, torch_backend

    assert decode_sizes(EagerRunner, 256) == [1]


def test_flashinfer_warms_up_each_query_tile_and_a_split_step(monkeypatch, request):
    """FlashInfer's FA2 plan() picks a 16-, 64- or 128-row query tile from the packed query
    length (rows x group), each a kernel CUDA loads at its first launch: on the H200 a first
    1,000-token prompt's step took 17.7 ms against 3.3 warm. The warm-up runs one chunk step
    per tile, each with no context and with a long one (plan() then splits the KV and a merge
    kernel runs)."""
    name = "flashlet.attention.flashinfer_backend"
    if importlib.util.find_spec("flashinfer") is None:  # a stand-in for the import, dropped after
        monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
        monkeypatch.delitem(sys.modules, name, raising=False)
        request.addfinalizer(lambda: sys.modules.pop(name, None))
    module = importlib.import_module(name)
    SPLIT_WARM_CONTEXT, FlashInferBackend = module.SPLIT_WARM_CONTEXT, module.FlashInferBackend

    for group, lengths in ((2, [2, 9, 33]), (7, [2, 3, 10]), (1, [2, 17, 65])):
        backend = types.SimpleNamespace(num_q_heads=8 * group, num_kv_heads=8)
        backend.prefill_variant = lambda n, b=backend: FlashInferBackend.prefill_variant(b, n)
        assert chunk_lengths(backend, 2048) == lengths
        tiles = [backend.prefill_variant(n)[1] for n in lengths]
        assert tiles == [16, 64, 128]
        assert {backend.prefill_variant(n) for n in range(2, 2049)} == set(map(backend.prefill_variant, lengths))
    backend.warm_contexts = lambda t, q, b=backend: FlashInferBackend.warm_contexts(b, t, q)
    assert chunk_contexts(backend, 33, 33, 32768) == [0, SPLIT_WARM_CONTEXT - 33]
    assert chunk_contexts(backend, 33, 33, 1024) == [0]  # a long context the model cannot hold


@pytest.mark.parametrize("max_seqs,budget,max_chunk,max_model_len", [
    (8, 300, 300, 2048), (4, 256, 100, 4096), (256, 8192, 4096, 32768)])
def test_mixed_graph_steps_capture_every_reachable_graph_and_no_other(max_seqs, budget, max_chunk,
                                                                      max_model_len):
    """Every step a scheduler can form (at most max_seqs sequences, chunks of at most max_chunk
    tokens, at most `budget` tokens, one chunk of 2+) replays a graph that the warm-up captures;
    and the warm-up captures no graph that no step replays."""
    tri = TritonBackend(_pool(1, 64), 2, num_sms=132)  # group 2: two prefill variants

    class Runner:  # mixed_graph_steps reads only these
        use_mixed_graphs, backend, token_buckets = True, tri, mixed_graph_buckets(budget)

    def key(tokens, longest, max_kv_len):
        bucket = next(t for t in Runner.token_buckets if t >= tokens)
        return bucket, tri.prefill_variant(longest), tri.prefill_splits(longest, bucket, max_kv_len)

    steps = mixed_graph_steps(Runner, max_chunk, max_seqs, max_model_len)
    captured = [key(bucket, q, context + q) for bucket, q, context in steps]
    assert len(set(captured)) == len(captured)
    reachable = set()
    for longest in range(2, max_chunk + 1):  # the token counts of its steps, bucket by bucket
        most, below = min(budget, max_seqs * longest), 0
        for bucket in Runner.token_buckets:
            if max(longest, below + 1) <= min(most, bucket):
                reachable |= {key(bucket, longest, kv) for kv in (longest, max_model_len)}
            below = bucket
    assert set(captured) == reachable
    splitting = {k for k in captured if k[2] > 1}
    assert bool(splitting) == (max_model_len >= tri.prefill_split_min_context)
    Runner.use_mixed_graphs = False
    assert mixed_graph_steps(Runner, max_chunk, max_seqs) == []


def test_representatives_keep_the_first_value_of_each_variant():
    assert representatives(lambda n: n // 10, range(1, 35)) == [1, 10, 20, 30]


def test_warm_up_leaves_the_engine_as_it_found_it(tiny_qwen2):
    """Warm-up writes only the scratch page: same greedy tokens, no page held, nothing cached."""
    cfg = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    cold, warm = Engine(cfg), Engine(cfg)
    assert cold.start_report["warmed_up"] is False and cold.start_report["load_s"] > 0
    report = warm_up(warm)
    assert report["decode_sizes"] == [1] and report["chunk_lengths"] == [16]
    assert warm.kv_pool.allocator.num_used == 0 and warm.scheduler.cache.num_pages == 0
    prompts = [[3, 5, 7, 9, 11] * 5, [2, 4, 6]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = []
    for engine in (cold, warm):
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outs.append([done[i] for i in ids])
    assert outs[0] == outs[1]


def test_compile_counter_counts_a_new_triton_variant():
    triton = pytest.importorskip("triton")
    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip("this Triton has no compile hooks")
    if not torch.cuda.is_available():
        pytest.skip("the interpreter compiles nothing (TRITON_INTERPRET=1 on CPU)")
    from flashlet.kernels.silu_mul import silu_and_mul

    x = torch.randn(3, 2 * 96, device="cuda")
    with count_triton_compiles() as first:
        silu_and_mul(x, block=32)
    with count_triton_compiles() as again:
        silu_and_mul(x, block=32)
    assert first.count >= 1 and again.count == 0


@pytest.mark.slow
def test_warm_up_runs_every_triton_variant_step(tiny_qwen2):
    """The Triton backend's warm-up steps (interpreter on the CPU): one chunk step per prefill
    bucket (from 2 tokens: a step of 1-token chunks is a pure-decode step) and one eager decode
    step per decode variant; the engine then gives the same tokens as the torch backend."""
    cfg = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
                       max_num_pages=32)
    engine = Engine(cfg.replace(backend="triton"))
    report = warm_up(engine)
    backend = engine.runner.backend
    assert report["chunk_lengths"] == [2, tuning.PREFILL_QLEN_BUCKETS[0] + 1]
    assert {backend.decode_variant(b) for b in report["decode_sizes"]} == \
        {backend.decode_variant(b) for b in range(1, 5)}
    assert engine.kv_pool.allocator.num_used == 0
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outs = []
    for e in (engine, Engine(cfg.replace(backend="torch"))):
        rid = e.add_request([3, 1, 4, 1, 5, 9, 2, 6], params)
        done = {}
        while e.has_unfinished():
            done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
        outs.append(done[rid])
    assert outs[0] == outs[1]


def test_without_mixed_graphs_the_warm_up_runs_a_chunk_of_each_token_buckets_length():
    """A backend without mixed graphs (FlashInfer) runs chunk steps eagerly, their GEMMs at the
    chunk's token count: on CUDA the warm-up runs one step at each token bucket's length too (a
    first 1,000-token prompt through FlashInfer on the H200 took 22-27 ms to its first token
    against 5 through the triton backend's captured mixed graphs). On the CPU, where nothing
    loads lazily, the variants alone."""
    torch_backend = create_backend("torch", _pool(), 4)
    runner = types.SimpleNamespace(backend=torch_backend, device=torch.device("cuda"),
                                   token_buckets=mixed_graph_buckets(2048))
    steps = eager_chunk_steps(runner, 2048, 32768)
    assert steps[0] == (16, 0) and [n for n, _ in steps] == sorted({16, *runner.token_buckets})
    assert {c for _, c in steps} == {0}
    assert [n for n, _ in eager_chunk_steps(runner, 300, 32768)] == [n for n in runner.token_buckets if n <= 300]
    runner.device = torch.device("cpu")
    assert eager_chunk_steps(runner, 2048, 32768) == [(16, 0)]
