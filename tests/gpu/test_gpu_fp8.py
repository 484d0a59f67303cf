"""GPU checks of the fp8 matmul (flashlet/models/quantization.py): torch._scaled_mm with per-token
activation scales against the dequantizing reference, at row counts that need padding to 16
and at a real projection shape; the weight-only fallback where _scaled_mm does not fit; and an
fp8 engine's greedy tokens against its bf16 twin."""

import pytest
import torch

from flashlet.models.quantization import dequant_linear, linear, quantize_weight, scaled_mm_fits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

needs_fp8_gemm = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="torch._scaled_mm needs an sm_89+ GPU (Ada, Hopper)")


@needs_fp8_gemm
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 300])
@pytest.mark.parametrize("n,k", [(1152, 896), (896, 4864)])  # Qwen2.5-0.5B's QKV and down
def test_scaled_mm_matches_the_dequant_reference(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    qw = quantize_weight(w)
    assert scaled_mm_fits(x, qw)
    ours, ref = linear(x, qw, bias), dequant_linear(x.float(), qw, bias.float())
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    # The activations' own fp8 rounding (2^-4 relative at most, ~1% RMS) on top of bf16's.
    err = (ours.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert err < 0.03, err


def test_shapes_scaled_mm_cannot_take_fall_back_to_dequant():
    w = torch.randn(40, 24, device="cuda")  # K = 24: not a multiple of 16
    x = torch.randn(3, 24, device="cuda").bfloat16()
    qw = quantize_weight(w)
    assert not scaled_mm_fits(x, qw)
    assert torch.equal(linear(x, qw), dequant_linear(x, qw))


@pytest.mark.slow
def test_fp8_engine_greedy_tokens_mostly_match_bf16(demo_model_dir):
    from flashlet import LLM
    from flashlet.core.sampling import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fp8 = [o.token_ids for o in LLM(str(demo_model_dir), quantization="fp8").generate(prompts, params)]
    bf16 = [o.token_ids for o in LLM(str(demo_model_dir)).generate(prompts, params)]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(fp8, bf16)]
    assert sum(prefix) >= 0.5 * 24 * len(prompts), prefix
