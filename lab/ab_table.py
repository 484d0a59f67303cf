"""An A/B's figures side by side: interleaved closed-loop pairs (the bench's `--out` JSON of
`--workload closed-loop`) and N streams through `LLM.generate` (`scripts/fused_decode_bench.py
--json`), each level as A, B and B's change, with the closed loop's per-stream ratio against
c = 1 (issue 29's yardstick). What `gpu_run.sh gemv-rows-ab` and `loop-table-ab` print last.

    python3 lab/ab_table.py --loop-a none-1.json none-2.json --loop-b plans-1.json plans-2.json \\
        --streams-a streams-none.json --streams-b streams-plans.json

The i-th files of --loop-a and --loop-b are one pair (run one after the other in the same call).
N streams run steps of exactly N rows, so each N reads a row count's plans alone, where the
closed loop mixes them (FUSED_NOTES.md, "Session 54").
"""

from __future__ import annotations

import argparse
import json
import sys


def loop_levels(path: str) -> dict[int, float]:
    """Output tok/s at each concurrency of one closed-loop run."""
    with open(path) as f:
        levels = json.load(f)["results"]["levels"]
    return {int(level["concurrency"]): float(level["output_tok_s"]) for level in levels}


def stream_levels(path: str) -> dict[int, float]:
    """The 2nd call's per-stream tok/s at each N of one fused_decode_bench run (its one path)."""
    with open(path) as f:
        runs = json.load(f)
    if len(runs) != 1:
        raise ValueError(f"{path}: one path expected (--paths default), got {sorted(runs)}")
    (run,) = runs.values()
    return {int(n): float(level["second_per_stream_tok_s"]) for n, level in run["streams"].items()}


def change(a: float, b: float) -> str:
    return f"{100 * (b / a - 1):+.1f}%"


def ratios(levels: dict[int, float]) -> str:
    """Per-stream tok/s at each concurrency past 1 against c = 1's, as "c4 0.71 c16 0.55"."""
    if 1 not in levels:
        return ""
    return " ".join(f"c{c} {levels[c] / c / levels[1]:.2f}" for c in sorted(levels) if c > 1)


def loop_table(a_paths: list[str], b_paths: list[str]) -> list[str]:
    if len(a_paths) != len(b_paths):
        raise ValueError(f"--loop-a has {len(a_paths)} files, --loop-b {len(b_paths)}: pairs needed")
    lines = ["| pair | c | A tok/s | B tok/s | change |", "|---:|---:|---:|---:|---:|"]
    notes = []
    for i, (a_path, b_path) in enumerate(zip(a_paths, b_paths), 1):
        a, b = loop_levels(a_path), loop_levels(b_path)
        for c in sorted(set(a) & set(b)):
            lines.append(f"| {i} | {c} | {a[c]:,.0f} | {b[c]:,.0f} | {change(a[c], b[c])} |")
        notes.append(f"pair {i} per stream against c = 1: A {ratios(a)}; B {ratios(b)}")
    return lines + notes


def stream_table(a_path: str, b_path: str) -> list[str]:
    a, b = stream_levels(a_path), stream_levels(b_path)
    lines = ["| N | A tok/s a stream | B | change |", "|---:|---:|---:|---:|"]
    return lines + [f"| {n} | {a[n]:,.1f} | {b[n]:,.1f} | {change(a[n], b[n])} |" for n in sorted(set(a) & set(b))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop-a", nargs="*", default=[], help="closed-loop JSONs without the change, in pair order")
    ap.add_argument("--loop-b", nargs="*", default=[], help="closed-loop JSONs with it, in the same order")
    ap.add_argument("--streams-a", help="fused_decode_bench JSON without the change")
    ap.add_argument("--streams-b", help="fused_decode_bench JSON with it")
    args = ap.parse_args(argv)
    if bool(args.streams_a) != bool(args.streams_b):
        ap.error("--streams-a and --streams-b come together")
    out = []
    if args.loop_a or args.loop_b:
        out += ["closed loop (output tok/s):"] + loop_table(args.loop_a, args.loop_b)
    if args.streams_a:
        out += ["N streams through LLM.generate (2nd call):"] + stream_table(args.streams_a, args.streams_b)
    if not out:
        ap.error("nothing to compare: give --loop-a/--loop-b or --streams-a/--streams-b")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
