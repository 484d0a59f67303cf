"""Where fp8 weights lose fidelity: each way of running them emulated on the CPU, against fp32.

Every variant runs the same model (bf16 activations, as the engine runs) with its decoder
projections replaced by what that variant multiplies, and is compared with the fp32 model on
the same tokens: argmax agreement (with its binomial standard error), and the logit error
(RMS and max of |logits - fp32 logits|). The variants separate the weight rounding itself
(per-row scales or 128 x 128 block scales, multiplied in fp32 or in bf16), the per-token fp8
activations of the `torch._scaled_mm` path, the LM head in fp8, and each projection alone.
The GPTQ variants keep the per-row format (e4m3 codes and one scale a row, loadable unchanged)
but choose each code by GPTQ's error-compensating rounding (`flashlet.models.gptq.gptq_rows`,
what `python -m flashlet.quantize` writes as a checkpoint) on the Hessians of a calibration
text (--calib: scripts/fidelity_text.txt and README.md, never a scored file).
With bf16 run too, each row's agreement is also given as its paired difference to bf16's.

    PYTHONPATH=. python lab/fp8_fidelity.py --preset qwen2.5-0.5b --layers 6
    PYTHONPATH=. python lab/fp8_fidelity.py --smollm2       # the real embedded model, its text
    PYTHONPATH=. python lab/fp8_fidelity.py --smollm2 --text docs/en/versions/*.md   # more positions

--smollm2 scores scripts/fidelity_text.txt (and prints each variant's perplexity), or with --text
each file given as one sequence of at most --max-len tokens; a preset
scores --seqs random sequences of --seq-len tokens, at the preset's shape with --layers layers.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import flashlet.models.ops
from flashlet.models import quantization as q
from flashlet.models.gptq import DenseAttention, gptq_rows  # the rounding the CLI writes
from flashlet.models.model import ModelConfig
from flashlet.models.weights import (embedded_model_dir, load_model, load_tokenizer,
                                     preset_config, random_model)
from scripts.fidelity import PERPLEXITY_TEXT, text_sequences  # the texts fidelity.py scores


class EmulatedWeight(q.QuantizedWeight):
    """A projection as a variant multiplies it: `weight` is the value it stands for (fp32),
    `act_fp8` quantizes each activation row to e4m3 first, `matmul_dtype` is the GEMM's."""

    def __init__(self, weight, act_fp8=False, matmul_dtype=torch.float32):
        torch.nn.Module.__init__(self)
        self.register_buffer("weight", weight.float())
        self.act_fp8, self.matmul_dtype = act_fp8, matmul_dtype

    @property
    def shape(self):
        return self.weight.shape

    def emulate(self, x, bias):
        xs = x.float()
        if self.act_fp8:
            xq, x_scale = q.quantize_rows(xs)
            xs = xq.float() * x_scale[:, None]
        out = F.linear(xs.to(self.matmul_dtype), self.weight.to(self.matmul_dtype)).float()
        return (out + bias.float() if bias is not None else out).to(x.dtype)


def emulated_linear(x, w, bias=None):
    return w.emulate(x, bias) if isinstance(w, EmulatedWeight) else q.linear(x, w, bias)


def per_row(w):
    qw, s = q.quantize_rows(w)
    return qw.float() * s[:, None]


