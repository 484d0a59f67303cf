"""FP8 weight matmuls per row count on a GPU: where quantization.TRITON_GEMM_MAX_ROWS belongs.

For each projection shape [N, K] and row count M, times (CUDA graphs, one replay running the
matmul over enough distinct weight copies that they cannot stay in L2, as a decode step's
layers do) and prints microseconds per matmul and the weight's effective GB/s:

  bf16        F.linear on a bf16 weight (cuBLAS): the unquantized baseline
  triton      flashlet/kernels/fp8_gemv.py: weight-only fp8, fp32 accumulation
  scaled_mm   per-token fp8 activations + torch._scaled_mm (sm_89+; the quantize kernels included)
  widen+bf16  the weight widened to bf16 per call, then cuBLAS (quantization.weight_only_linear)

    python scripts/fp8_gemm_bench.py                       # the default shapes, M = 1..256
    python scripts/fp8_gemm_bench.py --rows 1 4 16 --sweep # triton tiles side by side
    python scripts/fp8_gemm_bench.py --shapes 896x4864 --json out.json
    python scripts/fp8_gemm_bench.py --rows 1 --split-sweep   # tiles x K splits, best first
    python scripts/fp8_gemm_bench.py --rows 128 --bf16-weights --shapes 1152x896 896x896 \
        9728x896 896x4864     # the same kernel on bf16 weights (tiles x splits) against cuBLAS

--bf16-weights asks whether our own tiles beat cuBLAS on an unquantized weight at the rows
past the fused path (decode-sat's 128: cuBLAS runs the 0.5B's four GEMMs at ~1.2 TB/s,
flashlet/kernels/DECODE_NOTES.md round 3).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashlet.kernels.fp8_gemv import GemmTile, fp8_gemm  # noqa: E402
from flashlet.models.quantization import (quantize_weight, scaled_mm_fits, scaled_mm_linear,  # noqa: E402
                                   weight_only_linear)

# [N, K]: Qwen2.5-0.5B's QKV, O, gate-up, down, up alone; Qwen2.5-7B's QKV, O, gate-up, down.
SHAPES = ["1152x896", "896x896", "9728x896", "896x4864", "4864x896",
          "4608x3584", "3584x3584", "37888x3584", "3584x18944"]
SWEEP = ([GemmTile(16, bn, bk, 4, s) for bn in (32, 64, 128) for bk in (128, 256) for s in (3, 4)]
         + [GemmTile(16, 64, 128, 2, 4), GemmTile(bit_widen=False),  # Triton's own widening
            GemmTile(64, 64, 128, 4, 4), GemmTile(64, 128, 128, 8, 3)])  # for rows above 16
# --split-sweep: the one-pass tiles (BLOCK_M 16) against every K split 1..MAX_SPLIT_K
SPLIT_SWEEP_TILES = [GemmTile(16, bn, bk, w, s) for bn in (16, 32, 64, 128) for bk in (128, 256)
                     for w, s in ((4, 3), (4, 4), (8, 3)) if not (bn == 16 and w == 8)]
# --bf16-weights: tiles of many rows (one row tile holds all of a decode-sat step's 128)
BF16_SWEEP_TILES = [GemmTile(bm, bn, bk, w, st, bit_widen=False) for bm in (64, 128)
                    for bn in (32, 64, 128) for bk in (64, 128) for w, st in ((4, 3), (8, 3), (4, 4))
                    if not (bm == 128 and bn == 128 and w == 4)]
BF16_SPLITS = (1, 2, 4, 8)
L2_FLUSH_BYTES = 256 << 20  # weights touched per replay: well over an H200's 50 MB L2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="NxK projection shapes")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 64, 128, 256])
    p.add_argument("--sweep", action="store_true",
                   help="time the triton kernel at each tile in SWEEP")
    p.add_argument("--split-sweep", action="store_true",
                   help="time the triton kernel at each SPLIT_SWEEP_TILES tile and K split "
                        "(1..MAX_SPLIT_K) and print each shape's fastest against the default")
    p.add_argument("--bf16-weights", action="store_true",
                   help="time the kernel on bf16 weights (scale ones) at each BF16_SWEEP_TILES "
                        "tile and K split against cuBLAS, and print each shape's fastest")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def time_graph(fn, copies: int) -> float:
    """Microseconds per call of fn(i) for i in range(copies), replayed from one CUDA graph."""
    for i in range(copies):  # compile and allocate outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * copies)


def bench_shape(n: int, k: int, rows: list[int], sweep: bool) -> list[dict]:
    copies = max(2, -(-L2_FLUSH_BYTES // (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    quantized = [quantize_weight(w) for w in weights]
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        paths = {"bf16": lambda i: F.linear(x, weights[i]),
                 "triton": lambda i: fp8_gemm(x, quantized[i].qweight, quantized[i].scale),
                 "widen+bf16": lambda i: weight_only_linear(x, quantized[i])}
        if scaled_mm_fits(x, quantized[0]):
            paths["scaled_mm"] = lambda i: scaled_mm_linear(x, quantized[i])
        if sweep:
            for tile in SWEEP:
                widen = "" if tile.bit_widen else " cvt"
                name = (f"triton {tile.block_m}x{tile.block_n}x{tile.block_k} "
                        f"w{tile.num_warps} s{tile.num_stages}{widen}")
                paths[name] = lambda i, tile=tile: fp8_gemm(x, quantized[i].qweight,
                                                            quantized[i].scale, tile=tile)
        for name, fn in paths.items():
            us = time_graph(fn, copies)
            weight_bytes = n * k * (2 if name == "bf16" else 1)
            out.append({"shape": f"{n}x{k}", "rows": m, "path": name, "us": us,
                        "weight_GBps": weight_bytes / us / 1e3})
    return out


def split_sweep_shape(n: int, k: int, rows: list[int], top: int = 6) -> list[dict]:
    """Every SPLIT_SWEEP_TILES tile at every K split that leaves each split work; prints the
    fastest `top` per row count against the default launch (split_k_for's split)."""
    import triton

    from flashlet.kernels.fp8_gemv import MAX_SPLIT_K, _sm_count, split_k_for, split_layout

    copies = max(2, -(-L2_FLUSH_BYTES // (n * k)))
    quantized = [quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                 for _ in range(copies)]
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        default_us = time_graph(lambda i: fp8_gemm(x, quantized[i].qweight, quantized[i].scale),
                                copies)
        default_split = split_k_for(m, n, k, _sm_count(None))
        runs = []
        for tile in SPLIT_SWEEP_TILES:
            seen = set()
            for split in range(1, MAX_SPLIT_K + 1):
                real = split_layout(k, split, tile.block_k)[1]
                if real in seen:
                    continue
                seen.add(real)
                us = time_graph(lambda i, t=tile, s=real: fp8_gemm(
                    x, quantized[i].qweight, quantized[i].scale, split_k=s, tile=t), copies)
                runs.append(_tile_run(n, k, m, tile, real, us, n * k,
                                      programs=triton.cdiv(n, tile.block_n) * real))
        _print_fastest(f"{n}x{k} M={m}: default (split {default_split}) {default_us:.2f} us "
                       f"({n * k / default_us / 1e3:.0f} GB/s); fastest:", runs, top)
        out += [dict(r, default_us=default_us, default_split=default_split) for r in runs]
    return out


def _tile_run(n: int, k: int, m: int, tile: GemmTile, split: int, us: float, weight_bytes: int,
              **extra) -> dict:
    """One timed launch of a sweep, as its JSON record."""
    return {"shape": f"{n}x{k}", "rows": m, "block_m": tile.block_m, "block_n": tile.block_n,
            "block_k": tile.block_k, "num_warps": tile.num_warps, "num_stages": tile.num_stages,
            "split": split, "us": us, "weight_GBps": weight_bytes / us / 1e3, **extra}


def _print_fastest(header: str, runs: list[dict], top: int) -> None:
    """A sweep's header line, then its `top` fastest launches (sorts `runs` in place)."""
    runs.sort(key=lambda r: r["us"])
    print(header)
    for r in runs[:top]:
        programs = f" programs {r['programs']}" if "programs" in r else ""
        print(f"  {r['us']:6.2f} us ({r['weight_GBps']:5.0f} GB/s)  {r['block_m']}x{r['block_n']}"
              f"x{r['block_k']} w{r['num_warps']} s{r['num_stages']} split {r['split']:2d}{programs}",
              flush=True)


def bf16_sweep_shape(n: int, k: int, rows: list[int], top: int = 6) -> list[dict]:
    """The kernel on bf16 weights (scale ones) at every BF16_SWEEP_TILES tile and split in
    BF16_SPLITS against F.linear (cuBLAS); prints the fastest `top` per row count."""
    from flashlet.kernels.fp8_gemv import split_layout

    copies = max(2, -(-L2_FLUSH_BYTES // (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    ones = torch.ones(n, device="cuda", dtype=torch.float32)
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cublas_us = time_graph(lambda i: F.linear(x, weights[i]), copies)
        runs = []
        for tile in BF16_SWEEP_TILES:
            for split in sorted({split_layout(k, s, tile.block_k)[1] for s in BF16_SPLITS}):
                us = time_graph(lambda i, t=tile, s=split: fp8_gemm(x, weights[i], ones,
                                                                    split_k=s, tile=t), copies)
                runs.append(_tile_run(n, k, m, tile, split, us, 2 * n * k, cublas_us=cublas_us))
        _print_fastest(f"{n}x{k} M={m}: cuBLAS {cublas_us:.2f} us "
                       f"({2 * n * k / cublas_us / 1e3:.0f} GB/s); fastest of ours:", runs, top)
        out += runs
    return out


def table(results: list[dict]) -> str:
    paths = list(dict.fromkeys(r["path"] for r in results))
    lines = ["| shape N x K | M | " + " | ".join(f"{p} us (GB/s)" for p in paths) + " |",
             "|---" * (2 + len(paths)) + "|"]
    keys = list(dict.fromkeys((r["shape"], r["rows"]) for r in results))
    for shape, m in keys:
        cells = {r["path"]: f"{r['us']:.1f} ({r['weight_GBps']:.0f})" for r in results
                 if r["shape"] == shape and r["rows"] == m}
        lines.append(f"| {shape} | {m} | " + " | ".join(cells.get(p, "-") for p in paths) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_gemm_bench needs a CUDA GPU")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        if args.split_sweep or args.bf16_weights:
            sweep = bf16_sweep_shape if args.bf16_weights else split_sweep_shape
            results += sweep(n, k, args.rows)
            continue
        results += bench_shape(n, k, args.rows, args.sweep)
        print(f"{shape} done", flush=True)
    if not (args.split_sweep or args.bf16_weights):
        print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
