"""Where an in-process step's host time goes in a closed loop, at the engine's default
settings (overlap on, no device syncs added): each engine part wrapped by a timer (inclusive
seconds, so nested parts are also in their callers), per step, beside the step's wall time
and the part of it blocked on the device (Engine.device_wait_s). A part that is most of a
host-paced step is what to trim (issue 32: at 256 streams the step is paced by its host).

    python lab/host_phases.py --config qwen2.5-0.5b --backend triton --concurrency 64 256
    python lab/host_phases.py --device cpu --config /tmp/tiny.json --concurrency 256 --seconds 30 \
        --max-num-batched-tokens 8192 --max-num-pages 9000

`--burn N` runs each level again beside N busy processes (`--burn-kind spin`: a tight loop with
no memory to speak of, sharing only a core; `memory`: Python objects read and rewritten over
~64 MB each, as the server's API and client processes churn theirs, sharing the caches too):
does the same step's host part slow down beside them, as the server's engine core's does
(BENCHMARKS, session 30)?
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from collections import defaultdict

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.core.request_check import RequestLimits

# (owner attribute path from the engine, method): timed, inclusive of what each calls
PARTS = (
    ("scheduler", "schedule"),
    ("scheduler", "_schedule_decodes"),
    ("scheduler", "_schedule_prompts"),
    ("scheduler", "_batch_update"),
    ("scheduler", "_reserve"),
    ("scheduler.cache", "evict"),
    ("scheduler", "on_launch"),
    ("scheduler", "update"),
    ("scheduler", "finish"),
    ("", "_launch"),
    ("runner", "prepare"),
    ("runner", "load"),
    ("runner", "forward"),
    ("runner", "greedy_tokens"),
    ("sampler", "sample"),
    ("", "_finish"),
    ("", "add_request"),
)
# --fine: the parts of a one-row step's launch too (those an engine lacks are left out)
FINE_PARTS = (
    ("runner", "wait_inputs_staged"),
    ("runner.buffers", "load"),
    ("runner.buffers", "_feed"),
    ("runner.batch", "_advance"),
    ("runner.batch", "_decode_layout"),
    ("runner.batch", "_note_sampled"),
    ("runner", "_replay"),
    ("runner", "_replay_graph"),
    ("runner", "_decode_attention"),
    ("runner", "_decode_sampling_every_row"),
    ("runner.fused_attention", "plan_graph"),
    ("runner.fused_attention", "graph_key"),
    ("", "_greedy_tokens"),
)


class PartTimer:
    def __init__(self, engine: Engine, parts=PARTS):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for path, name in parts:
            owner = engine
            for attr in filter(None, path.split(".")):
                owner = getattr(owner, attr, None)
            if owner is None or not hasattr(owner, name):
                continue
            label = f"{path}.{name}" if path else f"engine.{name}"
            setattr(owner, name, self.timed(label, getattr(owner, name)))

    def timed(self, label: str, inner):
        """`inner`, its calls counted and their seconds added under `label`."""
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def run(*args, **kwargs):
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += clock() - t0
                calls[label] += 1
        return run

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def closed_loop(engine: Engine, timer: PartTimer, concurrency: int, seconds: float, rng,
                vocab: int, max_prompt: int, settle_steps: int) -> None:
    def add():
        n = rng.randint(32, max_prompt)
        engine.add_request([rng.randrange(2, vocab) for _ in range(n)],
                           SamplingParams(max_new_tokens=128, ignore_eos=True))
    for _ in range(concurrency):
        add()
    steps, step_s, tokens, left = 0, 0.0, 0, settle_steps
    loop_t0 = t_end = wait0 = None  # set once the level's opening burst (settle_steps) is over
    while t_end is None or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        outs = engine.step()
        step_s += time.perf_counter() - t0
        steps += 1
        for out in outs:
            tokens += len(out.new_token_ids)
            if out.finished:
                add()
        left -= 1
        if t_end is None and left <= 0:
            timer.clear()
            steps, step_s, tokens = 0, 0.0, 0
            loop_t0, wait0 = time.perf_counter(), engine.device_wait_s
            t_end = loop_t0 + seconds
    loop_s = time.perf_counter() - loop_t0
    wait_ms = (engine.device_wait_s - wait0) * 1e3 / steps
    print(f"\nc={concurrency}: {steps} steps, {tokens / steps:.1f} tokens a step, "
          f"{tokens / loop_s:,.0f} tok/s; step {step_s * 1e3 / steps:.3f} ms (loop "
          f"{loop_s * 1e3 / steps:.3f}), blocked on the device {wait_ms:.3f} ms")
    print(f"{'part':<34} {'calls/step':>10} {'ms/step':>8} {'us/call':>8}")
    for label, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
        n = timer.calls[label]
        print(f"{label:<34} {n / steps:10.2f} {s * 1e3 / steps:8.3f} {s * 1e6 / n:8.1f}")
    while engine.has_unfinished():
        engine.step()


def burn(kind: str, stop, ready) -> None:
    """One busy process until `stop` is set: a tight loop, or a walk over ~64 MB of objects."""
    if kind == "spin":
        ready.put(True)
        while not stop.is_set():
            sum(range(10_000))
        return
    rng = random.Random()
    rows = [[rng.random() for _ in range(64)] for _ in range(16_384)]  # ~64 MB of floats and lists
    ready.put(True)
    while not stop.is_set():
        for _ in range(10_000):
            row = rows[rng.randrange(len(rows))]
            row[rng.randrange(64)] = row[rng.randrange(64)] + 1.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--seconds", type=float, default=4.0, help="each level's timed time")
    p.add_argument("--settle-steps", type=int, default=200)
    p.add_argument("--max-prompt", type=int, default=768)
    p.add_argument("--max-num-pages", type=int, default=16384)
    p.add_argument("--fine", action="store_true", help="also time the parts of a one-row launch")
    p.add_argument("--burn", type=int, default=0, help="also run each level beside N busy processes")
    p.add_argument("--burn-kind", choices=["spin", "memory"], default="memory")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="(the CPU's default, 256, keeps a 256-stream loop from the GPU's mix)")
    args = p.parse_args(argv)
    kw = {"device": args.device} if args.device else {}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine = Engine(EngineConfig(config=args.config, backend=args.backend,
                                 dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
                                 max_num_pages=args.max_num_pages, **kw))
    vocab = min(30000, RequestLimits.of_engine(engine).vocab_size)
    timer = PartTimer(engine, PARTS + FINE_PARTS if args.fine else PARTS)
    rng = random.Random(0)
    for c in args.concurrency:
        closed_loop(engine, timer, c, args.seconds, rng, vocab, args.max_prompt, args.settle_steps)
        if args.burn:
            spawn = mp.get_context("spawn")  # (no fork of a process holding a CUDA context)
            stop, ready = spawn.Event(), spawn.Queue()
            burners = [spawn.Process(target=burn, args=(args.burn_kind, stop, ready), daemon=True)
                       for _ in range(args.burn)]
            for b in burners:
                b.start()
            for _ in burners:  # each busy before the level starts
                ready.get(timeout=120)
            print(f"\nbeside {args.burn} busy processes ({args.burn_kind}):", end="")
            try:
                closed_loop(engine, timer, c, args.seconds, rng, vocab, args.max_prompt,
                            args.settle_steps)
            finally:
                stop.set()
                for b in burners:
                    b.join()


if __name__ == "__main__":
    main()
