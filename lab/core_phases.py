"""The same engine parts timed in the server's engine core and in the bench's own process, on
the same closed-loop workload (issue 32: at one stream on the fused path the core's step spent
~0.38 ms on its host against in-process ~0.22, same code and requests; which part is slower,
and is every step slower or a few much slower?).

    PYTHONPATH=. python lab/core_phases.py --out DIR [--concurrency 1] [--tokenizer .tok/smollm2] \
        -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 --max-num-pages 16384

1. `python lab/core_phases.py bench ...` runs `flashlet.bench` (in-process closed loop) with the
   parts of its Engine timed (lab/host_phases.py's PartTimer) and each step's host and device
   wait recorded;
2. `python lab/core_phases.py server ...` runs `flashlet.server` from this file, so its spawned
   processes import this file too (multiprocessing's spawn re-imports the main module): the
   engine core's Engine gets the same timers, and its loop's receive / add / send parts their
   own; the bench's client (`flashlet.bench --url`, untimed) runs the workload twice, the second
   run is the one read;
3. one table: each part's calls a step and us a call on both sides, each side's CPU speed as
   it went (a fixed bit of Python timed at each flush: the H200 machine's vCPUs differ ~2x, and
   a process's speed changes within seconds), then each side's 1-row steps' host time (the
   step less its wait on the device) and wait at p10 / p50 / p90 / p99.

The timers cost ~0.5 us a call on both sides alike. Records go to DIR/<side>-<pid>.jsonl: every
0.5 s of steps (and when the engine goes idle) the parts' running totals and the new steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RECORDS_ENV = "CORE_PHASES_OUT"  # the folder records go to; set: the timers are installed
FLUSH_S = 0.5
CORE_LOOP_PARTS = ("run_once", "_receive", "_add_queued", "_step", "_send")
_recorder: "StepRecorder | None" = None  # this process's latest timed Engine (install)


def cpu_probe_us() -> float:
    """This process's CPU speed now: the best of three runs of a fixed bit of Python (dicts,
    lists, ints: the engine's host work in miniature), us. On the H200 machine one vCPU reads
    ~35 us and another ~65, and which is which changes within seconds."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(400):
            row = {"slot": i, "tokens": [i, i + 1, i + 2]}
            total += row["slot"] + len(row["tokens"])
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


class StepRecorder:
    """Wraps an Engine: its parts timed (PartTimer), each step's (time, host s, wait s, rows)
    kept, all flushed to a JSONL file every FLUSH_S of steps and when the engine goes idle."""

    def __init__(self, engine, side: str, folder: str):
        from lab.host_phases import PartTimer

        self.engine, self.timer = engine, PartTimer(engine)
        self.path = Path(folder) / f"{side}-{os.getpid()}.jsonl"
        self.steps: list[tuple[float, float, float, int]] = []
        self.last_flush = time.monotonic()
        inner = engine.step

        def step():
            wait0, t0 = engine.device_wait_s, time.perf_counter()
            outs = inner()
            took = time.perf_counter() - t0
            wait = engine.device_wait_s - wait0
            self.steps.append((time.time(), took - wait, wait, len(outs)))
            now = time.monotonic()
            if now - self.last_flush > FLUSH_S or not engine.has_unfinished():
                self.flush(now)
            return outs
        engine.step = step

    def time_methods(self, obj, names) -> None:
        """Time `obj`'s own methods too (the engine core's loop parts), as `core.<name>`."""
        for name in names:
            setattr(obj, name, self.timer.timed(f"core.{name}", getattr(obj, name)))

    def flush(self, now: float) -> None:
        record = {"time": time.time(), "probe_us": cpu_probe_us(), "seconds": dict(self.timer.seconds),
                  "calls": dict(self.timer.calls), "steps": self.steps}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.steps = []
        self.last_flush = now


def install(side: str) -> None:
    """Time every Engine this process builds (and the engine core's loop, where it runs)."""
    folder = os.environ[RECORDS_ENV]
    from flashlet.core import engine as engine_module

    init = engine_module.Engine.__init__

    def timed_init(self, *args, **kwargs):
        global _recorder
        init(self, *args, **kwargs)
        _recorder = StepRecorder(self, side, folder)
    engine_module.Engine.__init__ = timed_init
    if side == "core":
        from flashlet.server import engine_core

        core_init = engine_core.EngineCore.__init__

        def timed_core_init(self, *args, **kwargs):
            core_init(self, *args, **kwargs)
            _recorder.time_methods(self, CORE_LOOP_PARTS)
        engine_core.EngineCore.__init__ = timed_core_init


if __name__ == "__mp_main__" and os.environ.get(RECORDS_ENV):  # a process the server spawned
    install("core")


