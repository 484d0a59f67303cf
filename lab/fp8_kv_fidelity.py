"""Where an fp8 KV cache loses fidelity on SmolLM2-135M: K or V, and whether a scale or rotation helps.

Each variant runs the engine teacher-forced (bf16, CPU) over the same texts and is compared with
the fp32 engine: argmax agreement, its paired difference to the bf16 cache and to plain e4m3
K + V on the same positions (+- 1.96 standard errors; issue 31 allows an fp8 KV cache 1 point),
and perplexity with its paired ratio to bf16's. Variants:

    e4m3 K only / e4m3 V only / e4m3 K + V   the pool stays bf16; its one write rounds K, V or
                                             both through e4m3 first (what an fp8 pool at scale
                                             1.0 stores, K and V apart)
    e5m2 K + V                               the same through e5m2 (two mantissa bits)
    fp8 pool, scale 1.0                      the engine's `kv_cache_dtype="fp8"` as it runs
    absmax / 448 scales, K + V e4m3          per-layer K and V scales from the calibration
                                             text's largest |K|, |V| (stored values then span
                                             e4m3's range), rounded as the fp8 pool's write
                                             does (`kv_pool.quantize_fp8`)
    K smoothed (mean subtracted), K + V e4m3 each layer's post-RoPE mean K per head and channel
                                             (from the calibration text) subtracted before the
                                             rounding: attention is unchanged by a key offset
                                             common to every key (softmax per query row), so
                                             only the rounding of the remainder counts
    K rotated (Hadamard), K + V e4m3         each post-RoPE key head k rounded as k R (R the
                                             64 x 64 normalized Walsh-Hadamard matrix, entries
                                             +-1/8) and stored as round(k R) R^T. An engine would
                                             store round(k R) and rotate q by the same R; the
                                             scores agree exactly, q . round(k R) R^T =
                                             (q R) . round(k R), so attention stays untouched
                                             here (the stored value's bf16 rounding aside, 2^-8
                                             of it against e4m3's 2^-4)
    K and V rotated (Hadamard), K + V e4m3   V too: stored as round(v R) R^T, which is
                                             attention over round(v R) un-rotated after it
                                             (out = P round(v R) R^T: in an engine R folds into
                                             W_v and R^T into W_o, at no runtime cost)
    ... (randomized Hadamard)                R = diag(s) H, s a fixed-seed random +-1 vector
    K + V 3 / 4 / 5 mantissa bits            controls: both rounded to that many mantissa bits
                                             (no exponent limits; 3 is e4m3 without its
                                             subnormals): what one more bit buys

The rotation's aim: e4m3's relative rounding error eps_i is about uniform per element, so a
score's error sum_i q_i k_i eps_i has variance ~ sum_i q_i^2 k_i^2, large when q and k sit on
the same few channels; a rotation spreads them, towards |q|^2 |k|^2 / d. The script prints that
concentration, d sum_i q_i^2 k_i^2 / (|q|^2 |k|^2), per layer over the texts' causal (query,
key) pairs of each query head with its KV head, plain and attention-weighted (the weight the
score's error has on the output), unrotated and rotated, and the attention-weighted RMS error
that e4m3 keys (rounded in that basis) put on q . k / sqrt(d).

    PYTHONPATH=. python lab/fp8_kv_fidelity.py [--text docs/en/versions/*.md]
        [--calibration scripts/fidelity_text.txt] [--only VARIANT ...]

It also prints each layer's largest |K| and |V| and the share of values under e4m3's smallest
normal (2^-6). Run on the 2-core CPU: ~20 s a variant for 4,134 positions, ~1 min for the
fp32, calibration and bf16 runs and the concentration; --only runs just the named variants.
"""

from __future__ import annotations

import argparse
import functools
import glob
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from flashlet.kvcache.kv_pool import FP8_MAX, KVPool, dequantize, quantize_fp8
from flashlet.models.weights import load_tokenizer, resolve_model_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fidelity  # noqa: E402  (scripts/ is not a package: its teacher-forced logits and statistics)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALLEST_NORMAL = 2.0 ** -6  # e4m3's: below it the rounding's relative error grows


# What scripts/fidelity.py's --perplexity reads of its arguments (its defaults: the embedded
# model, the CPU, 16-token pages, 96-token chunks).
ENGINE = SimpleNamespace(model=None, device="cpu", page_size=16, chunk=96)


def engine_run(seqs: list[list[int]], dtype: str = "bfloat16", **variant):
    """Each position's argmax token and each next token's negative log-likelihood, teacher-forced
    through the engine (`fidelity.engine_scores`)."""
    return fidelity.engine_scores(ENGINE, seqs, dtype, variant)


