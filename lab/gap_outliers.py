"""Which steps make the long-prompt-gaps workload's token-gap tail (issue 32)?

    PYTHONPATH=. python lab/gap_outliers.py [--config qwen2.5-0.5b] [--streams 64]
        [--long 8 --long-len 8000] [--bound 512] [--top 12]

Runs `flashlet.bench --workload long-prompt-gaps`'s sequence in-process with the server's
decode-step bound (64 streams decoding, then eight 8,000-token prompts added at once, stepped
until each has its first token) and records, per engine.step(): its wall time, the time inside
the scheduler's schedule(), and what it scheduled (decode rows, prompt tokens, requests that
finished, Triton kernels compiled or loaded, CUDA graphs captured, device / pinned host allocations). Prints the step-time distribution in the window and the slowest steps with their
neighbours: a tail made by a few steps of one kind (the arrival, a finish, a capture) or by the
chunks' cost growing along a long prompt tells which lever to pull.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
import traceback
import warnings

import numpy as np
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.core.warmup import count_triton_compiles


def allocations() -> tuple[int, int]:
    """(device allocations, pinned host allocations) made so far: each is a cudaMalloc or
    cudaHostAlloc that a cached block did not serve (either may wait for the device)."""
    if not torch.cuda.is_available():
        return 0, 0
    device = torch.cuda.memory_stats().get("num_device_alloc", 0)
    host = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    return device, host


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="triton")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-prompt", type=int, default=128)
    p.add_argument("--long", type=int, default=8)
    p.add_argument("--long-len", type=int, default=8000)
    p.add_argument("--bound", type=int, default=512)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--rounds", type=int, default=1,
                   help="the long prompts' window this many times in one process (a first-time "
                        "cost shows in the first only)")
    p.add_argument("--sync-debug", action="store_true",
                   help="report each implicit device synchronization in the window, with its step "
                        "and stack (torch.cuda.set_sync_debug_mode)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-overlap: each step's wall time is its own host and device time")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)9.0f ms %(name)s: %(message)s")
    cfg = dict(config=args.config, backend=args.backend, dtype=args.dtype,
               max_decode_step_tokens=args.bound, overlap=args.overlap)
    if args.device:
        cfg["device"] = args.device
    engine = Engine(EngineConfig(**cfg))
    vocab = min(engine.model_config.vocab_size, 30000)
    rng = random.Random(0)
    sched = engine.scheduler
    schedule = sched.schedule
    log: list[dict] = []

    def timed_schedule(*a, **k):
        t0 = time.perf_counter()
        out = schedule(*a, **k)
        dt = time.perf_counter() - t0
        decodes = sum(1 for r, n in out.scheduled if r.num_computed_tokens >= r.num_prompt_tokens)
        log.append({"schedule_ms": dt * 1e3, "rows": len(out.scheduled), "decodes": decodes,
                    "tokens": sum(n for _, n in out.scheduled)})
        return out

    sched.schedule = timed_schedule
    stream_tokens = 4000
    for _ in range(args.streams):
        engine.add_request([rng.randrange(2, vocab) for _ in range(args.stream_prompt)],
                           SamplingParams(max_new_tokens=stream_tokens, ignore_eos=True))
    while engine.stats()["waiting"] or engine.num_decoding() < args.streams:
        engine.step()
    for _ in range(50):
        engine.step()
    for round_ in range(args.rounds):
        steps, add_ms = long_prompts_window(engine, args, rng, vocab, log)
        print_window(steps, add_ms, args, f"round {round_ + 1} of {args.rounds}")
    return 0


def long_prompts_window(engine, args, rng, vocab: int, log: list[dict]) -> tuple[list[dict], float]:
    """Add the long prompts at once and step until each has its first token: one entry a step."""
    steps: list[dict] = []
    longs = [[rng.randrange(2, vocab) for _ in range(args.long_len)] for _ in range(args.long)]
    t0 = time.perf_counter()
    ids = {engine.add_request(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
           for ids in longs}
    add_ms = (time.perf_counter() - t0) * 1e3
    if args.sync_debug:
        def show(message, category, filename, lineno, file=None, line=None):
            where = "".join(traceback.format_stack(limit=9)[:-2])
            print(f"step {len(steps)}: {message}\n{where}")
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
    done: set[int] = set()
    while len(done) < len(ids):
        log.clear()
        graphs, allocs = len(engine.runner.graphs), allocations()
        with count_triton_compiles() as compiles:
            t0 = time.perf_counter()
            outs = engine.step()
            wall = (time.perf_counter() - t0) * 1e3
        finished = [o.request_id for o in outs if o.request_id in ids and o.new_token_ids]
        done.update(finished)
        entry = {"wall_ms": wall, "finished": len(finished), "compiles": compiles.count or 0,
                 "names": compiles.names, "captures": len(engine.runner.graphs) - graphs,
                 "allocs": tuple(b - a for a, b in zip(allocs, allocations())),
                 "stream_tokens":
                 sum(1 for o in outs if o.request_id not in ids and o.new_token_ids)}
        entry.update(log[-1] if log else {"schedule_ms": 0.0, "rows": 0, "decodes": 0, "tokens": 0})
        steps.append(entry)
    if args.sync_debug:
        torch.cuda.set_sync_debug_mode("default")
    return steps, add_ms


def print_window(steps: list[dict], add_ms: float, args, title: str) -> None:
    wall = np.array([s["wall_ms"] for s in steps])
    print(f"\n== {title}: add_request of {args.long} x {args.long_len} tokens: {add_ms:.2f} ms "
          f"(in the gap before step 0)")
    print(f"{len(steps)} steps in the window: wall p50 {np.percentile(wall, 50):.2f}, p90 "
          f"{np.percentile(wall, 90):.2f}, p99 {np.percentile(wall, 99):.2f}, max {wall.max():.2f} ms")
    print(f"\n{'step':>5} {'wall ms':>8} {'sched ms':>9} {'rows':>5} {'decodes':>8} "
          f"{'tokens':>7} {'finished':>9} {'stream tokens out':>18} {'compiles':>9} {'captures':>9} {'allocs':>7}")
    for i in sorted(np.argsort(wall)[-args.top:]):
        for j in (i - 1, i, i + 1):
            if 0 <= j < len(steps):
                s = steps[j]
                mark = "*" if j == i else " "
                print(f"{j:>4}{mark} {s['wall_ms']:8.2f} {s['schedule_ms']:9.2f} {s['rows']:5d} "
                      f"{s['decodes']:8d} {s['tokens']:7d} {s['finished']:9d} {s['stream_tokens']:18d} "
                      f"{s['compiles']:9d} {s['captures']:9d} {s['allocs'][0]:3d}/{s['allocs'][1]:<3d} "
                      f"{' '.join(s['names'])[:60]}")
        print()


if __name__ == "__main__":
    raise SystemExit(main())
