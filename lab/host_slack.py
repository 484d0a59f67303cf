"""How much host time one stream's step loop can take before the host paces it (issue 32: the
server's core loop adds its send and receive, ~48 us a step, to what in-process runs).

    PYTHONPATH=.:$CUTE python3 lab/host_slack.py [--config qwen2.5-0.5b] [--extra-us 0 10 20 40 80]

One request decodes `--tokens` tokens through `Engine.step()`, as the server's engine core
drives it; after each step the loop spins for EXTRA us (a stand-in for the core's send and
receive, on the same thread, holding the GIL as they do). Each EXTRA runs `--rounds` times,
interleaved. Where ms a token stays flat as EXTRA grows, the device paces the loop and the
host has that much slack; where it grows by EXTRA, the host paces it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flashlet import Engine, EngineConfig, SamplingParams


def decode_ms_per_token(engine: Engine, prompt: list[int], tokens: int, extra_s: float) -> float:
    engine.add_request(prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    while engine.step() == []:  # the prefill step (and the first token's)
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if extra_s:
            until = time.perf_counter() + extra_s
            while time.perf_counter() < until:
                pass
    return (time.perf_counter() - t0) * 1000 / max(steps, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--extra-us", type=float, nargs="+", default=[0, 10, 20, 40, 80])
    args = p.parse_args()
    engine = Engine(EngineConfig(config=args.config, dtype=args.dtype, max_num_pages=4096))
    vocab = engine.model_config.vocab_size
    prompt = [(i * 7919 + 43) % vocab for i in range(32)]
    decode_ms_per_token(engine, prompt, 64, 0.0)  # warm
    times: dict[float, list[float]] = {x: [] for x in args.extra_us}
    for _ in range(args.rounds):
        for x in args.extra_us:
            times[x].append(decode_ms_per_token(engine, prompt, args.tokens, x / 1e6))
    base = statistics.median(times[args.extra_us[0]])
    print(f"{args.config}, fused path: {engine.runner.fused is not None}; {args.tokens} tokens, "
          f"{args.rounds} rounds; median ms a token")
    print("| extra host us a step | ms a token | rounds | added us a token |")
    print("|---:|---:|---|---:|")
    for x in args.extra_us:
        med = statistics.median(times[x])
        print(f"| {x:g} | {med:.4f} | {' '.join(f'{t:.4f}' for t in times[x])} | "
              f"{(med - base) * 1000:+.1f} |")
    print(json.dumps({str(x): times[x] for x in args.extra_us}))


if __name__ == "__main__":
    main()
