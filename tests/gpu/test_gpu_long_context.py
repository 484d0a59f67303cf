"""Decode attention after long prompts (8k and 32k tokens) on the GPU: the triton backend's
one-launch (the fused path's), per-op (`attend` asked for one launch: $FLASHLET_ONE_LAUNCH_DECODE=1)
and two-launch (the per-op default) forms, captured once in a CUDA graph at one row and
replayed over short and long contexts (the split count a row uses is decided on the device from
kv_lens), against the torch backend's attention."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
PAGE = 16
MAX_TOKENS = 32_768
# (query heads, KV heads, head_dim): Qwen2.5-0.5B's and Qwen3-0.6B's attention.
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen3-0.6b": (16, 8, 128)}
CONTEXTS = (100, 8_000, 32_000, 4_095, 4_096, 257)


def _randn(*shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(torch.bfloat16)


def _pool(num_kv_heads, head_dim):
    from flashlet.kvcache.kv_pool import KVPool

    pool = KVPool(1, MAX_TOKENS // PAGE + 4, PAGE, num_kv_heads, head_dim, torch.bfloat16, DEV)
    pool.k_cache.copy_(_randn(*pool.k_cache.shape, seed=0))
    pool.v_cache.copy_(_randn(*pool.v_cache.shape, seed=1))
    return pool


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("form", ["one-launch", "per-op", "two-launch"])
def test_long_contexts_replay_in_one_graph(shape, form):
    from flashlet.attention.torch_ref import TorchBackend
    from flashlet.attention.triton_backend import TritonBackend
    from flashlet.runner.batch import StepBuffers, StepRow, build_layout
    from flashlet.kernels.pdl import pdl_supported

    hq, hkv, head_dim = SHAPES[shape]
    pool = _pool(hkv, head_dim)
    pages = pool.allocator.allocate(MAX_TOKENS // PAGE)
    buffers = StepBuffers(1, 1, len(pages), torch.device(DEV))
    tri = TritonBackend(pool, hq, max_batch_size=1, max_pages_per_seq=len(pages),
                        one_launch_decode=form != "two-launch")
    pdl = form == "one-launch" and pdl_supported(torch.device(DEV))

    def load(n):
        return buffers.load(build_layout([StepRow([0], n - 1, pages)], PAGE))[1]

    def attend(q):
        return tri.attend_one_launch(0, q, pdl=pdl) if form == "one-launch" else tri.attend(0, q)

    q = _randn(1, hq, head_dim, seed=2)
    tri.plan(load(CONTEXTS[0]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            attend(q)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q)
    ref = TorchBackend(pool, hq)
    for seed, n in enumerate(CONTEXTS):
        meta = load(n)
        q.copy_(_randn(1, hq, head_dim, seed=10 + seed))
        tri.plan(meta)
        graph.replay()
        ref.plan(meta)
        assert _rel_err(out, ref.attend(0, q)) < 1e-2, (shape, form, n)
    torch.cuda.synchronize()
    assert not tri._merge_counts.any()


@pytest.mark.slow
def test_fused_path_after_long_prompts_gives_the_per_op_tokens(tmp_path):
    """Through the engine: prompts of 4,500 and 9,000 tokens (every layer's one-launch attention
    splits the row and merges many partials; the prompts are prefilled in chunks), the default
    fused path teacher-forced against the per-op path (tests/gpu/test_gpu_fused_decode.py's
    near-tie rule)."""
    from tests.conftest import save_tiny_model
    from tests.gpu.test_gpu_fused_decode import SM90, SMALL, check_against_reference_teacher_forced

    if not SM90:
        pytest.skip("auto turns the fused path on at sm_90+ only")
    dims = {**SMALL, "max_position_embeddings": 16_384}
    source, vocab = dict(model=str(save_tiny_model("qwen2", tmp_path, **dims))), dims["vocab_size"]
    ps = [[(i * 13 + 5 * p + 2) % vocab for i in range(n)] for p, n in enumerate((4_500, 9_000))]
    engine = check_against_reference_teacher_forced(source, ps, 12, fused=None)
    assert engine.runner.fused is not None and engine.runner.fused.one_launch_attention
