"""fp8 weights on the tensor cores (flashlet/kernels/cute_gemv.py, `fp8=True, mma=True`).

On any machine: the integer e4m3 -> bf16 widening (`widen_e4m3_word`, the exact instructions
the kernel issues, modelled bit for bit) against torch's float8_e4m3fn over all 256 codes; the
fragment layout of a 64-wide fp8 K step (four m16n8k16 products from each lane's natural
16-byte loads); the plan (opt-in, K steps of 64, 1 to 16 rows). With the CuTe DSL but no GPU:
each variant lowers to sm_90a PTX with four mma.sync a K step and n-tile, the designed 16-byte
loads, six integer instructions (two prmt) a 32-bit word of codes, no stack frame; the bf16
tensor-core kernels' PTX is what it was before this form existed (SHA-256). With CUDA and the
DSL: every epilogue at rows 1, 2, 7 and 16 against dequant_linear's numerics, and every e4m3
code through the tensor cores exactly.
"""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels import cute_gemv
from flashlet.kernels.cute_gemv import E4M3_BF16_SCALE, CuteGemv, RopeShape, plan_gemv, prmt, widen_e4m3_word
from tests.kernels.test_cute_gemv import (QWEN05_ROPE, check_rows_rope, lower_to_ptx,
                                          needs_cute, needs_gpu, rope_as_lowered)
from tests.kernels.test_cute_gemv_fp8 import check_fp8_argmax, check_fp8_rows, ptx_pins

on_the_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run for real (below)")
MMA_ROWS_TESTED = [1, 2, 7, 16]


# ---- the widening, bit for bit ----------------------------------------------------------------

def test_prmt_model_follows_the_ptx_rule():
    """Byte i of d: nibble i of the selector picks a byte of b:a (0-3 a, 4-7 b); bit 3 of the
    nibble replicates that byte's sign bit instead."""
    a, b = 0x8421F07F, 0x11223344
    assert prmt(a, b, 0x3210) == a and prmt(a, b, 0x7654) == b
    assert prmt(a, b, 0x0123) == 0x7FF02184  # a's bytes reversed
    assert prmt(a, 0, 0x9180) == 0xFFF0_007F  # bytes 0 (0x7f: sign 0) and 1 (0xf0: sign 1), each sign-extended
    assert prmt(a, 0, 0xB3A2) == 0xFF84_0021


