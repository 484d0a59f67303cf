"""The one-launch attention's table (tuning.ONE_LAUNCH_TABLE) in the engine: the closed loop and
one stream with the table as committed against the derived configs (the table emptied), in
interleaved fresh processes (issue 29: a kernel's winner alone can lose in the engine, where
the attention follows the QKV GEMV; Qwen2.5-0.5B's 4-row winner did).

    PYTHONPATH=.:$CUTE python3 lab/one_launch_ab.py [--config qwen3-0.6b] [--pairs 2]
        [--drop 128,2,4 ...]     (compare the table against itself without these entries instead)

Each process runs `python -m flashlet.bench --workload closed-loop --concurrency 1 4 16
--max-new-tokens 128 --num-requests 64` and then `--workload single` (the fused path serves
1-16 rows); the table is changed inside the process before the engine is built. Prints each
run's output tok/s and mean step per level, then the medians of each variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = """
import sys
from flashlet.kernels import tuning
drop = {drop!r}
if drop is None:
    tuning.ONE_LAUNCH_TABLE.clear()
else:
    for key in drop:
        tuning.ONE_LAUNCH_TABLE.pop(tuple(key), None)
from flashlet.bench.cli import main
sys.argv = ["bench"] + {argv!r}
sys.exit(main())
"""


def run_variant(drop, argv: list[str]) -> dict:
    """One fresh process with the table changed (drop None: emptied) -> its --out record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        code = RUNNER.format(drop=drop, argv=argv + ["--out", str(out)])
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def level_rows(record: dict) -> dict[str, tuple[float, float]]:
    """{level name: (output tok/s, mean step ms)} of a closed-loop or single record."""
    results = record["results"]
    rows = {}
    for level in results.get("levels", []):
        rows[f"c={level['concurrency']}"] = (level["output_tok_s"], level["step_ms"]["mean"])
    if "decode_tok_s" in results:  # the single workload
        rows["one stream"] = (results["decode_tok_s"], results["ms_per_token"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--drop", nargs="+", default=None, metavar="HEAD_DIM,GROUP,ROWS",
                   help="the other variant keeps the table but these entries (default: no table)")
    args = p.parse_args()
    other = None if args.drop is None else [[int(x) for x in d.split(",")] for d in args.drop]
    base = ["--config", args.config, "--dtype", "bfloat16", "--quiet", "--max-num-pages", "8192"]
    workloads = [base + ["--workload", "closed-loop", "--concurrency", "1", "4", "16",
                         "--max-new-tokens", "128", "--num-requests", "64"],
                 base + ["--workload", "single"]]
    variants = {"table": [], "without" if other is None else f"without {args.drop}": []}
    for i in range(args.pairs):
        for name, drop in zip(variants, ([], other)):
            rows = {}
            for argv in workloads:
                rows.update(level_rows(run_variant(drop, argv)))
            variants[name].append(rows)
            print(f"pair {i + 1} {name}: " + "; ".join(
                f"{k} {v[0]:,.0f} tok/s, {v[1]:.3f} ms" for k, v in rows.items()), flush=True)
    print("\n| level | " + " | ".join(f"{n} tok/s (median)" for n in variants) + " | ratio |")
    print("|---|" + "---:|" * (len(variants) + 1))
    first, second = variants.values()
    for level in first[0]:
        a = statistics.median(r[level][0] for r in first)
        b = statistics.median(r[level][0] for r in second)
        print(f"| {level} | {a:,.0f} | {b:,.0f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
