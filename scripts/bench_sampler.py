"""The sampled path per decode step, alone: ms/step of `Sampler.sample` on [rows, vocab] logits
(default 128 x 151,936, Qwen2.5's vocabulary), the torch reference path against the Triton
kernel path, with decode-sat's sampled settings (temperature 0.7, top_p 0.9, presence 0.5,
frequency 0.5, repetition 1.1) and greedy argmax for scale; also the kernel and the sparse
penalties on their own. Issue 17's target: the whole sampled path under ~0.15 ms a step.

    python scripts/bench_sampler.py [--rows 128] [--vocab 151936] [--json out.json]

The logits are nearly flat, as a random-weight model's are (a top_p 0.9 nucleus holds ~90% of
the vocabulary); --scale 6 gives peaked rows. The sampler writes penalised values into its
logits, so every timed step first copies fresh logits in (its time is measured and subtracted).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashlet.request import Request  # noqa: E402
from flashlet.sampler import Sampler  # noqa: E402
from flashlet.sampling import SamplingParams  # noqa: E402


def cuda_ms(fn, iters: int, warmup: int = 5) -> float:
    """Median device time of fn() in ms (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--scale", type=float, default=1.0, help="logit scale (1 flat, 6 peaked)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    source = torch.randn(args.rows, args.vocab, device=device, generator=gen) * args.scale
    logits = torch.empty_like(source)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5,
                             frequency_penalty=0.5, repetition_penalty=1.1, max_new_tokens=4096)
    prompts = torch.randint(args.vocab, (args.rows, args.prompt_len)).tolist()

    def requests(params):
        return [Request(i, prompts[i], params) for i in range(args.rows)]

    results = {"rows": args.rows, "vocab": args.vocab, "scale": args.scale,
               "prompt_len": args.prompt_len, "device": torch.cuda.get_device_name()}
    refill = lambda: logits.copy_(source)  # noqa: E731
    copy_ms = cuda_ms(refill, args.iters)
    results["copy_logits_ms"] = copy_ms
    results["greedy_argmax_ms"] = cuda_ms(lambda: source.argmax(dim=-1), args.iters)
    for name, use_kernel in (("torch", False), ("kernel", True)):
        sampler = Sampler(device, {0}, use_kernel=use_kernel)
        reqs = requests(sampled)
        sampler.warm_up(args.vocab)

        def step():
            refill()
            sampler.sample(logits, reqs)

        results[f"sampled_{name}_ms"] = cuda_ms(step, args.iters) - copy_ms
        plain = requests(SamplingParams(temperature=0.7, top_p=0.9))
        results[f"no_penalties_{name}_ms"] = cuda_ms(
            lambda: (refill(), sampler.sample(logits, plain)), args.iters) - copy_ms
    from flashlet.kernels.sampling import sample_rows

    params = torch.tensor([[0.7, 0, 0.9, 0.0]] * args.rows, device=device)
    ids = torch.stack([torch.arange(args.rows), 12345 + torch.arange(args.rows)], 1).to(device)
    out = torch.empty(args.rows, dtype=torch.int64, device=device)
    results["kernel_only_ms"] = cuda_ms(lambda: sample_rows(source, params, ids, out), args.iters)
    params_k = torch.tensor([[0.7, 50, 0.9, 0.0]] * args.rows, device=device)
    results["kernel_only_top_k50_top_p_ms"] = cuda_ms(
        lambda: sample_rows(source, params_k, ids, out), args.iters)
    for key, value in results.items():
        print(f"{key:32s} {value:.4f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
