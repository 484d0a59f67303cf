"""The CuTe DSL decode GEMV with fp8 weights (flashlet/kernels/cute_gemv.py, `fp8=True`).

On any machine: the plan (K chunked by 16: a 16-byte load holds 16 e4m3 weights), the call's
checks of the codes and row scales, and the fp32 reference against quantization.dequant_linear.
With the CuTe DSL but no GPU: each fp8 variant lowers to sm_90a PTX with one 16-byte load a
weight chunk, x's two 16-byte loads beside it, the hardware e4m3x2 -> f16x2 conversions and no
local-memory stack; and the bf16 kernels' PTX is byte for byte what it was before fp8 existed
(SHA-256). With CUDA and the DSL: every epilogue at 1, 2 and 4 rows against dequant_linear's
numerics (gemv_reference with the row scales) on random inputs, outputs poisoned first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashlet.kernels import cute_gemv
from flashlet.kernels.cute_gemv import (EPILOGUES, ROPE_EPILOGUES, TUNED_PLANS, CuteGemv, RopeKV, RopeShape,
                                        gemv_reference, lanes_for, plan_gemv, rope_kv_reference)
from flashlet.models.quantization import QuantizedWeight, dequant_linear, quantize_rows
from tests.kernels.test_cute_gemv import (QWEN05_ROPE, QWEN05_SHAPES, _rope_inputs, _rows_inputs, check_rows_rope,
                                          lower_to_ptx, needs_cute, needs_gpu, tiles_per_cta)

PLAIN_EPILOGUES = [e for e in EPILOGUES if e not in ROPE_EPILOGUES]
FP8_ROWS = [1, 2, 4]  # the fused path's row counts (SERVED_ROWS)


# ---- the plan ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n, k", QWEN05_SHAPES)
@pytest.mark.parametrize("epilogue", PLAIN_EPILOGUES)
def test_fp8_plan_chunks_k_by_16_and_covers_every_output(n, k, epilogue):
    p = plan_gemv(n, k, epilogue, fp8=True)
    assert p.fp8 and p.vec == 16
    assert p.lanes * p.chunks * 16 == k and p.lanes == lanes_for(k, 16)
    assert (p.lanes, p.chunks) == {896: (8, 7), 4864: (16, 19)}[k]
    assert sorted(t for tiles in tiles_per_cta(p) for t in tiles) == list(range(p.num_tiles))
    assert p.num_tiles * p.outs_per_tile >= p.n_out > (p.num_tiles - 1) * p.outs_per_tile
    assert "fp8" in p.describe()


def test_fp8_plan_refuses_k_not_a_multiple_of_16():
    plan_gemv(96, 200, "none")  # a multiple of 8: bf16 plans it
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_gemv(96, 200, "none", fp8=True)


def test_fp8_staged_plan_fits_the_same_shared_memory():
    """A staged slot is 16 bytes whatever the weights: 16 e4m3 or 8 bf16, so the 48 KB bound
    (and the warps it leaves) is the bf16 plan's at the same chunk count."""
    for k in (896, 4864):
        p = plan_gemv(9728 if k == 896 else 896, k, "silu_mul" if k == 896 else "residual", staged=True,
                      stages=2, fp8=True)
        assert p.staged and p.stages == 2 and p.vec == 16
        assert p.stages * p.warps * 32 * p.loads_in_flight_per_lane * 16 <= 48 << 10


def test_fp8_rows_plans_read_x_from_l2_at_most_twice_the_weights():
    """x stays bf16 while the weights halve: the M-row plan turns to a resident grid where x's
    bytes from L2 pass twice the fp8 weights' (down at M = 4: one tile a CTA read 4x)."""
    for n, k in QWEN05_SHAPES:
        for rows in (2, 4, 16):
            p = plan_gemv(n, k, rows=rows, fp8=True)
            x_bytes, w_bytes = p.grid * rows * k * 2, n * k
            assert x_bytes <= 2 * w_bytes or p.grid <= 2 * 132, (n, k, rows, p.describe())
    down = plan_gemv(896, 4864, "residual", rows=4, fp8=True)
    assert (down.warps, down.grid) == (2, 224)
    assert plan_gemv(896, 4864, "residual", rows=2, fp8=True).grid == 448  # 2 x 448 x 9.7 KB = 8.7 MB: 2x