# ---- the driver ---------------------------------------------------------------------------
def read(path: Path, t0: float = 0.0, t1: float = float("inf")) -> dict:
    """A side's records between t0 and t1: parts' totals over the window, its steps."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    inside = [r for r in records if t0 <= r["time"] <= t1]
    if len(inside) < 2:
        raise SystemExit(f"{path}: fewer than two records in the window")
    first, last = inside[0], inside[-1]
    seconds = {k: v - first["seconds"].get(k, 0.0) for k, v in last["seconds"].items()}
    calls = {k: v - first["calls"].get(k, 0) for k, v in last["calls"].items()}
    steps = [s for r in inside[1:] for s in r["steps"]]
    return {"seconds": seconds, "calls": calls, "steps": steps,
            "probes": [r["probe_us"] for r in inside]}


def quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)
    pick = [v[min(len(v) - 1, int(q * len(v)))] * 1e3 for q in (0.1, 0.5, 0.9, 0.99)]
    mean = sum(v) / len(v) * 1e3
    return " / ".join(f"{x:.3f}" for x in pick) + f" (mean {mean:.3f})"


def report(inproc: dict, core: dict) -> str:
    n_in, n_core = len(inproc["steps"]), len(core["steps"])
    lines = [f"steps: in-process {n_in}, core {n_core}", "",
             f"{'part':<34} {'in: calls/step':>14} {'us/call':>8} {'core: calls/step':>16} "
             f"{'us/call':>8} {'core / in':>9}"]
    labels = sorted(set(inproc["seconds"]) | set(core["seconds"]),
                    key=lambda k: -core["seconds"].get(k, inproc["seconds"].get(k, 0.0)))
    for label in labels:
        row = [f"{label:<34}"]
        per_call = []
        for side, n in ((inproc, n_in), (core, n_core)):
            calls, s = side["calls"].get(label, 0), side["seconds"].get(label, 0.0)
            us = s * 1e6 / calls if calls else None
            per_call.append(us)
            width = 14 if side is inproc else 16
            row.append(f"{calls / max(n, 1):{width}.2f} {us if us is not None else 0.0:8.1f}")
        ratio = (f"{per_call[1] / per_call[0]:9.2f}" if per_call[0] and per_call[1] else f"{'-':>9}")
        lines.append(" ".join(row) + " " + ratio)
    lines.append("")
    for name, side in (("in-process", inproc), ("core", core)):
        p = sorted(side["probes"])
        lines.append(f"CPU probe ({name}, every {FLUSH_S} s of steps): min / median / max "
                     f"{p[0]:.0f} / {p[len(p) // 2]:.0f} / {p[-1]:.0f} us ({len(p)} readings)")
    lines.append("1-row steps, ms at p10 / p50 / p90 / p99:")
    for name, side in (("in-process", inproc), ("core", core)):
        one = [s for s in side["steps"] if s[3] == 1]
        lines.append(f"  {name:<10} host {quantiles([s[1] for s in one])}; "
                     f"wait {quantiles([s[2] for s in one])}; {len(one)} steps")
    return "\n".join(lines)


def workload_flags(args) -> list[str]:
    return ["--workload", "closed-loop", "--concurrency", *map(str, args.concurrency),
            "--max-new-tokens", str(args.max_new_tokens), "--prompt-len-range", "32", "768",
            "--num-requests", str(args.requests), "--quiet"]


def drive(args, engine_flags: list[str]) -> None:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    env = {**os.environ, RECORDS_ENV: str(out)}
    me = [sys.executable, str(Path(__file__).resolve())]
    subprocess.run([*me, "bench", *engine_flags, *workload_flags(args),
                    "--out", str(out / "inprocess.json")], env=env, check=True, timeout=args.timeout)
    from scripts.serve_compare import _free_port, serving

    url = f"http://127.0.0.1:{_free_port()}"
    flags = [*engine_flags, "--port", url.rsplit(":", 1)[1], "--no-access-log",
             "--max-waiting", "100000"]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    with serving([*me, "server", *flags], url, out / "server.log", args.timeout, env=env):
        client = [sys.executable, "-m", "flashlet.bench", "--url", url, *workload_flags(args)]
        subprocess.run([*client, "--out", str(out / "server-warm.json")], check=True,
                       timeout=args.timeout)
        t0 = time.time()
        subprocess.run([*client, "--out", str(out / "server.json")], check=True, timeout=args.timeout)
        t1 = time.time()
    (inproc_path,) = out.glob("inprocess-*.jsonl")
    (core_path,) = out.glob("core-*.jsonl")
    for name in ("inprocess.json", "server.json"):
        record = json.loads((out / name).read_text())
        results = record.get("results") or next(iter(record["backends"].values()))
        for level in results["levels"]:
            print(f"{name}: c = {level['concurrency']}: {level['output_tok_s']:,.0f} output tok/s, "
                  f"TTFT p50 {level['ttft_ms']['p50']:.2f} ms, ITL p50 / p99 "
                  f"{level['itl_ms']['p50']:.3f} / {level['itl_ms']['p99']:.3f} ms")
    print(report(read(inproc_path), read(core_path, t0, t1)))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("bench", "server"):
        side, argv = sys.argv[1], sys.argv[2:]
        if side == "bench":
            install("inprocess")
            from flashlet.bench.cli import main as bench_main

            sys.exit(bench_main(argv))
        from flashlet.server.cli import main as server_main

        sys.exit(server_main(argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("engine_flags", nargs=argparse.REMAINDER)
    args = p.parse_args()
    flags = args.engine_flags[1:] if args.engine_flags[:1] == ["--"] else args.engine_flags
    drive(args, flags)


if __name__ == "__main__":
    main()
