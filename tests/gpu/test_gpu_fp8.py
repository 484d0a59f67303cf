"""GPU checks of the fp8 matmul (flashlet/models/quantization.py): the Triton weight-only kernel at real
projection shapes (and in a CUDA graph), which path each row count takes, torch._scaled_mm with
per-token activation scales against the dequantizing reference at row counts that need padding
to 16, the weight-only fallback where _scaled_mm does not fit; and an fp8 engine's greedy
tokens against its bf16 twin."""

import pytest
import torch

from flashlet.kernels.fp8_gemv import GemmTile, fp8_gemm, fp8_gemm_reference
from flashlet.models.quantization import (DECODE_ROWS, TRITON_GEMM_MAX_ROWS, dequant_linear, linear, quantize_weight,
                                   scaled_mm_fits, scaled_mm_linear, weight_only_linear)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

needs_fp8_gemm = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="torch._scaled_mm needs an sm_89+ GPU (Ada, Hopper)")


def _case(rows, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    return x, quantize_weight(w), bias


def _relative_rms(ours, ref):
    ours, ref = ours.float(), ref.float()
    return ((ours - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(896, 4864), (4864, 896), (3584, 18944)])  # 0.5B down, up; 7B down
def test_triton_fp8_gemm_matches_the_fp32_reference_at_real_shapes(rows, n, k):
    x, qw, bias = _case(rows, n, k, seed=rows)
    ours = fp8_gemm(x, qw.qweight, qw.scale, bias)
    ref = fp8_gemm_reference(x, qw.qweight, qw.scale, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    # fp32 sums in another order, each output rounded once to bf16: within an ulp or two.
    assert (ours.float() - ref.float()).abs().max() <= 2 * 2 ** -8 * ref.float().abs().max()


@pytest.mark.parametrize("bit_widen", [True, False])
def test_every_fp8_code_widens_exactly(bit_widen):
    """One-hot rows pick columns of a weight holding every finite e4m3 code (subnormals too):
    y must be each code's value exactly, whichever way the kernel widens it."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]  # 254 finite codes
    k = 256
    qweight = torch.zeros(64, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    qweight.view(-1)[:codes.numel()] = codes
    qweight = qweight.cuda()
    scale = torch.ones(64, device="cuda")
    for start in range(0, k, 16):
        x = torch.zeros(16, k, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(16), torch.arange(start, start + 16)] = 1
        y = fp8_gemm(x, qweight, scale, split_k=1, tile=GemmTile(bit_widen=bit_widen))
        assert torch.equal(y.float(), qweight.float()[:, start:start + 16].T)


def test_triton_fp8_gemm_in_fp16():
    x, qw, bias = _case(3, 896, 4864)
    x, bias = x.half(), bias.half()
    ours = fp8_gemm(x, qw.qweight, qw.scale, bias)
    ref = fp8_gemm_reference(x, qw.qweight, qw.scale, bias)
    assert ours.dtype == torch.float16
    assert (ours.float() - ref.float()).abs().max() <= 2 * 2 ** -11 * ref.float().abs().max()


def test_triton_fp8_gemm_replays_in_a_cuda_graph():
    x, qw, bias = _case(4, 896, 4864)
    static_x = x.clone()
    fp8_gemm(static_x, qw.qweight, qw.scale, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fp8_gemm(static_x, qw.qweight, qw.scale, bias)
    fresh = torch.randn_like(x.float()).bfloat16()
    static_x.copy_(fresh)
    graph.replay()
    assert torch.equal(static_y, fp8_gemm(fresh, qw.qweight, qw.scale, bias))


@needs_fp8_gemm
def test_linear_takes_triton_up_to_its_rows_and_weight_only_above():
    n, k = 1152, 896
    for rows in (1, DECODE_ROWS, 33, TRITON_GEMM_MAX_ROWS):  # both tiles
        x, qw, bias = _case(rows, n, k, seed=rows)
        ours = linear(x, qw, bias)
        assert torch.equal(ours, fp8_gemm(x, qw.qweight, qw.scale, bias))
        assert _relative_rms(ours, dequant_linear(x.float(), qw, bias.float())) < 0.005
    x, qw, bias = _case(TRITON_GEMM_MAX_ROWS + 1, n, k)
    assert torch.equal(linear(x, qw, bias), weight_only_linear(x, qw, bias))
    assert _relative_rms(linear(x, qw, bias), dequant_linear(x, qw, bias)) < 0.005
    for rows in (DECODE_ROWS + 1, TRITON_GEMM_MAX_ROWS + 1):  # opted in: fp8 activations
        x, qw, bias = _case(rows, n, k)
        qw.fp8_activations = True
        assert torch.equal(linear(x, qw, bias), scaled_mm_linear(x, qw, bias))


@needs_fp8_gemm
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 300])
@pytest.mark.parametrize("n,k", [(1152, 896), (896, 4864)])  # Qwen2.5-0.5B's QKV and down
def test_scaled_mm_matches_the_dequant_reference(rows, n, k):
    x, qw, bias = _case(rows, n, k, seed=rows)
    assert scaled_mm_fits(x, qw)
    ours, ref = scaled_mm_linear(x, qw, bias), dequant_linear(x.float(), qw, bias.float())
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    # The activations' own fp8 rounding (2^-4 relative at most, ~1% RMS) on top of bf16's.
    assert _relative_rms(ours, ref) < 0.03


def test_shapes_scaled_mm_cannot_take_fall_back_to_weight_only():
    w = torch.randn(40, 24, device="cuda")  # K = 24: not a multiple of 16
    x = torch.randn(TRITON_GEMM_MAX_ROWS + 3, 24, device="cuda").bfloat16()  # past Triton's rows
    qw = quantize_weight(w)
    qw.fp8_activations = True
    assert not scaled_mm_fits(x, qw)
    assert torch.equal(linear(x, qw), weight_only_linear(x, qw))


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
