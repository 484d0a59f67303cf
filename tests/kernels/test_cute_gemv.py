"""The CuTe DSL decode GEMV (flashlet/kernels/cute_gemv.py).

On any machine: the plan (lanes, chunks, rows in flight, grid) at the model's shapes and its
input checks. With the CuTe DSL installed but no GPU: each variant traces and lowers to PTX
for sm_90a with 16-byte weight loads (the driver load at the end fails without a GPU; the PTX
is what is checked). With CUDA and the DSL: every variant against an fp32 reference on random
inputs, output poisoned first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flashlet.kernels import cute_gemv
from flashlet.kernels.cute_gemv import (EPILOGUES, ROPE_EPILOGUES, TUNED_PLANS, VEC, CuteGemv, RopeKV,
                                        RopeShape, gemv_reference, lanes_for, plan_gemv, rope_kv_reference)
from flashlet.models.quantization import quantize_rows

QWEN05_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)]
HAVE_CUTE, NO_CUTE_REASON = cute_gemv.cute_available()
needs_cute = pytest.mark.skipif(not HAVE_CUTE, reason=f"needs the CuTe DSL: {NO_CUTE_REASON[:160]}")
GPU_SKIP = ("needs CUDA" if not torch.cuda.is_available()
            else None if HAVE_CUTE else f"needs the CuTe DSL: {NO_CUTE_REASON[:160]}")
needs_gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")
# The model's shapes with the epilogue each one has in the model, plus odd small shapes.
GPU_CASES = [(1152, 896, "none"), (1152, 896, "bias"), (896, 896, "residual"), (9728, 896, "silu_mul"),
             (896, 4864, "none"), (896, 4864, "residual"), (151936, 896, "none"), (151936, 896, "argmax")]
PLAIN_EPILOGUES = [e for e in EPILOGUES if e not in ROPE_EPILOGUES]  # the rope ones need a RopeShape
GPU_CASES += [(136, 200, e) for e in PLAIN_EPILOGUES] + [(96, 64, "silu_mul"), (96, 64, "argmax")]
GPU_VARIANTS = ([(*c, False, False) for c in GPU_CASES] + [(896, 896, "residual", True, False)]
                + [(896, 4864, "residual", False, True), (9728, 896, "silu_mul", True, True),
                   (136, 200, "bias", False, True)])  # (n, k, epilogue, pdl, staged)


@pytest.mark.parametrize("n, k", QWEN05_SHAPES)
@pytest.mark.parametrize("epilogue", PLAIN_EPILOGUES)
def test_plan_covers_every_row_and_column_once(n, k, epilogue):
    p = plan_gemv(n, k, epilogue, tuned=False)  # the heuristic (TUNED_PLANS is checked below)
    assert p.lanes * p.chunks * VEC == k                     # a row's chunks split evenly
    assert p.num_tiles * p.outs_per_tile >= p.n_out          # every output has a group
    assert (p.num_tiles - 1) * p.outs_per_tile < p.n_out     # and no tile is wholly idle
    assert 1 <= p.grid <= p.num_tiles
    one_output = p.chunks * (2 if epilogue == "silu_mul" else 1)
    assert p.loads_in_flight_per_lane <= max(24, one_output)  # registers bound the rows in flight
    if epilogue != "argmax":
        assert p.grid == p.num_tiles                         # one tile per CTA, no loop


def tiles_per_cta(p) -> list[list[int]]:
    """The tiles each CTA computes: the kernel's loop `for tile in range(bidx, num_tiles, grid)`."""
    return [list(range(b, p.num_tiles, p.grid)) for b in range(p.grid)]


def staged_schedule(p) -> list[tuple[int, int, int]]:
    """The two-stage pipeline as the kernel runs it, per CTA: (CTA, tile summed, buffer it was
    copied into). The prologue copies tile bidx into buffer 0; iteration i sums buffer i % 2
    after copying tile + grid (if any) into the other."""
    out = []
    for b, tiles in enumerate(tiles_per_cta(p)):
        buffers = {0: tiles[0]}
        for i, tile in enumerate(tiles):
            stage = i % 2
            if tile + p.grid < p.num_tiles:
                buffers[1 - stage] = tile + p.grid
            out.append((b, tile, buffers[stage]))
    return out


@pytest.mark.parametrize("n, k, epilogue, knobs", [
    (9728, 896, "silu_mul", dict(ctas_per_sm=3)), (896, 4864, "residual", dict(ctas_per_sm=2, warps=2)),
    (1152, 896, "bias", dict(ctas_per_sm=1, outs_per_group=2)), (136, 200, "none", dict(ctas_per_sm=4)),
    (9728, 896, "silu_mul", dict(staged=True, stages=2, ctas_per_sm=4)),
    (896, 4864, "residual", dict(staged=True, stages=2, ctas_per_sm=2)),
    (151936, 896, "argmax", dict(ctas_per_sm=1, warps=8, outs_per_group=3)),
])
def test_looping_grid_covers_every_tile_once(n, k, epilogue, knobs):
    p = plan_gemv(n, k, epilogue, num_sms=132, **knobs)
    assert p.grid == min(p.num_tiles, knobs["ctas_per_sm"] * 132)
    assert p.loops == (p.grid < p.num_tiles)
    assert sorted(t for tiles in tiles_per_cta(p) for t in tiles) == list(range(p.num_tiles))
    if p.stages == 2:  # every tile is summed from the buffer its own copies went to
        assert all(tile == staged for _, tile, staged in staged_schedule(p))
        assert p.warps * 32 * p.loads_in_flight_per_lane * 16 * 2 <= 48 << 10


def test_plan_overrides_win_over_the_heuristic():
    p = plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, warps=2, outs_per_group=2, late_g=True,
                  min_ctas_per_sm=6, tuned=False)
    assert (p.warps, p.outs_per_group, p.late_g, p.min_ctas) == (2, 2, True, 6)
    assert p.grid == p.num_tiles == -(-4864 // (2 * 2 * 2))  # 2 warps x 2 groups a warp x 2 outputs
    assert plan_gemv(9728, 896, "silu_mul", norm=True, late_g=True).late_g is False  # no wait to move g past
    assert plan_gemv(9728, 896, "silu_mul", ctas_per_sm=0).grid == plan_gemv(9728, 896, "silu_mul").grid
    assert plan_gemv(151936, 896, "argmax", ctas_per_sm=0).grid == plan_gemv(151936, 896, "argmax").num_tiles
    # Staged at gate_up: two stages of four warps would need 56 KB, so the heuristic halves the warps.
    assert plan_gemv(9728, 896, "silu_mul", staged=True, stages=2).warps == 2
    assert "st2" in plan_gemv(9728, 896, "silu_mul", staged=True, stages=2).describe()


@pytest.mark.parametrize("kwargs, match", [
    (dict(stages=2), "stages"), (dict(staged=True, stages=3), "stages"), (dict(late_g=True), "norm"),
    (dict(warps=3), "warps"), (dict(warps=0), "warps"), (dict(outs_per_group=0), "outs_per_group"),
    (dict(ctas_per_sm=-1), "ctas_per_sm"), (dict(staged=True, stages=2, warps=4), "48 KB"),
    (dict(min_ctas_per_sm=32, warps=4), "64 warps"), (dict(min_ctas_per_sm=2, staged=True), "register cap"),
])
def test_plan_rejects_bad_overrides(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_gemv(9728, 896, "silu_mul", **kwargs)


def test_tuned_plans_table_supplies_defaults(monkeypatch):
    key = (9728, 896, "silu_mul", True, True)
    monkeypatch.setitem(TUNED_PLANS, key, dict(warps=2, ctas_per_sm=4, late_g=True))
    p = plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, num_sms=132)
    assert (p.warps, p.grid, p.late_g) == (2, 4 * 132, True)
    assert plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, warps=4).warps == 4  # an argument wins
    assert plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, tuned=False) == \
        plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, tuned=False, warps=4, late_g=False)
    assert plan_gemv(9728, 896, "silu_mul", norm=True, pdl=False).grid == 608  # another key: untouched
    assert CuteGemv(9728, 896, "silu_mul", device="cpu", norm=True, pdl=True).plan == p
    monkeypatch.setitem(TUNED_PLANS, key, dict(staged=True, stages=2, ctas_per_sm=4))
    assert plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True).stages == 2
    p = plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, staged=False)  # registers: no stages
    assert (p.staged, p.stages, p.grid) == (False, 1, 4 * 132)
    monkeypatch.setitem(TUNED_PLANS, key, dict(wraps=2))
    with pytest.raises(ValueError, match="unknown knobs"):
        plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True)


