"""Tune the Triton attention kernels per shape on this GPU; print the tables of kernels/tuning.py.

    python scripts/tune_triton.py [--budget-s 240] [--shapes tinyllama-1.1b qwen2.5-7b ...]
                                  [--smoke] [--plan] [--json out.json]

For every model shape (head_dim, q heads, KV heads) and every bucket of `tuning.py`:
- decode (batch = the bucket's largest size; contexts 128, 1024, 8192): stage 1 times each tile
  (BLOCK_N, warps, stages) with the default split rule; stage 2 times the best tile with every
  split count `waves` gives and every smallest split. The score of a config is the geometric
  mean of its times over the contexts (one config must serve every context: a CUDA graph
  captured for a batch size is replayed at any KV length).
- prefill (the short-chunk bucket: mixed steps of 1- and 8-token chunks; the long bucket: 4 x
  1024-token prompts and one 2048-token chunk after 6144 cached tokens): every tile.
Each call is timed replayed from a CUDA graph of `--calls` launches, each over another layer's
K/V where memory allows (so small cases do not all run out of L2), median of `--reps`
replays. Every tile is checked against the plain PyTorch reference first (bf16 tolerance); one
that fails is dropped. FlashInfer (the FA2 kernel flashlet's backend runs, same graphs) is
timed at the same decode and prefill cases: its kernels-alone comparison per step kind, in
`BACKEND_PREFERENCE`'s form (whose entries are the engine's measurements, tuning.py).

Prints a table per shape (best config, its time, the current default's, FlashInfer's), then
DECODE_TABLE / PREFILL_TABLE / BACKEND_PREFERENCE as Python literals for kernels/tuning.py.
`--budget-s` bounds the sweep: shapes not started when it runs out are skipped (named).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter, for tests

from flashlet.kernels import tuning  # noqa: E402
from flashlet.kernels.tuning import DecodeConfig, PrefillConfig  # noqa: E402

# name -> (head_dim, q heads, KV heads); the three shapes first (a budget cut hits the others).
SHAPES = {
    "tinyllama-1.1b": (64, 32, 4),
    "qwen2.5-1.5b": (128, 12, 2),
    "qwen2.5-7b": (128, 28, 4),
    "qwen2.5-0.5b": (64, 14, 2),
    "llama-3.2-1b": (64, 32, 8),
    "qwen3-0.6b": (128, 16, 8),
}
DECODE_TILES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2)]  # BLOCK_N, warps, stages
WAVES = (1, 2, 4, 8)
MIN_SPLITS = (64, 128, 256)
CONTEXTS = (128, 1024, 8192)
PREFILL_TILES = {  # bucket -> (BLOCK_M, BLOCK_N, warps, stages)
    "short": [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2)],
    "long": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 4, 3)],
}
PREFILL_SPECS = {  # bucket -> the cases timed: lists of (new tokens, KV length) per sequence
    "short": [[(8, 1024)] * 64, [(1, 512)] * 127 + [(16, 512)]],
    "long": [[(1024, 1024)] * 4, [(2048, 8192)]],
}
PAGE = 16
MAX_SPLITS = 64
POOL_BUDGET_BYTES = 16 << 30  # K/V of all "layers" of one case


# ---- the plan: pure functions, checked on the CPU --------------------------------------
def decode_candidates(batch: int, hkv: int, num_sms: int, tile: tuple) -> list[DecodeConfig]:
    """Stage 2 of one bucket: every distinct (split count, smallest split) for the tile."""
    seen, out = set(), []
    for waves in WAVES:
        s = tuning.num_splits(batch, hkv, num_sms, waves, MAX_SPLITS)
        for m in MIN_SPLITS if s > 1 else (128,):
            if (s, m) not in seen:
                seen.add((s, m))
                bn, w, st = tile
                out.append(DecodeConfig(block_n=bn, num_warps=w, num_stages=st, min_split_tokens=m, waves=waves))
    return out


def geomean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("inf")


def best(scored: dict) -> tuple:
    """(config, score) with the smallest score; ties to the first."""
    return min(scored.items(), key=lambda kv: kv[1])


def table_literals(decode: dict, prefill: dict, preference: dict) -> str:
    """The three tables as Python source for kernels/tuning.py."""
    lines = ["DECODE_TABLE: dict[tuple[int, int, int], DecodeConfig] = {"]
    for key in sorted(decode):
        lines.append(f"    {key}: {decode[key]!r},")
    lines += ["}", "PREFILL_TABLE: dict[tuple[int, int, int], PrefillConfig] = {"]
    for key in sorted(prefill):
        lines.append(f"    {key}: {prefill[key]!r},")
    lines += ["}", "BACKEND_PREFERENCE: dict[tuple[int, int, str], str] = {"]
    for key in sorted(preference):
        lines.append(f"    {key}: {preference[key]!r},")
    lines.append("}")
    return "\n".join(lines)


def count_plan(shapes: dict, buckets, num_sms: int) -> dict:
    """How many timings and compiled main-kernel variants the sweep needs (printed by --plan)."""
    timings = compiles = 0
    for _, (d, hq, hkv) in shapes.items():
        compiles += 2 * len(DECODE_TILES) + sum(len(t) for t in PREFILL_TILES.values())
        for b in buckets:
            timings += len(CONTEXTS) * (len(DECODE_TILES) + len(decode_candidates(b, hkv, num_sms, DECODE_TILES[0])))
        timings += 2 * sum(len(t) for t in PREFILL_TILES.values())
    return {"timings": timings, "main_kernel_compiles": compiles}


# ---- measuring (CUDA) -------------------------------------------------------------------
class Bench:
    def __init__(self, calls: int, reps: int):
        self.calls, self.reps = calls, reps

    def safe_us(self, make_fns, what: str) -> float:
        """time_us(make_fns()), or inf (and a note) when the config fails to compile or run."""
        try:
            return self.time_us(make_fns())
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: the config is out
            print(f"  ! {what}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            return float("inf")

    def time_us(self, fns) -> float:
        """Median µs per call of fns (a list, one per layer, cycled) replayed from a graph."""
        fns[0]()  # compile, allocate
        if not torch.cuda.is_available():  # the CPU check of this script: wall clock, no graph
            t0 = time.perf_counter()
            for i in range(self.calls):
                fns[i % len(fns)]()
            return (time.perf_counter() - t0) * 1e6 / self.calls
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.calls):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
        start, end, times = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
        for _ in range(self.reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.calls)
        del graph
        return statistics.median(times)


class Case:
    """One attention problem: `layers` pools of K/V, scattered pages, q; seqs of (q_len, kv_len)."""

    def __init__(self, seqs, hq, hkv, d, dtype, gen, calls):
        self.seqs, self.hq, self.hkv, self.d = seqs, hq, hkv, d
        pages_per = [-(-kv // PAGE) for _, kv in seqs]
        num_pages = sum(pages_per) + 1
        per_layer = 2 * num_pages * PAGE * hkv * d * 2
        self.layers = max(1, min(calls, POOL_BUDGET_BYTES // per_layer))
        dev = DEVICE
        self.k = torch.empty(self.layers, num_pages, PAGE, hkv, d, dtype=dtype, device=dev).normal_(generator=gen)
        self.v = torch.empty_like(self.k).normal_(generator=gen)
        perm = torch.randperm(num_pages - 1, device=dev, generator=gen).to(torch.int32)
        i32 = dict(dtype=torch.int32, device=dev)
        self.kv_indptr = torch.tensor([0] + list(itertools_accumulate(pages_per)), **i32)
        self.kv_indices = perm[: sum(pages_per)].contiguous()
        self.kv_lens = torch.tensor([kv for _, kv in seqs], **i32)
        self.last = torch.tensor([kv - (p - 1) * PAGE for (_, kv), p in zip(seqs, pages_per)], **i32)
        self.qo_host = [0] + list(itertools_accumulate([q for q, _ in seqs]))
        self.qo = torch.tensor(self.qo_host, **i32)
        self.max_q = max(q for q, _ in seqs)
        self.q = torch.empty(self.qo_host[-1], hq, d, dtype=dtype, device=dev).normal_(generator=gen)
        self.out = torch.empty_like(self.q)
        self.scale = d**-0.5


def itertools_accumulate(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def triton_decode_fns(case: Case, cfg: DecodeConfig, num_sms: int):
    from flashlet.kernels.decode_attention import decode_attention

    b = len(case.seqs)
    s = tuning.num_splits(b, case.hkv, num_sms, cfg.waves, MAX_SPLITS)
    mid_o = torch.empty(b * s, case.hq, case.d, dtype=torch.float32, device=DEVICE) if s > 1 else None
    mid_lse = torch.empty(b * s, case.hq, dtype=torch.float32, device=DEVICE) if s > 1 else None

    def fn(layer):
        return lambda: decode_attention(
            case.q, case.k[layer], case.v[layer], case.kv_indptr, case.kv_indices, case.kv_lens, case.scale,
            out=case.out, num_splits=s, min_split_tokens=cfg.min_split_tokens, block_n=cfg.block_n,
            mid_o=mid_o, mid_lse=mid_lse, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    return [fn(i) for i in range(case.layers)]


def triton_prefill_fns(case: Case, cfg: PrefillConfig):
    from flashlet.kernels.prefill_attention import prefill_attention

    def fn(layer):
        return lambda: prefill_attention(
            case.q, case.k[layer], case.v[layer], case.qo, case.kv_indptr, case.kv_indices, case.kv_lens,
            case.scale, out=case.out, block_m=cfg.block_m, block_n=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    return [fn(i) for i in range(case.layers)]


def flashinfer_fns(case: Case, workspace):
    """As flashlet's FlashInfer backend runs: the FA2 ragged prefill wrapper, graph buffers."""
    import flashinfer

    b = len(case.seqs)
    i32 = dict(dtype=torch.int32, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(b + 1, **i32),
        paged_kv_indptr_buf=torch.zeros(b + 1, **i32),
        paged_kv_indices_buf=torch.zeros(case.kv_indices.numel(), **i32),
        paged_kv_last_page_len_buf=torch.zeros(b, **i32), backend="fa2")
    w.plan(torch.tensor(case.qo_host, dtype=torch.int32), case.kv_indptr.cpu(), case.kv_indices,
           case.last.cpu(), case.hq, case.hkv, case.d, PAGE, causal=True, sm_scale=case.scale,
           q_data_type=case.q.dtype, kv_data_type=case.k.dtype, max_token_per_sequence=case.max_q,
           seq_lens=case.kv_lens.cpu())
    return [(lambda layer=i: w.run(case.q, (case.k[layer], case.v[layer]))) for i in range(case.layers)]


