"""Score fp8 checkpoint folders as `scripts/fidelity.py --perplexity --device cpu --text
docs/en/versions/*.md --quantized-model DIR` does (its own engine path), with the fp32 and bf16
runs cached in --cache, and each folder's paired difference to bf16 and to the first folder."""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import fidelity  # noqa: E402
from flashlet.models.weights import load_tokenizer, resolve_model_dir  # noqa: E402


def paired(a, b):
    """fidelity.paired_difference in points, +- 1.96 SE."""
    mean, se = fidelity.paired_difference(a, b)
    return 100 * mean, 196 * se


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cache", type=Path, help="file holding the fp32 and bf16 runs (written on first use)")
    parser.add_argument("folders", nargs="*", help="checkpoint folders to score")
    cli = parser.parse_args()
    cache, folders = cli.cache, cli.folders
    files = sorted(str(f) for f in Path("docs/en/versions").glob("*.md"))
    args = fidelity.parse_args(["--perplexity", "--device", "cpu", "--text", *files])
    seqs = fidelity.text_sequences(load_tokenizer(resolve_model_dir(None)), files, args.max_len)
    if cache.exists():
        ref_top, bf16_top, bf16_nll = torch.load(cache)
    else:
        ref_top, _ = fidelity.engine_scores(args, seqs, "float32", {})
        bf16_top, bf16_nll = fidelity.engine_scores(args, seqs, "bfloat16", {})
        torch.save((ref_top, bf16_top, bf16_nll), cache)
    bf16 = bf16_top == ref_top
    print(f"bf16 {100 * bf16.float().mean():.2f}, ppl {math.exp(bf16_nll.mean()):.3f}")
    first = None
    for f in folders:
        top, nll = fidelity.engine_scores(args, seqs, "bfloat16", {}, model=f)
        agree = top == ref_top
        first = agree if first is None else first
        d, se = paired(agree, bf16)
        d1, se1 = paired(agree, first)
        print(f"{f}: {100 * agree.float().mean():.2f}, vs bf16 {d:+.2f} +- {se:.2f}, "
              f"vs first {d1:+.2f} +- {se1:.2f}, ppl x{math.exp(nll.mean() - bf16_nll.mean()):.4f}",
              flush=True)


if __name__ == "__main__":
    main()
