"""Where a decode step's time goes: wall time per step, CUDA graphs captured, and the top GPU
kernels and host functions of a few steps under torch.profiler.

    python scripts/profile_step.py --backend torch --batch 1 --config qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import time

import torch

from flashlet import Engine, EngineConfig, SamplingParams


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="torch")
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--rows", type=int, default=12)
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(config=args.config, backend=args.backend, max_num_pages=4096,
                                 cuda_graph=not args.no_cuda_graph, dtype="bfloat16"))
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


if __name__ == "__main__":
    main()