def check(fns, reference, what: str) -> bool:
    try:
        got = fns[0]().float()
    except Exception as e:  # noqa: BLE001 - a config that does not compile is dropped
        print(f"  ! {what}: {type(e).__name__}: {str(e)[:160]}: dropped", flush=True)
        return False
    err = (got - reference).abs().max().item()
    ok = err < 3e-2 * max(1.0, reference.abs().max().item())
    if not ok:
        print(f"  ! {what}: max error {err:.3g} against the reference: dropped", flush=True)
    return ok


def reference_out(case: Case) -> torch.Tensor:
    from flashlet.kernels.prefill_attention import prefill_attention_reference

    return prefill_attention_reference(case.q, case.k[0], case.v[0], case.qo, case.kv_indptr, case.kv_indices,
                                       case.kv_lens, case.scale).float()


def tune_shape(name, d, hq, hkv, args, bench, num_sms, gen, workspace, dtype):
    group = hq // hkv
    rows, decode_entries, prefill_entries = [], {}, {}
    tri_all, fi_all = {"decode": [], "prefill": []}, {"decode": [], "prefill": []}
    # Correctness of every tile first, on a small ragged case (lengths 1, 200, 1000).
    small = Case([(1, n) for n in args.check_lens], hq, hkv, d, dtype, gen, 1)
    ref = reference_out(small)
    tiles = [t for t in args.tiles if check(
        triton_decode_fns(small, DecodeConfig(block_n=t[0], num_warps=t[1], num_stages=t[2], min_split_tokens=64,
                                              waves=8), num_sms), ref, f"{name} decode tile {t} (split)")
        and check(triton_decode_fns(small, DecodeConfig(block_n=t[0], num_warps=t[1], num_stages=t[2], waves=1),
                                    num_sms=1), ref, f"{name} decode tile {t}")]
    for b in args.buckets:
        cases = {ctx: Case([(1, ctx)] * b, hq, hkv, d, dtype, gen, args.calls) for ctx in args.contexts}
        default = tuning.default_decode(d, group, b)

        def score(cfg):
            return [bench.safe_us(lambda: triton_decode_fns(c, cfg, num_sms), f"decode {cfg}") for c in cases.values()]

        stage1 = {DecodeConfig(block_n=t[0], num_warps=t[1], num_stages=t[2]): None for t in tiles}
        times = {cfg: score(cfg) for cfg in stage1}
        tile_best, _ = best({c: geomean(t) for c, t in times.items()})
        for cfg in decode_candidates(b, hkv, num_sms, (tile_best.block_n, tile_best.num_warps, tile_best.num_stages)):
            if cfg not in times:
                times[cfg] = score(cfg)
        if default not in times:
            times[default] = score(default)
        winner, _ = best({c: geomean(t) for c, t in times.items()})
        fi = [bench.safe_us(lambda: flashinfer_fns(c, workspace), "flashinfer") for c in cases.values()] \
            if workspace is not None else None
        decode_entries[(d, group, b)] = winner
        tri_all["decode"] += times[winner]
        fi_all["decode"] += fi or []
        rows.append(("decode", b, winner, times[winner], times[default], fi))
        del cases
    for bucket_name, bucket in (("short", tuning.PREFILL_QLEN_BUCKETS[0]), ("long", tuning.PREFILL_QLEN_BUCKETS[-1])):
        cases = [Case(s, hq, hkv, d, dtype, gen, args.calls) for s in args.prefill_specs[bucket_name]]
        small_ref = Case(args.prefill_check, hq, hkv, d, dtype, gen, 1)
        sref = reference_out(small_ref)
        times = {}
        for t in args.prefill_tiles[bucket_name]:
            cfg = PrefillConfig(*t)
            if check(triton_prefill_fns(small_ref, cfg), sref, f"{name} prefill {t}"):
                times[cfg] = [bench.safe_us(lambda: triton_prefill_fns(c, cfg), f"prefill {cfg}") for c in cases]
        default = tuning.default_prefill(d, group, bucket)
        if default not in times:
            times[default] = [bench.safe_us(lambda: triton_prefill_fns(c, default), f"prefill {default}") for c in cases]
        winner, _ = best({c: geomean(t) for c, t in times.items()})
        fi = [bench.safe_us(lambda: flashinfer_fns(c, workspace), "flashinfer") for c in cases] \
            if workspace is not None else None
        prefill_entries[(d, group, bucket)] = winner
        tri_all["prefill"] += times[winner]
        fi_all["prefill"] += fi or []
        rows.append(("prefill", bucket_name, winner, times[winner], times[default], fi))
        del cases
    # Triton's time over FlashInfer's per step kind (None without FlashInfer)
    ratio = {kind: geomean(tri_all[kind]) / geomean(fi_all[kind]) for kind in fi_all if fi_all[kind]} or None
    return rows, decode_entries, prefill_entries, ratio