def test_fp8_plans_do_not_take_the_bf16_tuned_entries(monkeypatch, tmp_path):
    """A bf16 plan tuned at a shape is measured for bf16's bytes; the fp8 GEMV of that shape
    has its own key (ending in "fp8"), from the table or a sweep file."""
    bf16_key = (9728, 896, "silu_mul", True, True)
    assert TUNED_PLANS[bf16_key].get("staged")  # the built-in gate_up plan stages
    p = plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, fp8=True)
    assert p == plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, fp8=True, tuned=False)
    monkeypatch.setitem(TUNED_PLANS, (*bf16_key, "fp8"), dict(warps=8))
    assert plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, fp8=True).warps == 8
    monkeypatch.setitem(TUNED_PLANS, (*bf16_key, 4, "fp8"), dict(warps=1))
    assert plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, fp8=True, rows=4).warps == 1
    sweep = tmp_path / "plans.json"
    sweep.write_text(json.dumps([{"key": [896, 4864, "residual", False, True, 2, "fp8"], "knobs": {"warps": 2}}]))
    monkeypatch.setattr(cute_gemv, "TUNED_PLANS", dict(TUNED_PLANS))
    assert cute_gemv.load_tuned_plans(str(sweep)) == 1
    assert cute_gemv.TUNED_PLANS[(896, 4864, "residual", False, True, 2, "fp8")] == {"warps": 2}


def test_fp8_tensor_core_plans_have_keys_of_their_own(monkeypatch, tmp_path):
    """The tensor-core fp8 form (mma=True, opt-in) is planned from entries ending in "fp8",
    "mma": its knobs (warps of K steps, splits) mean other things than the CUDA-core form's,
    which keeps the plain "fp8" entry; a sweep file's keys load the same way."""
    key = (3584, 3584, "residual", False, True, "fp8")  # Qwen2.5-7B's O
    base = plan_gemv(3584, 3584, "residual", pdl=True, fp8=True, mma=True)
    monkeypatch.setitem(TUNED_PLANS, key, dict(warps=1))  # the CUDA-core form's entry
    assert plan_gemv(3584, 3584, "residual", pdl=True, fp8=True, mma=True) == base
    assert plan_gemv(3584, 3584, "residual", pdl=True, fp8=True).warps == 1
    assert base.splits == 1
    monkeypatch.setitem(TUNED_PLANS, (*key, "mma"), dict(splits=3))
    assert plan_gemv(3584, 3584, "residual", pdl=True, fp8=True, mma=True).splits == 3
    sweep = tmp_path / "plans.json"
    sweep.write_text(json.dumps([{"key": [4608, 3584, "bias", True, True, "fp8", "mma"], "knobs": {"warps": 8}},
                                 {"key": [3584, 3584, "residual", False, True, 4, "fp8", "mma"],
                                  "knobs": {"splits": 2}}]))
    monkeypatch.setattr(cute_gemv, "TUNED_PLANS", dict(TUNED_PLANS))
    assert cute_gemv.load_tuned_plans(str(sweep)) == 2
    assert cute_gemv.TUNED_PLANS[(4608, 3584, "bias", True, True, "fp8", "mma")] == {"warps": 8}
    assert cute_gemv.TUNED_PLANS[(3584, 3584, "residual", False, True, 4, "fp8", "mma")] == {"splits": 2}
    assert plan_gemv(4608, 3584, "bias", norm=True, pdl=True, fp8=True, mma=True).warps == 8


# ---- the call's checks and the reference ------------------------------------------------------

def _fp8_inputs(n=96, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g) * 3).to(torch.bfloat16)
    q, scale = quantize_rows(torch.randn(n, k, generator=g) * k ** -0.5)
    return x, q, scale