def through(x: torch.Tensor, fmt: torch.dtype | int) -> torch.Tensor:
    """x rounded to the fp8 format `fmt` (saturating at its range, as the pool's store does); an
    int `fmt` is a mantissa width alone (round half to even, no exponent limits: 3 is e4m3 on
    its normal range)."""
    if isinstance(fmt, int):
        m, e = torch.frexp(x.float())  # |m| in [0.5, 1): its leading bit is the implicit one
        step = 2.0 ** (fmt + 1)
        return torch.ldexp(torch.round(m * step) / step, e).to(x.dtype)
    limit = torch.finfo(fmt).max
    return x.float().clamp(-limit, limit).to(fmt).float().to(x.dtype)


def hadamard(d: int) -> torch.Tensor:
    """The d x d Walsh-Hadamard matrix (Sylvester's construction), normalized: orthogonal."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs head_dim a power of 2, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)


def randomized_hadamard(d: int, seed: int = 0) -> torch.Tensor:
    """diag(s) H: H's rows' signs flipped by a fixed-seed random +-1 vector s (still orthogonal)."""
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs[:, None].float() * hadamard(d)


ROTATIONS = {"Hadamard": hadamard, "randomized Hadamard": randomized_hadamard}  # name -> d -> R


@functools.cache
def rotation(name: str | None, d: int) -> torch.Tensor | None:
    """ROTATIONS[name]'s d x d matrix; None for None (no rotation)."""
    return None if name is None else ROTATIONS[name](d)


def rotated_through(x: torch.Tensor, fmt: torch.dtype | int, rot: str | None) -> torch.Tensor:
    """x [..., D] rounded through `fmt` in the basis R = rotation(rot): round(x R) R^T
    (`through` when rot is None)."""
    r = rotation(rot, x.shape[-1])
    if r is None:
        return through(x, fmt)
    return (through(x.float() @ r, fmt) @ r.T).to(x.dtype)


class WriteHook:
    """KVPool.write wrapped for a block: `change(layer, k, v) -> (k, v)` before the store."""

    def __init__(self, change):
        self.change = change

    def __enter__(self):
        self.original = KVPool.write
        change, original = self.change, self.original

        def write(pool, layer, k, v, slot_mapping):
            k, v = change(layer, k, v)
            return original(pool, layer, k, v, slot_mapping)

        KVPool.write = write
        return self

    def __exit__(self, *exc):
        KVPool.write = self.original


class RopeHook:
    """KVPool.write_rope wrapped for a block: `see(layer, q, k, positions)` gets each step's
    post-RoPE q [T, Hq, D] and the k [T, Hkv, D] the pool stored."""

    def __init__(self, see):
        self.see = see

    def __enter__(self):
        self.original = KVPool.write_rope
        see, original = self.see, self.original

        def write_rope(pool, layer, q, k, v, positions, cos_sin_cache, slot_mapping, qk_norm=None):
            q = original(pool, layer, q, k, v, positions, cos_sin_cache, slot_mapping, qk_norm)
            stored = pool.k_cache[layer].view((-1,) + tuple(pool.k_cache.shape[3:]))[slot_mapping]
            see(layer, q, stored, positions)
            return q

        KVPool.write_rope = write_rope
        return self

    def __exit__(self, *exc):
        KVPool.write_rope = self.original