def test_every_e4m3_code_widens_exactly_by_the_integer_ops():
    """Each of the 256 codes, in each of a word's four byte positions: the bf16 it becomes, times
    2^120, is torch's e4m3 value exactly (subnormals, +-0 and +-448 included); the two NaN codes
    become a finite 480 (quantized weights never hold them). The other three codes of the word
    never leak into a code's half."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    for position in range(4):
        for filler in (0x00, 0xFF, 0x80, 0x5A):
            got = []
            for code in range(256):
                word = sum((code if i == position else filler) << 8 * i for i in range(4))
                pairs = widen_e4m3_word(word)
                half = (pairs[position // 2] >> 16 * (position % 2)) & 0xFFFF
                got.append(half)
            bf16 = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            value = bf16.double() * E4M3_BF16_SCALE
            finite = ~want.isnan()
            assert torch.equal(value[finite], want[finite].double()), (position, filler)
            assert torch.equal(torch.signbit(value[finite]), torch.signbit(want[finite]))  # -0 stays -0
            assert value[~finite].abs().tolist() == [480.0, 480.0]


def test_widening_is_the_designed_bit_placement():
    """The same result as the formula FUSED_NOTES.md states: sign at bit 15, the 7 exponent and
    mantissa bits at bits 4-10."""
    for code in range(256):
        lo, _ = widen_e4m3_word(code)
        assert lo & 0xFFFF == ((code & 0x80) << 8) | ((code & 0x7F) << 4)


# ---- the fragments ----------------------------------------------------------------------------

def test_fp8_fragments_from_natural_loads_give_exact_dot_products():
    """Lane 4 g + t holds 16 codes (physical K 16 t .. 16 t + 15 of the 64-wide step) of weight
    rows g and g + 8, widened to eight pairs, and x's two 16-byte chunks of the same K; product
    p takes pairs 2p and 2p + 1 (`mma_operands(..., p)`). Placed where the m16n8k16 fragment
    layout puts them, every (weight row, decode row) pair meets each of the 64 K exactly once,
    weight and x at the same K."""
    a_at, b_at = {}, {}
    for lane in range(32):
        g, t = lane // 4, lane % 4
        pairs = lambda row: [(row, 16 * t + 2 * i) for i in range(8)]  # noqa: E731 (a 32-bit pair each)
        for p in range(4):
            a, b = cute_gemv.mma_operands(pairs(g), pairs(g + 8), pairs(g), p)
            for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                for e in range(2):
                    a_at[p, row, col + e] = (a[reg][0], a[reg][1] + e)
            for reg, k in enumerate([2 * t, 2 * t + 8]):
                for e in range(2):
                    b_at[p, k + e, g] = (b[reg][0], b[reg][1] + e)
    for row in range(16):
        for col in range(8):
            seen = []
            for p in range(4):
                for k in range(16):
                    w_row, w_k = a_at[p, row, k]
                    x_row, x_k = b_at[p, k, col]
                    assert (w_row, x_row, w_k) == (row, col, x_k)
                    seen.append(w_k)
            assert sorted(seen) == list(range(64))


# ---- the plan ---------------------------------------------------------------------------------

def test_fp8_tensor_cores_are_opt_in():
    for rows in (1, 4, 16):
        assert not plan_gemv(9728, 896, "silu_mul", rows=rows, norm=True, fp8=True).mma
        p = plan_gemv(9728, 896, "silu_mul", rows=rows, norm=True, fp8=True, mma=True)
        assert p.mma and p.fp8 and p.k_step == 64 and "fp8 mma" in p.describe()
    assert plan_gemv(9728, 896, "silu_mul", rows=4, norm=True).mma  # bf16's default is unchanged
    assert not plan_gemv(9728, 896, "silu_mul", rows=1).mma


@pytest.mark.parametrize("kwargs, match", [
    (dict(k=928), "multiple of 64"), (dict(outs_per_group=2), "outs_per_group"), (dict(staged=True), "staged"),
    (dict(splits=15), "splits"),
])
def test_fp8_mma_plan_refuses_what_it_cannot_do(kwargs, match):
    kwargs = dict(dict(n_rows=896, k=896, rows=4), **kwargs)
    with pytest.raises(ValueError, match=match):
        plan_gemv(kwargs.pop("n_rows"), kwargs.pop("k"), "residual", mma=True, fp8=True, **kwargs)


FP8_MMA_SHAPES = [(1152, 896, "bias_rope_kv", 1, 1), (896, 896, "residual", 1, 0), (9728, 896, "silu_mul", 1, 1),
                  (896, 4864, "residual", 1, 0), (151936, 896, "argmax", 1, 1), (151936, 896, "none", 1, 1),
                  (256, 256, "rope_kv", 0, 1), (136, 64, "argmax", 0, 0), (96, 128, "bias", 0, 0)]


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("n, k, epilogue, pdl, norm", FP8_MMA_SHAPES)
def test_fp8_mma_plan_covers_every_output_and_k_step_once(n, k, epilogue, pdl, norm, rows):
    p = plan_gemv(n, k, epilogue, rope=rope_as_lowered(n, epilogue), norm=bool(norm), rows=rows, fp8=True, mma=True)
    steps = k // 64
    per_split = -(-steps // p.splits)  # K steps a CTA
    assert (p.warps - 1) * p.chunks < per_split <= p.warps * p.chunks
    assert (p.splits - 1) * per_split < steps
    assert p.num_tiles * p.outs_per_tile >= p.n_out > (p.num_tiles - 1) * p.outs_per_tile
    assert cute_gemv._mma_fits(p.warps, p.chunks, -(-rows // 8), 8)


def test_fp8_long_k_splits_so_every_sm_has_a_cta():
    """Down (K = 4864: 76 steps of 64) fits unsplit in ten warps, but its 56 tiles would leave
    76 SMs idle: it splits in three, as bf16's does (where 19 warps would not fit)."""
    for rows in (1, 4, 16):
        p = plan_gemv(896, 4864, "residual", rows=rows, pdl=True, fp8=True, mma=True)
        assert p.splits == 3 and p.grid == 168, p.describe()
    assert plan_gemv(896, 896, "residual", rows=4, fp8=True, mma=True).splits == 1  # short K: one CTA a tile


