"""The CuTe DSL decode GEMV (flashlet/kernels/cute_gemv.py) at the Qwen2.5-0.5B shapes, on a GPU.

For each shape and variant: compile (time it), check against an fp32 reference on fresh random
bf16 inputs with the output poisoned first, then time it inside a CUDA graph, beside cuBLAS
(F.linear) and the unfused PyTorch sequence, all in one table with the
fraction of the device-to-device copy bandwidth measured in the same run. Every stage is guarded:
a failure is printed and the rest still runs. Needs CUDA and the CuTe DSL on PYTHONPATH
(as scripts/gpu_run.sh's cute_env sets it up).

With --rows 1 2 4 8 16 each shape also runs the M-row kernel (`CuteGemv(..., rows=M)`: x [M, K],
the weights read once for all rows) beside cuBLAS at the same M (torch.matmul of [M, K] x W^T);
GB/s counts the weight bytes once per call, so a kernel that keeps the one-row figure as M grows
gets M rows for the price of one. At M > 1 the kernel's default form is the tensor-core one where it
plans (`plan_gemv(..., mma=True)`; FUSED_NOTES.md, "Stage 5"), and each M also runs the CUDA-core
form ("cores") beside it; --no-mma runs the CUDA-core form only.

With --fp8 each shape and M runs fp8 weights instead (e4m3 codes with per-row scales, checked
against gemv_reference with the scales): the CUDA-core form ("fp8 cores", fp8's default; "none")
and the tensor-core form ("fp8 mma", opt-in: `plan_gemv(..., fp8=True, mma=True)`, FUSED_NOTES.md "Issue 31:
fp8 on the tensor cores", with each of the shape's epilogues), beside bf16's default plan; GB/s
counts each form's own weight bytes (fp8: N x K).

    python3 scripts/fused_gemv_bench.py [--only NAME ...] [--rows M ...] [--no-mma] [--fp8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from flashlet.kernels import cute_gemv  # noqa: E402  (imports no cutlass until used)
from flashlet.kernels.bench import graph_time_us  # noqa: E402
from flashlet.models.quantization import quantize_rows  # noqa: E402

# name, N (rows of W), K, CuTe epilogues to run; the 0.5B model's five weight shapes.
SHAPES = [
    ("qkv", 1152, 896, ["none", "bias"]),
    ("o", 896, 896, ["none", "residual"]),
    ("gate_up", 9728, 896, ["none", "silu_mul"]),
    ("down", 896, 4864, ["none", "residual"]),
    ("lm_head", 151936, 896, ["none", "argmax"]),
]
L2_DEFEAT_BYTES = 256 << 20  # weights cycled per timed graph: several times the 50 MB L2
DEV = "cuda"
BF16 = torch.bfloat16


def log(msg: str) -> None:
    print(msg, flush=True)


def guarded(label: str, fn, *args, **kwargs):
    """Run one stage; on failure print the error and return None instead of stopping."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (the report is the point)
        log(f"FAILED {label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        log("  " + "  ".join(traceback.format_exc().splitlines(True)[-6:]))
        return None


def profiled_kernel_us(calls: int, launch, name_part: str) -> float:
    """Fallback when graph capture fails: mean device time of the kernels whose name holds
    `name_part`, from CUPTI (torch.profiler), so host overhead between launches is not counted."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        launch(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            launch(i)
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if name_part in e.name and e.device_time > 0]
    if not times:
        raise RuntimeError(f"the profiler saw no kernel named *{name_part}*")
    return sum(times) / len(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: (bytes read + bytes written) / median time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = graph_time_us(4, lambda i: dst.copy_(src), replays=10)
    del src, dst
    return 2 * (1 << 30) / (us * 1e-6) / 1e9


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(BF16)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))


def extra_for(gemv: cute_gemv.CuteGemv, epilogue: str, seed: int) -> torch.Tensor | None:
    """The bias [N] (one for all rows) or the residual [M, N]; None for the other epilogues."""
    n_out, rows = gemv.plan.n_out, gemv.plan.rows
    if epilogue == "bias":
        return rand(n_out, seed=seed)
    return rand(rows, n_out, seed=seed) if epilogue == "residual" else None


def check(gemv: cute_gemv.CuteGemv, n: int, k: int, epilogue: str, seed: int) -> str:
    """Fresh inputs, poisoned output, one call, compared with the fp32 reference; raises on a miss."""
    rows = gemv.plan.rows
    x = rand(rows, k, seed=seed)
    w = rand(n, k, seed=seed + 1, scale=k ** -0.5)
    scaled = {}
    if gemv.plan.fp8:  # e4m3 codes and row scales; the reference dequantizes them
        w, row_scales = quantize_rows(w)
        scaled = {"scale": row_scales}
    extra = extra_for(gemv, epilogue, seed + 2)
    out = gemv.out_like()
    out.fill_(-1) if epilogue == "argmax" else out.fill_(float("nan"))
    gemv(x, w, extra, out=out, **scaled)
    torch.cuda.synchronize()
    if epilogue == "argmax":
        logits = cute_gemv.gemv_reference(x, w, "none", **scaled)
        tokens = out.long()
        if not bool(((tokens >= 0) & (tokens < n)).all()):
            raise AssertionError(f"argmax wrote tokens {out.tolist()}, some outside [0, {n})")
        gap = float((logits.max(dim=-1).values - logits.gather(1, tokens[:, None])[:, 0]).max())
        if gap > 1e-3 * float(logits.abs().max()):
            raise AssertionError(f"argmax chose {out.tolist()}, reference {logits.argmax(dim=-1).tolist()}")
        return f"tokens ok (largest gap {gap:.2e})"
    ref = cute_gemv.gemv_reference(x, w, epilogue, extra, **scaled)
    if torch.isnan(out).any():
        raise AssertionError(f"{int(torch.isnan(out).sum())} outputs never written (NaN)")
    err = rel_err(out, ref)
    if not err < 1e-2:
        raise AssertionError(f"relative error {err:.3e} >= 1e-2")
    return f"rel err {err:.2e}"


def weight_bank(n: int, k: int, seed: int) -> tuple[torch.Tensor, int]:
    """[copies, n, k] random weights: cycling through them keeps each call's read out of L2."""
    copies = max(1, math.ceil(L2_DEFEAT_BYTES / (n * k * 2)))
    return rand(copies, n, k, seed=seed, scale=k ** -0.5), copies


def fp8_weight_bank(n: int, k: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """([copies, n, k] e4m3 codes, [copies, n] fp32 row scales): weight_bank's, in fp8 bytes."""
    copies = max(1, math.ceil(L2_DEFEAT_BYTES / (n * k)))
    codes, scales = [], []
    for c in range(copies):
        q, s = quantize_rows(rand(n, k, seed=seed + c, scale=k ** -0.5))
        codes.append(q)
        scales.append(s)
    return (torch.stack(codes), torch.stack(scales)), copies


def time_variant(gemv, epilogue, bank, copies, k):
    """bank: bf16 weights, or (codes, scales) for an fp8 GEMV."""
    x = rand(gemv.plan.rows, k, seed=7)
    extra = extra_for(gemv, epilogue, 8)
    out = gemv.out_like()
    calls = max(copies, 8)

    def launch(i):
        if gemv.plan.fp8:
            gemv(x, bank[0][i % copies], extra, out=out, scale=bank[1][i % copies])
        else:
            gemv(x, bank[i % copies], extra, out=out)

    try:
        return graph_time_us(calls, launch)
    except Exception as e:  # noqa: BLE001
        log(f"  graph timing failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
            f"kernel time from the profiler instead (no launch gaps: not comparable with the graph columns)")
        torch.cuda.synchronize()
        return profiled_kernel_us(min(calls, 50), launch, "cutlass")


def time_torch(kind, epilogue, bank, copies, n, k, rows=1):
    """cuBLAS alone (torch.matmul of [M, K] x W^T) or the unfused PyTorch sequence for the epilogue."""
    x = rand(rows, k, seed=7)
    extra = rand(rows, n // 2 if epilogue == "silu_mul" else n, seed=8)

    def run(i):
        w = bank[i % copies]
        if kind == "cublas":
            return torch.matmul(x, w.t())
        y = F.linear(x, w, extra.view(-1)) if epilogue == "bias" else F.linear(x, w)
        if epilogue == "residual":
            return y + extra
        if epilogue == "silu_mul":
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        if epilogue == "argmax":
            return y.argmax(dim=-1)
        return y

    return graph_time_us(max(copies, 8), run)


def time_token_chain(pdl: bool | None) -> tuple[float, torch.Tensor | None]:
    """All of a token's GEMVs (24 x QKV, O, gate+up, down, then the LM head with argmax) in one
    graph, the outputs feeding the next inputs as in the model (norms and attention left out).
    pdl None: the same chain in PyTorch (cuBLAS + unfused epilogues). Returns the time and, for
    CuTe, the final hidden state and token after the same number of replays, so the PDL run
    can be compared bit for bit with the plain one (a missed dependency would show there)."""
    layers, hidden, inter, vocab = 24, 896, 4864, 151936
    # O and down are scaled down so that, without the norms, the hidden state stays bounded.
    w = [dict(qkv=rand(1152, hidden, seed=10 * i, scale=hidden ** -0.5),
              bias=rand(1152, seed=10 * i + 1),
              o=rand(hidden, hidden, seed=10 * i + 2, scale=0.1 * hidden ** -0.5),
              gate_up=rand(2 * inter, hidden, seed=10 * i + 3, scale=hidden ** -0.5),
              down=rand(hidden, inter, seed=10 * i + 4, scale=0.02 * inter ** -0.5)) for i in range(layers)]
    head = rand(vocab, hidden, seed=999, scale=hidden ** -0.5)
    h0 = rand(1, hidden, seed=5)
    h = torch.empty_like(h0)  # every replay starts from h0, so every replay computes the same
    if pdl is None:
        def token(_):
            h.copy_(h0)
            x = h
            for lw in w:
                qkv = F.linear(x, lw["qkv"], lw["bias"])
                x = F.linear(qkv[:, :hidden], lw["o"]) + x
                gate, up = F.linear(x, lw["gate_up"]).chunk(2, dim=-1)
                x = F.linear(F.silu(gate) * up, lw["down"]) + x
            return F.linear(x, head).argmax(dim=-1)
        return graph_time_us(1, token), None
    make = dict(qkv=(1152, hidden, "bias"), o=(hidden, hidden, "residual"),
                gate_up=(2 * inter, hidden, "silu_mul"), down=(hidden, inter, "residual"),
                head=(vocab, hidden, "argmax"))
    g = {name: cute_gemv.CuteGemv(*shape, pdl=pdl) for name, shape in make.items()}
    qkv_out, act = g["qkv"].out_like(), g["gate_up"].out_like()
    token_out = g["head"].out_like()

    def token(_):
        h.copy_(h0)
        for lw in w:
            g["qkv"](h, lw["qkv"], lw["bias"], out=qkv_out)
            g["o"](qkv_out[:, :hidden], lw["o"], h, out=h)          # the residual add in place
            g["gate_up"](h, lw["gate_up"], out=act)
            g["down"](act, lw["down"], h, out=h)
        g["head"](h, head, out=token_out)

    us = graph_time_us(1, token)
    torch.cuda.synchronize()
    return us, torch.cat([h.view(-1).float(), token_out.float()])


def shape_variants(n: int, k: int, epilogues: list[str], args) -> list[tuple]:
    """(rows, epilogue, pdl, max_loads, staged, knobs) to run at one shape: at one row the
    model's epilogues and the comparisons (PDL, one output a group, staged); at M > 1 the model's
    epilogues, plain + PDL (each where the kernel plans it), the CUDA-core form beside the
    tensor-core one ("cores"), the tensor-core form in a resident grid of two CTAs an SM
    ("loop 2/SM") where its default differs and, past 8 rows, with twice its warps ("w<n>": half
    the K steps and registers a lane); with --no-mma (or where the tensor-core form does not plan) the
    CUDA-core form with the one-row plan's grid where the M-row plan differs (one tile a CTA, its warps: every CTA
    reads x from L2) and, from M = 4, more output rows a lane group where the shape allows
    (each x chunk read from L1 serves more weight rows)."""
    out = []
    one_row = cute_gemv.plan_gemv(n, k)
    cores = {"mma": False}
    for m in args.rows:
        base = cores if args.no_mma and m > 1 else {}

        def plans(epilogue, **knobs):
            try:
                return cute_gemv.plan_gemv(n, k, epilogue, rows=m, **knobs)
            except ValueError:  # e.g. a CUDA-core argmax with more rows than lanes a row
                return None

        out += [(m, e, False, 16, False, base) for e in epilogues if plans(e, **base)]
        if not args.no_pdl:
            out.append((m, "none", True, 16, False, base))
        if m == 1:
            if one_row.outs_per_group > 1:  # one row per lane group
                out.append((m, "none", False, 8, False, {}))
            out.append((m, "none", False, 24, True, {}))  # weights through shared memory (cp.async)
            continue
        default = plans("none")
        if default.mma and not args.no_mma:
            out.append((m, "none", False, 16, False, cores))
            more_warps = dict(warps=min(2 * default.warps, cute_gemv.MMA_MAX_WARPS))  # half the K steps a warp
            if m > 8 and plans("none", **more_warps) not in (None, default):  # fewer registers a lane
                out.append((m, "none", False, 16, False, more_warps))
            for e in ("none", "argmax"):  # a resident grid of two CTAs an SM looping over the tiles
                looping = plans(e, ctas_per_sm=2) if e in ("none", *epilogues) else None
                if looping is not None and looping.mma and looping != plans(e):
                    out.append((m, e, False, 16, False, {"ctas_per_sm": 2}))
            continue  # (the CUDA-core form's own plan comparisons: --no-mma)
        plan = plans("none", **cores)
        one_tile = dict(cores, ctas_per_sm=0, warps=one_row.warps)
        if plans("none", **one_tile) != plan:
            out.append((m, "none", False, 16, False, one_tile))
        if m >= 4 and plans("none", max_loads=32, **cores).outs_per_group > plan.outs_per_group:
            out.append((m, "none", False, 32, False, cores))  # more output rows a group: x reused more
    return out


def fp8_variants(n: int, k: int, epilogues: list[str], args) -> list[tuple]:
    """--fp8: at each M, bf16's default plan ("none"), the fp8 CUDA-core form ("none"), then the
    fp8 tensor-core form for "none" and the shape's epilogues (each where it plans), and as a
    PDL chain."""
    out = []
    for m in args.rows:
        out.append((m, "none", False, 16, False, {}))
        cases = [("none", {"fp8": True})] + [(e, {"fp8": True, "mma": True}) for e in dict.fromkeys(["none", *epilogues])]
        for e, knobs in cases:
            try:
                cute_gemv.plan_gemv(n, k, e, rows=m, **knobs)
            except ValueError:  # a shape the form cannot plan
                continue
            out.append((m, e, False, 16, False, knobs))
        if not args.no_pdl:
            out.append((m, "none", True, 16, False, {"fp8": True, "mma": True}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--no-pdl", action="store_true", help="skip the PDL chain variant")
    ap.add_argument("--no-token", action="store_true", help="skip the whole-token GEMV chain")
    ap.add_argument("--rows", nargs="+", type=int, default=[1],
                    help="decode rows per call (M): the M-row kernel beside cuBLAS at each M")
    ap.add_argument("--no-mma", action="store_true",
                    help="M > 1: the CUDA-core form only (no tensor-core rows)")
    ap.add_argument("--fp8", action="store_true",
                    help="fp8 weights: the CUDA-core and tensor-core fp8 forms beside bf16's default")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure")
        return 2
    t_start = time.perf_counter()
    t0 = time.perf_counter()
    ok, why = cute_gemv.cute_available()
    log(f"cutlass.cute import: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f}s {why}")
    if not ok:
        return 2
    import cutlass

    props = torch.cuda.get_device_properties(0)
    log(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"cutlass-dsl {getattr(cutlass, '__version__', '?')} from {cutlass.__file__}")
    copy_gbs = guarded("copy bandwidth", copy_bandwidth_gbs) or float("nan")
    log(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")

    results, failures = [], 0
    for name, n, k, epilogues in SHAPES:
        if args.only and name not in args.only:
            continue
        bank_copies = guarded(f"{name} weights", weight_bank, n, k, seed=100)
        if bank_copies is None:
            failures += 1
            continue
        bank, copies = bank_copies
        fp8_bank = guarded(f"{name} fp8 weights", fp8_weight_bank, n, k, seed=200) if args.fp8 else None
        if args.fp8 and fp8_bank is None:
            failures += 1
            continue
        variants = fp8_variants(n, k, epilogues, args) if args.fp8 else shape_variants(n, k, epilogues, args)
        for m, epilogue, pdl, max_loads, staged, knobs in variants:
            fp8 = knobs.get("fp8", False)
            tag = (epilogue + ("+pdl" if pdl else "") + (" R=1" if max_loads == 8 else "")
                   + (" R up" if max_loads == 32 else "")
                   + ({0: " tile/CTA"}.get(knobs.get("ctas_per_sm"), f" loop {knobs.get('ctas_per_sm')}/SM")
                      if "ctas_per_sm" in knobs else "")
                   + (" cores" if knobs.get("mma") is False and not args.no_mma else "")
                   + ((" fp8 mma" if knobs.get("mma") else " fp8 cores") if fp8 else "")
                   + (f" w{knobs['warps']}" if "warps" in knobs and "ctas_per_sm" not in knobs else "")
                   + (" staged" if staged else ""))
            label = f"{name} {n}x{k} M={m} {tag}"
            row = dict(shape=name, n=n, k=k, rows=m, variant=tag, bytes=n * k * (1 if fp8 else 2))
            gemv = guarded(f"{label} plan", cute_gemv.CuteGemv, n, k, epilogue, pdl=pdl,
                           max_loads=max_loads, staged=staged, rows=m, **knobs)
            if gemv is None:
                failures += 1
                continue
            row["plan"] = (f"L={gemv.plan.lanes} C={gemv.plan.chunks} R={gemv.plan.outs_per_group} "
                           f"warps={gemv.plan.warps} grid={gemv.plan.grid}" + (" mma" if gemv.plan.mma else ""))
            secs = guarded(f"{label} compile", gemv.compile)
            row["compile_s"] = secs
            if secs is None:
                failures += 1
                results.append(row)
                continue
            verdict = guarded(f"{label} check", check, gemv, n, k, epilogue, seed=len(results) * 10)
            row["check"] = verdict or "FAILED"
            failures += verdict is None
            row["cute_us"] = guarded(f"{label} time", time_variant, gemv, epilogue, *(fp8_bank if fp8 else (bank, copies)),
                                     k)
            baseline = not pdl and max_loads == 16 and not staged and knobs == ({"mma": False} if args.no_mma and m > 1 else {})
            if baseline and epilogue == "none":
                row["cublas_us"] = guarded(f"{label} cublas", time_torch, "cublas", epilogue, bank, copies, n, k, m)
                if row["cublas_us"]:
                    row["cublas_gbs"] = row["bytes"] / (row["cublas_us"] * 1e-6) / 1e9
            elif baseline and m == 1:  # the same work unfused: F.linear (bias folded in) then PyTorch ops
                row["torch_us"] = guarded(f"{label} torch", time_torch, "seq", epilogue, bank, copies, n, k)
            if row.get("cute_us"):
                row["gbs"] = row["bytes"] / (row["cute_us"] * 1e-6) / 1e9
                row["of_copy"] = row["gbs"] / copy_gbs
                torch_us = row.get("cublas_us") or row.get("torch_us")
                row["speedup"] = torch_us / row["cute_us"] if torch_us else None
            log(f"{label}: plan {row['plan']}, compiled in {secs:.2f}s, {row['check']}, "
                f"{row.get('cute_us') or float('nan'):.2f} us")
            results.append(row)
        del bank, fp8_bank
        torch.cuda.empty_cache()

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    log("")
    log(f"copy bandwidth {copy_gbs:.0f} GB/s; times are per call inside a CUDA graph that cycles "
        f"through >= {L2_DEFEAT_BYTES >> 20} MB of weights (median of 20 replays)")
    log("speed-up: cuBLAS (or the unfused PyTorch sequence) time / CuTe time; +pdl rows are a chain of "
        "PDL launches (weights loaded before griddepcontrol.wait)")
    log("GB/s: weight bytes (read once a call, whatever M) / time; cuBLAS GB/s the same for torch.matmul "
        "of [M, K] x W^T")
    log("| shape | M | variant | MB | cute us | GB/s | of copy | cuBLAS us | cuBLAS GB/s | torch seq us "
        "| speed-up | compile s | check |")
    log("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        log(f"| {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {r['variant']} | {r['bytes'] / 1e6:.2f} | "
            f"{f(r.get('cute_us'), '.2f')} | {f(r.get('gbs'), '.0f')} | {f(r.get('of_copy'), '.2f')} | "
            f"{f(r.get('cublas_us'), '.2f')} | {f(r.get('cublas_gbs'), '.0f')} | {f(r.get('torch_us'), '.2f')} | "
            f"{f(r.get('speedup'), '.2f')} | "
            f"{f(r.get('compile_s'), '.2f')} | {r.get('check', '-')} |")
    token = {}
    if not args.no_token and not args.only:
        floor_us = 0.988e9 / (copy_gbs * 1e9) * 1e6
        log("")
        log(f"a token's GEMVs only (24 layers x QKV+bias, O+residual, gate_up+SiLU-mul, down+residual, "
            f"LM head+argmax; no norms or attention), one graph; the bytes floor is {floor_us:.0f} us")
        finals = {}
        for label, pdl in (("cuBLAS + PyTorch epilogues", None), ("CuTe", False), ("CuTe + PDL", True)):
            res = guarded(f"token chain {label}", time_token_chain, pdl)
            failures += res is None
            if res:
                us, finals[label] = res
                token[label] = us
                log(f"  {label}: {us:.0f} us/token ({1e6 / us:.0f} tok/s ceiling, "
                    f"{floor_us / us:.2f} of the bytes floor)")
        if finals.get("CuTe") is not None and finals.get("CuTe + PDL") is not None:
            same = torch.equal(finals["CuTe"], finals["CuTe + PDL"])
            failures += not same
            log(f"  CuTe + PDL final hidden state and token {'bit-identical to' if same else 'DIFFER from'} "
                f"the plain chain's")
    log(f"total {time.perf_counter() - t_start:.0f}s, {failures} failed stage(s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(copy_gbs=copy_gbs, rows=results, token_chain_us=token), fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