def per_block(w, block=128):
    """e4m3 with one scale per block x block tile (DeepSeek-V3's weight_block_size)."""
    n, k = w.shape
    pn, pk = -n % block, -k % block
    t = F.pad(w.float(), (0, pk, 0, pn)).reshape((n + pn) // block, block, (k + pk) // block, block)
    s = (t.abs().amax(dim=(1, 3), keepdim=True) / q.FP8_MAX).clamp(min=q.MIN_SCALE)
    return ((t / s).to(q.FP8).float() * s).reshape(n + pn, k + pk)[:n, :k]


class RecordingWeight(EmulatedWeight):
    """A bf16 projection (multiplied in fp32) that sums X^T X of the rows it sees."""

    def __init__(self, weight):
        super().__init__(weight)
        self.hessian, self.rows = torch.zeros(weight.shape[1], weight.shape[1]), 0

    def emulate(self, x, bias):
        xs = x.float()
        self.hessian += xs.T @ xs
        self.rows += xs.shape[0]
        return super().emulate(x, bias)


class Gptq:
    """The GPTQ variant's settings: each decoder layer in turn records its projections' inputs
    on the calibration sequences, from the unquantized model's activations or, `sequential`,
    from the already-quantized earlier layers' (GPTQ's order), then rounds with `gptq_rows`."""

    def __init__(self, damp=0.01, act_order=True, sequential=False, calib_fraction=1.0):
        self.damp, self.act_order = damp, act_order
        self.sequential, self.calib_fraction = sequential, calib_fraction

    @torch.inference_mode()
    def apply(self, model, calib):
        tokens = [t for s in calib for t in s]
        keep = round(len(tokens) * self.calib_fraction)
        seqs = [s for s in (tokens[i:i + 1024] for i in range(0, keep, 1024)) if s]
        states = [(model.embed_tokens(torch.tensor(s)), None, torch.arange(len(s))) for s in seqs]
        attn = DenseAttention()
        for i, layer in enumerate(model.layers):
            recorders = {}
            for proj in q.QUANTIZED_PROJECTIONS:
                linear = getattr(layer, proj)
                recorders[proj] = RecordingWeight(linear.weight.float())
                q.swap_weight(linear, recorders[proj])
            run = lambda: [(*layer(x, r, pos, model.cos_sin_cache, i, attn, model.ops), pos)
                           for x, r, pos in states]
            outs = run()
            for proj, rec in recorders.items():
                codes, scale = gptq_rows(rec.weight, rec.hessian / rec.rows, self.damp,
                                         self.act_order)
                value = codes.float() * scale[:, None]
                # the engine's format: requantizing the value under the same scale gives the codes
                assert torch.equal((value / scale[:, None]).to(q.FP8).float(), codes.float())
                q.swap_weight(getattr(layer, proj), EmulatedWeight(value))
            states = run() if self.sequential else outs


def variants():
    """name -> (weight rounding, act_fp8 (or the projections it applies to), matmul dtype,
    projections quantized, LM head in fp8[, the layers kept in bf16: a function of the layer
    count -> indices])."""
    all_p = q.QUANTIZED_PROJECTIONS
    f32, bf16 = torch.float32, torch.bfloat16
    table = {
        "bf16": None,
        "fp8 W per-row, fp32 matmul (weight-only; CPU path)": (per_row, False, f32, all_p, False),
        "fp8 W per-row, bf16 matmul": (per_row, False, bf16, all_p, False),
        "fp8 W per-row + fp8 A per-token (_scaled_mm)": (per_row, True, f32, all_p, False),
        "fp8 W 128x128 blocks, fp32 matmul": (per_block, False, f32, all_p, False),
        "fp8 A per-token only (W bf16)": (lambda w: w, True, f32, all_p, False),
        "fp8 W per-row + LM head fp8": (per_row, False, f32, all_p, True),
        "LM head fp8 only (decoder bf16)": (per_row, False, f32, (), True),
    }
    for proj in all_p:
        table[f"fp8 W per-row, {proj} only"] = (per_row, False, f32, (proj,), False)
    for proj in all_p:
        table[f"fp8 W per-row, fp8 A on {proj} only"] = (per_row, (proj,), f32, all_p, False)
    for proj in all_p:  # mixed precision: one projection kept in bf16 everywhere
        table[f"fp8 W per-row, all but {proj}"] = (
            per_row, False, f32, tuple(p for p in all_p if p != proj), False)
    for k in (1, 2):  # mixed precision: the first and last k layers kept in bf16
        table[f"fp8 W per-row, first and last {k} layer(s) bf16"] = (
            per_row, False, f32, all_p, False,
            lambda n, k=k: set(range(k)) | set(range(n - k, n)))
    for name, g in {", damp 0.01": Gptq(), " sequential": Gptq(sequential=True),
                    ", damp 0.1": Gptq(damp=0.1), " no act-order": Gptq(act_order=False),
                    " half calibration": Gptq(calib_fraction=0.5)}.items():
        table[f"fp8 W per-row GPTQ{name}"] = g
    return table


def apply_variant(model, spec, calib):
    if isinstance(spec, Gptq):
        return spec.apply(model, calib)
    rounding, act_fp8, matmul_dtype, projs, lm_head_fp8, *kept = spec
    kept_layers = kept[0](len(model.layers)) if kept else set()
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            if i in kept_layers:
                continue
            for proj in projs:
                linear = getattr(layer, proj)
                act = act_fp8 if isinstance(act_fp8, bool) else proj in act_fp8
                emulated = EmulatedWeight(rounding(linear.weight.float()), act, matmul_dtype)
                q.swap_weight(linear, emulated)
    if lm_head_fp8:
        head = per_row(model.lm_head_weight.float())
        model.compute_logits = lambda h: F.linear(h.float(), head)


@torch.inference_mode()
def logits_of(model, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor(s)
        out.append(model.compute_logits(model(ids, torch.arange(len(s)), DenseAttention())).float())
    return torch.cat(out)


def measure(ref, logits, seqs):
    agree = (ref.argmax(-1) == logits.argmax(-1)).float()
    p, n = agree.mean().item(), agree.numel()
    diff = logits - ref
    row = {"agree": agree, "agreement": p, "se": math.sqrt(p * (1 - p) / n),
           "rms_logit_err": diff.pow(2).mean().sqrt().item(),
           "max_logit_err": diff.abs().max().item()}
    targets = torch.cat([torch.tensor(s[1:] + [-100]) for s in seqs])
    row["perplexity"] = math.exp(F.cross_entropy(logits, targets, ignore_index=-100).item())
    return row


def build(args, dtype):
    if args.smollm2:
        model, _, _ = load_model(str(embedded_model_dir()), dtype=dtype)
        return model
    cfg = preset_config(args.preset)
    cfg["num_hidden_layers"] = args.layers
    return random_model(ModelConfig.from_hf(cfg), dtype=dtype, seed=args.seed)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smollm2", action="store_true")
    p.add_argument("--only", nargs="*", help="variant names containing any of these")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="with --smollm2: score these files (one sequence each) instead")
    p.add_argument("--max-len", type=int, default=1024, help="tokens a --text sequence keeps")
    p.add_argument("--calib", nargs="+", default=[str(PERPLEXITY_TEXT), "README.md"],
                   metavar="FILE", help="with --smollm2: the GPTQ variants' calibration text "
                   "(less any file scored), cut to --calib-tokens")
    p.add_argument("--calib-tokens", type=int, default=4096)
    args = p.parse_args()
    flashlet.models.ops.quantized_linear = emulated_linear
    if args.smollm2:
        tok = load_tokenizer(embedded_model_dir())
        scored = args.text or [str(PERPLEXITY_TEXT)]
        seqs = text_sequences(tok, scored, args.max_len)
        calib_files = [f for f in args.calib if Path(f).resolve() not in
                       {Path(t).resolve() for t in scored}]
        calib = [sum(text_sequences(tok, calib_files, 10 ** 9), [])[:args.calib_tokens]]
    else:
        vocab = preset_config(args.preset)["vocab_size"]
        g = torch.Generator().manual_seed(args.seed)
        seqs = [torch.randint(0, vocab, (args.seq_len,), generator=g).tolist()
                for _ in range(args.seqs)]
        calib = [torch.randint(0, vocab, (args.calib_tokens,), generator=g).tolist()]
    ref = logits_of(build(args, torch.float32), seqs)
    top2 = ref.topk(2, -1).values
    gap = (top2[:, 0] - top2[:, 1]).median().item()
    what = "SmolLM2-135M" if args.smollm2 else f"{args.preset} at {args.layers} layers"
    print(f"{what}, {ref.shape[0]} positions, fp32 top-2 gap median {gap:.3f}, "
          f"fp32 perplexity {measure(ref, ref, seqs)['perplexity']:.3f}; GPTQ calibration "
          f"{len(calib[0])} tokens" + (f" of {', '.join(calib_files)}" if args.smollm2 else ""))
    print("| variant | agreement % | vs bf16, points | RMS logit err | max logit err | perplexity "
          "| s |")
    print("|---|---|---|---|---|---|---|")
    bf16_agree = None  # bf16's per-position agreement, where it ran: each row's paired difference
    for name, spec in variants().items():
        if args.only and not any(o in name for o in args.only):
            continue
        model, t0 = build(args, torch.bfloat16), time.perf_counter()
        if spec is not None:
            apply_variant(model, spec, calib)
        r = measure(ref, logits_of(model, seqs), seqs)
        bf16_agree = r["agree"] if spec is None else bf16_agree
        vs = "-"
        if bf16_agree is not None:
            d = r["agree"] - bf16_agree
            vs = f"{100 * d.mean():+.2f} +- {196 * d.std() / math.sqrt(d.numel()):.2f}"
        print(f"| {name} | {100 * r['agreement']:.2f} +- {196 * r['se']:.2f} | {vs} "
              f"| {r['rms_logit_err']:.3f} | {r['max_logit_err']:.2f} | {r['perplexity']:.3f} "
              f"| {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
