"""A closed loop's steps on a virtual clock: why the server reads 0.92-0.94 of in-process at 16
streams with equal output lengths, and what would move it (issue 32).

    PYTHONPATH=. python lab/closed_loop_sim.py [--concurrency 4 16] [--requests 512] [--turnaround 2.5]
        [--jitter 1.0] [--bound 512]

No model and no engine: each step is scheduled as flashlet's scheduler does it (every decoding
request gets a token; prompt chunks in arrival order up to the step's prompt-token cap: the whole
budget when nothing decodes, else max(bound - decodes, 4 x decodes), scheduler.py's
`prompt_tokens_beside`) and costs what the H200 measured for that kind of step at the
qwen2.5-0.5b shape (STEP COSTS below). A request that finishes comes back after the client's
turnaround (0 in-process; through the server, --turnaround +- --jitter ms, uniform), with a
prompt of 32-768 tokens and 128 new tokens (or --output-len-range).

It prints output tok/s in-process (turnaround 0) and through the "server" (turnaround), and
their ratio, for: the scheduler as it is; `pack K` (whole prompts of at most --bound tokens
added beyond the cap, up to K x bound tokens a step); no bound; and the mixed step's decode
rows at the fused path's cost (what a cheaper mixed step would give).

Calibration (session 19, H200 at 43e2e4f, `serve_compare.py`, 256-512 requests a level): the
server / in-process ratio measured 0.95 / 0.92-0.94 at c = 4 / 16 with 128 tokens each and
0.98 / 0.97 with 64-192; this model gives 0.953 / 0.929 and 0.981 / 0.985. Its absolute
figures are rough (c = 16 in-process 17.2k against 16.6-17.2k measured; c = 4 5.7k against
6.4k), and it knows nothing of host time, the API processes or preemption.
"""

from __future__ import annotations

import argparse
import random

from flashlet.core.scheduler import prompt_tokens_beside

# STEP COSTS (ms, H200, qwen2.5-0.5b, bf16; BENCHMARKS.md): a pure decode step on the fused path
# by rows (1: one stream, 2,170 tok/s; 4 / 16: the profiled fused steps 0.690 / 0.864); a step
# with a prompt chunk runs per-op (16 decode rows alone: 1.23) plus its prompt tokens (the
# server's mixed-step gaps at c = 16: 1.2-2.2 ms); a prefill-only step (the in-process waves'
# TTFT: ~10 ms for 16 prompts of ~400 tokens).
FUSED_MS = {1: 0.46, 2: 0.55, 4: 0.69, 8: 0.78, 16: 0.864}
PER_OP_MS, PER_OP_16_ROWS_MS = 1.0, 1.23
MIXED_MS_PER_PROMPT_TOKEN = 1.6e-3
PREFILL_MS, PREFILL_MS_PER_TOKEN = 0.5, 1.4e-3
BUDGET = 8192  # max_num_batched_tokens


def fused_ms(rows: int) -> float:
    keys = sorted(FUSED_MS)
    rows = min(max(rows, keys[0]), keys[-1])
    for lo, hi in zip(keys, keys[1:]):
        if lo <= rows <= hi:
            return FUSED_MS[lo] + (FUSED_MS[hi] - FUSED_MS[lo]) * (rows - lo) / (hi - lo)
    return FUSED_MS[keys[-1]]


def per_op_ms(rows: int) -> float:
    return PER_OP_MS + (PER_OP_16_ROWS_MS - PER_OP_MS) * min(rows, 16) / 16


def step_ms(decodes: int, prompt_tokens: int, cheap_mixed: bool) -> float:
    if not prompt_tokens:
        return fused_ms(decodes)
    if not decodes:
        return PREFILL_MS + PREFILL_MS_PER_TOKEN * prompt_tokens
    rows = fused_ms(decodes) if cheap_mixed else per_op_ms(decodes)
    return rows + MIXED_MS_PER_PROMPT_TOKEN * prompt_tokens


def prompt_cap(decodes: int, bound: int) -> int:
    """A step's prompt tokens as the scheduler caps them (the whole budget with no decodes)."""
    return min(prompt_tokens_beside(decodes, bound), BUDGET) if decodes else BUDGET


def run(concurrency: int, requests: int, turnaround: float, jitter: float, bound: int,
        output_range: tuple[int, int], pack: int = 0, cheap_mixed: bool = False,
        seed: int = 0) -> float:
    """Output tok/s of one closed loop on the virtual clock."""
    rng = random.Random(seed)
    specs = [(rng.randint(32, 768), rng.randint(*output_range)) for _ in range(requests)]
    # a client's request: [arrival ms, prompt tokens left, tokens to make, tokens made]
    clients: list[list | None] = [[0.0, p, o, 0] for p, o in specs[:concurrency]]
    sent, now, tokens = concurrency, 0.0, 0
    while any(c is not None for c in clients):
        here = [c for c in clients if c is not None and c[0] <= now]
        decoding = [c for c in here if c[1] == 0]
        prompts = [c for c in here if c[1] > 0]
        if not here:
            now = min(c[0] for c in clients if c is not None)
            continue
        cap, taken, first = prompt_cap(len(decoding), bound), 0, []
        for c in prompts:
            if taken >= cap:
                break
            chunk = min(c[1], cap - taken)
            c[1] -= chunk
            taken += chunk
            if not c[1]:
                first.append(c)
        if pack and decoding:  # whole short prompts beyond the cap, up to pack x bound
            for c in prompts:
                if 0 < c[1] <= bound and taken + c[1] <= pack * bound:
                    taken += c[1]
                    c[1] = 0
                    first.append(c)
        now += step_ms(len(decoding), taken, cheap_mixed)
        for c in decoding + first:
            c[3] += 1
            tokens += 1
        for i, c in enumerate(clients):
            if c is not None and c[1] == 0 and c[3] >= c[2]:
                if sent < requests:
                    p, o = specs[sent]
                    sent += 1
                    back = now + max(0.0, turnaround + rng.uniform(-jitter, jitter))
                    clients[i] = [back, p, o, 0]
                else:
                    clients[i] = None
    return tokens / now * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--turnaround", type=float, default=2.5, help="ms (the server's p50: 2.2-2.7)")
    p.add_argument("--jitter", type=float, default=1.0, help="+- ms, uniform")
    p.add_argument("--bound", type=int, default=512, help="max_decode_step_tokens")
    p.add_argument("--output-len-range", type=int, nargs=2, default=None)
    args = p.parse_args(argv)
    ranges = [tuple(args.output_len_range)] if args.output_len_range else [(128, 128), (64, 192)]
    print("| streams | output tokens | in-process tok/s | server / in-process: as it is | "
          "pack 2 | pack 4 | no bound | mixed steps' decode rows at the fused cost |")
    print("|---" * 8 + "|")
    for out in ranges:
        for c in args.concurrency:
            base = run(c, args.requests, 0.0, 0.0, args.bound, out)
            ratios = [run(c, args.requests, args.turnaround, args.jitter, bound, out, pack, cheap)
                      / base for bound, pack, cheap in ((args.bound, 0, False),
                                                        (args.bound, 2, False),
                                                        (args.bound, 4, False),
                                                        (BUDGET, 0, False),
                                                        (args.bound, 0, True))]
            print(f"| {c} | {out[0]}-{out[1]} | {base:,.0f} | "
                  + " | ".join(f"{r:.3f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
