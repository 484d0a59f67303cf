"""GPU checks of the FP8 KV cache (`kv_cache_dtype="fp8"`): the Triton and FlashInfer backends
over an fp8 pool against the torch oracle in bf16, the fused RoPE + K/V write kernel storing
exactly the torch write's bytes, and engines whose greedy tokens with an fp8 cache stay near a
bf16 cache's (the fused one-stream path declining an fp8 cache under auto)."""

import pytest
import torch

from tests.gpu.test_gpu_engine import DECODE, RAGGED, flashinfer_backend, triton_backend
from tests.test_kv_fp8 import assert_same_fp8, compare_over_fp8_pool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("make", [flashinfer_backend, triton_backend], ids=["flashinfer", "triton"])
@pytest.mark.parametrize("seqs", [RAGGED, DECODE], ids=["ragged", "decode"])
@pytest.mark.parametrize("hq,d", [(14, 64), (8, 128)], ids=["qwen2.5-0.5b", "d128"])
def test_backend_over_an_fp8_pool_matches_the_reference(make, seqs, hq, d):
    err = compare_over_fp8_pool(make, seqs, hq=hq, hkv=2, d=d, ps=16, dtype=torch.bfloat16,
                                device="cuda")
    assert err < 1e-2  # bf16 q and outputs (the fp8 values are the same on both sides)


def test_triton_backend_at_128_decode_rows_matches_the_reference():
    """128 decode rows (past tokens 0-2,000): the batched decode's table row for 65-256
    sequences over an fp8 pool (two KV heads a program, the merge in the kernel)."""
    seqs = [((i * 397) % 2001, 1) for i in range(128)]
    err = compare_over_fp8_pool(triton_backend, seqs, hq=14, hkv=2, d=64, ps=16, dtype=torch.bfloat16,
                                device="cuda")
    assert err < 1e-2


def test_rope_kv_write_kernel_stores_the_torch_writes_bytes():
    from flashlet.kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference
    from flashlet.models.rope import cos_sin_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(64, h, 64, device="cuda", generator=g).bfloat16() * 100
               for h in (14, 2, 2))  # some past 448: saturated
    positions = torch.randint(0, 512, (64,), device="cuda", generator=g)
    cos_sin = cos_sin_cache(64, 1e6, {"rope_type": "default"}, 512, 512).cuda()
    slots = torch.randperm(128, device="cuda", generator=g)[:64]
    slots[5] = -1  # a padding row: skipped
    caches = [[torch.zeros(8, 16, 2, 64, dtype=FP8, device="cuda") for _ in range(2)]
              for _ in range(2)]
    for scales in ((1.0, 1.0), (0.5, 2.0)):
        rope_kv_write(q, k, v, positions, cos_sin, *caches[0], slots, kv_scales=scales)
        rope_kv_write_reference(q, k, v, positions, cos_sin, *caches[1], slots, kv_scales=scales)
        for got, want in zip(*caches):
            assert_same_fp8(got, want)  # exact on the GPU
    assert caches[0][0].float().abs().max() == 448.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_fp8_cache_greedy_tokens_mostly_match_bf16(demo_model_dir, backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    from flashlet import LLM
    from flashlet.core.sampling import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"] * 3
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    outs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(demo_model_dir), backend=backend, kv_cache_dtype=kv)
        assert llm.engine.kv_pool.k_cache.dtype == (FP8 if kv == "fp8" else torch.bfloat16)
        if kv == "fp8" and llm.engine.runner.fused is not None:  # auto takes it: RoPE outside the epilogue
            assert not llm.engine.runner.fused.parts.rope
        outs[kv] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.close()
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(outs["fp8"], outs["auto"])]
    assert sum(prefix) >= 0.5 * 32 * len(prompts), prefix


@pytest.mark.slow
def test_forced_fused_path_runs_an_fp8_cache_with_rope_outside_the_epilogue(demo_model_dir):
    from flashlet import LLM
    from flashlet.kernels.cute_gemv import cute_available
    from flashlet.core.sampling import SamplingParams

    ok, why = cute_available()
    if not ok or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip(f"the fused path needs sm_90+ and the CuTe DSL ({why or 'sm_90+'})")
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    tokens = {}
    for fused in (True, False):
        llm = LLM(str(demo_model_dir), backend="triton", kv_cache_dtype="fp8", fused_decode=fused)
        if fused:
            parts = llm.engine.runner.fused.parts
            assert (parts.rope, parts.attn) == (False, True)  # the pool's write; fp8 attention
        tokens[fused] = llm.generate(["The capital of France is"], params)[0].token_ids
        llm.close()
    same = next((i for i, (a, b) in enumerate(zip(tokens[True], tokens[False])) if a != b), 48)
    assert same >= 24, (same, tokens)
