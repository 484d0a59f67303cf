"""The weight-only FP8 GEMM (flashlet/kernels/fp8_gemv.py) against its fp32 reference: split and
unsplit K, ragged shapes, bias, strided activations, and the split-K choice. Small shapes: on the
CPU these run in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.fp8_gemv import (DEFAULT_TILE, INTERPRETED, MANY_ROWS_MIN_WEIGHTS,
                                       MANY_ROWS_TILE, MAX_SPLIT_K, SKINNY_MAX_ROWS, TUNED_SPLITS,
                                       TUNED_SPLITS_SMS, GemmTile,
                                       dequantize_rows, fp8_gemm, fp8_gemm_reference, split_k_for,
                                       tile_for)
from flashlet.models.quantization import quantize_rows
from tests.triton_interpreter import interpreted_accesses


def _case(m, n, k, *, bias, seed, device, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]  # rows of many scales
    qweight, scale = quantize_rows(w)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return [t.to(device) if t is not None else None for t in (x, qweight, scale, b)]


def _close(ours, ref):
    """Equal up to the output's own rounding (two ulps of the largest value's dtype)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    eps = torch.finfo(ref.dtype).eps
    tol = 2 * eps * ref.float().abs().max().item()
    assert (ours.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("m,n,k,split_k,bias", [
    (1, 40, 200, 1, True),     # N, K not multiples of the blocks
    (1, 96, 384, 3, False),    # split K, every split a full block
    (5, 70, 300, 2, True),     # split K with a ragged last split
    (16, 64, 256, 1, False),   # a whole 16-row tile
    (17, 33, 130, 2, True),    # two row tiles, the second of one row
    (70, 150, 300, 2, True),   # past SKINNY_MAX_ROWS on a small weight: 16-row tiles, five
])
def test_fp8_gemm_matches_the_fp32_reference(kh, m, n, k, split_k, bias):
    x, qweight, scale, b = _case(m, n, k, bias=bias, seed=m + n, device=kh.device)
    ours = fp8_gemm(x, qweight, scale, b, split_k=split_k)
    _close(ours, fp8_gemm_reference(x, qweight, scale, b))


def test_split_k_only_reorders_the_fp32_sum(kh):
    x, qweight, scale, b = _case(3, 48, 512, bias=True, seed=7, device=kh.device)
    whole = fp8_gemm(x, qweight, scale, b, split_k=1)
    for split_k in (2, 4):
        _close(fp8_gemm(x, qweight, scale, b, split_k=split_k), whole)


def test_split_launches_leave_their_counters_at_zero(kh):
    from flashlet.kernels.fp8_gemv import _split_counters

    x, qweight, scale, b = _case(18, 80, 512, bias=True, seed=5, device=kh.device)
    first = fp8_gemm(x, qweight, scale, b, split_k=4)  # 2 x 2 tiles, 4 splits each
    assert not _split_counters(x.device).any()
    again = fp8_gemm(x, qweight, scale, b, split_k=4)
    assert torch.equal(again, first)  # the next launch finds them at zero and merges too


def test_other_tiles_compute_the_same_product(kh):
    x, qweight, scale, b = _case(40, 72, 320, bias=True, seed=11, device=kh.device)
    ref = fp8_gemm_reference(x, qweight, scale, b)
    for tile in (GemmTile(block_m=32, block_n=32, block_k=64), GemmTile(block_n=128, block_k=256),
                 MANY_ROWS_TILE):
        _close(fp8_gemm(x, qweight, scale, b, split_k=2, tile=tile), ref)


def test_a_bf16_weight_with_unit_scales_gives_its_plain_product(kh):
    """The kernel on an unquantized weight (the bench's --bf16-weights: its tiles against
    cuBLAS at rows past the fused path), never widened as if it were fp8."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, 192, generator=g).to(torch.bfloat16).to(kh.device)
    w = (torch.randn(72, 192, generator=g) * 0.1).to(torch.bfloat16).to(kh.device)
    ones = torch.ones(72, dtype=torch.float32, device=kh.device)
    ref = (x.float() @ w.float().T).to(torch.bfloat16)
    for tile in (DEFAULT_TILE, GemmTile(block_m=32, block_n=32, block_k=64)):
        for split_k in (1, 3):
            _close(fp8_gemm(x, w, ones, split_k=split_k, tile=tile), ref)


def test_strided_activation_rows_and_fp16(kh):
    x, qweight, scale, _ = _case(4, 32, 160, bias=False, seed=3, device=kh.device,
                                 dtype=torch.float16)
    wide = torch.zeros(4, 200, dtype=torch.float16, device=kh.device)
    wide[:, 20:180] = x
    view = wide[:, 20:180]  # rows 200 apart: a slice of a fused projection's output
    assert not view.is_contiguous()
    _close(fp8_gemm(view, qweight, scale), fp8_gemm_reference(x, qweight, scale))


def test_no_rows_gives_an_empty_result(kh):
    x, qweight, scale, _ = _case(0, 32, 64, bias=False, seed=1, device=kh.device)
    assert fp8_gemm(x, qweight, scale).shape == (0, 32)


def test_mismatched_shapes_are_refused(kh):
    x, qweight, scale, _ = _case(2, 32, 64, bias=False, seed=1, device=kh.device)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemm(x[:, :48], qweight, scale)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemm(x, qweight, scale[:16])


def test_the_tile_follows_the_row_count_and_the_weight():
    big, small = (37888, 3584), (9728, 896)  # the 7B and 0.5B gate+up
    assert big[0] * big[1] >= MANY_ROWS_MIN_WEIGHTS > small[0] * small[1]
    assert tile_for(1, *big) is DEFAULT_TILE and tile_for(SKINNY_MAX_ROWS, *big) is DEFAULT_TILE
    assert tile_for(SKINNY_MAX_ROWS + 1, *big) is MANY_ROWS_TILE
    assert tile_for(64, *small) is DEFAULT_TILE
    assert split_k_for(512, *big, 132) == 1  # 8 x 296 tiles of 64 x 128 fill it already


def test_split_k_fills_the_gpu_only_where_columns_do_not():
    sms = 132
    assert split_k_for(1, 896, 4864, sms) == MAX_SPLIT_K   # 14 column tiles: split to the cap
    assert split_k_for(1, 4096, 14336, sms) == 8           # 64 tiles: 8 x 64 >= 3.5 per SM
    assert split_k_for(1, 3584, 3584, sms) == 9            # 9 wanted (14 K blocks of 256)
    assert split_k_for(1, 151936, 896, sms) == 1           # thousands of tiles already
    assert split_k_for(1, 64, 128, sms) == 1               # one K block: nothing to split


def test_a_tuned_split_holds_only_the_launch_it_was_measured_at():
    """TUNED_SPLITS (the 7B down projection's 7) at one row tile on the GPU it was measured on;
    the rule elsewhere: 17+ rows (a second row tile), another SM count, another tile."""
    sms, down = TUNED_SPLITS_SMS, (3584, 18944)
    assert TUNED_SPLITS[down] == 7
    assert split_k_for(1, *down, sms) == split_k_for(16, *down, sms) == 7
    assert split_k_for(17, *down, sms) == 5  # 112 tiles: 5 x 112 >= 3.5 per SM
    assert split_k_for(1, *down, 78) == 5    # 56 tiles on 78 SMs
    assert split_k_for(1, *down, sms, GemmTile(block_n=128)) == 16  # 28 tiles: 17 wanted, the cap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_rows_rounds_code_times_scale_once(kh, dtype):
    _, qweight, scale, _ = _case(1, 37, 300, bias=False, seed=13, device=kh.device)  # ragged tiles
    ours, ref = dequantize_rows(qweight, scale, dtype), (qweight.float() * scale[:, None]).to(dtype)
    if INTERPRETED and dtype == torch.bfloat16:  # the interpreter's bf16 cast truncates (NumPy
        ulp = ref.float().abs() * torch.finfo(dtype).eps  # has no bf16): within one ulp there
        assert ((ours.float() - ref.float()).abs() <= ulp).all()
    else:
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("m,split_k", [(1, 1), (1, 4), (5, 3), (17, 2)])
def test_accumulate_into_adds_the_product_to_its_values_rounded_once(kh, m, split_k):
    """The fused path's residual stream: residual + x @ W^T summed in fp32 and rounded once, in
    place (the tensor returned is the one given), split or not; in the interpreter, the split
    tiles' partials and the residual read only as their counters order them."""
    x, qweight, scale, _ = _case(m, 72, 512, bias=False, seed=40 + m, device=kh.device)
    residual = (torch.randn(m, 72, generator=torch.Generator().manual_seed(m)) * 4).to(torch.bfloat16)
    residual = residual.to(kh.device)
    want = (residual.float() + fp8_gemm_reference(x.float(), qweight, scale)).to(torch.bfloat16)
    before = residual.clone()
    # Each tile's last split reads the others' partials and the residual only after its counter
    # says they are written (the access log, tests/triton_interpreter.py).
    with interpreted_accesses(sync="COUNTS", args=("PARTIAL", "Y")) as log:
        got = fp8_gemm(x, qweight, scale, split_k=split_k, accumulate_into=residual)
    assert log is None or (log.hazards() == [] and len(log.launches) == 1)
    assert got is residual and not torch.equal(residual, before)
    _close(got, want)
    with pytest.raises(ValueError, match="accumulate_into"):
        fp8_gemm(x, qweight, scale, accumulate_into=residual[:, :64])
