"""The sampled path per decode step, alone: ms/step of `Sampler.sample` on [rows, vocab] logits
(default 128 x 151,936, Qwen2.5's vocabulary), the torch reference path against the Triton
kernel path, with decode-sat's sampled settings (temperature 0.7, top_p 0.9, presence 0.5,
frequency 0.5, repetition 1.1) and greedy argmax for scale; also the kernel and the sparse
penalties on their own. Issue 17's target: the whole sampled path under ~0.15 ms a step.

    python lab/bench_sampler.py [--rows 128] [--vocab 151936] [--json out.json]
    python lab/bench_sampler.py --host [--vocab 4096]   # on the CPU, no GPU needed
    python lab/bench_sampler.py --sweep   # and the kernel per (block size, warps)

--host counts what one steady sampled step (the same 128 requests as the step before) issues
on the kernel path: torch ops (torch.profiler, top-level aten ops) and Triton launches (the
launch functions replaced by counters, so these are counts, not times); and times the torch
path's whole `sample()` with time.perf_counter on the CPU at a small vocabulary, where the
host's per-row work is a visible part of it. The counts are device-independent, except that
on CUDA every host list sent to the device costs a pin_memory and a copy more.

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

from flashlet.core.request import Request  # noqa: E402
from flashlet.core.sampling import SamplingParams  # noqa: E402
from flashlet.runner.batch import InputBatch  # noqa: E402
from flashlet.runner.sampler import Sampler  # noqa: E402


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


def host_ms(fn, iters: int) -> float:
    """Median host time of fn() in ms (time.perf_counter; the device is idle before each call,
    so this is the Python and launch work alone, what an overlapped engine step pays)."""
    import time

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--scale", type=float, default=1.0, help="logit scale (1 flat, 6 peaked)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--host", action="store_true", help="op counts and host time, on the CPU")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the kernel alone per (block size, warps)")
    args = ap.parse_args()
    if args.host:
        return host_side(args)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    source = torch.randn(args.rows, args.vocab, device=device, generator=gen) * args.scale
    logits = torch.empty_like(source)
    sampled = SamplingParams(**SAMPLED)
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
        batch = InputBatch.holding(reqs)  # the state kept between steps
        sampler.warm_up(args.vocab)

        def step():
            refill()
            sampler.sample(logits, reqs, batch)

        results[f"sampled_{name}_ms"] = cuda_ms(step, args.iters) - copy_ms
        results[f"sampled_{name}_host_ms"] = host_ms(lambda: sampler.sample(logits, reqs, batch),
                                                     args.iters)
        plain = requests(SamplingParams(temperature=0.7, top_p=0.9))
        plain_batch = InputBatch.holding(plain)
        results[f"no_penalties_{name}_ms"] = cuda_ms(
            lambda: (refill(), sampler.sample(logits, plain, plain_batch)), args.iters) - copy_ms
    from flashlet.kernels.sampling import sample_rows

    params = torch.tensor([[0.7, 0, 0.9, 0.0]] * args.rows, device=device)
    ids = torch.stack([torch.arange(args.rows), 12345 + torch.arange(args.rows)], 1).to(device)
    # The sampler's form: (row, seed, position), mixed in the kernel (position -1: unseeded).
    mixed = torch.stack([torch.arange(args.rows), torch.zeros(args.rows, dtype=torch.int64),
                         torch.full((args.rows,), -1)], 1).to(device)
    out = torch.empty(args.rows, dtype=torch.int64, device=device)
    results["kernel_only_ms"] = cuda_ms(lambda: sample_rows(source, params, ids, out), args.iters)
    results["kernel_only_mixed_seeds_ms"] = cuda_ms(
        lambda: sample_rows(source, params, mixed, out), args.iters)
    params_k = torch.tensor([[0.7, 50, 0.9, 0.0]] * args.rows, device=device)
    results["kernel_only_top_k50_top_p_ms"] = cuda_ms(
        lambda: sample_rows(source, params_k, ids, out), args.iters)
    if args.sweep:
        results["sweep"] = sweep(source, args)
    return report(results, args.json, width=32)


def sweep(flat: torch.Tensor, args) -> list[dict]:
    """--sweep: the kernel alone per (block size, warps), flat and peaked rows, top_p 0.9
    and top_k 50 + top_p 0.9; a seed's tokens do not depend on the warps (checked here)."""
    from flashlet.kernels.sampling import sample_rows

    device = flat.device
    peaked = flat * 6
    p = torch.tensor([[0.7, 0, 0.9, 0.0]] * args.rows, device=device)
    pk = torch.tensor([[0.7, 50, 0.9, 0.0]] * args.rows, device=device)
    ids = torch.stack([torch.arange(args.rows), 12345 + torch.arange(args.rows)], 1).to(device)
    out = torch.empty(args.rows, dtype=torch.int64, device=device)
    rows = []
    print(f"{'block/4':>11} {'warps':>5} {'flat ms':>8} {'peaked ms':>9} {'top_k50 ms':>10}")
    for sub in (256, 512, 1024, 2048):
        sample_rows(flat, p, ids, out, sub=sub)
        want = out.clone()
        for warps in (4, 8, 16, 32):
            knobs = dict(sub=sub, num_warps=warps)
            try:
                sample_rows(flat, p, ids, out, **knobs)
                same = bool(torch.equal(out, want))
                row = dict(sub=sub, num_warps=warps, same_tokens=same,
                           flat_ms=cuda_ms(lambda: sample_rows(flat, p, ids, out, **knobs), args.iters),
                           peaked_ms=cuda_ms(lambda: sample_rows(peaked, p, ids, out, **knobs), args.iters),
                           top_k50_ms=cuda_ms(lambda: sample_rows(flat, pk, ids, out, **knobs), args.iters))
            except Exception as e:  # noqa: BLE001 (a variant that cannot compile: out of resources)
                row = dict(sub=sub, num_warps=warps, error=f"{type(e).__name__}: {e}"[:200])
            rows.append(row)
            if "error" in row:
                print(f"{sub:>11} {warps:>5} {row['error'][:60]}")
            else:
                print(f"{sub:>11} {warps:>5} {row['flat_ms']:8.4f} {row['peaked_ms']:9.4f} "
                      f"{row['top_k50_ms']:10.4f}" + ("" if row["same_tokens"] else "  TOKENS DIFFER"))
    return rows


