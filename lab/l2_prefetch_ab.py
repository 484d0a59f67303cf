"""The fused path's L2 prefetch of each layer's MLP weights (fused_decode.L2_PREFETCH_MLP: the
one-launch attention asks L2 for gate | up and down while it waits) on and off, in interleaved
fresh processes: the closed loop at 1, 4 and 16 streams, and one stream after a long prompt.

    PYTHONPATH=.:$CUTE python3 lab/l2_prefetch_ab.py [--config qwen2.5-0.5b] [--pairs 2]
        [--long 8000]   (one stream after that many prompt tokens too; 0: not run)

Each process runs `python -m flashlet.bench --workload closed-loop --concurrency 1 4 16
--max-new-tokens 128 --num-requests 64` (or `--workload single --single-prompt-len N`) with
the flag set before the engine is built. Prints each run's output tok/s and mean step per
level, then the medians of each variant (lab/one_launch_ab.py's table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lab.one_launch_ab import level_rows

RUNNER = """
import sys
from flashlet.runner import fused_decode
fused_decode.L2_PREFETCH_MLP = {on!r}
from flashlet.bench.cli import main
sys.argv = ["bench"] + {argv!r}
sys.exit(main())
"""


def run_variant(on: bool, argv: list[str]) -> dict:
    """One fresh process with the prefetch on or off -> its --out record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        code = RUNNER.format(on=on, argv=argv + ["--out", str(out)])
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--long", type=int, default=0, help="also one stream after this many prompt tokens")
    args = p.parse_args()
    base = ["--config", args.config, "--dtype", "bfloat16", "--quiet", "--max-num-pages", "8192"]
    workloads = [base + ["--workload", "closed-loop", "--concurrency", "1", "4", "16",
                         "--max-new-tokens", "128", "--num-requests", "64"]]
    if args.long:
        workloads.append(base + ["--workload", "single", "--single-prompt-len", str(args.long)])
    variants: dict[str, list[dict]] = {"prefetch": [], "off": []}
    for i in range(args.pairs):
        for name, on in (("prefetch", True), ("off", False)):
            rows = {}
            for argv in workloads:
                rows.update(level_rows(run_variant(on, argv)))
            variants[name].append(rows)
            print(f"pair {i + 1} {name}: " + "; ".join(
                f"{k} {v[0]:,.0f} tok/s, {v[1]:.3f} ms" for k, v in rows.items()), flush=True)
    print("\n| level | prefetch tok/s (median) | off tok/s (median) | ratio |")
    print("|---|---:|---:|---:|")
    first, second = variants.values()
    for level in first[0]:
        a = statistics.median(r[level][0] for r in first)
        b = statistics.median(r[level][0] for r in second)
        print(f"| {level} | {a:,.0f} | {b:,.0f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
