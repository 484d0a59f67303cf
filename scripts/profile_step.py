"""Where a decode step's time goes: wall time per step, CUDA graphs captured, and the top GPU
kernels and host functions of a few steps under torch.profiler.

    python scripts/profile_step.py --backend torch --batch 1 --config qwen2.5-0.5b
    python scripts/profile_step.py --backend triton --batch 8 --fused-decode --fused-parts pdl rope attn \
        --served-rows 8 --timeline     # a fused step of rows past fused_decode.SERVED_ROWS
    python scripts/profile_step.py --backend triton --fused-decode --fused-parts default --prompt-len 1000 \
        --config qwen2.5-1.5b --timeline   # one row as the engine runs it by default
"""

from __future__ import annotations

import argparse
import time

import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.runner import fused_decode
from flashlet.runner.fused_decode import FusedParts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="torch")
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--max-num-pages", type=int, default=4096,
                   help="KV pages (16 tokens each): raise it for many long rows")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="weight quantization (fp8: the weight-only e4m3 GEMMs)")
    # Each off unless given (not the engine's auto): a profile names the variant it shows.
    p.add_argument("--fused-decode", action="store_true", help="the CuTe fused decode path")
    p.add_argument("--fused-parts", nargs="*", default=[], choices=("pdl", "rope", "attn", "default"),
                   help="with --fused-decode: the parts on (the rest off); 'default': each where it "
                        "applies, as the engine chooses")
    p.add_argument("--served-rows", type=int, default=None,
                   help="with --fused-decode: the most rows it serves (fused_decode.SERVED_ROWS, "
                        "the measured choice, by default; up to MAX_ROWS)")
    p.add_argument("--timeline", action="store_true",
                   help="also list one step's GPU kernels in order: start offset, duration, gap")
    args = p.parse_args(argv)
    if args.served_rows is not None:
        if not 1 <= args.served_rows <= fused_decode.MAX_ROWS:
            p.error(f"--served-rows must be in 1..{fused_decode.MAX_ROWS}")
        fused_decode.SERVED_ROWS = args.served_rows
    parts = (FusedParts() if "default" in args.fused_parts
             else FusedParts(**{part: part in args.fused_parts for part in ("pdl", "rope", "attn")}))
    engine = Engine(EngineConfig(config=args.config, backend=args.backend, max_num_pages=args.max_num_pages,
                                 cuda_graph=not args.no_cuda_graph, dtype="bfloat16",
                                 kv_cache_dtype=args.kv_cache_dtype,
                                 quantization=args.quantization,
                                 fused_decode=args.fused_decode),
                    parts if args.fused_decode else None)
    for b in range(args.batch):
        engine.add_request([(b * 7 + i) % 1000 + 1 for i in range(args.prompt_len)],
                           SamplingParams(max_new_tokens=10_000, ignore_eos=True))
    for _ in range(args.steps):  # prefill, then graph captures for the widths ahead
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"## {args.backend} batch {args.batch}: {ms:.3f} ms/step, {args.batch / ms * 1e3:.0f} "
          f"tok/s, graphs captured: {engine.stats()['cuda_graphs']}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.timeline:
        print_timeline(prof, steps=5)


def print_timeline(prof, steps: int) -> None:
    """The last step's kernels in launch order (the profile's kernels split evenly by step):
    where one step's GPU time goes, gaps included."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    last = kernels[len(kernels) - per_step:]
    if not last:
        print("timeline: no GPU kernels recorded")
        return
    t0, prev_end, busy = last[0].time_range.start, last[0].time_range.start, 0.0
    print(f"## one step's {len(last)} kernels: offset us, duration us, gap before us, name")
    by_name: dict[str, list[float]] = {}
    # With PDL a kernel starts early and waits, so durations overlap; what each kernel adds to
    # the step is how much later it ends than the kernel before it (its end delta).
    end_delta: dict[str, list[float]] = {}
    for e in last:
        dur = e.time_range.elapsed_us()
        gap = e.time_range.start - prev_end
        busy += dur
        print(f"{e.time_range.start - t0:9.1f} {dur:8.2f} {gap:7.2f}  {e.name[:90]}")
        end_delta.setdefault(e.name[:60], []).append(e.time_range.end - prev_end)
        prev_end = max(prev_end, e.time_range.end)
        by_name.setdefault(e.name[:60], []).append(dur)
    span = prev_end - t0
    print(f"## span {span:.1f} us, kernels busy {busy:.1f} us ({busy / span:.0%}); per kernel name "
          "(count x mean duration = total; mean end delta = what it adds to the step):")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        deltas = end_delta[name]
        print(f"{len(durs):5d} x {sum(durs) / len(durs):7.2f} us = {sum(durs):8.1f} us"
              f"   end delta {sum(deltas) / len(deltas):6.2f} us = {sum(deltas):7.1f} us  {name}")


if __name__ == "__main__":
    main()
