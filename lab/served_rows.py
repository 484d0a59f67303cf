"""The harness (or `lab/one_stream_pair.py` with `pair`) with one of the fused path's served-row
constants set: how many rows a fused step serves at a model's kind (`fused_decode.SERVED_ROWS`,
`SERVED_ROWS_FP8`, `SERVED_ROWS_FP8_LARGE` or `SERVED_ROWS_BF16_LARGE`), for an A/B against the
tree's value before the constant moves (a measurement, not a setting: the constant is where the
measured answer goes).

    python3 lab/served_rows.py SERVED_ROWS_FP8_LARGE=16 --config qwen2.5-7b --quantization fp8 --dtype bfloat16 \\
        --quiet --workload closed-loop --concurrency 1 4 16 --max-num-pages 8192
    python3 lab/served_rows.py SERVED_ROWS_BF16_LARGE=8 pair rows8 --config qwen2.5-7b
"""

from __future__ import annotations

import os
import sys

from flashlet.kernels.cute_gemv import MAX_ROWS
from flashlet.runner import fused_decode

CONSTANTS = ("SERVED_ROWS", "SERVED_ROWS_FP8", "SERVED_ROWS_FP8_LARGE", "SERVED_ROWS_BF16_LARGE")


def set_constant(setting: str) -> str:
    """NAME=N: fused_decode.NAME set to N (NAME one of CONSTANTS, N within 1..MAX_ROWS)."""
    name, _, value = setting.partition("=")
    if name not in CONSTANTS or not value.isdigit():
        raise SystemExit(f"the first argument is NAME=N with NAME one of {', '.join(CONSTANTS)}: got {setting!r}")
    rows = int(value)
    if not 1 <= rows <= MAX_ROWS:
        raise SystemExit(f"{name}={rows}: the fused path's kernels take 1 to {MAX_ROWS} rows")
    was = getattr(fused_decode, name)
    setattr(fused_decode, name, rows)
    return f"{name} = {rows} (the tree's {was})"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(set_constant(sys.argv[1]), file=sys.stderr)
    args = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lab/, whatever the cwd
    from one_stream_pair import run_patched

    run_patched(args)