@pytest.mark.parametrize("key", sorted(TUNED_PLANS, key=str))
def test_every_tuned_plan_is_valid(key):
    n, k, epilogue, norm, pdl, *rows = key  # the built-in entries are bf16: M follows where M > 1
    # a rope entry's rows are (Hq + 2 Hkv) heads of 64 (the 0.5B's 14 + 2 x 2 at N = 1,152)
    rope = RopeShape(64, n // 64 - 4, 2, 4096, 8193 * 16) if epilogue in ROPE_EPILOGUES else None
    p = plan_gemv(n, k, epilogue, norm=norm, pdl=pdl, rope=rope, rows=rows[0] if rows else 1)
    assert sorted(t for tiles in tiles_per_cta(p) for t in tiles) == list(range(p.num_tiles))
    assert (p.num_tiles - 1) * p.outs_per_tile < p.n_out <= p.num_tiles * p.outs_per_tile


def rope_rows(p) -> list[tuple[int, int]]:
    """The two W rows behind each output slot of a rope plan (the kernel's mapping)."""
    half = p.rope.head_dim // 2
    return [((s // half) * p.rope.head_dim + s % half, (s // half) * p.rope.head_dim + s % half + half)
            for s in range(p.n_out)]


@pytest.mark.parametrize("shape", [RopeShape(64, 14, 2, 4096, 1024), RopeShape(32, 4, 2, 64, 16),
                                   RopeShape(128, 8, 8, 64, 16)])
@pytest.mark.parametrize("epilogue", ROPE_EPILOGUES)
def test_rope_plan_pairs_every_row_once(shape, epilogue):
    p = plan_gemv(shape.rows, 896, epilogue, rope=shape)
    assert p.n_out == shape.rows // 2 and p.rows_per_out == 2
    assert p.loads_in_flight_per_lane == 2 * p.chunks * p.outs_per_group
    assert p.num_tiles * p.outs_per_tile >= p.n_out and p.grid == p.num_tiles
    pairs = rope_rows(p)
    assert sorted(r for pair in pairs for r in pair) == list(range(shape.rows))  # each row once
    assert all(b - a == shape.head_dim // 2 and a // shape.head_dim == b // shape.head_dim for a, b in pairs)


@pytest.mark.parametrize("args, kwargs, match", [
    ((1152, 896, "rope_kv"), {}, "needs a RopeShape"),
    ((1152, 896, "bias"), {"rope": RopeShape(64, 14, 2, 64, 16)}, "takes no"),
    ((1088, 896, "rope_kv"), {"rope": RopeShape(64, 14, 2, 64, 16)}, "rows"),
    ((1152, 896, "rope_kv"), {"rope": RopeShape(64, 14, 2, 64, 16), "staged": True}, "staged"),
])
def test_rope_plan_rejects_bad_shapes(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_gemv(*args, **kwargs)


def test_rope_shape_refuses_32_bit_overflow():
    with pytest.raises(ValueError, match="32 bits"):
        RopeShape(128, 32, 8, 4096, 2**21)


def _rope_inputs(shape, k, seed, device="cpu", bias=True):
    g = torch.Generator(device=device).manual_seed(seed)
    n, d = shape.rows, shape.head_dim
    x = (torch.randn(k, generator=g, device=device) * 3 + 0.25).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g, device=device).to(torch.bfloat16) if bias else None
    nw = (torch.rand(k, generator=g, device=device) + 0.5).to(torch.bfloat16)
    theta = torch.arange(shape.table_rows, device=device)[:, None] * 10000.0 ** (
        -torch.arange(d // 2, device=device) / (d // 2))
    table = torch.cat((theta.cos(), theta.sin()), dim=-1).float()
    pool = (shape.cache_slots // 4, 4, shape.num_kv_heads, d)  # [pages, page_size, Hkv, D]
    step = RopeKV(torch.tensor([shape.table_rows - 3], device=device), table,
                  torch.full(pool, 7.0, dtype=torch.bfloat16, device=device),
                  torch.full(pool, -7.0, dtype=torch.bfloat16, device=device),
                  torch.tensor([shape.cache_slots - 6], device=device))
    return x, w, b, nw, step


def test_rope_reference_is_the_two_kernel_path_in_fp32():
    """In fp32 the reference is gemv + bias, then `TorchOps.rope` and the pool write: the per-op
    path's operations (the kernel skips only the bf16 rounding between them)."""
    from flashlet.models.ops import TorchOps

    shape = RopeShape(16, 4, 2, 32, 16)
    x, w, b, nw, step = _rope_inputs(shape, 64, 0)
    step.k_cache, step.v_cache = step.k_cache.float(), step.v_cache.float()
    y = rope_kv_reference(x, w, b, shape, step, norm_weight=nw, dtype=torch.float32)
    heads = (gemv_reference(x, w, "bias", b, norm_weight=nw).reshape(-1, 16))
    q, k, v = heads[:4], heads[4:6], heads[6:]
    q2, k2 = TorchOps.rope(q[None], k[None], step.positions, step.cos_sin_cache)
    torch.testing.assert_close(y.reshape(-1, 16), torch.cat((q2[0], k2[0], v)), rtol=0, atol=0)
    slot = int(step.slot_mapping)
    torch.testing.assert_close(step.k_cache.view(-1, 2, 16)[slot], k2[0], rtol=0, atol=0)
    torch.testing.assert_close(step.v_cache.view(-1, 2, 16)[slot], v, rtol=0, atol=0)
    assert (step.k_cache.view(-1, 2, 16)[:slot] == 7).all()  # nothing else written
    step.slot_mapping.fill_(-1)  # a negative slot: no pool write
    before = step.k_cache.clone()
    rope_kv_reference(x, w, b, shape, step, norm_weight=nw, dtype=torch.float32)
    assert torch.equal(step.k_cache, before)


def test_rope_call_checks_its_tensors():
    shape = RopeShape(32, 4, 2, 64, 16)
    gemv = CuteGemv(shape.rows, 256, "bias_rope_kv", device="cpu", norm=True, rope=shape)
    x, w, b, nw, step = _rope_inputs(shape, 256, 0)
    with pytest.raises(ValueError, match="rope_kv"):
        gemv(x, w, b, out=gemv.out_like(), norm_weight=nw)
    bad = RopeKV(step.positions.int(), step.cos_sin_cache, step.k_cache, step.v_cache, step.slot_mapping)
    with pytest.raises(ValueError, match="positions"):
        gemv(x, w, b, out=gemv.out_like(), norm_weight=nw, rope_kv=bad)
    bad = RopeKV(step.positions, step.cos_sin_cache[:10], step.k_cache, step.v_cache, step.slot_mapping)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        gemv(x, w, b, out=gemv.out_like(), norm_weight=nw, rope_kv=bad)
    bad = RopeKV(step.positions, step.cos_sin_cache, step.k_cache[:2], step.v_cache, step.slot_mapping)
    with pytest.raises(ValueError, match="k_cache"):
        gemv(x, w, b, out=gemv.out_like(), norm_weight=nw, rope_kv=bad)
    with pytest.raises(ValueError, match="takes no rope_kv"):
        CuteGemv(96, 64, "bias", device="cpu")(torch.zeros(64, dtype=torch.bfloat16),
                                              torch.zeros(96, 64, dtype=torch.bfloat16),
                                              torch.zeros(96, dtype=torch.bfloat16), rope_kv=step)


def test_plan_keeps_small_shapes_spread_over_the_sms():
    for n, k in QWEN05_SHAPES[:4]:
        assert plan_gemv(n, k, num_sms=132, tuned=False).grid >= 2 * 132


def test_lanes_are_the_largest_power_of_two_dividing_the_chunks():
    assert lanes_for(896) == 16 and lanes_for(4864) == 32 and lanes_for(8) == 1 and lanes_for(24) == 1


@pytest.mark.parametrize("args, match", [
    ((128, 900), "multiple of 8"),
    ((127, 64, "silu_mul"), "even number"),
    ((128, 64, "gelu"), "unknown epilogue"),
])
def test_plan_rejects_bad_shapes(args, match):
    with pytest.raises(ValueError, match=match):
        plan_gemv(*args)


def test_reference_epilogues_match_plain_pytorch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    r = torch.randn(32, generator=g).to(torch.bfloat16)
    y = w.float() @ x.float()
    assert torch.equal(gemv_reference(x, w, "residual", r), (y + r.float()).reshape(1, -1))
    gate, up = y[:16], y[16:]
    assert torch.allclose(gemv_reference(x, w, "silu_mul"), (gate * torch.sigmoid(gate) * up).reshape(1, -1))
    assert gemv_reference(x, w, "argmax").item() == int(y.argmax())


def test_missing_dsl_gives_install_hint(monkeypatch):
    if HAVE_CUTE:
        pytest.skip("the CuTe DSL is installed here; the missing-package message cannot be shown")
    with pytest.raises(cute_gemv.CuteUnavailable, match=cute_gemv.CUTE_DSL_PIN):
        CuteGemv(128, 64, device="cpu").compile()


def test_one_cute_dsl_version_everywhere():
    """The DSL release the install hint names is the `cuda` extra's pin (what `make setup`
    installs on a CUDA machine, resolved by `make check-pins`) and the one gpu_wheels.sh packs
    for the GPU figures."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    extra = re.search(r"^cuda = \[(.*)\]$", (root / "pyproject.toml").read_text(), re.M)
    assert extra and f'"{cute_gemv.CUTE_DSL_PIN}"' in extra.group(1)
    wheels = re.search(r"^CUTE_DSL_VERSION=(\S+)", (root / "scripts/gpu_wheels.sh").read_text(), re.M)
    assert wheels and cute_gemv.CUTE_DSL_PIN == f"nvidia-cutlass-dsl=={wheels.group(1)}"
    assert 'cuda' in re.search(r"^EXTRAS.*$", (root / "Makefile").read_text(), re.M).group(0)

# One row compiles to the kernel it was before M rows existed: its 16-byte loads and FMAs in the
# PTX, as counted on the one-row kernel (whose whole PTX the M-row change left byte-identical).
ONE_ROW_PTX = {(1152, 896, "bias", 1, 0, 1): (21, 114), (896, 896, "residual", 1, 0, 0): (14, 56),
               (9728, 896, "silu_mul", 0, 0, 1): (28, 169), (896, 4864, "residual", 0, 0, 0): (38, 152),
               (1152, 896, "bias_rope_kv", 1, 0, 1): (28, 172)}


PTX_SCRIPT = textwrap.dedent("""
    import glob, hashlib, json, re, shutil, subprocess, sys, torch
    from flashlet.kernels import cute_gemv
    from flashlet.kernels.cute_gemv import CuteGemv, RopeShape, ROPE_EPILOGUES
    n, k, epilogue, pdl, staged = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[6] == "1"
    norm = sys.argv[7] == "1"
    knobs = json.loads(sys.argv[8])
    rows = int(sys.argv[9])
    fp8 = len(sys.argv) > 10 and sys.argv[10] == "1"
    d = 64 if n == 1152 else 32  # the rope variants: Qwen2.5-0.5B's heads, or 4 q + 2 kv heads of 32
    rope = RopeShape(d, n // d - 4, 2, 32768, 8193 * 16) if epilogue in ROPE_EPILOGUES else None
    cute_gemv._dsl()
    import cutlass.cutlass_dsl.cutlass as dsl_module
    # A register cap's shared-memory carveout hint queries the GPU (4.3.5 at launch, 4.6 on while
    # lowering): answer with the H200's 228 KB an SM.
    dsl_module._build_kernel_attrs = lambda config: {}
    dsl_module.cuda_helpers.get_device_attribute = lambda attribute, *args: 233472
    try:
        CuteGemv(n, k, epilogue, device="cpu", pdl=pdl, staged=staged, norm=norm, rope=rope, rows=rows,
                 **({"fp8": True} if fp8 else {}), **knobs).compile()
    except Exception as e:  # without a GPU the final module load fails; the PTX is written before it
        print("compile stopped:", type(e).__name__)
    ptx = "".join(open(f, errors="replace").read() for f in glob.glob(sys.argv[5] + "/*.ptx")).replace(chr(0), "")
    sha = hashlib.sha256(ptx.encode()).hexdigest()
    ptx = re.sub(r"[ \t]+", " ", ptx)  # 4.6 on separates an opcode from its operands by a tab
    stack = regs = -1  # ptxas's stack frame (spills, local arrays) where a CUDA toolkit's ptxas is at hand
    try:  # Triton's wheel brings one
        import triton
        bundled = glob.glob(triton.__path__[0] + "/backends/nvidia/bin/ptxas")
    except ImportError:
        bundled = []
    ptxas = shutil.which("ptxas") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ptxas") + bundled)), None)
    if ptxas and ptx:
        open(sys.argv[5] + "/all.ptx.s", "w").write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", sys.argv[5] + "/all.ptx.s", "-o", "/dev/null"],
                             capture_output=True, text=True)
        frames = re.findall(r"([0-9]+) bytes stack frame", res.stderr)
        stack = max(map(int, frames)) if frames else -1
        regs = max(map(int, re.findall(r"Used ([0-9]+) registers", res.stderr)), default=-1)
    # The DSL's LLVM names a load's type as it likes: 4.3.5 x's 16 bytes .b32, fp8 weights' .u32, an
    # fp32 .f32; 4.6 on all .b32 (W128U and F32LOAD's int32 loads then count elsewhere or too).
    print("W128", ptx.count("ld.global.v4.b32"), "W128U", ptx.count("ld.global.v4.u32"), "STORE", ptx.count("st.global"),
          "ATOM", ptx.count("atom.global"), "GRIDDEP", ptx.count("griddepcontrol"),
          "CPASYNC", ptx.count("cp.async.cg.shared.global"), "RSQRT", ptx.count("rsqrt"),
          "F32LOAD", ptx.count("ld.global.f32") + ptx.count("ld.global.b32"), "MINNCTA", ptx.count(".minnctapersm"),
          "WAITGROUP1", ptx.count("cp.async.wait_group 1"), "FMA", ptx.count("fma.rn.f32"), "STACK", stack,
          "REGS", regs, "CVT8", ptx.count("cvt.rn.f16x2.e4m3x2"), "LOCAL", ptx.count(".local"),
          "MMA", ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"), "PRMT", ptx.count("prmt.b32"),
          "WIDEN", ptx.count(", t, 0x87f087f0;"),
          "PREWAIT", sum(ptx.split("griddepcontrol.wait")[0].count(op)  # 16-byte loads before the PDL wait
                         for op in ("ld.global.v4.b32", "ld.global.v4.u32")),
          "SHA", sha)
""")


def rope_as_lowered(n: int, epilogue: str) -> RopeShape | None:
    """The head layout PTX_SCRIPT gives a rope epilogue at n rows (None for the others)."""
    d = 64 if n == 1152 else 32
    return RopeShape(d, n // d - 4, 2, 32768, 8193 * 16) if epilogue in ROPE_EPILOGUES else None


def lower_to_ptx(tmp_path, n, k, epilogue, pdl, staged, norm, knobs, rows, fp8=False) -> dict[str, str]:
    """Trace and lower one variant to sm_90a PTX in a fresh process -> PTX_SCRIPT's counts."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    res = subprocess.run([sys.executable, "-c", PTX_SCRIPT, str(n), str(k), epilogue, str(pdl), str(tmp_path),
                          str(staged), str(norm), json.dumps(knobs), str(rows), str(int(fp8))],
                         env=env, capture_output=True, text=True, timeout=300)
    counts = dict(zip(*[iter(res.stdout.split("\n")[-2].split())] * 2)) if "W128" in res.stdout else {}
    assert counts, res.stdout[-2000:] + res.stderr[-2000:]
    return counts


@pytest.mark.slow
@needs_cute
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels for real")
@pytest.mark.parametrize("n, k, epilogue, pdl, staged, norm, knobs, rows", [
    (1152, 896, "bias", 0, 0, 0, {}, 1), (896, 896, "residual", 1, 0, 0, {}, 1), (9728, 896, "silu_mul", 0, 0, 0, {}, 1),
    (896, 4864, "residual", 0, 0, 0, {}, 1), (151936, 896, "argmax", 0, 0, 0, {}, 1), (9728, 896, "silu_mul", 1, 1, 0, {}, 1),
    (1152, 896, "bias", 1, 0, 1, {}, 1), (9728, 896, "silu_mul", 0, 0, 1, {}, 1), (151936, 896, "argmax", 0, 0, 1, {}, 1),
    (136, 200, "silu_mul", 0, 0, 1, {}, 1), (1152, 896, "bias_rope_kv", 0, 0, 1, {}, 1),
    (1152, 896, "bias_rope_kv", 1, 0, 1, {}, 1), (256, 256, "rope_kv", 0, 0, 1, {}, 1),
    # The plan sweep's knobs (scripts/gemv_sweep.py): looping grids, the two-stage pipeline, g
    # after the wait, a register cap, more warps and rows.
    (9728, 896, "silu_mul", 1, 0, 1, dict(late_g=True, ctas_per_sm=3), 1),
    (9728, 896, "silu_mul", 1, 1, 1, dict(stages=2, ctas_per_sm=4), 1),
    # (warps=2: the tuned down plan's 4 warps would need 76 KB for two stages, over the 48 KB a CTA gets)
    (896, 4864, "residual", 1, 1, 0, dict(stages=2, ctas_per_sm=2, warps=2), 1),
    (896, 4864, "residual", 0, 0, 0, dict(ctas_per_sm=4, warps=2), 1),
    (1152, 896, "bias_rope_kv", 1, 0, 1, dict(late_g=True, warps=2), 1),
    (9728, 896, "silu_mul", 1, 0, 1, dict(late_g=True, min_ctas_per_sm=3), 1),
    (896, 896, "residual", 1, 0, 0, dict(warps=8, outs_per_group=3), 1),
    # M decode rows a launch on the CUDA cores (mma=False): each epilogue at 2 to 16 rows.
    (1152, 896, "bias", 1, 0, 1, dict(mma=False), 2), (896, 896, "residual", 1, 0, 0, dict(mma=False), 16),
    (9728, 896, "silu_mul", 1, 0, 1, dict(mma=False), 4), (9728, 896, "silu_mul", 1, 1, 1, dict(stages=2, ctas_per_sm=4), 16),
    (896, 4864, "residual", 0, 0, 0, dict(mma=False), 16), (151936, 896, "argmax", 1, 0, 1, dict(mma=False), 16),
    (151936, 896, "argmax", 0, 0, 0, dict(mma=False), 4), (1152, 896, "bias_rope_kv", 1, 0, 1, dict(mma=False), 16),
    (256, 256, "rope_kv", 0, 0, 1, dict(mma=False), 4), (136, 200, "silu_mul", 0, 0, 1, dict(mma=False), 2),
    # The fused path's M-row GEMVs as the engine builds them (PDL, the norm where it has one).
    (1152, 896, "bias_rope_kv", 1, 0, 1, dict(mma=False), 8), (896, 896, "residual", 1, 0, 0, dict(mma=False), 8),
    (9728, 896, "silu_mul", 1, 0, 1, dict(mma=False), 8), (896, 4864, "residual", 1, 0, 0, dict(mma=False), 8),
    (151936, 896, "none", 1, 0, 1, dict(mma=False), 8), (151936, 896, "argmax", 1, 0, 1, dict(mma=False), 8),
    (151936, 896, "argmax", 1, 0, 1, dict(mma=False), 4), (9728, 896, "silu_mul", 1, 0, 1, dict(mma=False), 16),
])
def test_variant_lowers_to_ptx_with_16_byte_loads(tmp_path, n, k, epilogue, pdl, staged, norm, knobs, rows):
    counts = lower_to_ptx(tmp_path, n, k, epilogue, pdl, staged, norm, knobs, rows)
    rope = rope_as_lowered(n, epilogue)
    p = plan_gemv(n, k, epilogue, staged=bool(staged), rope=rope, pdl=bool(pdl), norm=bool(norm), rows=rows,
                  **knobs)
    # x takes C loads a decode row, and the norm's weight C more
    x_and_g = p.chunks * (rows + (1 if norm else 0))
    weights = int(counts["CPASYNC"]) if staged else int(counts["W128"]) - x_and_g
    assert weights >= p.loads_in_flight_per_lane * p.stages   # every weight chunk, 16 bytes a copy
    if not staged:  # read once for all the rows: the weight loads do not grow with M
        assert weights == p.loads_in_flight_per_lane
    if staged:
        assert int(counts["W128"]) == x_and_g
    # every weight chunk multiplies every row's x chunk (8 FMAs), plus the norm's sums of squares
    assert int(counts["FMA"]) >= rows * p.loads_in_flight_per_lane * VEC
    # ptxas's stack frame (-1: no ptxas here to ask): a few spilled words at most, except under a
    # register cap, whose spills the sweep measures (x hoisted out of a loop once made it 1.5 KB)
    assert int(counts["STACK"]) <= 64 or p.min_ctas
    if rows == 1 and (n, k, epilogue, pdl, staged, norm) in ONE_ROW_PTX and not knobs:
        assert (int(counts["W128"]), int(counts["FMA"])) == ONE_ROW_PTX[(n, k, epilogue, pdl, staged, norm)]

    assert (int(counts["MINNCTA"]) > 0) == bool(p.min_ctas)  # the register cap reaches ptxas
    assert (int(counts["WAITGROUP1"]) > 0) == (p.stages == 2)  # the pipeline leaves one tile in flight
    assert (int(counts["CPASYNC"]) > 0) == bool(staged)
    assert int(counts["STORE"]) >= 1
    assert (int(counts["ATOM"]) > 0) == (epilogue == "argmax")
    assert (int(counts["GRIDDEP"]) > 0) == bool(pdl)
    assert (int(counts["RSQRT"]) > 0) == bool(norm)
    if epilogue in ROPE_EPILOGUES:  # cos and sin from the fp32 table; q | k | v pair, k or v pool pair
        assert int(counts["F32LOAD"]) >= 2 and int(counts["STORE"]) >= 4


# The tensor-core form at the fused path's shapes and flags, M = 2 to 16 (PDL, the norm where it has one).
MMA_LOWERING = [(1152, 896, "bias_rope_kv", 1, 1), (1152, 896, "bias", 1, 1), (896, 896, "residual", 1, 0),
                (9728, 896, "silu_mul", 1, 1), (151936, 896, "argmax", 1, 1), (151936, 896, "none", 1, 1),
                (256, 256, "rope_kv", 0, 1), (136, 64, "argmax", 0, 0), (896, 4864, "residual", 1, 0),
                (896, 4864, "none", 0, 0)]


@pytest.mark.slow
@needs_cute
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels for real")
@pytest.mark.parametrize("rows", [2, 4, 8, 16])
@pytest.mark.parametrize("n, k, epilogue, pdl, norm", MMA_LOWERING)
def test_mma_variant_lowers_to_mma_sync_with_16_byte_fragment_loads(tmp_path, n, k, epilogue, pdl, norm, rows):
    """The PTX holds m16n8k16 bf16 products, two a K step and n-tile, and per K step each lane's
    16-byte loads as designed: weight rows g and g + 8, x of decode row g (and g + 8 past 8
    rows), the norm's weight; ptxas keeps it all in registers (no stack frame)."""
    counts = lower_to_ptx(tmp_path, n, k, epilogue, pdl, 0, norm, {"mma": True}, rows)  # (a tuned entry
    rope = rope_as_lowered(n, epilogue)  # may plan the CUDA-core form: the 0.5B's 2-row down)
    p = plan_gemv(n, k, epilogue, rope=rope, pdl=bool(pdl), norm=bool(norm), rows=rows, mma=True)
    assert p.mma
    n_tiles = -(-rows // 8)
    # the first tile's products, and where the grid loops the loop's (each traced once); its
    # weight loads, and where the grid loops the next tile's after the first tile's products and
    # in the loop
    loops = p.grid < p.num_tiles
    assert int(counts["MMA"]) == (2 if loops else 1) * p.chunks * 2 * n_tiles
    weight_loads = (3 if loops else 1) * p.loads_in_flight_per_lane
    x_and_g = p.chunks * (n_tiles + norm)
    assert int(counts["W128"]) + int(counts["W128U"]) == weight_loads + x_and_g
    assert int(counts["STACK"]) == 0 and int(counts["LOCAL"]) == 0
    assert (int(counts["ATOM"]) > 0) == (epilogue == "argmax" or p.splits > 1)
    assert (int(counts["GRIDDEP"]) > 0) == bool(pdl)
    assert (int(counts["RSQRT"]) > 0) == bool(norm)
    assert int(counts["STORE"]) >= 1 and int(counts["FMA"]) < rows * p.loads_in_flight_per_lane * VEC


@pytest.mark.slow
@needs_cute
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels for real")
@pytest.mark.parametrize("n, k, epilogue, rows", [(7168, 5120, "none", 16), (27648, 5120, "silu_mul", 16),
                                                   (6144, 4096, "none", 16), (28672, 4096, "silu_mul", 16)])
def test_the_norm_with_k_split_reads_only_its_own_part_of_x(tmp_path, n, k, epilogue, rows):
    """Qwen2.5-14B's and Llama-3.1-8B's normed GEMVs on the tensor cores at 16 rows: K over CTAs,
    each CTA's products and fragment loads as an unsplit CTA's of its K and no other load of x
    (its sums of squares are its own K's, stored for the split's last CTA, which takes the
    rsqrt), the split's counter; no stack frame."""
    counts = lower_to_ptx(tmp_path, n, k, epilogue, 1, 0, 1, {"mma": True}, rows)
    p = plan_gemv(n, k, epilogue, pdl=True, norm=True, rows=rows, mma=True)
    assert p.splits > 1 and not p.loops
    n_tiles = -(-rows // 8)
    assert int(counts["MMA"]) == p.chunks * 2 * n_tiles
    x_and_g = p.chunks * (n_tiles + 1)
    assert int(counts["W128"]) + int(counts["W128U"]) == p.loads_in_flight_per_lane + x_and_g
    assert int(counts["RSQRT"]) > 0 and int(counts["ATOM"]) > 0
    assert int(counts["STACK"]) <= 0 and int(counts["LOCAL"]) == 0


@pytest.mark.slow
@needs_cute
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels for real")
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("n, k, epilogue", [(6144, 4096, "bias"), (28672, 4096, "silu_mul"),
                                            (7168, 5120, "bias"), (27648, 5120, "silu_mul")])
def test_the_norm_at_k_4096_and_5120_holds_k_in_one_cta(tmp_path, n, k, epilogue, rows):
    """Llama-3.1-8B's and Qwen2.5-14B's normed GEMVs up to 8 rows (one n-tile): one CTA a tile,
    16 / 20 warps of 8 K steps (`_mma_fits`' lean count), which ptxas keeps within the SM's 64K
    registers (128 a thread at 512 threads, 96 at 640) with no stack frame. (The 14B's QKV at 2
    rows lowers with 8-16 bytes of stack: not asserted here.)"""
    p = plan_gemv(n, k, epilogue, pdl=True, norm=True, rows=rows, mma=True)
    assert (p.splits, p.warps, p.chunks) == (1, k // 256, 8), p.describe()
    counts = lower_to_ptx(tmp_path, n, k, epilogue, 1, 0, 1, {"mma": True}, rows)
    if int(counts["REGS"]) < 0:
        pytest.skip("no ptxas (a CUDA toolkit's or Triton's) to count the registers")
    assert int(counts["STACK"]) == 0 and int(counts["LOCAL"]) == 0
    assert int(counts["REGS"]) * p.warps * 32 <= 65536, counts["REGS"]


# tile_group: G weight tiles a CTA against one load of x, at Qwen3-0.6B's 16-row shapes (O, down,
# gate+up with the norm, QKV with RoPE), unsplit and with K over CTAs.
TILE_GROUP_LOWERING = [(1024, 2048, "residual", 0, dict(tile_group=2, splits=2)),
                       (1024, 2048, "residual", 0, dict(tile_group=2, warps=8)),
                       (1024, 3072, "residual", 0, dict(tile_group=4, splits=4)),
                       (6144, 1024, "silu_mul", 1, dict(tile_group=2)),
                       (4096, 1024, "rope_kv", 1, dict(tile_group=2))]


@pytest.mark.slow
@needs_cute
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels for real")
@pytest.mark.parametrize("n, k, epilogue, norm, knobs", TILE_GROUP_LOWERING)
def test_tile_group_issues_its_tiles_loads_before_the_wait_and_reads_x_once(tmp_path, n, k, epilogue, norm, knobs):
    """A CTA of G tiles: G tiles' products and weight loads, every weight load before the PDL
    wait, and x's fragments (and the norm's weight) loaded once, as one tile's; no stack frame."""
    counts = lower_to_ptx(tmp_path, n, k, epilogue, 1, 0, norm, dict(knobs, mma=True), 16)
    p = plan_gemv(n, k, epilogue, rope=rope_as_lowered(n, epilogue), pdl=True, norm=bool(norm), rows=16,
                  mma=True, **knobs)
    group = knobs["tile_group"]
    assert p.tile_group == group and not p.loops and p.grid * group == p.num_tiles * p.splits
    assert int(counts["MMA"]) == group * p.chunks * 2 * 2
    weight_loads = group * p.loads_in_flight_per_lane
    assert int(counts["PREWAIT"]) == weight_loads
    assert int(counts["W128"]) + int(counts["W128U"]) == weight_loads + p.chunks * (2 + norm)
    assert int(counts["STACK"]) == 0 and int(counts["LOCAL"]) == 0, counts["REGS"]
    assert (int(counts["ATOM"]) > 0) == (p.splits > 1)


def test_mma_fragments_from_natural_loads_give_exact_dot_products():
    """The permutation argument, lane by lane: place each lane's operand registers
    (`mma_operands` of its 16-byte loads) where the PTX fragment layout of m16n8k16 puts them,
    and every (weight row, decode row) pair of the two products meets each physical K of the
    32-wide step exactly once, weight and x at the same K."""
    a_at = {}  # (product, row, logical k) -> (weight row, physical k)
    b_at = {}  # (product, logical k, column) -> (decode row, physical k)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        pairs = lambda row: [(row, 8 * t + 2 * i) for i in range(4)]  # noqa: E731 (a 32-bit pair each)
        for half in range(2):
            a, b = cute_gemv.mma_operands(pairs(g), pairs(g + 8), pairs(g), half)
            for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                for e in range(2):
                    a_at[half, row, col + e] = (a[reg][0], a[reg][1] + e)
            for reg, k in enumerate([2 * t, 2 * t + 8]):
                for e in range(2):
                    b_at[half, k + e, g] = (b[reg][0], b[reg][1] + e)
    for row in range(16):
        for col in range(8):
            seen = []
            for half in range(2):
                for k in range(16):
                    w_row, w_k = a_at[half, row, k]
                    x_row, x_k = b_at[half, k, col]
                    assert (w_row, x_row, w_k) == (row, col, x_k)
                    seen.append(w_k)
            assert sorted(seen) == list(range(32))


def test_mma_plan_covers_every_output_and_k_step_once():
    for n, k, epilogue, _, norm in MMA_LOWERING:
        rope = rope_as_lowered(n, epilogue)
        for rows in (2, 3, 5, 9, 16):
            p = plan_gemv(n, k, epilogue, rope=rope, norm=bool(norm), rows=rows)
            assert p.mma and p.lanes == 32
            per_split = -(-k // 32 // p.splits)  # K steps a CTA
            assert (p.warps - 1) * p.chunks < per_split <= p.warps * p.chunks  # every warp has a K step
            assert (p.splits - 1) * per_split < k // 32                         # and every split
            assert p.num_tiles * p.outs_per_tile >= p.n_out > (p.num_tiles - 1) * p.outs_per_tile
            loop = cute_gemv.MMA_ARGMAX_CTAS_PER_SM * 132 if epilogue == "argmax" else p.num_tiles
            assert p.grid == (p.num_tiles * p.splits if p.splits > 1 else min(p.num_tiles, loop))


@pytest.mark.parametrize("kwargs, match", [
    (dict(k=200), "multiple of 32"), (dict(fp8=True, k=928), "multiple of 64"),
    (dict(outs_per_group=2), "outs_per_group"), (dict(staged=True), "staged"), (dict(warps=33), "warps"),
    (dict(k=4864, warps=19, splits=1), "registers"), (dict(k=5632, norm=True, splits=1), "registers"),
    (dict(splits=29), "splits"), (dict(splits=2, ctas_per_sm=1), "ctas_per_sm"),
    (dict(tile_group=3), "dividing the 56 tiles"), (dict(tile_group=0), "tile_group"),
    (dict(tile_group=2, ctas_per_sm=1), "looping grid"),
])
def test_mma_plan_refuses_what_it_cannot_do(kwargs, match):
    kwargs = dict(dict(n_rows=896, k=896, rows=4), **kwargs)
    with pytest.raises(ValueError, match=match):
        plan_gemv(kwargs.pop("n_rows"), kwargs.pop("k"), "residual", mma=True, **kwargs)


def test_mma_argmax_does_not_split_k():
    with pytest.raises(ValueError, match="argmax"):
        plan_gemv(151936, 896, "argmax", norm=True, rows=4, mma=True, splits=2)


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_the_norm_splits_k_only_where_one_cta_cannot_hold_it(rows):
    """A normed tensor-core GEMV keeps K in one CTA where its warps fit (the fused presets'
    shapes: plans as before; Llama-3.1-8B's K = 4,096 and Qwen2.5-14B's 5,120 up to 8 rows, by
    the lean count of their registers: 16 and 20 warps), and splits it where they do not (both
    at 16 rows: before 913c4fb, the planner raised), each split's CTA then storing its K's sums
    of x^2."""
    one_cta = [(1152, 896, "bias"), (9728, 896, "silu_mul"), (4096, 1024, "none"), (12288, 2048, "silu_mul")]
    split = []
    (one_cta if rows <= 8 else split).extend([(6144, 4096, "none"), (28672, 4096, "silu_mul"),
                                              (7168, 5120, "bias"), (27648, 5120, "silu_mul")])
    for n, k, epilogue in one_cta:
        p = plan_gemv(n, k, epilogue, norm=True, pdl=True, rows=rows, mma=True)
        assert p.splits == 1, (n, k, rows, p.describe())
    for n, k, epilogue in split:
        p = plan_gemv(n, k, epilogue, norm=True, pdl=True, rows=rows, mma=True)
        assert p.splits > 1 and p.grid == p.num_tiles * p.splits, (n, k, rows, p.describe())
        assert cute_gemv._mma_fits(p.warps, p.chunks, -(-rows // 8), lean_x=True)
        with pytest.raises(ValueError, match="registers"):
            plan_gemv(n, k, epilogue, norm=True, pdl=True, rows=rows, mma=True, splits=1)


@pytest.mark.parametrize("n, k, epilogue, norm, knobs", [
    (1024, 2048, "residual", False, dict(tile_group=2, splits=2)), (1024, 2048, "residual", False, dict(tile_group=4)),
    (1024, 3072, "residual", False, dict(tile_group=4, splits=4)), (6144, 1024, "silu_mul", True, dict(tile_group=2)),
    (896, 4864, "residual", False, dict(tile_group=2, splits=4)), (416, 1184, "bias", False, dict(tile_group=2, splits=3))])
@pytest.mark.parametrize("rows, fp8", [(16, False), (2, True), (16, True)])
def test_tile_group_plan_gives_every_tile_and_split_one_cta(n, k, epilogue, norm, knobs, rows, fp8):
    """CTA b computes tiles G (b // splits) .. + G - 1 over split b % splits of K (the kernel's
    mapping): each (tile, split) once, every CTA's registers within 255 a thread (fp8 at 2 rows:
    more warps of fewer K steps than without the group), the split-K workspace a slot for every
    (tile, split), and with the norm a row's sum of x^2 for each."""
    if fp8 and k % 64:
        pytest.skip("fp8 K steps are 64 wide")
    p = plan_gemv(n, k, epilogue, norm=norm, pdl=True, rows=rows, fp8=fp8, mma=True, **knobs)
    g = knobs["tile_group"]
    assert p.mma and p.tile_group == g and not p.loops and f"tg{g}" in p.describe()
    seen = sorted((p.tile_group * (b // p.splits) + j, b % p.splits) for b in range(p.grid) for j in range(g))
    assert seen == [(t, s) for t in range(p.num_tiles) for s in range(p.splits)]
    assert cute_gemv._mma_fits(p.warps, p.chunks, -(-rows // 8), 8 if fp8 else 4, g)
    if p.splits > 1:
        sums = p.num_tiles * p.splits * -(-rows // 8) * 4 * 32
        assert cute_gemv._buffer_sizes(p) == (sums + norm * p.num_tiles * p.splits * cute_gemv.MMA_ROWS, p.num_tiles)


def test_tile_group_refuses_the_argmax_and_tiles_past_a_threads_registers():
    with pytest.raises(ValueError, match="looping grid"):
        plan_gemv(151936, 896, "argmax", norm=True, rows=16, tile_group=2)
    with pytest.raises(ValueError, match="255 a thread .* tile_group"):  # three tiles of 8 K steps a warp
        plan_gemv(6144, 1024, "silu_mul", norm=True, rows=16, tile_group=3, warps=4, splits=1)


def test_one_bf16_row_takes_the_tensor_core_form_only_where_asked(monkeypatch):
    """One bf16 row keeps the CUDA-core kernel by default (a CUDA-core knob too); mma=True plans
    the tensor-core form at one row (at Qwen2.5-7B's shapes, where the one-row CUDA-core GEMVs
    collapse: 14 warps of 8 K steps), from TUNED_PLANS entries keyed apart ("mma")."""
    assert not plan_gemv(4608, 3584, "bias", norm=True, pdl=True).mma
    for n, k, epilogue, norm in ((4608, 3584, "bias", True), (3584, 3584, "residual", False),
                                 (37888, 3584, "silu_mul", True), (152064, 3584, "argmax", True)):
        p = plan_gemv(n, k, epilogue, norm=norm, pdl=True, mma=True)
        assert p.mma and p.rows == 1 and not p.fp8 and p.warps * p.chunks * 32 >= k, p.describe()
    # the 0.5B's one-row CUDA-core entries (staged, ...) do not bind the asked-for form
    assert cute_gemv.TUNED_PLANS[(896, 896, "residual", False, True)].get("staged")
    assert plan_gemv(896, 896, "residual", pdl=True, mma=True).mma
    monkeypatch.setitem(cute_gemv.TUNED_PLANS, (3584, 3584, "residual", False, True, "mma"), dict(splits=2))
    assert plan_gemv(3584, 3584, "residual", pdl=True, mma=True).splits == 2
    assert not plan_gemv(3584, 3584, "residual", pdl=True).mma


def test_mma_is_the_default_for_rows_where_it_plans():
    assert plan_gemv(9728, 896, "silu_mul", rows=2, norm=True).mma
    assert not plan_gemv(9728, 896, "silu_mul", rows=1).mma                  # one row: CUDA cores
    assert not plan_gemv(136, 200, "silu_mul", rows=4).mma                   # K not a multiple of 32
    down = plan_gemv(896, 4864, "residual", rows=4)                          # 19 warps would not fit an SM:
    assert down.mma and down.splits == 3 and down.grid == 3 * 56             # K over three CTAs a tile
    normed = plan_gemv(896, 5632, "none", rows=4, norm=True)                 # under the norm too (22 warps
    assert normed.mma and normed.splits == 3                                 # even at the lean count), each
    assert plan_gemv(896, 4864, "none", rows=4, norm=True).splits == 1       # split storing its sums of x^2
    with pytest.raises(ValueError, match="tensor-core"):
        plan_gemv(896, 4864, "residual", rows=4, mma=False, splits=2)
    with pytest.raises(ValueError, match="tile_group .* tensor-core"):
        plan_gemv(896, 4864, "residual", rows=4, mma=False, tile_group=2)
    assert not plan_gemv(896, 896, "residual", rows=4, fp8=True).mma
    assert not plan_gemv(9728, 896, "silu_mul", rows=4, staged=True).mma    # a CUDA-core knob asks for that form
    assert not plan_gemv(9728, 896, "silu_mul", rows=4, mma=False).mma
    assert "mma" in plan_gemv(9728, 896, "silu_mul", rows=4).describe()


def _inputs(n, k, epilogue, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    n_out = n // 2 if epilogue == "silu_mul" else n
    extra = torch.randn(n_out, generator=g, device="cuda").to(torch.bfloat16) if epilogue in ("bias", "residual") else None
    return x, w, extra


def _normed_inputs(n, k, epilogue, seed, norm=True):
    """_inputs with x far from unit scale (so a missing norm shows) and, with norm, the norm's
    weight g (else None)."""
    x, w, extra = _inputs(n, k, epilogue, seed)
    x = (x.float() * 7 + 0.5).to(torch.bfloat16)
    g = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16) if norm else None
    return x, w, extra, g


def _poisoned_out(gemv, epilogue):
    """A fresh output that a kernel which writes nothing cannot pass with: -1 / NaN."""
    out = gemv.out_like()
    out.fill_(-1) if epilogue == "argmax" else out.fill_(float("nan"))
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, k, epilogue, pdl, staged", GPU_VARIANTS)
def test_variant_matches_fp32_reference(kh, n, k, epilogue, pdl, staged):
    gemv = CuteGemv(n, k, epilogue, pdl=pdl, staged=staged)
    for seed in (0, 1):  # a second call also checks the argmax counter was reset
        x, w, extra = _inputs(n, k, epilogue, seed)
        out = _poisoned_out(gemv, epilogue)
        gemv(x, w, extra, out=out)
        torch.cuda.synchronize()
        if epilogue == "argmax":
            logits = w.float() @ x.float()
            token = int(out.item())
            assert 0 <= token < n
            assert float(logits.max() - logits[token]) <= 1e-3 * float(logits.abs().max())
        else:
            assert not torch.isnan(out).any()
            assert kh.rel_err(out, gemv_reference(x, w, epilogue, extra)) < 1e-2


# The RMSNorm prologue (the fused decode path's QKV, gate+up and LM head): (n, k, epilogue, pdl).
NORM_CASES = [(1152, 896, "bias", False), (9728, 896, "silu_mul", False), (151936, 896, "none", False),
              (151936, 896, "argmax", False), (1152, 896, "bias", True), (136, 200, "silu_mul", False),
              (96, 64, "argmax", False), (768, 256, "none", False)]


def assert_normed_argmax(out, x, w, g, eps):
    """out holds argmax(W RMSNorm(x) g), ties within 1e-3 of the largest logit allowed."""
    xn = x.float() * torch.rsqrt(x.float().pow(2).mean() + eps) * g.float()
    logits = w.float() @ xn
    token = int(out.item())
    assert 0 <= token < w.shape[0]
    assert float(logits.max() - logits[token]) <= 1e-3 * float(logits.abs().max())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, k, epilogue, pdl", NORM_CASES)
def test_norm_prologue_matches_fp32_reference(kh, n, k, epilogue, pdl):
    """y = W (RMSNorm(x) * g) [+ epilogue], x far from unit scale so a missing norm shows."""
    eps = 1e-6
    gemv = CuteGemv(n, k, epilogue, pdl=pdl, norm=True, eps=eps)
    for seed in (0, 1):
        x, w, extra, g = _normed_inputs(n, k, epilogue, seed)
        out = _poisoned_out(gemv, epilogue)
        gemv(x, w, extra, out=out, norm_weight=g)
        torch.cuda.synchronize()
        if epilogue == "argmax":
            assert_normed_argmax(out, x, w, g, eps)
        else:
            assert not torch.isnan(out).any()
            assert kh.rel_err(out, gemv_reference(x, w, epilogue, extra, norm_weight=g, eps=eps)) < 1e-2


# The plan sweep's knobs (scripts/gemv_sweep.py), each against the reference:
# (n, k, epilogue, norm, pdl, knobs). ctas_per_sm=1 makes each CTA loop over ~4-7 tiles.
KNOB_CASES = [
    (9728, 896, "silu_mul", True, True, dict(late_g=True)),
    (9728, 896, "silu_mul", True, True, dict(late_g=True, ctas_per_sm=3)),
    (9728, 896, "silu_mul", True, True, dict(staged=True, stages=2, ctas_per_sm=4)),
    (9728, 896, "silu_mul", True, False, dict(staged=True, stages=2, ctas_per_sm=1)),
    (9728, 896, "silu_mul", False, False, dict(staged=True, late_g=False, ctas_per_sm=1, warps=1)),
    (896, 4864, "residual", False, True, dict(staged=True, stages=2, ctas_per_sm=2, warps=2)),
    (896, 4864, "residual", False, False, dict(ctas_per_sm=1, warps=2)),
    (896, 4864, "none", False, True, dict(warps=8, outs_per_group=2)),
    (1152, 896, "bias", True, True, dict(warps=8, outs_per_group=3, late_g=True)),
    (1152, 896, "bias", True, False, dict(staged=True, stages=2, ctas_per_sm=1)),
    (896, 896, "residual", False, True, dict(min_ctas_per_sm=6, warps=2, staged=False)),  # not the tuned staged plan
    (151936, 896, "argmax", True, True, dict(late_g=True, ctas_per_sm=2, warps=2)),
    (151936, 896, "none", False, True, dict(ctas_per_sm=4, staged=True, stages=2)),
    (136, 200, "bias", False, False, dict(staged=True, stages=2, ctas_per_sm=1)),
    (96, 64, "silu_mul", True, True, dict(late_g=True, warps=1, ctas_per_sm=1)),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, k, epilogue, norm, pdl, knobs", KNOB_CASES)
def test_plan_knobs_match_fp32_reference(kh, n, k, epilogue, norm, pdl, knobs):
    """Output poisoned first; the residual epilogue in place (out is the residual, as in the
    fused path); two calls, so a looping CTA's pipeline and the argmax counter start clean."""
    eps = 1e-6
    gemv = CuteGemv(n, k, epilogue, pdl=pdl, norm=norm, eps=eps, **knobs)
    for seed in (0, 1):
        x, w, extra, g = _normed_inputs(n, k, epilogue, seed, norm)
        want = (None if epilogue == "argmax"
                else gemv_reference(x, w, epilogue, extra, norm_weight=g, eps=eps))
        out = extra.reshape(1, -1) if epilogue == "residual" else _poisoned_out(gemv, epilogue)
        gemv(x, w, extra, out=out, norm_weight=g)
        torch.cuda.synchronize()
        if epilogue == "argmax":
            assert_normed_argmax(out, x, w, g, eps)
        else:
            assert not torch.isnan(out).any()
            assert kh.rel_err(out, want) < 1e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, k", [(896, 896), (896, 4864), (136, 200)])
def test_residual_in_place(kh, n, k):
    """out is the residual (the fused decode path's O and down): each output read, then written."""
    gemv = CuteGemv(n, k, "residual")
    x, w, r = _inputs(n, k, "residual", 3)
    expected = gemv_reference(x, w, "residual", r)
    stream = r.clone().reshape(1, n)
    gemv(x, w, stream, out=stream)
    torch.cuda.synchronize()
    assert kh.rel_err(stream, expected) < 1e-2


def test_norm_weight_is_checked():
    gemv = CuteGemv(96, 64, "none", device="cpu", norm=True)
    x, w = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(96, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, out=gemv.out_like())
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, out=gemv.out_like(), norm_weight=torch.zeros(32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="norm_weight"):
        CuteGemv(96, 64, "none", device="cpu")(x, w, out=gemv.out_like(), norm_weight=x)


def test_reference_norm_prologue_is_rmsnorm_then_matmul():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, generator=g) * 5).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    nw = torch.rand(64, generator=g).to(torch.bfloat16)
    xn = x.float() / torch.sqrt(x.float().pow(2).mean() + 1e-5) * nw.float()
    torch.testing.assert_close(gemv_reference(x, w, "none", norm_weight=nw, eps=1e-5),
                               (w.float() @ xn).reshape(1, -1))


@pytest.mark.parametrize("bad", ["weight_shape", "weight_dtype", "weight_view", "missing_bias", "x_len",
                                 "misaligned_x", "out_shape"])
def test_bad_inputs_are_refused_before_launch(bad):
    gemv = CuteGemv(96, 64, "bias", device="cpu")  # the checks run before the DSL is needed
    x = torch.zeros(64, dtype=torch.bfloat16)
    w = torch.zeros(96, 64, dtype=torch.bfloat16)
    b = torch.zeros(96, dtype=torch.bfloat16)
    args = dict(weight_shape=(x, w[:64], b), weight_dtype=(x, w.float(), b), weight_view=(x, w.t().contiguous().t(), b),
                missing_bias=(x, w, None), x_len=(x[:32], w, b), misaligned_x=(torch.zeros(72, dtype=torch.bfloat16)[1:65], w, b),
                out_shape=(x, w, b))[bad]
    out = torch.zeros(1, 95, dtype=torch.bfloat16) if bad == "out_shape" else gemv.out_like()
    with pytest.raises(ValueError):
        gemv(*args, out=out)


# The rope epilogues (the fused decode path's QKV with fused_decode_rope): (shape, K, bias, pdl).
QWEN05_ROPE = RopeShape(64, 14, 2, 4096, 8193 * 16)
ROPE_GPU_CASES = [(QWEN05_ROPE, 896, True, False, {}), (QWEN05_ROPE, 896, True, True, {}),
                  (RopeShape(64, 4, 2, 2048, 1025 * 16), 256, False, False, {}),  # the small Llama's
                  (QWEN05_ROPE, 896, True, True, dict(late_g=True, warps=2)),  # plan sweep knobs
                  (QWEN05_ROPE, 896, True, True, dict(ctas_per_sm=1, outs_per_group=2))]


def _pool_rows(step, shape):
    flat = (-1, shape.num_kv_heads, shape.head_dim)
    return step.k_cache.view(flat), step.v_cache.view(flat)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape, k, bias, pdl, knobs", ROPE_GPU_CASES)
def test_rope_kv_epilogue_matches_fp32_reference(kh, shape, k, bias, pdl, knobs):
    """q | k rotated, v as is, all in out (poisoned first); k and v at the slot in the pool
    (every other pool row keeps its poison); a negative slot writes no pool row."""
    gemv = CuteGemv(shape.rows, k, "bias_rope_kv" if bias else "rope_kv", pdl=pdl, norm=True, rope=shape, **knobs)
    hq, hkv = shape.num_q_heads, shape.num_kv_heads
    for seed in (0, 1):
        x, w, b, nw, step = _rope_inputs(shape, k, seed, device="cuda", bias=bias)
        if seed:  # another table row and pool slot
            step.positions.fill_(5)
            step.slot_mapping.fill_(3)
        mirror = RopeKV(step.positions, step.cos_sin_cache, step.k_cache.clone(), step.v_cache.clone(),
                        step.slot_mapping)
        want = rope_kv_reference(x, w, b, shape, mirror, norm_weight=nw)
        out = gemv.out_like().fill_(float("nan"))
        gemv(x, w, b, out=out, norm_weight=nw, rope_kv=step)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        assert kh.rel_err(out, want) < 1e-2
        heads, slot = out.view(-1, shape.head_dim), int(step.slot_mapping)
        kc, vc = _pool_rows(step, shape)
        assert torch.equal(kc[slot], heads[hq: hq + hkv]) and torch.equal(vc[slot], heads[hq + hkv:])
        others = torch.arange(kc.shape[0], device="cuda") != slot
        assert (kc[others] == 7).all() and (vc[others] == -7).all()
    step.slot_mapping.fill_(-1)
    before = step.k_cache.clone(), step.v_cache.clone()
    gemv(x, w, b, out=out, norm_weight=nw, rope_kv=step)
    torch.cuda.synchronize()
    assert torch.equal(step.k_cache, before[0]) and torch.equal(step.v_cache, before[1])


@pytest.mark.gpu
@needs_gpu
def test_rope_kv_epilogue_matches_the_two_kernel_path(kh):
    """Against what the fused path runs without it: the bias GEMV, then the pool's Triton
    RoPE + K/V write kernel. v is the same sum rounded once (bit for bit); q and k differ only
    by the bf16 rounding the two-kernel path applies before rotating."""
    from flashlet.kernels.rope_kv_write import rope_kv_write

    shape, k = QWEN05_ROPE, 896
    d, hq, hkv = shape.head_dim, shape.num_q_heads, shape.num_kv_heads
    x, w, b, nw, step = _rope_inputs(shape, k, 2, device="cuda")
    out = CuteGemv(shape.rows, k, "bias_rope_kv", norm=True, rope=shape)(x, w, b, norm_weight=nw, rope_kv=step)
    qkv = CuteGemv(shape.rows, k, "bias", norm=True)(x, w, b, norm_weight=nw)
    q, kk, v = qkv.view(-1, d).split([hq, hkv, hkv])
    kc2, vc2 = torch.full_like(step.k_cache, 7.0), torch.full_like(step.v_cache, -7.0)
    q2, _ = rope_kv_write(q[None], kk[None], v[None], step.positions, step.cos_sin_cache, kc2, vc2,
                          step.slot_mapping, return_k=False)
    torch.cuda.synchronize()
    slot = int(step.slot_mapping)
    kc, vc = _pool_rows(step, shape)
    assert kh.rel_err(out.view(-1, d)[:hq], q2[0]) < 1e-2
    assert kh.rel_err(kc[slot], kc2.view(-1, hkv, d)[slot]) < 1e-2
    assert torch.equal(vc[slot], vc2.view(-1, hkv, d)[slot])
    assert torch.equal(out.view(-1, d)[hq + hkv:], v)


def test_tuned_plans_load_from_a_sweep_file(tmp_path, monkeypatch):
    """FLASHLET_GEMV_PLANS entries (gemv_sweep --plans-out) join TUNED_PLANS and steer the plan;
    an unknown knob is refused."""
    import json

    from flashlet.kernels import cute_gemv

    monkeypatch.setattr(cute_gemv, "TUNED_PLANS", dict(cute_gemv.TUNED_PLANS))
    path = tmp_path / "plans.json"
    path.write_text(json.dumps([{"key": [9728, 896, "silu_mul", True, True],
                                 "knobs": {"warps": 2, "ctas_per_sm": 4}}]))
    assert cute_gemv.load_tuned_plans(str(path)) == 1
    plan = cute_gemv.plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True)
    assert plan.warps == 2 and plan.grid <= 4 * 132
    path.write_text(json.dumps([{"key": [896, 896, "residual", False, True], "knobs": {"speed": 9}}]))
    with pytest.raises(ValueError, match="unknown knobs"):
        cute_gemv.load_tuned_plans(str(path))
    for text in ('[{"knobs": {}}]', '[[896, 896]]', '{"key": [896]}'):  # not plans
        path.write_text(text)
        with pytest.raises(ValueError, match="plans.json: the entry .* is not a"):
            cute_gemv.load_tuned_plans(str(path))
    path.write_text("[{")  # cut short
    with pytest.raises(ValueError, match="plans.json: not a readable plan file"):
        cute_gemv.load_tuned_plans(str(path))
    with pytest.raises(ValueError, match="nope.json: not a readable plan file"):
        cute_gemv.load_tuned_plans(str(tmp_path / "nope.json"))



# Qwen3-0.6B's 16-row O GEMV as ptxas scheduled it (sm_90a, CuTe DSL 4.8.1 on the CPU; cuobjdump
# -sass, cut down): two of the x loads issued after the first products.
O_16_SASS = """
        /*0240*/                   LDG.E.128 R16, desc[UR6][R34.64+0x1c0] ;
        /*0250*/                   ACQBULK ;
        /*0260*/                   LDG.E.128 R52, desc[UR6][R52.64] ;
        /*0290*/                   LDG.E.128 R48, desc[UR6][R48.64] ;
        /*0380*/                   HMMA.16816.F32.BF16 R80, R76, R52, RZ ;
        /*03a0*/                   HMMA.16816.F32.BF16 R80, R60, R48, R80 ;
        /*04c0*/                   LDG.E.128 R52, desc[UR6][R52.64] ;
        /*0500*/                   LDG.E.128 R60, desc[UR6][R60.64] ;
        /*0650*/                   HMMA.16816.F32.BF16 R80, R88, R52, R80 ;
        /*0f60*/                   LDG.E.U16 R51, desc[UR6][R4.64] ;
"""


def test_the_sweep_counts_the_loads_ptxas_issues_before_the_first_product(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import gemv_sweep

    assert gemv_sweep.loads_before_first_product(O_16_SASS) == "2 / 4"  # the wait's loads, not the weights'
    assert gemv_sweep.loads_before_first_product(O_16_SASS.replace("HMMA", "FFMA")) == "-"  # CUDA cores
    assert gemv_sweep.loads_before_first_product(O_16_SASS.replace("ACQBULK", "NOP")) == "-"  # no PDL wait


def test_the_m_row_sweep_tries_both_forms_knobs(monkeypatch):
    """gemv_sweep --rows M (bf16): the tensor-core form, M rows' default, with its own knobs
    (splits of K where the epilogue allows them) beside the CUDA-core form's (staged, R): every
    variant a distinct plan, each planned as the engine plans its key (no "mma" element)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import gemv_sweep

    for name in ("o", "gate_up"):
        n, k, epilogue, norm, rope = gemv_sweep.SHAPES[name]
        found = gemv_sweep.variants(name, True, 4)
        plans = [plan_gemv(n, k, epilogue, pdl=True, norm=norm, rope=rope, tuned=False, rows=4, **knobs)
                 for _, knobs in found]
        assert len(set(plans)) == len(plans) and found[0][0] == "default" and plans[0].mma
        assert any(p.mma for p in plans[1:]) and any(not p.mma for p in plans)
    assert any(label.startswith("mma splits") for label, _ in gemv_sweep.variants("o", True, 4))
    for name in ("o", "gate_up", "down"):  # tiles sharing x: with splits where the epilogue has them
        labels = [label for label, _ in gemv_sweep.variants(name, True, 16)]
        assert any(label.startswith("mma group 2") for label in labels), labels
        assert any(" splits=" in label for label in labels if "group" in label) == (name != "gate_up")
    assert not any("group" in label for label, _ in gemv_sweep.variants("lm_head", True, 16))
    for name in ("down", "lm_head"):  # from CUDA_CORE_ROWS_CAP rows: the tensor-core form's plans only
        n, k, epilogue, norm, rope = gemv_sweep.SHAPES[name]
        for rows in (gemv_sweep.CUDA_CORE_ROWS_CAP, 16):
            found = gemv_sweep.variants(name, True, rows)
            assert len(found) > 3 and all(plan_gemv(n, k, epilogue, pdl=True, norm=norm, rope=rope, tuned=False,
                                                    rows=rows, **knobs).mma for _, knobs in found)
    monkeypatch.setattr(gemv_sweep, "VARIANTS_MATCHING", ["group", "splits=2"])  # --variants
    labels = [label for label, _ in gemv_sweep.variants("o", True, 16)]
    assert labels[0] == "default" and len(labels) > 3
    assert all("group" in label or "splits=2" in label for label in labels[1:]), labels


def test_every_one_row_tuned_plan_is_a_presets_gemv_and_steers_its_plan(monkeypatch):
    """Each built-in bf16 entry of TUNED_PLANS (one row, or M rows) names a GEMV the fused path
    builds at one of the presets it serves (gemv_sweep.shapes_for: a mistyped or stale shape would
    steer nothing), and planning that GEMV at its row count gives the plan its knobs give, not the
    heuristic's."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import gemv_sweep

    from tests.gpu.test_gpu_fused_decode import FUSED_PRESETS  # the presets past the 0.5B it serves

    gemvs = {shape[:4]: shape[4] for preset in ("qwen2.5-0.5b", *FUSED_PRESETS) for shape in gemv_sweep.shapes_for(preset).values()}
    one_row = {key: knobs for key, knobs in TUNED_PLANS.items() if len(key) == 5}
    assert len(one_row) >= 6 + 23  # the 0.5B's and five more presets' (the O at K = 2048 shared)
    m_rows = {key: knobs for key, knobs in TUNED_PLANS.items() if len(key) == 6 and isinstance(key[5], int)}
    assert {key[5] for key in m_rows} >= {2, 4, 16}  # the 0.5B's 2-, 4- and 16-row plans
    for (n, k, epilogue, norm, pdl, *rows), knobs in {**one_row, **m_rows}.items():
        assert (n, k, epilogue, norm) in gemvs, f"{(n, k, epilogue, norm)} is no fused preset's GEMV"
        rope, m = gemvs[(n, k, epilogue, norm)], rows[0] if rows else 1
        tuned = plan_gemv(n, k, epilogue, pdl=pdl, norm=norm, rope=rope, rows=m)
        assert tuned == plan_gemv(n, k, epilogue, pdl=pdl, norm=norm, rope=rope, rows=m, tuned=False, **knobs)
        assert tuned != plan_gemv(n, k, epilogue, pdl=pdl, norm=norm, rope=rope, rows=m, tuned=False), \
            (n, k, epilogue, m)

# ---------------------------------------------------------------------------------------------
# M decode rows a launch (rows=M): y[M, N] = x[M, K] W^T, the weights read once for all rows.

@pytest.mark.parametrize("lanes", [1, 2, 8, 16, 32])
@pytest.mark.parametrize("rows", [2, 3, 7, 8, 16])
def test_reduce_scatter_leaves_each_row_whole_on_one_finishing_lane(lanes, rows):
    """The kernel's reduction over a group's lanes, run on lane vectors (shuffle = the partner
    lane's value): every row's full sum lands on exactly one lane that finishes it, every lane
    sharing a row holds the same sum (the argmax merge relies on it), padding rows on none."""
    sub = torch.arange(lanes)
    parts = torch.randn(rows, lanes, generator=torch.Generator().manual_seed(rows * 40 + lanes),
                        dtype=torch.float64)  # row m's partial sum on lane l

    def shuffle(v, offset):
        return v[sub ^ offset]

    def select(c, a, b):
        return torch.where(c, a, torch.as_tensor(b, dtype=torch.as_tensor(a).dtype))

    pad = [torch.zeros(lanes, dtype=torch.float64)] * (cute_gemv.rows_padded(rows) - rows)
    kept = cute_gemv.reduce_scatter([parts[m] for m in range(rows)] + pad, sub, lanes, shuffle, select)
    owned = cute_gemv.lane_rows(sub, lanes, rows, select)
    assert len(kept) == len(owned) == max(1, cute_gemv.rows_padded(rows) // lanes)
    finished = []
    for values, row in zip(kept, owned):
        row = torch.as_tensor(row).expand(lanes)
        for lane in range(lanes):
            if row[lane] < rows:
                finished.append(int(row[lane]))
                torch.testing.assert_close(values[lane], parts[row[lane]].sum())
    assert sorted(finished) == list(range(rows))
    if cute_gemv.rows_padded(rows) <= lanes:  # lanes that share a row hold its sum too
        stride = lanes // cute_gemv.rows_padded(rows)
        for lane in range(lanes):
            if lane // stride < rows:
                torch.testing.assert_close(kept[0][lane], parts[lane // stride].sum())


@pytest.mark.parametrize("rows", [0, 17, 2.0, None])
def test_plan_refuses_rows_out_of_range(rows):
    with pytest.raises(ValueError, match="rows"):
        plan_gemv(896, 896, "residual", rows=rows)


def test_rows_plans_read_x_from_l2_at_most_twice_the_weights():
    """Every CTA reads all M rows of x: where one tile a CTA would make that more than twice the
    weights' bytes (down: one output row a CTA), the plan is a resident grid that keeps x in L1
    (at M = 16 one tile a CTA read 139 MB of x a call at down, for 8.7 MB of weights)."""
    for n, k in QWEN05_SHAPES:
        for rows in (2, 4, 16):
            p = plan_gemv(n, k, rows=rows, tuned=False, mma=False)
            x_bytes, w_bytes = p.grid * rows * k * 2, n * k * 2
            assert x_bytes <= 2 * w_bytes or p.grid <= 2 * 132, (n, k, rows, p.describe())
            if x_bytes <= 2 * w_bytes and p.grid > 2 * 132:  # not x-bound: the one-row plan's shape
                assert (p.warps, p.grid) == (plan_gemv(n, k, tuned=False).warps, plan_gemv(n, k, tuned=False).grid)
    down = plan_gemv(896, 4864, "residual", rows=4, tuned=False, mma=False)
    assert (down.warps, down.grid) == (4, 224) and plan_gemv(896, 4864, "residual", rows=2, tuned=False, mma=False).grid == 896
    assert plan_gemv(151936, 896, "argmax", rows=2, mma=False).grid == 2 * 132
    assert plan_gemv(896, 4864, rows=4, ctas_per_sm=0, warps=1, mma=False).grid == 896  # the knobs still win


def test_argmax_rows_need_as_many_lanes():
    """The CUDA-core form keeps one row's running best a lane; the tensor-core form has no such limit."""
    assert plan_gemv(96, 64, "argmax", rows=8, mma=False).rows == 8  # K = 64: 8 lanes a row
    with pytest.raises(ValueError, match="lanes"):
        plan_gemv(96, 64, "argmax", rows=9, mma=False)
    assert plan_gemv(151936, 896, "argmax", rows=16, mma=False).lanes == 16
    assert plan_gemv(96, 64, "argmax", rows=9).mma


def test_tuned_plans_hold_for_their_own_row_count(tmp_path, monkeypatch):
    """An entry measured at one row does not steer the M-row kernel; a sixth key element does."""
    one_row = {key: knobs for key, knobs in cute_gemv.TUNED_PLANS.items() if len(key) == 5}
    monkeypatch.setattr(cute_gemv, "TUNED_PLANS", one_row)  # the built-in M-row entries aside
    one_row = cute_gemv.plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True)
    four = cute_gemv.plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, rows=4)
    assert one_row.staged and not four.staged and four == cute_gemv.plan_gemv(
        9728, 896, "silu_mul", norm=True, pdl=True, rows=4, tuned=False)
    path = tmp_path / "plans.json"
    path.write_text(json.dumps([{"key": [9728, 896, "silu_mul", True, True, 4], "knobs": {"warps": 2}}]))
    assert cute_gemv.load_tuned_plans(str(path)) == 1
    assert cute_gemv.plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, rows=4).warps == 2
    assert cute_gemv.plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, rows=2) == \
        cute_gemv.plan_gemv(9728, 896, "silu_mul", norm=True, pdl=True, rows=2, tuned=False)


def test_an_m_row_entry_steers_only_the_form_it_was_measured_in():
    """The 0.5B's 4-row down entry is a tensor-core plan (splits of K), its 2-row one a CUDA-core
    plan (2 warps, a looping grid): a caller asking for the other form gets the heuristic's plan of
    that form, not an error or a plan nobody measured."""
    four, two = (896, 4864, "residual", False, True, 4), (896, 4864, "residual", False, True, 2)
    assert TUNED_PLANS[four] == {"splits": 2} and "warps" in TUNED_PLANS[two]
    args = (896, 4864, "residual")
    assert plan_gemv(*args, pdl=True, rows=4).splits == 2
    assert plan_gemv(*args, pdl=True, rows=4, mma=False) == plan_gemv(*args, pdl=True, rows=4, mma=False, tuned=False)
    assert plan_gemv(*args, pdl=True, rows=4, mma=True).splits == 2
    assert not plan_gemv(*args, pdl=True, rows=2).mma
    assert plan_gemv(*args, pdl=True, rows=2, mma=False) == plan_gemv(*args, pdl=True, rows=2)
    assert plan_gemv(*args, pdl=True, rows=2, mma=True) == plan_gemv(*args, pdl=True, rows=2, mma=True, tuned=False)


def _rows_inputs(n, k, epilogue, rows, seed, device="cpu", norm=False):
    """x [M, K] far from unit scale, W, the bias [N] or the residual [M, N], g (with norm)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(rows, k, generator=g, device=device) * 5 + 0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(torch.bfloat16)
    n_out = n // 2 if epilogue == "silu_mul" else n
    extra = {"bias": torch.randn(n_out, generator=g, device=device).to(torch.bfloat16),
             "residual": torch.randn(rows, n_out, generator=g, device=device).to(torch.bfloat16)}.get(epilogue)
    nw = (torch.rand(k, generator=g, device=device) + 0.5).to(torch.bfloat16) if norm else None
    return x, w, extra, nw


@pytest.mark.parametrize("epilogue", PLAIN_EPILOGUES)
@pytest.mark.parametrize("norm", [False, True])
def test_reference_rows_are_single_rows_stacked(epilogue, norm):
    """Each row its own rstd and residual; the bias is the layer's, the same for every row."""
    x, w, extra, nw = _rows_inputs(96, 64, epilogue, 5, 0, norm=norm)
    got = gemv_reference(x, w, epilogue, extra, norm_weight=nw)
    for m in range(5):
        row_extra = extra[m] if epilogue == "residual" else extra
        want = gemv_reference(x[m], w, epilogue, row_extra, norm_weight=nw)
        # fp32 matmuls of [5, K] and [1, K] may sum in another order: equal to rounding
        torch.testing.assert_close(got[m].reshape(-1), want.reshape(-1), rtol=1e-5, atol=1e-5)
    assert got.shape == ((5,) if epilogue == "argmax" else (5, 48 if epilogue == "silu_mul" else 96))


def _rows_rope_step(shape, rows, device="cpu"):
    """Positions and slots distinct per row (the last row's slot negative: no pool write)."""
    positions = torch.tensor([(3 + 7 * m) % shape.table_rows for m in range(rows)], device=device)
    slots = torch.tensor([(shape.cache_slots - 2 - 5 * m) for m in range(rows)], device=device)
    if rows > 1:
        slots[-1] = -1
    return positions, slots


def test_rope_reference_rows_each_at_its_position_and_slot():
    shape = RopeShape(16, 4, 2, 64, 64)
    x, w, b, nw, step = _rope_inputs(shape, 64, 0)
    xs = (torch.randn(4, 64) * 3).to(torch.bfloat16)
    positions, slots = _rows_rope_step(shape, 4)
    step.k_cache, step.v_cache = step.k_cache.float(), step.v_cache.float()
    rows_step = RopeKV(positions, step.cos_sin_cache, step.k_cache.clone(), step.v_cache.clone(), slots)
    got = rope_kv_reference(xs, w, b, shape, rows_step, norm_weight=nw, dtype=torch.float32)
    kc, vc = _pool_rows(rows_step, shape)
    for m in range(4):
        one = RopeKV(positions[m:m + 1], step.cos_sin_cache, step.k_cache.clone(), step.v_cache.clone(),
                     slots[m:m + 1])
        want = rope_kv_reference(xs[m], w, b, shape, one, norm_weight=nw, dtype=torch.float32)
        torch.testing.assert_close(got[m], want[0], rtol=1e-5, atol=1e-5)
        if slots[m] >= 0:
            torch.testing.assert_close(kc[slots[m]], _pool_rows(one, shape)[0][slots[m]], rtol=1e-5, atol=1e-5)
    written = set(slots[slots >= 0].tolist())
    assert all((kc[s] == 7).all() for s in range(kc.shape[0]) if s not in written)


@pytest.mark.parametrize("bad, match", [
    ("x_one_row", "x must"), ("residual_one_row", "residual"), ("bias_per_row", "bias"),
    ("out_one_row", "out must"), ("argmax_out", "out must"), ("rope_positions", "positions"),
])
def test_rows_call_checks_its_shapes(bad, match):
    rows, n, k = 4, 96, 64
    x, w, r, _ = _rows_inputs(n, k, "residual", rows, 0)
    if bad in ("x_one_row", "residual_one_row", "out_one_row"):
        gemv = CuteGemv(n, k, "residual", device="cpu", rows=rows)
        args = dict(x_one_row=(x[0], w, r, r), residual_one_row=(x, w, r[0], gemv.out_like()),
                    out_one_row=(x, w, r, gemv.out_like()[:1]))[bad]
        call = lambda: gemv(*args[:3], out=args[3])  # noqa: E731
    elif bad == "bias_per_row":
        gemv = CuteGemv(n, k, "bias", device="cpu", rows=rows)
        call = lambda: gemv(x, w, r, out=gemv.out_like())  # noqa: E731
    elif bad == "argmax_out":
        gemv = CuteGemv(n, k, "argmax", device="cpu", rows=rows)
        assert gemv.out_like().shape == (rows,)
        call = lambda: gemv(x, w, out=torch.zeros(1, dtype=torch.int32))  # noqa: E731
    else:
        shape = RopeShape(16, 2, 2, 64, 64)
        gemv = CuteGemv(shape.rows, k, "rope_kv", device="cpu", rope=shape, rows=rows)
        _, w2, _, _, step = _rope_inputs(shape, k, 0, bias=False)
        call = lambda: gemv(x, w2, out=gemv.out_like(), rope_kv=step)  # noqa: E731  (one position)
    with pytest.raises(ValueError, match=match):
        call()


# GPU: every epilogue at 1, 2, 7 and 16 rows against the fp32 reference, outputs poisoned first.
ROWS = [1, 2, 7, 16]
# (n, k, epilogue, norm, pdl, knobs): the 0.5B shapes as the fused path builds them, and small odd
# ones (K = 200: one lane a row, so each lane finishes several rows; K = 64: 8 lanes, 16 rows).
ROWS_CASES = [
    (1152, 896, "bias", True, True, {}), (1152, 896, "none", False, False, dict(ctas_per_sm=0, warps=1)),
    (896, 896, "residual", False, True, {}), (9728, 896, "silu_mul", True, True, {}),
    (896, 4864, "residual", False, True, {}), (151936, 896, "none", True, True, {}),
    (9728, 896, "silu_mul", True, True, dict(staged=True, stages=2, ctas_per_sm=4)),
    (896, 4864, "residual", False, False, dict(ctas_per_sm=1, warps=2)),
    (136, 200, "silu_mul", True, False, {}), (96, 64, "bias", False, False, {}),
    (136, 200, "residual", False, True, {}),
    # the CUDA-core form where the tensor-core one is the default
    (9728, 896, "silu_mul", True, True, dict(mma=False)), (151936, 896, "none", True, True, dict(mma=False)),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, epilogue, norm, pdl, knobs", ROWS_CASES)
def test_rows_match_fp32_reference(kh, n, k, epilogue, norm, pdl, knobs, rows):
    check_rows(kh, CuteGemv(n, k, epilogue, pdl=pdl, norm=norm, rows=rows, **knobs), epilogue, norm, rows)


# The tensor-core form at every row count it is built for: the fused path's shapes and flags, a
# tail tile in N (200 rows: 12.5 tiles of 16; silu's 68 outputs: 8.5 tiles of 8), K = 1184 (37
# steps of 32 over 5 warps of 8: the last warp's 3 steps past K are zeros; split over 2 or 3
# CTAs, the last split shorter), K = 64 (one warp).
MMA_ROWS_TESTED = [2, 3, 4, 5, 8, 16]
MMA_GPU_CASES = [(1152, 896, "bias", True, True, {}), (896, 896, "residual", False, True, {}),
                 (9728, 896, "silu_mul", True, True, {}), (151936, 896, "none", True, True, {}),
                 (896, 4864, "residual", False, True, {}), (1152, 896, "none", False, False, {}),
                 (200, 96, "residual", False, False, {}), (136, 64, "silu_mul", False, False, {}),
                 (256, 1184, "bias", True, False, {}), (200, 1184, "bias", False, False, dict(splits=3)),
                 (136, 1184, "silu_mul", False, True, dict(splits=2, warps=3)),
                 (9000, 64, "residual", False, True, {}),  # a looping grid (563 tiles), a tail tile
                 (256, 8960, "residual", False, True, {}),  # Qwen2.5-1.5B's down K: split over 9 CTAs
                 # Llama-3.1-8B's K with the norm: one CTA of 16 warps up to 8 rows, K over CTAs at 16
                 # (each storing its K's sums of x^2 for the last CTA's rstd); a short K split as asked
                 (256, 4096, "silu_mul", True, True, {}), (192, 4096, "bias", True, False, {}),
                 (136, 1184, "none", True, True, dict(splits=3)),
                 # Qwen2.5-14B's K with the norm: one CTA of 20 warps (96 registers) up to 8 rows
                 (256, 5120, "silu_mul", True, True, {})]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, k, epilogue, norm, pdl, knobs", MMA_GPU_CASES[:6] + [(4608, 3584, "bias", True, True, {}),
                                                                                (6144, 4096, "none", True, True, {}),
                                                                                (7168, 5120, "bias", True, True, {}),
                                                                                (7168, 5120, "bias", True, True, dict(splits=2))])
def test_mma_one_row_asked_for_matches_fp32_reference(kh, n, k, epilogue, norm, pdl, knobs):
    """One bf16 row on the tensor cores (mma=True: one real column of the 8-row tile), at the
    fused path's 0.5B shapes and the 7B's, 8B's (one CTA of 16 warps) and 14B's (one CTA of 20
    warps, and K split with the norm as asked) QKV."""
    gemv = CuteGemv(n, k, epilogue, pdl=pdl, norm=norm, rows=1, mma=True, **knobs)
    assert gemv.plan.mma and gemv.plan.rows == 1, gemv.plan.describe()
    check_rows(kh, gemv, epilogue, norm, 1)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", MMA_ROWS_TESTED)
@pytest.mark.parametrize("n, k, epilogue, norm, pdl, knobs", MMA_GPU_CASES)
def test_mma_rows_match_fp32_reference(kh, n, k, epilogue, norm, pdl, knobs, rows):
    """Also K split over CTAs (down's default; forced on small shapes with tails); two calls,
    so the second finds the split counters reset."""
    gemv = CuteGemv(n, k, epilogue, pdl=pdl, norm=norm, rows=rows, **knobs)
    assert gemv.plan.mma, gemv.plan.describe()
    check_rows(kh, gemv, epilogue, norm, rows)


# tile_group (G tiles a CTA against one load of x) at Qwen3-0.6B's O, down, gate+up and QKV, and with
# K split (unevenly over three CTAs; gate+up's norm over two).
TILE_GROUP_GPU_CASES = [(1024, 2048, "residual", False, True, dict(tile_group=2, splits=2)),
                        (1024, 3072, "residual", False, True, dict(tile_group=4, splits=4)),
                        (6144, 1024, "silu_mul", True, True, dict(tile_group=2)),
                        (4096, 1024, "none", True, True, dict(tile_group=2)),
                        (416, 1184, "bias", False, False, dict(tile_group=2, splits=3)),
                        # the norm with K split: each CTA's sums of x^2 stored for both its tiles
                        (6144, 1024, "silu_mul", True, True, dict(tile_group=2, splits=2))]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 5, 16])
@pytest.mark.parametrize("n, k, epilogue, norm, pdl, knobs", TILE_GROUP_GPU_CASES)
def test_tile_group_rows_match_fp32_reference(kh, n, k, epilogue, norm, pdl, knobs, rows):
    gemv = CuteGemv(n, k, epilogue, pdl=pdl, norm=norm, rows=rows, **knobs)
    assert gemv.plan.tile_group == knobs["tile_group"], gemv.plan.describe()
    check_rows(kh, gemv, epilogue, norm, rows)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 7, 16])
def test_tile_group_rope_kv_each_at_its_position_and_slot(kh, rows):
    gemv = CuteGemv(QWEN05_ROPE.rows, 896, "bias_rope_kv", pdl=True, norm=True, rope=QWEN05_ROPE, rows=rows,
                    tile_group=2)
    assert gemv.plan.tile_group == 2, gemv.plan.describe()
    check_rows_rope(kh, gemv, QWEN05_ROPE, 896, True, rows)


def check_rows(kh, gemv: CuteGemv, epilogue: str, norm: bool, rows: int) -> None:
    """out poisoned (NaN) so an unwritten row fails; the residual updated in place (out is the
    residual, [M, N], as in the fused path); two calls with different inputs."""
    n, k = gemv.plan.n_rows, gemv.plan.k
    for seed in (0, 1):
        x, w, extra, nw = _rows_inputs(n, k, epilogue, rows, seed, device="cuda", norm=norm)
        want = gemv_reference(x, w, epilogue, extra, norm_weight=nw)
        out = extra if epilogue == "residual" else gemv.out_like().fill_(float("nan"))
        if epilogue == "residual":  # the rows before and after stay untouched: a guard row each
            guarded = torch.full((rows + 2, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            guarded[1:-1] = extra
            out = extra = guarded[1:-1]
        gemv(x, w, extra, out=out, norm_weight=nw)
        torch.cuda.synchronize()
        assert out.shape == want.shape and not torch.isnan(out).any()
        for m in range(rows):  # row by row, so a row computed from another row's x shows
            assert kh.rel_err(out[m], want[m]) < 1e-2, f"row {m}"
        if epilogue == "residual":
            assert torch.isnan(guarded[0]).all() and torch.isnan(guarded[-1]).all()


def _argmax_rows_inputs(n, k, rows, seed, norm):
    """Random logits, plus for each row m two identical weight rows i_m < j_m along x_m, which
    make row m's largest logit an exact tie: the kernel must answer i_m (torch's first index)."""
    x, w, _, nw = _rows_inputs(n, k, "argmax", rows, seed, device="cuda", norm=norm)
    ties = [((5 + 37 * m) % (n // 2), n - 1 - m) for m in range(rows)]  # distinct at the n tested
    for m, (i, j) in enumerate(ties):
        w[i] = w[j] = x[m] / x[m].float().abs().max()
    return x, w, nw, [i for i, _ in ties]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", ROWS + [3, 5, 8, 9])
@pytest.mark.parametrize("n, k, norm, pdl, knobs", [
    (151936, 896, True, True, {}), (151936, 896, False, False, dict(ctas_per_sm=1, warps=8)),
    (256, 256, True, False, {}), (96, 64, False, True, {}), (151936, 896, True, True, dict(mma=False)),
    (5000, 64, False, False, dict(ctas_per_sm=1)),  # the tensor-core form: 132 CTAs walk 313 tiles, a tail
])
def test_rows_argmax_per_row_with_ties(kh, n, k, norm, pdl, knobs, rows):
    """Each row's token is its own argmax (ties: the lower index); random rows then tied rows;
    repeated calls check that the counter was reset."""
    try:
        gemv = CuteGemv(n, k, "argmax", pdl=pdl, norm=norm, rows=rows, **knobs)
    except ValueError as e:  # the CUDA-core form keeps a row's best a lane: at most `lanes` rows
        assert "lanes" in str(e) and rows > cute_gemv.lanes_for(k)
        pytest.skip(f"argmax with {rows} rows needs {rows} lanes a row; K = {k} gives {cute_gemv.lanes_for(k)}")
    eps = gemv.plan.eps
    for seed in (0, 1):
        x, w, _, nw = _rows_inputs(n, k, "argmax", rows, seed, device="cuda", norm=norm)
        out = gemv.out_like().fill_(-1)
        gemv(x, w, out=out, norm_weight=nw)
        torch.cuda.synchronize()
        for m in range(rows):
            if norm:
                assert_normed_argmax(out[m:m + 1], x[m], w, nw, eps)
            else:
                logits = w.float() @ x[m].float()
                assert float(logits.max() - logits[int(out[m])]) <= 1e-3 * float(logits.abs().max()), f"row {m}"
    x, w, nw, firsts = _argmax_rows_inputs(n, k, rows, 2, norm)
    out = gemv.out_like().fill_(-1)
    gemv(x, w, out=out, norm_weight=nw)
    torch.cuda.synchronize()
    assert out.tolist() == firsts


ROWS_ROPE_CASES = [(QWEN05_ROPE, 896, True, True, {}), (QWEN05_ROPE, 896, True, False, dict(warps=2)),
                   (QWEN05_ROPE, 896, True, True, dict(mma=False)), (RopeShape(16, 4, 2, 64, 256), 128, False, False, {}),
                   (RopeShape(64, 200, 2, 64, 256), 128, True, True, {}),  # 816 tiles: the grid loops
                   (RopeShape(64, 4, 2, 2048, 1025 * 16), 256, False, True, {}),
                   (RopeShape(32, 4, 2, 64, 256), 200, True, False, {})]  # K = 200: one lane a row


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", ROWS + [3, 8])
@pytest.mark.parametrize("shape, k, bias, pdl, knobs", ROWS_ROPE_CASES)
def test_rows_rope_kv_each_at_its_position_and_slot(kh, shape, k, bias, pdl, knobs, rows):
    """Row m rotated at its own position and stored at its own slot (the last of several rows
    at slot -1: no write); out poisoned, pool poisoned (+-7) everywhere else."""
    gemv = CuteGemv(shape.rows, k, "bias_rope_kv" if bias else "rope_kv", pdl=pdl, norm=True, rope=shape,
                    rows=rows, **knobs)
    check_rows_rope(kh, gemv, shape, k, bias, rows)


def check_rows_rope(kh, gemv: CuteGemv, shape, k: int, bias: bool, rows: int, fp8: bool = False) -> None:
    """One call of an M-row RoPE GEMV on random inputs (fp8: the weight quantized per row, its
    scales given to both the GEMV and the reference), each row at its own position and slot,
    checked by assert_rope_rows."""
    _, w, b, nw, step = _rope_inputs(shape, k, 0, device="cuda", bias=bias)
    scale = {}
    if fp8:
        w, row_scales = quantize_rows(w)
        scale = {"scale": row_scales}
    x = (torch.randn(rows, k, device="cuda") * 3 + 0.25).to(torch.bfloat16)
    positions, slots = _rows_rope_step(shape, rows, device="cuda")
    step = RopeKV(positions, step.cos_sin_cache, step.k_cache, step.v_cache, slots)
    mirror = RopeKV(positions, step.cos_sin_cache, step.k_cache.clone(), step.v_cache.clone(), slots)
    want = rope_kv_reference(x, w, b, shape, mirror, norm_weight=nw, **scale)
    out = gemv.out_like().fill_(float("nan"))
    gemv(x, w, b, out=out, norm_weight=nw, rope_kv=step, **scale)
    assert_rope_rows(kh, out, want, step, shape, slots)


def assert_rope_rows(kh, out, want, step: "RopeKV", shape, slots) -> None:
    """Each row of an M-row RoPE epilogue's output is the reference's, its k / v heads sit at its
    slot in the pool (none for slot -1), and every other slot keeps its fill (7 / -7)."""
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    hq, hkv = shape.num_q_heads, shape.num_kv_heads
    kc, vc = _pool_rows(step, shape)
    for m in range(len(slots)):
        assert kh.rel_err(out[m], want[m]) < 1e-2, f"row {m}"
        heads, slot = out[m].view(-1, shape.head_dim), int(slots[m])
        if slot >= 0:
            assert torch.equal(kc[slot], heads[hq: hq + hkv]) and torch.equal(vc[slot], heads[hq + hkv:])
    untouched = torch.ones(kc.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots[slots >= 0]] = False
    assert (kc[untouched] == 7).all() and (vc[untouched] == -7).all()
