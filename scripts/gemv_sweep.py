"""Plan sweep for the CuTe DSL decode GEMV (flashlet/kernels/cute_gemv.py) at the fused decode
path's shapes (Qwen2.5-0.5B): which plan streams each GEMV fastest, with and without PDL.

For each shape as the fused path builds it (QKV + norm + bias, and + RoPE/K-V write; O +
residual in place; gate+up + norm + SiLU-mul; down + residual in place; optionally the LM head
+ norm + argmax) and each variant of its plan (warps per CTA, outputs per lane group, a
resident looping grid of c x SMs CTAs against one tile per CTA, registers against cp.async
staging, the two-stage staged pipeline, the norm's weight read after the PDL wait, a register
cap): compile, check one call against the fp32 reference (output poisoned first), then time a
chain of calls in one CUDA graph, weights cycled through >= 256 MB so no call finds its matrix
in L2. With PDL the graph is a chain of PDL launches (each call's weight loads may overlap the
previous call's tail, as in the fused step); the residual epilogues update one residual in
place, so each call depends on the one before it. Then one layer (QKV, O, gate+up, down; 24
layers of distinct weights) as a chain: the default plans against the best per shape.

Prints a table per shape (variant, plan, us, GB/s, fraction of the copy bandwidth) and the best
of each, and TUNED_PLANS entries to paste into cute_gemv.py; --json keeps every row.

    python3 scripts/gemv_sweep.py [--only qkv o gate_up down qkv_rope lm_head] [--pdl on|off|both]
                                  [--budget-s 220] [--json PATH] [--rows M]
    python3 scripts/gemv_sweep.py --registers --cuobjdump PATH/cuobjdump   # CPU: regs per variant

--rows M sweeps the M-row kernel (`CuteGemv(..., rows=M)`; plus the one-tile-a-CTA plan), and its
TUNED_PLANS entries and --plans-out keys carry M as a sixth element. bf16 M rows run the
tensor-core form by default (the CUDA-core form where a knob only it has is asked for): both
forms' knobs are swept, keyed as the engine looks them up (no "mma" element).

--fp8 sweeps the fp8-weight kernel (`CuteGemv(..., fp8=True)`: e4m3 codes, a scale a row, as
--quantization fp8 runs the fused path; the bank quantized per row, the check against
gemv_reference with the scales); its keys end in "fp8". With --mma its tensor-core form (as
`fused_decode.FP8_MMA_SHAPES` runs it) and that form's knobs (warps of K steps, a looping grid,
splits of K over CTAs, a register cap); its keys end in "fp8", "mma". --mma without --fp8 (one
row) sweeps bf16's one-row tensor-core form, which no engine path takes yet: whether it streams
the 7B's GEMVs, where the one-row CUDA-core form collapses (keys ending in "mma"). GPU only.

--config PRESET takes the shapes from a preset (hidden, intermediate, heads, vocab; the default
is Qwen2.5-0.5B's), e.g. the 7B fp8 step's GEMVs, applied at once through FLASHLET_GEMV_PLANS:

    python3 scripts/gemv_sweep.py --config qwen2.5-7b --fp8 --mma --pdl on \
        --only qkv_rope o gate_up --plans-out plans.json
    FLASHLET_GEMV_PLANS=plans.json python3 -m flashlet.bench --config qwen2.5-7b ... --quantization fp8

--registers needs no GPU: every variant is traced for sm_90a (CUTE_DSL_ARCH=sm_90a is set
here), its cubin read with cuobjdump -res-usage and -sass: registers, local memory (spills),
16-byte loads, and for the tensor-core form how many of the loads after the PDL wait ptxas issues
before the first product (cuobjdump: the CUDA toolkit's, or the one in Triton's wheel at
triton/backends/nvidia/bin).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from flashlet.kernels import cute_gemv  # noqa: E402
from flashlet.kernels.bench import graph_time_us  # noqa: E402
from flashlet.kernels.cute_gemv import CuteGemv, RopeKV, RopeShape, plan_gemv  # noqa: E402
from flashlet.models.quantization import quantize_rows  # noqa: E402
from fused_gemv_bench import L2_DEFEAT_BYTES, copy_bandwidth_gbs, rand, rel_err  # noqa: E402



def shapes_for(preset: str) -> dict:
    """name -> (N, K, epilogue, norm, rope): a preset's GEMVs as flashlet/runner/fused_decode.py
    builds them (the QKV bias only where the model has one; the rope pool of 8,193 pages)."""
    from flashlet.models.model import ModelConfig
    from flashlet.models.weights import preset_config

    cfg = ModelConfig.from_hf(preset_config(preset))
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    rope = RopeShape(d, cfg.num_heads, cfg.num_kv_heads, 4096, 8193 * 16)
    return {
        "qkv": (q + 2 * kv, h, "bias" if cfg.qkv_bias else "none", True, None),
        "o": (h, q, "residual", False, None),
        "gate_up": (2 * inter, h, "silu_mul", True, None),
        "down": (h, inter, "residual", False, None),
        "qkv_rope": (q + 2 * kv, h, "bias_rope_kv" if cfg.qkv_bias else "rope_kv", True, rope),
        "lm_head": (cfg.vocab_size, h, "argmax", True, None),
    }


# name -> (N, K, epilogue, norm, rope): the GEMVs of the preset swept (--config; main() rebinds it).
SHAPES = shapes_for("qwen2.5-0.5b")
DEFAULT_ONLY = ["gate_up", "down", "qkv", "o", "qkv_rope"]  # the LM head on request (272 MB a call)
VARIANTS_MATCHING: list[str] = []  # --variants: only labels holding one of these (and the default)
DEV = "cuda"
BF16 = torch.bfloat16


def log(msg: str) -> None:
    print(msg, flush=True)


def mma_variants(name: str) -> list[tuple[str, dict]]:
    """The tensor-core form's knobs (`cute_gemv._plan_mma`): warps (K steps each), a looping
    grid, splits of K over CTAs (no argmax; a normed GEMV in two only, the split norm's last CTA
    taking the rstd), a register cap, tiles a CTA sharing one load of x (tile_group; not with
    the argmax's looping grid)."""
    norm, epilogue = SHAPES[name][3], SHAPES[name][2]
    out = [(f"warps={w}", dict(warps=w)) for w in (4, 7, 8, 14, 16)]
    out += [(f"loop {c}/SM", dict(ctas_per_sm=c)) for c in (1, 2, 4)]
    can_split = not norm and epilogue != "argmax"
    if norm and epilogue != "argmax":  # K in two where the planner keeps it in one CTA (or the reverse)
        out += [("splits=2", dict(splits=2))]
    if can_split:
        out += [(f"splits={s}", dict(splits=s)) for s in (2, 3, 4, 6, 8)]
        out += [(f"splits={s} warps={w}", dict(splits=s, warps=w)) for s, w in ((2, 8), (4, 4), (4, 8))]
    out += [(f"regcap {c} CTAs/SM", dict(min_ctas_per_sm=c)) for c in (2, 3)]
    if epilogue != "argmax":  # at 16 rows x costs a CTA as many L2 bytes as its weights: G tiles share it
        out += [(f"group {g}", dict(tile_group=g)) for g in (2, 4)]
        out += [(f"group 2 warps={w}", dict(tile_group=2, warps=w)) for w in (2, 4, 8)]
    if can_split:
        out += [(f"group {g} splits={s}", dict(tile_group=g, splits=s))
                for g, s in ((2, 2), (2, 3), (2, 4), (4, 4), (4, 8))]
        out += [(f"group {g} splits={s} warps={w}", dict(tile_group=g, splits=s, warps=w))
                for g, s, w in ((2, 2, 4), (2, 4, 4), (4, 4, 4))]
    return out


# From this many bf16 rows the sweep leaves out the CUDA-core M-row form's plans: on an H100 (session
# 53, 0.5B shapes) they read 3-4x the tensor-core form's time at 8 rows (down 17-18 us against 5.4)
# and 3-12x at 16 (down 19-52 against 6.1; the LM head 394-1,179 against 94-100), and the 16-row
# LM head's CUDA-core variants took the sweep past its call's limit twice (a compile of minutes).
CUDA_CORE_ROWS_CAP = 8


def variants(name: str, pdl: bool, rows: int = 1, fp8: bool = False, mma: bool = False) -> list[tuple[str, dict]]:
    """(label, plan_gemv knobs) for one shape at M = rows, deduplicated by the plan they give
    (H200: 132 SMs). mma: the fp8 tensor-core form's knobs."""
    if VARIANTS_MATCHING:
        return [(label, knobs) for label, knobs in variants_unfiltered(name, pdl, rows, fp8, mma)
                if label == "default" or any(part in label for part in VARIANTS_MATCHING)]
    return variants_unfiltered(name, pdl, rows, fp8, mma)


def variants_unfiltered(name: str, pdl: bool, rows: int = 1, fp8: bool = False,
                        mma: bool = False) -> list[tuple[str, dict]]:
    """`variants` before --variants' filter."""
    n, k, epilogue, norm, rope = SHAPES[name]
    if mma:
        seen, kept = set(), []
        for label, knobs in [("default", {})] + mma_variants(name):
            try:
                plan = plan_gemv(n, k, epilogue, pdl=pdl, norm=norm, rope=rope, tuned=False, rows=rows, fp8=fp8,
                                 mma=True, **knobs)
            except ValueError:
                continue  # not a plan of this shape (registers, K steps a warp)
            if plan not in seen:
                seen.add(plan)
                kept.append((label, knobs))
        return kept
    w0 = plan_gemv(n, k, epilogue, pdl=pdl, norm=norm, rope=rope, tuned=False, rows=rows, fp8=fp8).warps
    staged_ok = epilogue not in ("argmax", "bias_rope_kv", "rope_kv")
    # Most promising first: a budget cut drops the tail.
    out = [("default", {})]
    if norm and pdl:  # g after the wait: fewer registers held across it
        out += [("late_g", dict(late_g=True)), ("late_g warps=1", dict(late_g=True, warps=1)),
                ("late_g warps=2", dict(late_g=True, warps=2)),
                ("late_g loop 3/SM", dict(late_g=True, ctas_per_sm=3))]
    # A resident grid looping over the tiles (as the argmax LM head does), c CTAs an SM.
    out += [(f"loop {c}/SM", dict(ctas_per_sm=c)) for c in (1, 2, 3, 4)]
    if rows > 1:  # the one-row plan's shape: one tile a CTA, each CTA reading x from L2
        out += [("tile/CTA", dict(ctas_per_sm=0)), ("tile/CTA warps=1", dict(ctas_per_sm=0, warps=1))]
    out += [(f"loop {c}/SM warps={w}", dict(ctas_per_sm=c, warps=w)) for c, w in ((4, 2), (8, 1), (8, 2))]
    if staged_ok:
        # cp.async double-buffered: the next tile's copies fly while this one is summed.
        out += [(f"staged2 loop {c}/SM", dict(staged=True, stages=2, ctas_per_sm=c)) for c in (2, 4, 8)]
        out += [("staged2 loop 4/SM warps=2", dict(staged=True, stages=2, ctas_per_sm=4, warps=2)),
                ("staged", dict(staged=True))]
        if norm and pdl:
            out += [("staged late_g", dict(staged=True, late_g=True))]
    out += [(f"warps={w}", dict(warps=w)) for w in (1, 2, 4, 8)]
    out += [(f"R={r}", dict(outs_per_group=r)) for r in (1, 2, 3)]
    out += [(f"warps={w} R=2", dict(warps=w, outs_per_group=2)) for w in (1, 2)]
    # Register caps (.minnctapersm, the default warps): 128 or ~168 registers a thread, i.e. 16
    # or 12 warps an SM. ptxas may spill to fit (--registers shows which do) or, where the
    # kernel needs fewer, take more.
    out += [(f"regcap {regs}", dict(min_ctas_per_sm=warps_sm // w0)) for regs, warps_sm in ((128, 16), (168, 12))]
    if norm and pdl:
        out += [("late_g regcap 168", dict(late_g=True, min_ctas_per_sm=12 // w0))]
    if rows > 1 and not fp8:  # bf16 M rows run the tensor-core form by default: its own knobs too
        out += [(f"mma {label}", knobs) for label, knobs in mma_variants(name)]
    seen, kept = set(), []
    for label, knobs in out:
        try:
            plan = plan_gemv(n, k, epilogue, pdl=pdl, norm=norm, rope=rope, tuned=False, rows=rows, fp8=fp8,
                             **knobs)
        except ValueError:
            continue  # e.g. over the 48 KB of shared memory, or staged fp8: not a variant of this shape
        if rows >= CUDA_CORE_ROWS_CAP and not fp8 and not plan.mma:
            continue  # the CUDA-core M-row form at 8+ rows: 3-12x the tensor-core form's time, slow to compile
        if plan not in seen:
            seen.add(plan)
            kept.append((label, knobs))
    return kept


def make_gemv(name: str, pdl: bool, knobs: dict, rows: int = 1, device: str | None = None,
              fp8: bool = False, mma: bool = False) -> CuteGemv:
    n, k, epilogue, norm, rope = SHAPES[name]
    return CuteGemv(n, k, epilogue, device=device or DEV, pdl=pdl, norm=norm, rope=rope, tuned=False,
                    rows=rows, fp8=fp8, **({"mma": True} if mma else {}), **knobs)


# ---------------------------------------------------------------------------------------------
# On the GPU.

class Inputs:
    """One shape's call inputs: a weight bank cycled so no call finds its matrix in L2, x (far
    from unit scale, so a missing norm shows), norm weight, bias / residual, the rope step."""

    def __init__(self, name: str, rows: int = 1, fp8: bool = False):
        n, k, epilogue, norm, rope = SHAPES[name]
        self.name, self.n, self.k, self.epilogue, self.rows = name, n, k, epilogue, rows
        self.weight_bytes = n * k * (1 if fp8 else 2)
        self.copies = max(1, -(-L2_DEFEAT_BYTES // self.weight_bytes))
        self.bank = rand(self.copies, n, k, seed=100, scale=k ** -0.5)
        self.scales = None  # fp8: the bank's codes, and a scale a row
        if fp8:
            codes, scales = zip(*(quantize_rows(w) for w in self.bank))
            self.bank, self.scales = torch.stack(codes), torch.stack(scales)
        self.x = (rand(rows, k, seed=7).float() * 3 + 0.25).to(BF16)
        self.g = (torch.rand(k, device=DEV) + 0.5).to(BF16) if norm else None
        # the bias is the layer's (one for all rows); the residual is each row's
        extra_shape = {"bias": (n,), "bias_rope_kv": (n,), "residual": (rows, n)}.get(epilogue)
        self.extra = rand(*extra_shape, seed=8) if extra_shape else None
        self.rope = None
        if rope is not None:
            d = rope.head_dim
            theta = torch.arange(rope.table_rows, device=DEV)[:, None] * 10000.0 ** (
                -torch.arange(d // 2, device=DEV) / (d // 2))
            pool = (rope.cache_slots // 16, 16, rope.num_kv_heads, d)
            self.rope = RopeKV(77 + 3 * torch.arange(rows, device=DEV), torch.cat((theta.cos(), theta.sin()), -1).float(),
                               torch.zeros(pool, dtype=BF16, device=DEV), torch.zeros(pool, dtype=BF16, device=DEV),
                               1234 + 5 * torch.arange(rows, device=DEV))

    def scale(self, i: int) -> dict:
        """The call's `scale=` (fp8: bank entry i's row scales)."""
        return {} if self.scales is None else {"scale": self.scales[i % self.copies]}

    def reference(self, w: torch.Tensor) -> torch.Tensor:
        if self.rope is not None:
            mirror = RopeKV(self.rope.positions, self.rope.cos_sin_cache, self.rope.k_cache.clone(),
                            self.rope.v_cache.clone(), self.rope.slot_mapping)
            return cute_gemv.rope_kv_reference(self.x, w, self.extra, SHAPES[self.name][4], mirror,
                                               norm_weight=self.g, **self.scale(0))
        return cute_gemv.gemv_reference(self.x, w, self.epilogue, self.extra, norm_weight=self.g, **self.scale(0))

    def check(self, gemv: CuteGemv) -> str:
        """One call on bank[0], output poisoned, against the fp32 reference; raises on a miss."""
        w = self.bank[0]
        out = gemv.out_like()
        out.fill_(-1) if self.epilogue == "argmax" else out.fill_(float("nan"))
        gemv(self.x, w, self.extra, out=out, norm_weight=self.g, rope_kv=self.rope, **self.scale(0))
        torch.cuda.synchronize()
        if self.epilogue == "argmax":
            logits = cute_gemv.gemv_reference(self.x, w, "none", norm_weight=self.g, eps=gemv.plan.eps,
                                              **self.scale(0))  # [M, N]
            for m, token in enumerate(out.tolist()):
                gap = float(logits[m].max() - logits[m, token]) if 0 <= token < self.n else float("inf")
                if not gap <= 1e-3 * float(logits[m].abs().max()):
                    raise AssertionError(f"row {m}: argmax chose {token}, reference {int(logits[m].argmax())}")
            return "ok"
        if torch.isnan(out).any():
            raise AssertionError(f"{int(torch.isnan(out).sum())} outputs never written (NaN)")
        err = rel_err(out, self.reference(w))
        if not err < 1e-2:
            raise AssertionError(f"relative error {err:.3e} >= 1e-2")
        return f"{err:.1e}"

    def launcher(self, gemv: CuteGemv):
        """launch(i): call i of the chain. The residual epilogues write in place (out is the
        residual, as in the fused path), so each call depends on the previous one."""
        out = self.extra.view(self.rows, -1) if self.epilogue == "residual" else gemv.out_like()

        def launch(i):
            gemv(self.x, self.bank[i % self.copies], self.extra, out=out, norm_weight=self.g, rope_kv=self.rope,
                 **self.scale(i))
        return launch


def time_chain(inputs: Inputs, gemv: CuteGemv) -> float:

    extra0 = inputs.extra.clone() if inputs.extra is not None else None
    try:
        return graph_time_us(max(inputs.copies, 16), inputs.launcher(gemv))
    finally:
        if extra0 is not None:
            inputs.extra.copy_(extra0)  # the residual chain drifted it


def sweep_shape(name: str, pdl: bool, copy_gbs: float, deadline: float, m: int = 1,
                fp8: bool = False, mma: bool = False) -> list[dict]:
    n, k, epilogue, norm, rope = SHAPES[name]
    inputs = Inputs(name, m, fp8)
    rows = []
    for label, knobs in variants(name, pdl, m, fp8, mma):
        if time.perf_counter() > deadline:
            log(f"  budget spent: {name} pdl={pdl} stops before {label!r}")
            break
        row = dict(shape=name, n=n, k=k, epilogue=epilogue, norm=norm, pdl=pdl, rows=m, variant=label,
                   knobs=knobs, bytes=inputs.weight_bytes, fp8=fp8)
        try:
            gemv = make_gemv(name, pdl, knobs, m, fp8=fp8, mma=mma)
            row["plan"] = gemv.plan.describe()
            row["compile_s"] = round(gemv.compile(inputs.rope), 2)
            row["check"] = inputs.check(gemv)
            row["us"] = time_chain(inputs, gemv)
            row["gbs"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
            row["of_copy"] = row["gbs"] / copy_gbs
        except Exception as e:  # noqa: BLE001  (a failed variant is a row, the sweep goes on)
            row["check"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001  (a sticky CUDA error: the next rows will say so)
                pass
        log(f"  {name} {'pdl' if pdl else 'nopdl'} {label:<28} {row.get('plan', '-'):<22} "
            f"{row.get('us', float('nan')):7.2f} us  {row.get('gbs', float('nan')):6.0f} GB/s  {row['check']}")
        rows.append(row)
    del inputs
    torch.cuda.empty_cache()
    return rows


def best_of(rows: list[dict]) -> dict | None:
    timed = [r for r in rows if r.get("us") and not r["check"].startswith("FAILED")]
    return min(timed, key=lambda r: r["us"]) if timed else None


def call_weight(w: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, dict]:
    """(weight, the call's scale kwargs): bf16 as it is; fp8 its codes and {"scale": row scales}."""
    if not fp8:
        return w, {}
    codes, scale = quantize_rows(w)
    return codes, {"scale": scale}


def layer_chain_us(plans: dict[str, dict], pdl: bool, layers: int = 24, m: int = 1, fp8: bool = False,
                   mma: bool = False) -> float:
    """One decode layer's four GEMVs (QKV + norm (+ bias), O + residual, gate+up + norm + SiLU-mul,
    down + residual), `layers` layers of distinct weights (nothing stays in L2), as one
    graph; the residual updated in place, outputs feeding inputs as in the fused step (no
    attention: at one row O reads the QKV output's first q columns; at M rows those are not
    contiguous, so O reads a fixed [M, q]). Returns us per layer."""

    g = {s: make_gemv(s, pdl, plans.get(s, {}), m, fp8=fp8, mma=mma) for s in ("qkv", "o", "gate_up", "down")}
    w = [{s: rand(SHAPES[s][0], SHAPES[s][1], seed=1000 + 10 * i + j, scale=SHAPES[s][1] ** -0.5 * (0.1 if s in ("o", "down") else 1))
          for j, s in enumerate(g)} for i in range(layers)]
    w = [{s: call_weight(t, fp8) for s, t in lw.items()} for lw in w]
    hidden, q = SHAPES["o"][0], SHAPES["o"][1]
    bias = rand(SHAPES["qkv"][0], seed=3) if SHAPES["qkv"][2] == "bias" else None
    nw = (torch.rand(hidden, device=DEV) + 0.5).to(BF16)
    h0 = rand(m, hidden, seed=5)
    h = torch.empty_like(h0)
    qkv_out, act = g["qkv"].out_like(), g["gate_up"].out_like()
    attn = qkv_out[:, :q] if m == 1 else rand(m, q, seed=6)

    def step(_):
        h.copy_(h0)
        for lw in w:
            g["qkv"](h, lw["qkv"][0], bias, out=qkv_out, norm_weight=nw, **lw["qkv"][1])
            g["o"](attn, lw["o"][0], h, out=h, **lw["o"][1])
            g["gate_up"](h, lw["gate_up"][0], out=act, norm_weight=nw, **lw["gate_up"][1])
            g["down"](act, lw["down"][0], h, out=h, **lw["down"][1])

    return graph_time_us(1, step) / layers


def write_plans(path: str, rows: list[dict], best: dict, args) -> int:
    """Write the winners that beat their shape's default by >= 3% as FLASHLET_GEMV_PLANS entries;
    returns how many."""
    entries = []
    for (name, pdl), b in best.items():
        base = next((d for d in rows if d["shape"] == name and d["pdl"] == pdl
                     and d["variant"] == "default" and d.get("us")), None)
        if b["variant"] != "default" and (base is None or base["us"] >= 1.03 * b["us"]):
            n, k, epilogue, norm, _ = SHAPES[name]
            key = [n, k, epilogue, norm, pdl] + ([args.rows] if args.rows > 1 else []) + (["fp8"] if args.fp8 else [])
            key += ["mma"] if args.mma else []
            entries.append(dict(key=key, knobs=b["knobs"], us=b["us"], shape=name, variant=b["variant"]))
    with open(path, "w") as fh:
        json.dump(entries, fh, indent=1)
    return len(entries)


def run_gpu(args) -> int:

    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    ok, why = cute_gemv.cute_available()
    if not ok:
        log(f"the CuTe DSL is not importable: {why}")
        return 2
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    log(f"{props.name}, {props.multi_processor_count} SMs; copy bandwidth {copy_gbs:.0f} GB/s; "
        f"budget {args.budget_s:.0f} s")
    pdls = {"on": [True], "off": [False], "both": [True, False]}[args.pdl]
    rows, best = [], {}
    todo = [(name, pdl) for pdl in pdls for name in args.only]  # PDL first: the fused path's form
    for i, (name, pdl) in enumerate(todo):
        # An equal share of what is left, so a slow shape cannot starve the ones after it.
        share = (deadline - time.perf_counter()) / (len(todo) - i)
        log(f"== {name} {SHAPES[name][:3]} norm={SHAPES[name][3]} pdl={pdl} rows={args.rows} fp8={args.fp8} "
            f"mma={args.mma} ({share:.0f} s)")
        shape_rows = sweep_shape(name, pdl, copy_gbs, time.perf_counter() + share, args.rows, args.fp8, args.mma)
        rows += shape_rows
        b = best_of(shape_rows)
        if b:
            best[(name, pdl)] = b
        if args.json:  # after every shape: a timeout still leaves what was measured
            dump(args.json, copy_gbs, rows, best, {})
        if args.plans_out:  # so too the winners so far
            write_plans(args.plans_out, rows, best, args)

    log("")
    log(f"copy bandwidth {copy_gbs:.0f} GB/s; us per call in a CUDA graph chain of calls (PDL launches "
        f"where pdl), weights cycled through >= {L2_DEFEAT_BYTES >> 20} MB")
    log("| shape | pdl | variant | plan | us | GB/s | of copy | vs default | check |")
    log("|---|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        base = next((d for d in rows if d["shape"] == r["shape"] and d["pdl"] == r["pdl"]
                     and d["variant"] == "default"), None)
        vs = f"{base['us'] / r['us']:.2f}x" if r.get("us") and base and base.get("us") else "-"
        mark = " **best**" if best.get((r["shape"], r["pdl"])) is r else ""
        log(f"| {r['shape']} | {'on' if r['pdl'] else 'off'} | {r['variant']}{mark} | {r.get('plan', '-')} | "
            f"{r.get('us', float('nan')):.2f} | {r.get('gbs', float('nan')):.0f} | "
            f"{r.get('of_copy', float('nan')):.2f} | {vs} | {r['check']} |")
    log("")
    log("best per shape; TUNED_PLANS entries (flashlet/kernels/cute_gemv.py) for the winners:")
    for (name, pdl), b in best.items():
        n, k, epilogue, norm, _ = SHAPES[name]
        m = f", {args.rows}" if args.rows > 1 else ""  # M > 1: the sixth key element
        m += ', "fp8"' if args.fp8 else ""
        m += ', "mma"' if args.mma else ""
        log(f"    ({n}, {k}, {epilogue!r}, {norm}, {pdl}{m}): {b['knobs']},  "
            f"# {name}: {b['us']:.2f} us, {b['gbs']:.0f} GB/s, {b['of_copy']:.2f} of copy ({b['variant']})")
    if args.plans_out:
        log(f"{write_plans(args.plans_out, rows, best, args)} tuned plan(s) written to {args.plans_out} "
            f"(FLASHLET_GEMV_PLANS)")
    chain = {}
    for pdl in pdls:
        if time.perf_counter() > deadline + 60 or not all((s, pdl) in best for s in ("qkv", "o", "gate_up", "down")):
            continue
        tuned = {s: best[(s, pdl)]["knobs"] for s in ("qkv", "o", "gate_up", "down")}
        for label, plans in (("default plans", {}), ("best per shape", tuned)):
            try:
                us = layer_chain_us(plans, pdl, m=args.rows, fp8=args.fp8, mma=args.mma)
                chain[f"{label} pdl={pdl}"] = us
                layer_bytes = sum(SHAPES[s][0] * SHAPES[s][1] for s in ("qkv", "o", "gate_up", "down"))
                layer_bytes *= 1 if args.fp8 else 2
                log(f"layer chain (QKV, O, gate+up, down; 24 layers), {label}, pdl={pdl}: {us:.1f} us a layer "
                    f"({layer_bytes / (us * 1e-6) / 1e9:.0f} GB/s; byte floor {layer_bytes / (copy_gbs * 1e3):.1f} us)")
            except Exception as e:  # noqa: BLE001
                log(f"layer chain {label} pdl={pdl} FAILED: {type(e).__name__}: {str(e)[:200]}")
    if args.json:
        dump(args.json, copy_gbs, rows, best, chain)
    failed = sum(r["check"].startswith("FAILED") for r in rows)
    log(f"total {time.perf_counter() - t_start:.0f} s, {len(rows)} variants, {failed} failed")
    return 1 if failed else 0


def dump(path, copy_gbs, rows, best, chain):
    with open(path, "w") as fh:
        json.dump(dict(copy_gbs=copy_gbs, rows=rows, chain_us_per_layer=chain,
                       best={f"{n} pdl={p}": b["variant"] for (n, p), b in best.items()}), fh, indent=1)


# ---------------------------------------------------------------------------------------------
# On the CPU: registers and spills per variant (sm_90a cubin, cuobjdump).

def cubin_stats(cuobjdump: str, cubin_dir: str) -> dict:
    cubins = glob.glob(os.path.join(cubin_dir, "*.cubin"))
    if not cubins:
        return {}
    res = subprocess.run([cuobjdump, "-res-usage", *cubins], capture_output=True, text=True).stdout
    sass = subprocess.run([cuobjdump, "-sass", *cubins], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", res)
    stats = dict(regs=int(m[1]), stack=int(m[2]), local=int(m[3])) if m else {}
    stats["spill_ops"] = len(re.findall(r"\b(LDL|STL)\b", sass))
    stats["ldg128"] = sass.count("LDG.E.128")
    stats["ldgsts"] = sass.count("LDGSTS")
    stats["x_first"] = loads_before_first_product(sass)
    return stats


def loads_before_first_product(sass: str) -> str:
    """'issued / all' of the 16-byte loads after the PDL wait (ACQBULK) that ptxas issues before
    the first tensor-core product (HMMA), '-' without both: how many of x's fragment loads fly
    together after the wait (at Qwen3-0.6B's 16-row O 4 of 16; FUSED_NOTES.md, "Session 63")."""
    lines = sass.splitlines()
    wait = next((i for i, line in enumerate(lines) if "ACQBULK" in line), None)
    if wait is None:
        return "-"
    after = lines[wait + 1:]
    first = next((i for i, line in enumerate(after) if "HMMA" in line), None)
    if first is None:
        return "-"
    loads = [i for i, line in enumerate(after) if "LDG.E.128" in line]
    return f"{sum(i < first for i in loads)} / {len(loads)}"


def trace_one(name: str, pdl: bool, index: int, rows: int = 1, mma: bool = False) -> None:
    """Compile variant `index` of (name, pdl) for sm_90a in this process (the DSL reads its
    dump settings from the environment at import: one process a variant); mma: of the
    tensor-core form's variants (one bf16 row asked for)."""
    cute_gemv._dsl()
    import cutlass.cutlass_dsl.cutlass as dsl_module
    # Without a GPU: the launch's shared-memory carveout hint (set only with a register cap)
    # queries the device; it is a runtime hint, not part of the code, so tracing skips it.
    dsl_module._build_kernel_attrs = lambda config: {}
    label, knobs = variants(name, pdl, rows, mma=mma)[index]
    try:
        make_gemv(name, pdl, knobs, rows, device="cpu", mma=mma).compile()
    except Exception:  # noqa: BLE001  (no GPU: the final module load fails after the cubin is written)
        pass


def run_registers(args) -> int:
    ok, why = cute_gemv.cute_available()
    if not ok:
        log(why)
        return 2
    pdls = {"on": [True], "off": [False], "both": [True, False]}[args.pdl]
    rows = []
    for pdl in pdls:
        for name in args.only:
            for index, (label, knobs) in enumerate(variants(name, pdl, args.rows, mma=args.mma)):
                with tempfile.TemporaryDirectory() as d:
                    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=d)
                    subprocess.run([sys.executable, __file__, "--config", args.config, "--trace-one", name,
                                    str(int(pdl)), str(index), str(args.rows), str(int(args.mma))],
                                   env=env, capture_output=True, timeout=300)
                    stats = cubin_stats(args.cuobjdump, d)
                plan = make_gemv(name, pdl, knobs, args.rows, device="cpu", mma=args.mma).plan.describe()
                row = dict(shape=name, pdl=pdl, variant=label, plan=plan, **stats)
                rows.append(row)
                log(f"| {name} | {'on' if pdl else 'off'} | {label} | {plan} | {stats.get('regs', '?')} | "
                    f"{stats.get('stack', '?')} | {stats.get('spill_ops', '?')} | {stats.get('ldg128', '?')} | "
                    f"{stats.get('ldgsts', '?')} | {stats.get('x_first', '?')} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all("regs" in r for r in rows) else 1


def main() -> int:
    global SHAPES  # --config's shapes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=DEFAULT_ONLY, choices=list(SHAPES))
    ap.add_argument("--pdl", default="both", choices=["on", "off", "both"])
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="stop starting variants after this many seconds (the rows so far are kept)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--plans-out", help="write the winners as FLASHLET_GEMV_PLANS entries (JSON)")
    ap.add_argument("--registers", action="store_true", help="CPU: registers / spills per variant (sm_90a)")
    ap.add_argument("--cuobjdump", default="cuobjdump", help="with --registers: the cuobjdump binary")
    ap.add_argument("--rows", type=int, default=1, help="decode rows per call (M, 1-16): plans for the M-row kernel")
    ap.add_argument("--fp8", action="store_true", help="fp8 (e4m3) weights with row scales (GPU sweep only)")
    ap.add_argument("--mma", action="store_true",
                    help="the tensor-core form and its knobs, where it is asked for: --fp8, or one bf16 row")
    ap.add_argument("--config", default="qwen2.5-0.5b", help="the preset whose GEMV shapes are swept")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="only the variants whose label holds one of these (e.g. 'group' 'splits=2'); "
                         "the default plan always")
    ap.add_argument("--trace-one", nargs=5, metavar=("SHAPE", "PDL", "INDEX", "ROWS", "MMA"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    SHAPES = shapes_for(args.config)
    VARIANTS_MATCHING[:] = args.variants
    if args.mma and not args.fp8 and args.rows > 1:
        ap.error("--mma sweeps the tensor-core form where it is asked for: fp8 weights, or one bf16 row "
                 "(bf16's M-row plans take it by default)")
    if args.trace_one:
        name, pdl, index, rows, mma = args.trace_one
        trace_one(name, pdl == "1", int(index), int(rows), mma == "1")
        return 0
    if args.registers and args.fp8:
        ap.error("--fp8 sweeps on the GPU only: --registers traces the bf16 variants")
    if args.registers:
        log("| shape | pdl | variant | plan | registers | stack bytes | LDL/STL | LDG.128 | LDGSTS | "
            "loads after the wait before the first HMMA |")
        log("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
        return run_registers(args)
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure (--registers runs on the CPU)")
        return 2
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
