"""The harness with one preset's bf16 shape added to `fused_decode.BF16_ONE_ROW_MMA_SHAPES`: its
one-row GEMVs on the tensor cores, and auto taking the fused path there for up to
SERVED_ROWS_BF16_LARGE rows, before the set holds it (a measurement, not a default: a shape joins
the set once this beats per-op; the 7B's has, session 64).

    python3 lab/bf16_one_row_mma.py --config qwen2.5-7b --dtype bfloat16 --quiet --workload single \\
        --max-num-pages 8192            # any flashlet.bench arguments; --config names the shape
    python3 lab/bf16_one_row_mma.py pair mma --config qwen2.5-7b --prompt-len 1000
                                        # `pair`: lab/one_stream_pair.py's arguments instead
                                        # (one stream through LLM.generate, a fresh process)
"""

from __future__ import annotations

import os
import sys

from flashlet.models.model import ModelConfig
from flashlet.models.weights import preset_config
from flashlet.runner import fused_decode


def add_shape(argv: list[str]) -> tuple[int, int]:
    """The --config preset's (hidden size, intermediate size), added to the set."""
    if "--config" not in argv:
        raise SystemExit("give --config PRESET (the shape to put on the tensor cores)")
    cfg = ModelConfig.from_hf(preset_config(argv[argv.index("--config") + 1]))
    shape = (cfg.hidden_size, cfg.intermediate_size)
    fused_decode.BF16_ONE_ROW_MMA_SHAPES.add(shape)
    return shape


if __name__ == "__main__":
    args = sys.argv[1:]
    print(f"BF16_ONE_ROW_MMA_SHAPES += {add_shape(args)}", file=sys.stderr)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lab/, whatever the cwd
    from one_stream_pair import run_patched

    run_patched(args)
