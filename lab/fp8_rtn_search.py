"""Round-to-nearest fp8 weights with each row's scale searched by plain squared error (no
calibration text, no Hessian; `quantization.quantize_weight_rows`, what `--quantization fp8`
does at load since this measurement) at a chosen candidate count, written as an FP8 checkpoint
to score with scripts/fidelity.py (issue 31).

    PYTHONPATH=. python lab/fp8_rtn_search.py --candidates 8 --out /tmp/rtn-c8
    PYTHONPATH=. python scripts/fidelity.py --perplexity --device cpu \
        --text docs/en/versions/*.md --quantized-model /tmp/rtn-c8

Each row tries the scales of `quantization.scale_fractions(candidates)` (the row's amax mapped
to 448 f, f from 1 down to just above 1/2: the e4m3 grid moved under the row's values, nothing
clipped) and keeps the one whose dequantized row is closest to the float row. --candidates 1 is
plain round-to-nearest (`quantize_rows`' codes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashlet.models.quantization import (QUANTIZED_PROJECTIONS, QuantizedWeight,
                                          quantize_weight_rows, swap_weight)
from flashlet.models.weights import load_model, resolve_model_dir, save_fp8_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--candidates", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model_dir = resolve_model_dir(args.model)
    model, _, _ = load_model(model_dir, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        for layer in model.layers:
            for name in QUANTIZED_PROJECTIONS:
                codes, scale = quantize_weight_rows(getattr(layer, name).weight, args.candidates)
                swap_weight(getattr(layer, name), QuantizedWeight(codes, scale))
    save_fp8_checkpoint(model, model_dir, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