class Concentration:
    """Per layer and rotation: d sum_i q_i^2 k_i^2 / (|q|^2 |k|^2) (1 when q and k spread evenly
    over the d channels; d when both sit on one) over each query head's causal pairs with its
    KV head's keys, plain and weighted by the pair's attention probability. Sequences run one at
    a time, in order (position 0 starts one), as `fidelity.engine_scores` runs them."""

    def __init__(self, rotations: dict[str, torch.Tensor | None]):
        self.rotations = rotations
        self.keys: dict[int, torch.Tensor] = {}  # layer -> this sequence's keys so far [L, Hkv, D]
        # plain sum, pairs, weighted sum, rows, weighted squared score error of e4m3 keys
        self.sums: dict[tuple[int, str], list[float]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        k = k.float()
        start = int(positions[0])
        keys = k if start == 0 else torch.cat((self.keys[layer], k))
        self.keys[layer] = keys
        if keys.shape[0] != int(positions[-1]) + 1:
            raise RuntimeError("Concentration expects one sequence a step, its chunks in order")
        q, d = q.float(), q.shape[-1]
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)  # [L, Hq, D]
        causal = torch.arange(keys.shape[0])[None, :] <= positions[:, None]  # [T, L]
        scores = torch.einsum("thd,lhd->htl", q, keys) / math.sqrt(d)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [Hq, T, L]
        for name, r in self.rotations.items():
            qr, kr = (q, keys) if r is None else (q @ r, keys @ r)
            q2, k2 = qr.square(), kr.square()
            ratio = d * torch.einsum("thd,lhd->htl", q2, k2) / (
                q2.sum(-1).T[:, :, None] * k2.sum(-1).T[:, None, :])
            # q . (round(k R) R^T - k) = (q R) . (round(k R) - k R), over sqrt(d) as softmax sees it
            error = torch.einsum("thd,lhd->htl", qr, through(kr, E4M3) - kr) / math.sqrt(d)
            s = self.sums.setdefault((layer, name), [0.0, 0, 0.0, 0, 0.0])
            s[0] += ratio.masked_fill(~causal, 0.0).sum().item()
            s[1] += int(causal.sum()) * q.shape[1]
            s[2] += (ratio * probs).sum().item()
            s[3] += probs.shape[0] * probs.shape[1]
            s[4] += (error.square() * probs).sum().item()

    def table(self) -> str:
        """Markdown: per layer, each rotation's plain / attention-weighted mean, and the
        attention-weighted RMS error e4m3 keys (rounded in that basis) put on the scores."""
        layers = sorted({layer for layer, _ in self.sums})
        lines = ["| layer | " + " | ".join(f"{n}: plain / weighted / score RMS error"
                                        for n in self.rotations) + " |",
                 "|---" * (1 + len(self.rotations)) + "|"]
        for layer in layers:
            cells = []
            for name in self.rotations:
                s = self.sums[layer, name]
                cells.append(f"{s[0] / s[1]:.2f} / {s[2] / s[3]:.2f} / {math.sqrt(s[4] / s[3]):.4f}")
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def calibrate(seqs: list[list[int]]) -> dict:
    """Per layer over `seqs` through the bf16 engine: largest |K| and |V|, the share of each
    under SMALLEST_NORMAL, and the mean post-RoPE K per head and channel."""
    stats: dict[int, dict] = {}

    def observe(layer, k, v):
        s = stats.setdefault(layer, {"k_max": 0.0, "v_max": 0.0, "k_small": 0, "v_small": 0,
                                     "n": 0, "k_sum": 0.0})
        for name, x in (("k", k), ("v", v)):
            a = x.detach().float().abs()
            s[f"{name}_max"] = max(s[f"{name}_max"], a.max().item())
            s[f"{name}_small"] += int((a < SMALLEST_NORMAL).sum())
        s["n"] += k.numel()
        s["k_sum"] = s["k_sum"] + k.detach().float().sum(0)
        s["rows"] = s.get("rows", 0) + k.shape[0]
        return k, v

    with WriteHook(observe):
        engine_run(seqs)
    for s in stats.values():
        s["k_mean"] = s["k_sum"] / s["rows"]
    return stats