# ---- lowering on the CPU ----------------------------------------------------------------------

# The bf16 tensor-core kernels' PTX before the fp8 form existed (SHA-256, first 16 hex digits;
# PTX_SCRIPT's variants at 0872e61): the fp8 form shares their code and must not move them.
BF16_MMA_PTX_SHA = {
    (1152, 896, "bias_rope_kv", 1, 1, 4): "f86e79c520f8924d",
    (9728, 896, "silu_mul", 1, 1, 16): "f0ec7a14f0135f89",
    (896, 4864, "residual", 1, 0, 4): "046af9f2e214f6f4",
    (151936, 896, "argmax", 1, 1, 8): "ed8afe52b8a694a6",
    (896, 896, "residual", 1, 0, 2): "6a674faed60c9d93",
    (151936, 896, "none", 1, 1, 16): "b77cd5eb7b8755ac",
    (136, 64, "argmax", 0, 0, 2): "b3f229344042e826",
}
BF16_MMA_PTX_SHA_481 = {  # the same from DSL 4.8.1 (code whose 4.3.5 PTX matches the pins above)
    (1152, 896, "bias_rope_kv", 1, 1, 4): "4e6004f68a49bfaa",
    (9728, 896, "silu_mul", 1, 1, 16): "1ece88d8e6a72f12",
    (896, 4864, "residual", 1, 0, 4): "441b11c9d8cf41b6",
    (151936, 896, "argmax", 1, 1, 8): "3e8251a8457849cc",
    (896, 896, "residual", 1, 0, 2): "1b5697a7cc4176c2",
    (151936, 896, "none", 1, 1, 16): "f47973830bd595bd",
    (136, 64, "argmax", 0, 0, 2): "717f144c72938ab5",
}


@pytest.mark.slow
@needs_cute
@on_the_cpu
@pytest.mark.parametrize("n, k, epilogue, pdl, norm, rows", sorted(BF16_MMA_PTX_SHA))
def test_bf16_mma_ptx_is_unchanged_by_the_fp8_form(tmp_path, n, k, epilogue, pdl, norm, rows):
    # the heuristic's plans: the pins predate TUNED_PLANS' M-row entries, which change plans, not code
    counts = lower_to_ptx(tmp_path, n, k, epilogue, pdl, 0, norm, {"tuned": False}, rows)
    pins = ptx_pins({"4.3.5": BF16_MMA_PTX_SHA, "4.8.1": BF16_MMA_PTX_SHA_481})
    assert counts["SHA"][:16] == pins[(n, k, epilogue, pdl, norm, rows)]


