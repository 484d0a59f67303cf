"""Where a single-stream `LLM.generate` step's host time goes (issue 16's end-to-end gap).

    python lab/generate_trace.py [--config qwen2.5-0.5b] [--backend triton] [--no-fused-decode]

One fresh process: the engine starts (warm-up included), one untimed `generate` (32-token
prompt, 256 greedy tokens), then three timed ones:
  plain     wall clock, as `scripts/fused_decode_bench.py` reports it
  split     the same with the host time of the step's parts summed (perf_counter around
            Engine._launch and its parts: scheduling, ModelRunner.load, the model/graph launch,
            the sampler; Engine._finish, which waits for the step's tokens; the text outputs),
            per step, so host work can be told from waiting on the GPU
  engine    the harness's form: `engine.add_request` + `engine.step()` until done, no text
            outputs, wall clock
and a cProfile of one more `generate`, its top functions by own time. A step is host-bound
when its host work (everything but the wait inside _finish) exceeds the GPU's step time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_LEN, NEW_TOKENS = 32, 256


def timed(owner, name: str, totals: dict, label: str | None = None) -> None:
    """Wrap owner.name so that each call's host time adds to totals[label]."""
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[label or name] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="qwen2.5-0.5b", help="a preset (random weights); "
                    "'' with --model for real weights")
    ap.add_argument("--model", default=None, help="a model directory (default: the preset)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--max-num-pages", type=int, default=4096)
    ap.add_argument("--no-fused-decode", action="store_true", help="the per-op path")
    args = ap.parse_args()

    import torch

    from flashlet import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, config=args.config or None, backend=args.backend, dtype=args.dtype,
              max_num_pages=args.max_num_pages, **({"fused_decode": False} if args.no_fused_decode else {}))
    print(f"start {time.perf_counter() - t0:.1f} s; fused decode {llm.engine.config.fused_decode}")
    engine = llm.engine
    prompt = [(i * 7919 + 11) % engine.model_config.vocab_size for i in range(PROMPT_LEN)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([prompt], params)  # untimed

    def wall(fn) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    plain = wall(lambda: llm.generate([prompt], params))
    print(f"plain    generate {NEW_TOKENS / plain:8.0f} tok/s  ({plain * 1e3:.1f} ms)")

    totals: dict[str, float] = defaultdict(float)
    runner = engine.runner
    timed(engine, "step", totals)
    timed(engine, "_launch", totals)
    timed(engine, "_finish", totals)
    timed(engine.scheduler, "schedule", totals)
    timed(runner, "load", totals, "runner.load")
    timed(runner, "forward", totals, "runner.forward")
    timed(runner, "greedy_tokens", totals, "runner.greedy_tokens")
    timed(engine.sampler, "sample", totals, "sampler.sample")
    timed(llm.text_outputs, "process", totals, "text_outputs.process")
    steps0 = engine.num_steps
    split = wall(lambda: llm.generate([prompt], params))
    steps = engine.num_steps - steps0
    print(f"split    generate {NEW_TOKENS / split:8.0f} tok/s  ({split * 1e3:.1f} ms, {steps} steps); "
          f"host us per step:")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {seconds / steps * 1e6:8.1f}")
    wall_per_step = split / steps * 1e6
    other = wall_per_step - totals["step"] / steps * 1e6 - totals["text_outputs.process"] / steps * 1e6
    print(f"  {'(generate loop, other)':24s} {other:8.1f}   of {wall_per_step:.1f} us wall a step")

    def engine_loop():
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()

    loop = wall(engine_loop)
    print(f"engine   step loop {NEW_TOKENS / loop:8.0f} tok/s  ({loop * 1e3:.1f} ms)")

    prof = cProfile.Profile()
    prof.enable()
    profiled = wall(lambda: llm.generate([prompt], params))
    prof.disable()
    print(f"cProfile generate {NEW_TOKENS / profiled:8.0f} tok/s (profiled)")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(45)
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
