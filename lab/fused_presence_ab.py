"""Does the fused decode path slow the steps it does not serve (issues 29 and 32)?

    PYTHONPATH=.:$CUTE python lab/fused_presence_ab.py [--config qwen2.5-0.5b-smolvocab]
        [--concurrency 64 256] [--requests-per-stream 8] [--pairs 2] [--json OUT]

On the H200 (session 28), the in-process closed loop at 64 / 256 streams read 34,959-37,858 /
58,989-61,513 tok/s with the CuTe DSL installed and 38,291 / 72,569 without it, on the same
schedule (same steps, no preemption): steps of 64-256 rows and mixed steps, which the fused path
never runs, took longer when it existed. Two causes fit: the DSL's import (its native libraries,
threads, hooks) or something the fused path's set-up leaves behind (its warm-up, graphs,
buffers). This script tells them apart. Each run is a fresh process running the bench's closed
loop (prompts 32-768, 128 new tokens, the server's decode-step bound) at each concurrency, in one
of two modes, alternated over --pairs:

  default    the engine's default: the fused path on where the DSL is importable
  no-fused   fused_decode=False, the DSL still importable (and imported: `cutlass` is loaded
             first, as the default's warm-up does)

and, run with a PYTHONPATH without the DSL (`gpu_run.sh fused-presence` does both), the same
two modes without it. Each run reports tok/s, the mean and p50 step, and the mean wall of an
engine.step() call split by what the step before it launched (with overlap a call returns once
the previous step's tokens are read, so its wall is mostly that step's device time): pure decode
(by rows: up to 16, 17-64, 65+) or mixed (with a prompt chunk).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODES = ("default", "no-fused")


def run_child(args) -> dict:
    """One mode in this process: the closed loop at each concurrency."""
    import numpy as np

    from flashlet import Engine, EngineConfig
    from flashlet.bench.common import make_specs
    from flashlet.bench.workloads import check_counts, run_engine

    if args.mode == "no-fused":
        try:  # imported as the default's warm-up would: only the import differs from no DSL
            import cutlass.cute  # noqa: F401
        except Exception:  # noqa: BLE001 - no DSL on this path: the mode runs without it
            pass
    cfg = dict(backend="triton", dtype="bfloat16", max_num_pages=args.max_num_pages,
               max_decode_step_tokens=args.bound)
    cfg.update(model=args.model) if args.model else cfg.update(config=args.config)
    if args.device:  # the CPU check: the torch backend in fp32
        cfg.update(device=args.device, backend="torch", dtype="float32")
    if args.mode == "no-fused":
        cfg["fused_decode"] = False
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(**cfg))
    start_s = time.perf_counter() - t0
    launched: list[tuple[bool, int]] = []  # per schedule() call: (has a prompt chunk, rows)
    schedule = engine.scheduler.schedule

    def logged_schedule(*a, **k):
        out = schedule(*a, **k)
        chunk = any(r.num_computed_tokens < r.num_prompt_tokens for r, _ in out.scheduled)
        launched.append((chunk, len(out.scheduled)))
        return out

    engine.scheduler.schedule = logged_schedule
    vocab = engine.model_config.vocab_size
    levels = []
    for li, c in enumerate(args.concurrency):
        n = max(args.requests_per_stream * c, 8)
        specs = make_specs(n, (32, 768), (args.max_new_tokens,) * 2, vocab, 0, stream=li + 1)
        launched.clear()
        trace = run_engine(engine, specs, c)
        check_counts(trace, f"c={c}")
        walls = np.array(trace.step_s) * 1e3
        kinds: dict[str, list[float]] = {}
        # call i's wall is mostly the device time of the step launched by call i - 1
        for (chunk, rows), wall in zip(launched[:-1], walls[1:]):
            kind = "mixed" if chunk else ("decode <=16" if rows <= 16 else
                                          "decode 17-64" if rows <= 64 else "decode 65+")
            kinds.setdefault(kind, []).append(float(wall))
        m = trace.metrics(keep_samples=False)
        levels.append({"concurrency": c, "requests": n, "output_tok_s": m["output_tok_s"],
                       "steps": m["num_steps"], "step_ms_mean": float(walls.mean()),
                       "step_ms_p50": float(np.median(walls)), "preemptions": m["num_preemptions"],
                       "by_kind": {k: {"steps": len(v), "mean_ms": float(np.mean(v))}
                                   for k, v in sorted(kinds.items())}})
    return {"mode": args.mode, "dsl_loaded": "cutlass" in sys.modules,
            "fused_path": engine.runner.fused is not None, "start_s": start_s, "levels": levels}


def table(runs: list[dict]) -> list[str]:
    lines = [f"{'run':22} {'c':>4} {'tok/s':>9} {'steps':>6} {'mean ms':>8} {'p50 ms':>7}  by kind: steps x mean ms"]
    for r in runs:
        name = f"{r['mode']}{' +DSL' if r['dsl_loaded'] else ''}{' (fused)' if r['fused_path'] else ''}"
        for lv in r["levels"]:
            kinds = ", ".join(f"{k} {v['steps']} x {v['mean_ms']:.3f}" for k, v in lv["by_kind"].items())
            lines.append(f"{name:22} {lv['concurrency']:4d} {lv['output_tok_s']:9.0f} {lv['steps']:6d} "
                         f"{lv['step_ms_mean']:8.3f} {lv['step_ms_p50']:7.3f}  {kinds}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen2.5-0.5b-smolvocab")
    p.add_argument("--model", default=None, help="a model folder instead of --config's preset")
    p.add_argument("--device", default=None, help="cpu: the script's own check (torch backend, fp32)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--requests-per-stream", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-num-pages", type=int, default=16384)
    p.add_argument("--bound", type=int, default=512, help="max_decode_step_tokens (the server's default on CUDA)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="default", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    runs, ok = [], True
    for _ in range(args.pairs):
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--child", "--mode", mode, "--config", args.config,
                   "--concurrency", *map(str, args.concurrency), "--requests-per-stream",
                   str(args.requests_per_stream), "--max-new-tokens", str(args.max_new_tokens),
                   "--max-num-pages", str(args.max_num_pages), "--bound", str(args.bound)]
            cmd += ["--model", args.model] if args.model else []
            cmd += ["--device", args.device] if args.device else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                ok = False
                print(f"{mode} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
                continue
            runs.append(json.loads(lines[-1]))
    print("\n".join(table(runs)))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