SAMPLED = dict(temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
               repetition_penalty=1.1, max_new_tokens=4096)


def host_side(args) -> int:
    """--host: see the module docstring."""
    import time
    from collections import Counter

    import flashlet.kernels.sampling as kernels

    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(args.rows, args.vocab, generator=gen)
    prompts = torch.randint(args.vocab, (args.rows, args.prompt_len), generator=gen).tolist()
    results = {"rows": args.rows, "vocab": args.vocab}
    for name, params in (("sampled", SamplingParams(**SAMPLED)),
                         ("no_penalties", SamplingParams(temperature=0.7, top_p=0.9))):
        reqs = [Request(i, prompts[i], params) for i in range(args.rows)]
        batch = InputBatch.holding(reqs)
        launches = Counter()

        def counter(kernel):
            def launch(*a, **k):
                launches[kernel] += 1
                if kernel == "sample_rows":
                    a[3].zero_()  # valid tokens for what follows (its op is subtracted below)
            return launch

        saved = {k: getattr(kernels, k) for k in ("sample_rows", "penalise_rows", "record_rows")
                 if hasattr(kernels, k)}
        for k in saved:
            setattr(kernels, k, counter(k))
        try:
            sampler = Sampler(device, {0}, use_kernel=True)
            for _ in range(3):  # the first step sets up the batch (and penalty rows)
                sampler.sample(source.clone(), reqs, batch)
            launches.clear()
            steps = 10
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    sampler.sample(source, reqs, batch)
        finally:
            for k, fn in saved.items():
                setattr(kernels, k, fn)
        top = Counter(e.name for e in prof.events()
                      if e.name.startswith("aten::") and e.cpu_parent is None)
        top["aten::zero_"] -= launches["sample_rows"]
        results[f"{name}_kernel_path_torch_ops"] = sum(top.values()) / steps
        results[f"{name}_kernel_path_triton_launches"] = sum(launches.values()) / steps
        results[f"{name}_kernel_path_ops_by_name"] = {k: v / steps for k, v in top.items() if v}
        sampler = Sampler(device, {0}, use_kernel=False)
        logits = source.clone()
        for _ in range(3):
            sampler.sample(logits, reqs, batch)
        times = []
        for _ in range(args.iters):
            logits.copy_(source)
            start = time.perf_counter()
            sampler.sample(logits, reqs, batch)
            times.append((time.perf_counter() - start) * 1e3)
        results[f"{name}_torch_path_cpu_ms"] = sorted(times)[len(times) // 2]
    return report(results, args.json, width=42)


def report(results: dict, json_path, width: int) -> int:
    """Print one `key value` line per figure, keep them as JSON where asked; exit status 0."""
    for key, value in results.items():
        print(f"{key:{width}s} {value:.4f}" if isinstance(value, float) else f"{key:{width}s} {value}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