def fmt_times(ts) -> str:
    return "-" if ts is None else " ".join(f"{t:7.1f}" for t in ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new shapes after this")
    p.add_argument("--calls", type=int, default=10, help="launches per graph replay")
    p.add_argument("--reps", type=int, default=5, help="replays timed per config (median)")
    p.add_argument("--smoke", action="store_true", help="one shape, two buckets, two contexts, two tiles")
    p.add_argument("--plan", action="store_true", help="print the sweep's size and exit (no GPU needed)")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--json", type=Path, help="also write every measurement here")
    args = p.parse_args(argv)
    args.buckets, args.contexts = list(tuning.DECODE_BATCH_BUCKETS), list(CONTEXTS)
    args.tiles, args.prefill_tiles, args.prefill_specs = DECODE_TILES, PREFILL_TILES, PREFILL_SPECS
    args.check_lens, args.prefill_check = (1, 200, 1000), [(5, 40), (16, 16), (1, 300)]
    if args.smoke:
        args.shapes, args.buckets, args.contexts = args.shapes[:1], [1, 64], [128, 1024]
        args.tiles = DECODE_TILES[2:4]
        args.prefill_tiles = {k: v[-2:] for k, v in PREFILL_TILES.items()}
    shapes = {n: SHAPES[n] for n in args.shapes}
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    if args.plan:
        print(json.dumps({"shapes": shapes, "buckets": args.buckets, "contexts": args.contexts,
                          **count_plan(shapes, args.buckets, num_sms)}))
        return 0
    if not torch.cuda.is_available():
        print("tune_triton.py needs a CUDA GPU (use --plan on the CPU)", file=sys.stderr)
        return 2
    workspace = None
    if not args.no_flashinfer:
        try:
            import flashinfer  # noqa: F401

            workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        except ImportError as e:
            print(f"flashinfer not importable ({e}): no backend comparison", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bench = Bench(args.calls, args.reps)
    started = time.perf_counter()
    decode, prefill, preference, record, skipped = {}, {}, {}, {}, []
    print(f"{torch.cuda.get_device_name(0)}, {num_sms} SMs; times in µs per call at contexts "
          f"{args.contexts} (decode) or per case (prefill)", flush=True)
    for name, (d, hq, hkv) in shapes.items():
        if time.perf_counter() - started > args.budget_s:
            skipped.append(name)
            continue
        t0 = time.perf_counter()
        try:
            rows, dec, pre, ratio = tune_shape(name, d, hq, hkv, args, bench, num_sms, gen, workspace, torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - keep the other shapes' results
            print(f"\n{name}: failed: {type(e).__name__}: {e}", flush=True)
            skipped.append(f"{name} (failed)")
            continue
        decode.update(dec)
        prefill.update(pre)
        for kind, r in (ratio or {}).items():
            preference[(d, hq // hkv, kind)] = "triton" if r <= 1.0 else "flashinfer"
        print(f"\n{name} (head_dim {d}, group {hq // hkv}, {hkv} KV heads) in {time.perf_counter() - t0:.0f} s; "
              f"Triton/FlashInfer time ratio per kind {ratio if ratio is None else {k: round(r, 3) for k, r in ratio.items()}}")
        print(f"{'kind':8} {'bucket':>6}  {'best config':70} {'best':>24} | {'default':>24} | {'flashinfer':>24}")
        for kind, b, cfg, t_best, t_def, t_fi in rows:
            print(f"{kind:8} {b!s:>6}  {repr(cfg):70} {fmt_times(t_best):>24} | {fmt_times(t_def):>24} | {fmt_times(t_fi):>24}")
        record[name] = [dict(kind=k, bucket=b, config=asdict(c), best_us=tb, default_us=td, flashinfer_us=tf)
                        for k, b, c, tb, td, tf in rows]
        sys.stdout.flush()
    print(f"\n# sweep took {time.perf_counter() - started:.0f} s" +
          (f"; skipped (budget): {', '.join(skipped)}" if skipped else ""))
    print("# paste into flashlet/kernels/tuning.py:")
    print(table_literals(decode, prefill, preference))
    if args.json:
        args.json.write_text(json.dumps({"shapes": record, "skipped": skipped,
                                         "preference": {str(k): v for k, v in preference.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