@pytest.mark.slow
@needs_cute
@on_the_cpu
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n, k, epilogue, pdl, norm", FP8_MMA_SHAPES)
def test_fp8_mma_lowers_to_mma_sync_and_integer_widening(tmp_path, n, k, epilogue, pdl, norm, rows):
    """Four bf16 m16n8k16 products a K step of 64 and n-tile; per K step a lane's two 16-byte
    weight loads (16 codes each) and x's two 16-byte chunks an n-tile (and the norm's two);
    each 32-bit word of codes widened by two prmt (with a shift and a mask each: no cvt); the
    row scales read as fp32; no stack frame, no local memory."""
    counts = {key: int(v) for key, v in lower_to_ptx(tmp_path, n, k, epilogue, pdl, 0, norm, {"mma": True}, rows,
                                                     fp8=True).items() if key != "SHA"}
    p = plan_gemv(n, k, epilogue, rope=rope_as_lowered(n, epilogue), pdl=bool(pdl), norm=bool(norm), rows=rows,
                  fp8=True, mma=True)
    n_tiles = -(-rows // 8)
    loops = p.grid < p.num_tiles  # the first tile's products and the loop's, each traced once
    assert counts["MMA"] == (2 if loops else 1) * p.chunks * 4 * n_tiles, counts
    weight_loads = (3 if loops else 1) * p.loads_in_flight_per_lane
    assert counts["W128"] + counts["W128U"] == weight_loads + 2 * p.chunks * (n_tiles + norm), counts
    assert counts["PRMT"] == (2 if loops else 1) * p.loads_in_flight_per_lane * 4 * 2, counts
    assert counts["WIDEN"] == counts["PRMT"]  # each prmt's pair masked as `widen_e4m3_word` models it
    assert counts["CVT8"] == 0 and counts["STACK"] == 0 and counts["LOCAL"] == 0, counts
    assert counts["F32LOAD"] >= 2  # rows g and g + 8's scales
    assert (counts["ATOM"] > 0) == (epilogue == "argmax" or p.splits > 1)
    assert (counts["GRIDDEP"] > 0) == bool(pdl) and (counts["RSQRT"] > 0) == bool(norm)


@pytest.mark.slow
@needs_cute
@on_the_cpu
@pytest.mark.parametrize("n, k, epilogue, norm, knobs", [(1024, 2048, "residual", 0, dict(tile_group=2, splits=2)),
                                                       (6144, 1024, "silu_mul", 1, dict(tile_group=2))])
def test_fp8_mma_tile_group_widens_each_tile_and_reads_x_once(tmp_path, n, k, epilogue, norm, knobs):
    """fp8 with tile_group G (Qwen3-0.6B's O and gate+up at 16 rows): G tiles' weight loads, all
    before the PDL wait, each widened; x's two chunks a K step and n-tile loaded once."""
    counts = {key: int(v) for key, v in lower_to_ptx(tmp_path, n, k, epilogue, 1, 0, norm, dict(knobs, mma=True),
                                                     16, fp8=True).items() if key != "SHA"}
    p = plan_gemv(n, k, epilogue, pdl=True, norm=bool(norm), rows=16, fp8=True, mma=True, **knobs)
    group = knobs["tile_group"]
    assert p.tile_group == group and not p.loops
    weight_loads = group * p.loads_in_flight_per_lane
    assert counts["MMA"] == group * p.chunks * 4 * 2 and counts["PREWAIT"] == weight_loads, counts
    assert counts["W128"] + counts["W128U"] == weight_loads + 2 * p.chunks * (2 + norm), counts
    assert counts["PRMT"] == weight_loads * 4 * 2 and counts["WIDEN"] == counts["PRMT"], counts
    assert counts["STACK"] == 0 and counts["LOCAL"] == 0, counts


# ---- on the GPU -------------------------------------------------------------------------------

FP8_MMA_GPU_CASES = [  # (n, k, epilogue, norm, pdl): the fused path's GEMVs (Qwen2.5-0.5B), small shapes
    (1152, 896, "bias", True, True), (1152, 896, "none", True, False), (896, 896, "residual", False, True),
    (9728, 896, "silu_mul", True, True), (896, 4864, "residual", False, True), (896, 4864, "none", False, False),
    (151936, 896, "none", True, True), (136, 64, "silu_mul", True, False), (96, 128, "bias", False, False),
    (256, 256, "residual", False, False), (3584, 18944, "residual", False, True),  # 7B's down: split over CTAs
    (4608, 3584, "bias", True, True),  # 7B's QKV: at 16 rows the norm with K split over two CTAs
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", MMA_ROWS_TESTED)
@pytest.mark.parametrize("n, k, epilogue, norm, pdl", FP8_MMA_GPU_CASES)
def test_fp8_mma_gemv_matches_dequant_linear(kh, n, k, epilogue, norm, pdl, rows):
    """out poisoned (NaN) so an unwritten row fails; the residual in place between guard rows;
    each row against gemv_reference with the row scales (dequant_linear's fp32 numerics)."""
    gemv = CuteGemv(n, k, epilogue, pdl=pdl, norm=norm, rows=rows, fp8=True, mma=True)
    assert gemv.plan.mma and gemv.plan.fp8
    check_fp8_rows(kh, gemv)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 16])
