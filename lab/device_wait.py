"""Is a workload's step paced by the host or by the device? From bench JSON files (`python -m
flashlet.bench --out`, `scripts/serve_compare.py --out`), each level's or run's mean step and
the part of it the host spent blocked reading the step's tokens (`Engine.device_wait_s`, as
`device_wait_ms`; the server's core: `server_diag`'s `device_wait_ms_mean`), with the core's
CPU busy and preemptions a second where the server reports them, and the machine's CPUs busy
and stolen by the hypervisor (`machine_cpu`) (issue 32: the server's steps at 64-256 streams
ran slower than in-process by a margin that changed from run to run).

    python lab/device_wait.py out/decode-sat.json out/serve/inprocess.json out/serve/server.json

With overlap on, a step whose wait is near its mean was paced by the device; one whose wait is
near 0, by its host (the device idled while the host prepared the next step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(node):
    """(run, step ms mean, device wait ms, extra) for every measured run in a JSON tree: a bench
    level or decode-sat's steady steps, and a server level's cores."""
    if isinstance(node, dict):
        run = f"c={node['concurrency']}" if "concurrency" in node else "steady"
        if "device_wait_ms" in node and isinstance(node.get("step_ms"), dict):
            yield run, node["step_ms"].get("mean"), node["device_wait_ms"], _machine(node)
        for k, core in enumerate((node.get("server_diag") or {}).get("cores", [])):
            yield (f"{run} core {k}", core.get("step_ms_mean"), core.get("device_wait_ms_mean"),
                   f"CPU busy {_f(core.get('cpu_busy'))}, "
                   f"preempted {_f(core.get('preempted_per_s'), '.0f')}/s"
                   + (f"; {_machine(node)}" if node.get("machine_cpu") else ""))
        for key, value in node.items():
            if key not in ("samples", "server_diag"):
                yield from rows(value)
    elif isinstance(node, list):
        for item in node:
            yield from rows(item)


def _machine(node: dict) -> str:
    """The machine's CPUs over the run (bench's machine_cpu), where recorded."""
    cpu = node.get("machine_cpu")
    return "" if not cpu else f"machine CPUs {100 * cpu['busy']:.0f}% busy, {100 * cpu['steal']:.1f}% stolen"


def _f(x, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args()
    print("| file | run | step ms mean | blocked on the device ms | share | |")
    print("|---|---|---:|---:|---:|---|")
    for path in args.files:
        seen = set()  # a run the record holds twice (closed-loop's levels and its backend's)
        for label, step, wait, extra in rows(json.loads(path.read_text())):
            if (label, step, wait) in seen:
                continue
            seen.add((label, step, wait))
            share = wait / step if step and wait is not None else None
            print(f"| {path.name} | {label} | {_f(step)} | {_f(wait)} | "
                  f"{_f(share, '.2f')} | {extra} |")


if __name__ == "__main__":
    main()