def versus(agree: torch.Tensor, other: torch.Tensor | None) -> str:
    """The paired agreement difference to `other`, in points +- 1.96 SE ("" without one)."""
    if other is None:
        return ""
    diff, se = fidelity.paired_difference(agree, other)
    return f"{100 * diff:+.2f} +- {100 * fidelity.Z95 * se:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", nargs="+", default=sorted(glob.glob(str(ROOT / "docs/en/versions/*.md"))))
    p.add_argument("--calibration", nargs="+", default=[str(ROOT / "scripts/fidelity_text.txt")])
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--only", nargs="+", default=None, metavar="VARIANT",
                   help="run only these variants (their names as the table prints them)")
    args = p.parse_args()

    def rounding(k_fmt=None, v_fmt=None, smooth=False, k_rot=None, v_rot=None):
        def change(layer, k, v):
            if k_fmt is not None:
                mean = stats[layer]["k_mean"] if smooth else 0.0
                k = (rotated_through(k.float() - mean, k_fmt, k_rot) + mean).to(k.dtype)
            return k, (rotated_through(v, v_fmt, v_rot) if v_fmt is not None else v)
        return change

    def scaled(layer, k, v):  # stored as the fp8 pool's write stores them, read back scaled
        ks, vs = stats[layer]["k_max"] / FP8_MAX, stats[layer]["v_max"] / FP8_MAX
        return (dequantize(quantize_fp8(k, ks, E4M3), ks, k.dtype),
                dequantize(quantize_fp8(v, vs, E4M3), vs, v.dtype))

    def hooked(change):
        with WriteHook(change):
            return engine_run(seqs)

    h, rh = "Hadamard", "randomized Hadamard"
    variants = {  # each runs after `stats` (the calibration) is set
        "e4m3 K only": lambda: hooked(rounding(k_fmt=E4M3)),
        "e4m3 V only": lambda: hooked(rounding(v_fmt=E4M3)),
        "e4m3 K + V": lambda: hooked(rounding(E4M3, E4M3)),
        "e5m2 K + V": lambda: hooked(rounding(E5M2, E5M2)),
        "fp8 pool, scale 1.0": lambda: engine_run(seqs, kv_cache_dtype="fp8"),
        "absmax / 448 scales, K + V e4m3": lambda: hooked(scaled),
        "K smoothed, K + V e4m3": lambda: hooked(rounding(E4M3, E4M3, smooth=True)),
        "K rotated (Hadamard), K + V e4m3": lambda: hooked(rounding(E4M3, E4M3, k_rot=h)),
        "K and V rotated (Hadamard), K + V e4m3":
            lambda: hooked(rounding(E4M3, E4M3, k_rot=h, v_rot=h)),
        "K rotated (randomized Hadamard), K + V e4m3":
            lambda: hooked(rounding(E4M3, E4M3, k_rot=rh)),
        "K and V rotated (randomized Hadamard), K + V e4m3":
            lambda: hooked(rounding(E4M3, E4M3, k_rot=rh, v_rot=rh)),
        # controls: how the loss falls with each mantissa bit (no rotation, no range limits)
        "K + V 3 mantissa bits": lambda: hooked(rounding(3, 3)),
        "K + V 4 mantissa bits": lambda: hooked(rounding(4, 4)),
        "K + V 5 mantissa bits": lambda: hooked(rounding(5, 5)),
    }
    if args.only:
        unknown = [n for n in args.only if n not in variants]
        if unknown:
            p.error(f"--only: unknown variants {unknown}; known: {list(variants)}")
        variants = {n: variants[n] for n in args.only}

    tokenizer = load_tokenizer(resolve_model_dir(None))
    seqs = fidelity.text_sequences(tokenizer, args.text, args.max_len)
    calib = fidelity.text_sequences(tokenizer, args.calibration, args.max_len)
    print(f"SmolLM2-135M, {len(seqs)} texts, {sum(map(len, seqs))} positions; calibration "
          f"{sum(map(len, calib))} tokens", flush=True)
    ref, _ = engine_run(seqs, "float32")
    stats = calibrate(calib)
    layers = sorted(stats)
    for name in "kv":
        print(f"{name.upper()}: largest |x| per layer", [round(stats[i][f"{name}_max"], 2) for i in layers])
        print(f"{name.upper()}: share under 2^-6 per layer",
              [round(stats[i][f"{name}_small"] / stats[i]["n"], 3) for i in layers])

    head_dim = stats[layers[0]]["k_mean"].shape[-1]
    concentration = Concentration({"none": None, h: rotation(h, head_dim),
                                   rh: rotation(rh, head_dim)})
    with RopeHook(concentration):
        bf16, bf16_nll = engine_run(seqs)
    print("\nd sum_i q_i^2 k_i^2 / (|q|^2 |k|^2) per layer, mean over causal (query, key) pairs, "
          "plain / attention-weighted; and the attention-weighted RMS of the error e4m3 keys put "
          "on q . k / sqrt(d)\n" + concentration.table(), flush=True)

    base, plain = bf16 == ref, None  # plain: e4m3 K + V's agreement, once it has run
    print(f"\n| variant | agreement with fp32, % | minus bf16's, points (paired) | minus e4m3 K + V's "
          f"| perplexity | / bf16's, % (paired) |\n|---|---|---|---|---|---|\n| bf16 cache | "
          f"{100 * base.float().mean():.2f} | | | {math.exp(bf16_nll.mean().item()):.4f} | |",
          flush=True)
    for name, run in variants.items():
        top, nll = run()
        agree = top == ref
        # the perplexity ratio is exp of the mean per-token NLL difference: paired, as agreement
        diff, se = fidelity.paired_difference(nll, bf16_nll)
        print(f"| {name} | {100 * agree.float().mean():.2f} | {versus(agree, base)} | "
              f"{versus(agree, plain)} | {math.exp(nll.mean().item()):.4f} | "
              f"{100 * math.expm1(diff):+.2f} +- {100 * fidelity.Z95 * se:.2f} |", flush=True)
        plain = agree if name == "e4m3 K + V" else plain
    return 0


if __name__ == "__main__":
    sys.exit(main())