@pytest.mark.parametrize("bad, match", [
    ("bf16_weight", "float8_e4m3fn"), ("no_scale", "needs scale"), ("scale_dtype", "scale must"),
    ("scale_shape", "scale must"), ("scale_to_bf16", "takes no scale"),
])
def test_fp8_call_checks_codes_and_scales_before_launch(bad, match):
    fp8 = CuteGemv(96, 64, "none", device="cpu", fp8=True)  # the checks run before the DSL is needed
    x, q, scale = _fp8_inputs()
    gemv, args = {"bf16_weight": (fp8, (x, q.to(torch.bfloat16), scale)), "no_scale": (fp8, (x, q, None)),
                  "scale_dtype": (fp8, (x, q, scale.double())), "scale_shape": (fp8, (x, q, scale[:48])),
                  "scale_to_bf16": (CuteGemv(96, 64, "none", device="cpu"), (x, q.to(torch.bfloat16), scale))}[bad]
    with pytest.raises(ValueError, match=match):
        gemv(args[0], args[1], out=gemv.out_like(), scale=args[2])


def test_fp8_reference_is_dequant_linear():
    """gemv_reference with the row scales is quantization.dequant_linear's fp32 numerics (the
    per-op fp8 path on the CPU), and the rope reference dequantizes alike."""
    x, q, scale = _fp8_inputs(seed=1)
    want = dequant_linear(x.float(), QuantizedWeight(q, scale))
    torch.testing.assert_close(gemv_reference(x, q, "none", scale=scale), want, rtol=1e-6, atol=1e-6)
    shape = RopeShape(16, 2, 1, 64, 64)  # (2 + 2) heads of 16 = 64 rows
    x, w, b, nw, step = _rope_inputs(shape, 64, 2)
    q, scale = quantize_rows(w)
    twin = RopeKV(step.positions, step.cos_sin_cache, step.k_cache.clone(), step.v_cache.clone(), step.slot_mapping)
    got = rope_kv_reference(x, q, b, shape, step, nw, scale=scale, dtype=torch.float32)
    want = rope_kv_reference(x, q.float() * scale[:, None], b, shape, twin, nw, dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---- lowering on the CPU ----------------------------------------------------------------------

# The bf16 kernels as the fused path builds them (PDL, the norm where it has one, the tuned
# plans' knobs): their PTX's SHA-256 (first 16 hex digits) before fp8 weights existed. The
# multi-row entries pin the CUDA-core form (`mma: false`), which fp8 shares; bf16 at 2-16 rows
# defaults to the tensor-core form, pinned by its own lowering tests in test_cute_gemv.py.
BF16_PTX_SHA = {
    (1152, 896, "bias_rope_kv", 1, 0, 1, "{}", 1): "1d764f3be1936ec5",
    (896, 896, "residual", 1, 0, 0, "{}", 1): "cc3644930e1f1d80",
    (9728, 896, "silu_mul", 1, 1, 1, '{"stages": 2, "ctas_per_sm": 4}', 1): "4ef05af488e0d8e3",
    (896, 4864, "residual", 1, 0, 0, '{"warps": 4}', 1): "4789925125f469c9",
    (151936, 896, "argmax", 1, 0, 1, '{"ctas_per_sm": 2}', 1): "7a2f4546078a277d",
    (1152, 896, "bias_rope_kv", 1, 0, 1, '{"mma": false}', 4): "c194a1a6e64b2766",
    (896, 4864, "residual", 1, 0, 0, '{"mma": false}', 2): "ab6da7598b77cc17",
    (151936, 896, "argmax", 1, 0, 1, '{"mma": false}', 4): "ce415fb029ee1115",
    (9728, 896, "silu_mul", 1, 0, 1, '{"mma": false}', 4): "1b3e00c86f8b27b0",
    (896, 4864, "residual", 0, 0, 0, "{}", 1): "a305f2cbe7d817e4",
}
# The same variants' PTX from DSL 4.8.1 (recorded from code whose 4.3.5 PTX matches the pins above).
BF16_PTX_SHA_481 = {
    (1152, 896, "bias_rope_kv", 1, 0, 1, "{}", 1): "746bb90b5c6c9a6e",
    (896, 896, "residual", 1, 0, 0, "{}", 1): "9fbe6fd510fecc45",
    (9728, 896, "silu_mul", 1, 1, 1, '{"stages": 2, "ctas_per_sm": 4}', 1): "870c57605de867e1",
    (896, 4864, "residual", 1, 0, 0, '{"warps": 4}', 1): "b77287a17e0896f6",
    (151936, 896, "argmax", 1, 0, 1, '{"ctas_per_sm": 2}', 1): "bb40659cea7abb55",
    (1152, 896, "bias_rope_kv", 1, 0, 1, '{"mma": false}', 4): "6040077e20b8243f",
    (896, 4864, "residual", 1, 0, 0, '{"mma": false}', 2): "743b6d7374070c3a",
    (151936, 896, "argmax", 1, 0, 1, '{"mma": false}', 4): "10928ddbb745ef7c",
    (9728, 896, "silu_mul", 1, 0, 1, '{"mma": false}', 4): "17596d28972da5f7",
    (896, 4864, "residual", 0, 0, 0, "{}", 1): "1e39615fcd93e561",
}
on_the_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run for real (below)")


def ptx_pins(pins_by_version: dict) -> dict:
    """The PTX pins of the importable DSL's version (the PTX differs between versions); skips
    the test for a version with none."""
    version = cute_gemv.dsl_version()
    if version not in pins_by_version:
        pytest.skip(f"PTX pins are DSL {' and '.join(pins_by_version)}'s, not {version}'s")
    return pins_by_version[version]


@pytest.mark.slow
@needs_cute
@on_the_cpu
@pytest.mark.parametrize("n, k, epilogue, pdl, staged, norm, knobs, rows", sorted(BF16_PTX_SHA))
def test_bf16_kernels_ptx_is_unchanged_by_fp8(tmp_path, n, k, epilogue, pdl, staged, norm, knobs, rows):
    # M rows: the heuristic's plans (the pins predate TUNED_PLANS' M-row entries, which change plans, not code)
    planned = json.loads(knobs) | ({"tuned": False} if rows > 1 else {})
    counts = lower_to_ptx(tmp_path, n, k, epilogue, pdl, staged, norm, planned, rows)
    pins = ptx_pins({"4.3.5": BF16_PTX_SHA, "4.8.1": BF16_PTX_SHA_481})
    assert counts["SHA"][:16] == pins[(n, k, epilogue, pdl, staged, norm, knobs, rows)]


# (n, k, epilogue, pdl, norm, rows, knobs): the fused path's fp8 GEMVs at Qwen2.5-0.5B's shapes,
# each epilogue, a one-lane-a-row shape (K = 208: 13 chunks of 16), the plain (no PDL) forms, and
# the cp.async-staged pipeline the bf16 O and gate+up plans use.
STAGED2 = {"staged": True, "stages": 2, "ctas_per_sm": 4}
FP8_LOWERING = [(1152, 896, "bias_rope_kv", 1, 1, r, {}) for r in FP8_ROWS] + [
    (896, 896, "residual", 1, 0, 1, {}), (896, 896, "residual", 1, 0, 4, {}), (9728, 896, "silu_mul", 1, 1, 1, {}),
    (9728, 896, "silu_mul", 1, 1, 2, {}), (896, 4864, "residual", 1, 0, 1, {}), (896, 4864, "residual", 1, 0, 4, {}),
    (896, 4864, "residual", 0, 0, 1, {}), (1152, 896, "bias", 0, 1, 1, {}), (151936, 896, "none", 1, 1, 2, {}),
    (151936, 896, "argmax", 1, 1, 1, {}), (151936, 896, "argmax", 0, 1, 4, {}), (256, 256, "rope_kv", 0, 1, 1, {}),
    (136, 208, "silu_mul", 0, 1, 2, {}), (9728, 896, "silu_mul", 1, 1, 1, STAGED2), (896, 896, "residual", 1, 0, 1, STAGED2),
    (896, 896, "residual", 0, 0, 4, {"staged": True}),
]


@pytest.mark.slow
@needs_cute
@on_the_cpu
@pytest.mark.parametrize("n, k, epilogue, pdl, norm, rows, knobs", FP8_LOWERING)
def test_fp8_variant_lowers_to_16_byte_loads_and_hardware_conversions(tmp_path, n, k, epilogue, pdl, norm, rows,
                                                                      knobs):
    knobs = dict(knobs)
    staged = knobs.pop("staged", False)
    counts = {key: int(v) for key, v in lower_to_ptx(tmp_path, n, k, epilogue, pdl, int(staged), norm, knobs, rows,
                                                     fp8=True).items() if key != "SHA"}
    d = 64 if n == 1152 else 32  # as PTX_SCRIPT builds it
    rope = RopeShape(d, n // d - 4, 2, 32768, 8193 * 16) if epilogue in ROPE_EPILOGUES else None
    p = plan_gemv(n, k, epilogue, rope=rope, pdl=bool(pdl), norm=bool(norm), rows=rows, fp8=True, staged=staged,
                  **knobs)
    weights = p.loads_in_flight_per_lane  # 16 e4m3 a 16-byte load, read once for all rows
    x_and_g = 2 * p.chunks * (rows + norm)  # each weight chunk meets two 16-byte x (and g) loads
    # (DSL 4.3.5 types the weights' loads .u32, x's .b32; 4.6 on both .b32: the sum is what holds)
    if staged:  # 16-byte cp.async copies (both stages' where two), none loaded straight
        assert counts["CPASYNC"] >= weights * p.stages and counts["W128"] + counts["W128U"] == x_and_g, counts
    else:
        assert counts["W128"] + counts["W128U"] == x_and_g + weights and counts["CPASYNC"] == 0, counts
    assert counts["CVT8"] == 8 * weights  # every e4m3 pair widened once by the hardware cvt, whatever M
    assert counts["FMA"] >= rows * weights * 16
    # no local memory; ptxas's stack (-1: no ptxas here to ask) empty for the plans the fused path
    # builds, a few spilled words at most for the staged sweep variants (as in bf16's test)
    assert counts["LOCAL"] == 0 and counts["STACK"] <= (64 if staged else 0), counts
    assert counts["F32LOAD"] >= p.outs_per_group * p.rows_per_out  # the row scales
    assert (counts["GRIDDEP"] > 0) == bool(pdl) and (counts["RSQRT"] > 0) == bool(norm)
    assert (counts["ATOM"] > 0) == (epilogue == "argmax")


# ---- on the GPU -------------------------------------------------------------------------------

def check_fp8_rows(kh, gemv: CuteGemv) -> None:
    """An fp8 GEMV of any form against dequant_linear's numerics (fp32 from the same codes and
    scales), each row: out poisoned (NaN) so an unwritten row fails, the residual in place
    between guard rows. Two seeds."""
    p = gemv.plan
    n, k, epilogue, rows, norm = p.n_rows, p.k, p.epilogue, p.rows, p.norm
    for seed in (0, 1):
        x, w, extra, nw = _rows_inputs(n, k, epilogue, rows, seed, device="cuda", norm=norm)
        q, scale = quantize_rows(w)
        want = gemv_reference(x, q, epilogue, extra, norm_weight=nw, scale=scale)
        if epilogue == "none" and not norm:  # the reference is the per-op path's own
            # (two fp32 GEMMs, maybe summed in another order: equal to fp32 rounding)
            torch.testing.assert_close(want, dequant_linear(x.float(), QuantizedWeight(q, scale)), rtol=1e-4, atol=1e-4)
        out = gemv.out_like().fill_(float("nan"))
        if epilogue == "residual":
            guarded = torch.full((rows + 2, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            guarded[1:-1] = extra
            out = extra = guarded[1:-1]
        gemv(x, q, extra, out=out, norm_weight=nw, scale=scale)
        torch.cuda.synchronize()
        assert out.shape == want.shape and not torch.isnan(out).any()
        for m in range(rows):
            assert kh.rel_err(out[m], want[m]) < 1e-2, f"row {m}"
        if epilogue == "residual":
            assert torch.isnan(guarded[0]).all() and torch.isnan(guarded[-1]).all()


def check_fp8_argmax(kh, gemv: CuteGemv) -> None:
    """Each row's token the argmax of its dequantized logits (ties within 1e-3 of the top),
    twice (the counter reset between calls)."""
    p = gemv.plan
    n, k, rows, norm = p.n_rows, p.k, p.rows, p.norm
    for seed in (0, 1):
        x, w, _, nw = _rows_inputs(n, k, "argmax", rows, seed, device="cuda", norm=norm)
        q, scale = quantize_rows(w)
        logits = gemv_reference(x, q, "none", norm_weight=nw, eps=gemv.plan.eps, scale=scale)
        out = gemv.out_like().fill_(-1)
        gemv(x, q, out=out, norm_weight=nw, scale=scale)
        torch.cuda.synchronize()
        for m in range(rows):
            top = logits[m].max()
            assert float(top - logits[m, int(out[m])]) <= 1e-3 * float(logits[m].abs().max()), f"row {m}"


FP8_GPU_CASES = [  # (n, k, epilogue, norm, pdl, knobs): the fused path's GEMVs, the others, small shapes
    (1152, 896, "bias", True, True, {}), (1152, 896, "none", True, False, {}), (896, 896, "residual", False, True, {}),
    (9728, 896, "silu_mul", True, True, {}), (896, 4864, "residual", False, True, {}),
    (896, 4864, "residual", False, False, {}), (151936, 896, "none", True, True, {}),
    (136, 208, "silu_mul", True, False, {}), (96, 64, "bias", False, False, {}), (256, 256, "residual", False, False, {}),
    (9728, 896, "silu_mul", True, True, STAGED2), (896, 896, "residual", False, True, STAGED2),
    (896, 4864, "residual", False, False, {"staged": True, "warps": 2}),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", FP8_ROWS)
@pytest.mark.parametrize("n, k, epilogue, norm, pdl, knobs", FP8_GPU_CASES)
def test_fp8_gemv_matches_dequant_linear(kh, n, k, epilogue, norm, pdl, knobs, rows):
    """out poisoned (NaN) so an unwritten row fails; the residual in place between guard rows;
    each row against dequant_linear's numerics (fp32 from the same codes and scales)."""
    check_fp8_rows(kh, CuteGemv(n, k, epilogue, pdl=pdl, norm=norm, rows=rows, fp8=True, **knobs))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", FP8_ROWS)
@pytest.mark.parametrize("n, k, norm, pdl", [(151936, 896, True, True), (256, 256, False, False)])
def test_fp8_argmax_per_row(kh, n, k, norm, pdl, rows):
    """Each row's token the argmax of its dequantized logits (ties within 1e-3 of the top),
    twice (the counter reset between calls)."""
    check_fp8_argmax(kh, CuteGemv(n, k, "argmax", pdl=pdl, norm=norm, rows=rows, fp8=True))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", FP8_ROWS)
@pytest.mark.parametrize("shape, k, bias, pdl", [(QWEN05_ROPE, 896, True, True), (QWEN05_ROPE, 896, True, False),
                                                 (RopeShape(64, 4, 2, 2048, 1025 * 16), 256, False, True)])
def test_fp8_rope_kv_each_row_at_its_position_and_slot(kh, shape, k, bias, pdl, rows):
    """The fused path's fp8 QKV: RoPE + the K/V write from the scaled sums; the pool poisoned
    (+-7) everywhere it must not write."""
    gemv = CuteGemv(shape.rows, k, "bias_rope_kv" if bias else "rope_kv", pdl=pdl, norm=True, rope=shape,
                    rows=rows, fp8=True)
    check_rows_rope(kh, gemv, shape, k, bias, rows, fp8=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("k", [256, 768])  # 1 and 3 chunks a lane
def test_every_e4m3_code_widens_exactly_in_place(k):
    """One-hot rows of x pick single columns of a weight holding every finite e4m3 code (scale
    1): y[m, r] must be W[r, column] exactly. A code widened wrong, or a chunk's half met by
    the wrong x load, shows as a different value."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]
    n, rows = 64, 16
    flat = codes[torch.arange(n * k) % codes.numel()]
    q = flat.view(n, k).cuda()
    scale = torch.ones(n, device="cuda")
    gemv = CuteGemv(n, k, "none", rows=rows, fp8=True)
    for start in range(0, k, rows):
        x = torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(rows), torch.arange(start, start + rows)] = 1
        y = gemv(x, q, scale=scale)
        torch.cuda.synchronize()
        assert torch.equal(y.float(), q[:, start:start + rows].float().t()), f"columns {start}..{start + rows - 1}"


def test_gemv_sweep_refuses_fp8_with_registers():
    """--registers traces the bf16 variants only: asked for fp8 as well it says so, not a bf16
    table under an fp8 request."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gemv_sweep.py"
    done = subprocess.run([sys.executable, str(script), "--registers", "--fp8"], capture_output=True,
                          text=True, timeout=120, cwd=script.parents[1],
                          env={**os.environ, "PYTHONPATH": str(script.parents[1])})
    assert done.returncode == 2 and "--fp8 sweeps on the GPU only" in done.stderr, done.stderr[-500:]


def test_gemv_sweep_takes_a_presets_shapes_and_the_tensor_core_knobs(monkeypatch):
    """--config: the sweep's shapes are the fused path's GEMVs of that preset (the 7B's as
    fused_decode builds them); --mma: every variant it times is a distinct tensor-core plan, its
    splits where the epilogue allows them (O and down; the norm-folded QKV / gate+up only where one CTA
    cannot hold K)."""
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    import gemv_sweep

    shapes = gemv_sweep.shapes_for("qwen2.5-7b")
    assert shapes["qkv_rope"][:4] == (4608, 3584, "bias_rope_kv", True)
    assert shapes["o"][:2] == (3584, 3584) and shapes["down"][:2] == (3584, 18944)
    assert shapes["gate_up"][:3] == (37888, 3584, "silu_mul") and shapes["lm_head"][:2] == (152064, 3584)
    assert gemv_sweep.shapes_for("llama-3.1-8b")["qkv"][2] == "none"  # no QKV bias
    monkeypatch.setattr(gemv_sweep, "SHAPES", shapes)
    for name in ("qkv_rope", "o", "gate_up", "down"):
        n, k, epilogue, norm, rope = shapes[name]
        found = gemv_sweep.variants(name, True, 1, fp8=True, mma=True)
        plans = [plan_gemv(n, k, epilogue, pdl=True, norm=norm, rope=rope, tuned=False, fp8=True, mma=True, **knobs)
                 for _, knobs in found]
        assert found[0][0] == "default" and len(found) >= 4 and len(set(plans)) == len(plans)
        assert all(p.mma and p.fp8 for p in plans)
        if not norm:  # (under the norm only a plan whose K one CTA cannot hold splits)
            assert any(p.splits > 1 for p in plans), name


def test_gemv_sweep_refuses_mma_for_bf16_rows_past_one():
    """bf16's M-row plans are the tensor-core form already: --mma is for fp8 or one bf16 row."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gemv_sweep.py"
    done = subprocess.run([sys.executable, str(script), "--mma", "--rows", "4"], capture_output=True,
                          text=True, timeout=120, cwd=script.parents[1],
                          env={**os.environ, "PYTHONPATH": str(script.parents[1])})
    assert done.returncode == 2 and "one bf16 row" in done.stderr, done.stderr[-500:]