@pytest.mark.parametrize("n, k, epilogue, norm, knobs", [(1024, 2048, "residual", False, dict(tile_group=2, splits=2)),
                                                       (6144, 1024, "silu_mul", True, dict(tile_group=2))])
def test_fp8_mma_tile_group_matches_dequant_linear(kh, n, k, epilogue, norm, knobs, rows):
    gemv = CuteGemv(n, k, epilogue, pdl=True, norm=norm, rows=rows, fp8=True, mma=True, **knobs)
    assert gemv.plan.tile_group == knobs["tile_group"], gemv.plan.describe()
    check_fp8_rows(kh, gemv)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", MMA_ROWS_TESTED)
@pytest.mark.parametrize("n, k, norm, pdl", [(151936, 896, True, True), (256, 256, False, False)])
def test_fp8_mma_argmax_per_row(kh, n, k, norm, pdl, rows):
    """Each row's token the argmax of its dequantized logits (ties within 1e-3 of the top),
    twice (the counter reset between calls)."""
    check_fp8_argmax(kh, CuteGemv(n, k, "argmax", pdl=pdl, norm=norm, rows=rows, fp8=True, mma=True))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", MMA_ROWS_TESTED)
@pytest.mark.parametrize("shape, k, bias, pdl", [(QWEN05_ROPE, 896, True, True), (QWEN05_ROPE, 896, False, False),
                                                 (RopeShape(64, 4, 2, 2048, 1025 * 16), 256, False, True)])
def test_fp8_mma_rope_kv_each_row_at_its_position_and_slot(kh, shape, k, bias, pdl, rows):
    gemv = CuteGemv(shape.rows, k, "bias_rope_kv" if bias else "rope_kv", pdl=pdl, norm=True, rope=shape,
                    rows=rows, fp8=True, mma=True)
    check_rows_rope(kh, gemv, shape, k, bias, rows, fp8=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("k", [128, 768])  # one and three K steps of 64 a lane
def test_every_e4m3_code_through_the_tensor_cores_exactly(k):
    """One-hot rows of x pick single columns of a weight holding every finite e4m3 code (scale
    1): y[m, r] must be W[r, column] exactly. A code widened wrong, a pair in the wrong fragment
    register, or x's chunk met at the wrong K shows as a different value."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]
    n, rows = 64, 16
    q = codes[torch.arange(n * k) % codes.numel()].view(n, k).cuda()
    scale = torch.ones(n, device="cuda")
    gemv = CuteGemv(n, k, "none", rows=rows, fp8=True, mma=True)
    for start in range(0, k, rows):
        x = torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(rows), torch.arange(start, start + rows)] = 1
        y = gemv(x, q, scale=scale)
        torch.cuda.synchronize()
        want = q[:, start:start + rows].float().t()
        wrong = (y.float() != want).nonzero()
        bad_codes = sorted({int(q[r, start + m].view(torch.uint8)) for m, r in wrong.tolist()})
        assert not bad_codes, f"columns {start}..{start + rows - 1}: codes {[hex(c) for c in bad_codes]} wrong"


def test_sha_table_keys_are_lowerable_plans():
    """The pinned bf16 variants still plan on the tensor cores (a pin of a CUDA-core plan would
    not test this form)."""
    for n, k, epilogue, pdl, norm, rows in BF16_MMA_PTX_SHA:
        assert plan_gemv(n, k, epilogue, rope=rope_as_lowered(n, epilogue), pdl=bool(pdl), norm=bool(norm),
                         rows=rows).mma
