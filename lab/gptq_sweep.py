"""Sweep GPTQ settings for SmolLM2's fp8 checkpoint (issue 31): the calibration Hessians computed
once per calibration setting (text, tokens, sequence length, how the windows are taken, the
first tokens of each sequence left out), then each rounding variant (damping, scale candidates
of `gptq_rows_searched`) written as a checkpoint folder, scored by `lab/gptq_score.py`.

    PYTHONPATH=. python lab/gptq_sweep.py --calib-text README.md docs/en/*.md \
        --out-root /tmp/sweep --variants d0.01 d0.003 d0.01:s8"""

import argparse
import time
from pathlib import Path

import torch

from flashlet.models.gptq import DenseAttention, HessianOps, gptq_rows_searched
from flashlet.models.ops import TorchOps
from flashlet.models.quantization import FP8_MAX, QUANTIZED_PROJECTIONS, QuantizedWeight, swap_weight
from flashlet.models.weights import load_model, save_fp8_checkpoint


def calib_tokens(tok, files, n, seq_len, sampling):
    """The files' token stream as sequences: its first `n` tokens cut every `seq_len` ("head",
    what the tool does), or n // seq_len windows spread evenly over the whole stream."""
    per_file = [tok.encode(Path(f).read_text()) for f in files]
    stream = [t for f in per_file for t in f]
    if sampling == "head":
        s = stream[:n]
        return [s[i:i + seq_len] for i in range(0, len(s), seq_len)]
    if sampling == "spread":  # n // seq_len windows spread evenly over the stream
        k = max(1, n // seq_len)
        step = (len(stream) - seq_len) / max(k - 1, 1)
        return [stream[round(i * step):round(i * step) + seq_len] for i in range(k)]
    raise ValueError(sampling)


class TailHessianOps(HessianOps):
    """HessianOps leaving each sequence's first `skip` rows out of X^T X."""

    def __init__(self, weights, skip):
        super().__init__(weights)
        self.skip = skip

    def linear(self, x, weight, bias=None):
        name = self.names.get(id(weight))
        if name is not None:
            xs = x[self.skip:].float()
            self.sums[name].addmm_(xs.T, xs)
            self.rows[name] += xs.shape[0]
        return TorchOps.linear(x, weight, bias)


@torch.inference_mode()
def hessians(model, seqs, skip_first=0):
    """Each decoder layer's mean X^T X per projection, on the float model's activations (the
    tool's order), held for all layers at once (SmolLM2: ~0.4 GB)."""
    attn = DenseAttention()
    states = [(model.embed_tokens(torch.tensor(s)), None, torch.arange(len(s))) for s in seqs]
    out = []
    for i, layer in enumerate(model.layers):
        weights = {p: getattr(layer, p).weight for p in QUANTIZED_PROJECTIONS}
        ops = TailHessianOps(weights, skip_first) if skip_first else HessianOps(weights)
        states = [(*layer(x, r, pos, model.cos_sin_cache, i, attn, ops), pos) for x, r, pos in states]
        out.append({p: ops.hessian(p) for p in weights})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calib-text", nargs="+", required=True)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--sampling", default="head", choices=["head", "spread"])
    p.add_argument("--skip-first", type=int, default=0,
                   help="leave each sequence's first tokens out of the Hessians")
    p.add_argument("--variants", nargs="+", default=["d0.01"],
                   help="dDAMP or dDAMP:sG (G scale candidates, gptq_rows_searched)")
    p.add_argument("--out-root", required=True)
    a = p.parse_args()
    t0 = time.perf_counter()
    model, tok, model_dir = load_model(None)
    seqs = calib_tokens(tok, a.calib_text, a.calib_tokens, a.seq_len, a.sampling)
    print(f"{sum(map(len, seqs))} tokens in {len(seqs)} seqs", flush=True)
    hs = hessians(model, seqs, a.skip_first)
    print(f"hessians {time.perf_counter() - t0:.0f} s", flush=True)
    for v in a.variants:
        parts = dict((x[0], x[1:]) for x in v.split(":"))
        damp = float(parts.get("d", 0.01))
        g = int(parts.get("s", 0))
        model, _, _ = load_model(None)
        picked = []
        for i, layer in enumerate(model.layers):
            for proj in QUANTIZED_PROJECTIONS:
                w = getattr(layer, proj).weight.detach().float()
                codes, scale = gptq_rows_searched(w, hs[i][proj], damp, candidates=max(g, 1))
                if g:  # which candidate each row kept
                    f = w.abs().amax(dim=1) / scale / FP8_MAX
                    picked.append(((1 - f) * 2 * g).round().long().clamp(0, g - 1))
                swap_weight(getattr(layer, proj), QuantizedWeight(codes, scale))
        if picked:
            print(f"{v}: picked candidate histogram {torch.bincount(torch.cat(picked), minlength=g).tolist()}")
        save_fp8_checkpoint(model, model_dir, Path(a.out_root) / v.replace(":", "_"))
        print(f"{v} written {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
