"""`python -m flashlet.quantize --out DIR`: write an FP8 checkpoint of a model, rounded by GPTQ.

Offline, once: the model (--model, a Hugging Face folder, hub id or GGUF file; default the
embedded SmolLM2-135M) loads in fp32 on --device (cuda where available: the rounding runs
there too), runs the calibration text one decoder layer at a time, and each layer's linear
weights are rounded to e4m3 with one scale a row by GPTQ, each row's scale the best of
--scale-candidates (`flashlet/models/gptq.py`); the folder written
(`weights.save_fp8_checkpoint`) then loads with `LLM(model=DIR)` or `--model DIR`, no
--quantization needed, at no cost at load. The calibration text is the user's (--calib-text,
required): text like what the model will serve, none of what it will be scored on. Bad usage is one
line on stderr, exit code 2."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from flashlet.config import CliParser
from flashlet.models.gptq import calibration_sequences, gptq_model
from flashlet.models.weights import load_model, resolve_model_dir, save_fp8_checkpoint


def build_parser() -> CliParser:
    p = CliParser(prog="python -m flashlet.quantize", description=__doc__)
    p.add_argument("--model", default=None,
                   help="folder, hub id or .gguf file (default: the embedded SmolLM2-135M)")
    p.add_argument("--out", required=True, help="the folder to write (absent or empty)")
    p.add_argument("--calib-text", nargs="+", required=True, metavar="FILE",
                   help="calibration text files, tokenized and concatenated: text like what the "
                        "model will serve (e.g. README.md docs/en/*.md for the embedded model)")
    p.add_argument("--calib-tokens", type=int, default=8192,
                   help="calibration tokens, the text's first (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=1024,
                   help="calibration tokens per sequence (default: %(default)s)")
    p.add_argument("--device", default=None,
                   help="where the model calibrates and rounds, in fp32 (default: cuda where "
                        "available, else cpu; a 7B model needs ~30 GB there)")
    p.add_argument("--damp", type=float, default=0.01,
                   help="GPTQ damping, a fraction of diag(H)'s mean (default: %(default)s)")
    p.add_argument("--scale-candidates", type=int, default=8,
                   help="scales tried for each row, the best kept (1: amax / 448 alone; the "
                        "rounding time grows with it; default: %(default)s)")
    return p


def check_args(p: CliParser, args) -> None:
    missing = [f for f in args.calib_text if not Path(f).is_file()]
    if missing:
        p.error(f"--calib-text: no such file: {', '.join(missing)}")
    if args.calib_tokens < 1:
        p.error(f"--calib-tokens must be at least 1, got {args.calib_tokens}")
    if args.seq_len < 1:
        p.error(f"--seq-len must be at least 1, got {args.seq_len}")
    if args.scale_candidates < 1:
        p.error(f"--scale-candidates must be at least 1, got {args.scale_candidates}")
    if not 0 < args.damp <= 1:
        p.error(f"--damp must be in (0, 1], got {args.damp}")
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError as e:
            p.error(f"--device {args.device!r}: {e}")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            p.error(f"--device {args.device}: no CUDA device here")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"--out {out} exists and is not an empty folder")


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    t0 = time.perf_counter()
    try:
        model_dir = resolve_model_dir(args.model)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer, _ = load_model(model_dir, device=device, dtype=torch.float32)
    except (OSError, ValueError) as e:
        p.exit(1, f"{p.prog}: error: could not load the model: {e}\n")
    if tokenizer is None:
        p.exit(1, f"{p.prog}: error: {model_dir} has no tokenizer to encode the calibration text\n")
    tokens = [t for f in args.calib_text for t in tokenizer.encode(Path(f).read_text())]
    tokens = tokens[:args.calib_tokens]
    if not tokens:
        p.exit(1, f"{p.prog}: error: the calibration text has no tokens\n")
    if len(tokens) < args.calib_tokens:
        print(f"note: the calibration text has {len(tokens)} tokens, fewer than --calib-tokens")
    print(f"{model_dir}: loaded on {device} in {time.perf_counter() - t0:.1f} s; GPTQ on {len(tokens)} "
          f"calibration tokens of {', '.join(Path(f).name for f in args.calib_text)}")
    seqs = calibration_sequences(tokens, args.seq_len)
    layers = len(model.layers)
    try:
        gptq_model(model, seqs, damp=args.damp, scale_candidates=args.scale_candidates,
                   on_layer=lambda i: print(f"layer {i + 1}/{layers} rounded "
                                            f"({time.perf_counter() - t0:.0f} s)", flush=True))
        save_fp8_checkpoint(model, model_dir, Path(args.out))
    except (OSError, ValueError) as e:
        p.exit(1, f"{p.prog}: error: {e}\n")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s: load it with --model {args.out}")


if __name__ == "__main__":
    main()
