"""Where an in-process step's time goes, by kind (pure decode / with a prefill chunk): the host
time to launch its forward, the time the device still needed after that, and the step's wall
time, for a closed loop of random prompts (issue 13: are the server's workloads host-bound?).
Then one-request prefills of each length twice: the first step of a new shape against a repeat.

    python lab/step_anatomy.py --config qwen2.5-0.5b --backend triton --concurrency 1 64 256

`--no-mixed-graphs` runs steps with a prefill chunk eagerly (EngineConfig.mixed_graphs), as
before mixed-step CUDA graphs: run once with and once without to compare. A chunk step's
token count is its real one (qo_indptr's last entry), not the bucket it was padded to.

Each forward is followed by a device synchronize here (to split launch from device time), so
the overlap of host and device is off: the figures are the parts, not the overlapped whole.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.core.request_check import RequestLimits

VOCAB = 30000  # prompt ids are drawn below this (set from the model in main)
MAX_PROMPT = 768


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ForwardTimer:
    """Wraps the runner's forward: host launch time and device-finish time, per step kind."""

    def __init__(self, engine: Engine):
        self.runner = engine.runner
        self.records: list[tuple[bool, int, float, float]] = []
        # A step runs one of them: `forward` (logits), or `greedy_tokens` (a plain greedy
        # decode step's graph ending in the argmax; None where no such graph serves it, and
        # then the step calls `forward`).
        for name in ("forward", "greedy_tokens"):
            setattr(self.runner, name, self._timed(getattr(self.runner, name)))

    def _timed(self, inner):
        def run(input_ids, meta):
            sync()
            t0 = time.perf_counter()
            out = inner(input_ids, meta)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if out is not None:
                tokens = int(meta.host.arrays["qo_indptr"][-1])
                self.records.append((meta.host.is_pure_decode, tokens, t1 - t0, t2 - t1))
            return out
        return run


def summarize(label: str, records, step_walls) -> None:
    for decode in (True, False):
        rows = [r for r in records if r[0] == decode]
        if not rows:
            continue
        launch = statistics.mean(r[2] for r in rows) * 1e3
        device = statistics.mean(r[3] for r in rows) * 1e3
        tokens = statistics.mean(r[1] for r in rows)
        print(f"{label:>10} {'decode' if decode else 'mixed':>7} {len(rows):6d} {tokens:8.1f} "
              f"{launch:10.3f} {device:10.3f}")
    print(f"{label:>10} step wall mean {statistics.mean(step_walls) * 1e3:.3f} ms "
          f"(host outside forward: {statistics.mean(step_walls) * 1e3 - statistics.mean(r[2] + r[3] for r in records) * 1e3:.3f})")


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def closed_loop(engine: Engine, timer: ForwardTimer, concurrency: int, seconds: float, rng,
                label: str | None = None, settle_steps: int = 200) -> None:
    def add():
        n = rng.randint(32, MAX_PROMPT)
        engine.add_request([rng.randrange(2, VOCAB) for _ in range(n)],
                           SamplingParams(max_new_tokens=128, ignore_eos=True))
    for _ in range(concurrency):
        add()
    # a level's opening burst (every stream's prompt at once, then lockstep decodes) is not
    # its steady state: the first settle_steps steps are left out
    walls, t_end, warm = [], time.perf_counter() + seconds, settle_steps
    timer.records.clear()
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        outs = engine.step()
        walls.append(time.perf_counter() - t0)
        for out in outs:
            if out.finished:
                add()
        if warm:
            warm -= 1
            if not warm:
                timer.records.clear()
                walls.clear()
    if warm:
        print(f"(c={concurrency}: {seconds} s ended {warm} steps before the level settled; "
              "the figures hold its opening)")
    summarize(label or f"c={concurrency}", timer.records, walls)
    while engine.has_unfinished():
        for out in engine.step():
            pass


def prefill_lengths(engine: Engine, timer: ForwardTimer, rng) -> None:
    lengths = [rng.randint(32, MAX_PROMPT) for _ in range(12)]
    print("\nprefill of one request (ms): length, first launch / device, repeat launch / device")
    for n in lengths:
        row = []
        for _ in range(2):
            timer.records.clear()
            engine.add_request([rng.randrange(2, VOCAB) for _ in range(n)],
                               SamplingParams(max_new_tokens=1, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            first = next(r for r in timer.records if not r[0])
            row.append(f"{first[2] * 1e3:7.2f} / {first[3] * 1e3:6.2f}")
        print(f"{n:6d}  " + "   ".join(row))


def profile_prefill(engine: Engine, tokens: int, rng) -> None:
    def one():
        engine.add_request([rng.randrange(2, VOCAB) for _ in range(tokens)],
                           SamplingParams(max_new_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        sync()
    one()  # the shape's first time
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        one()
    table = prof.key_averages()
    print(f"one prefill of {tokens} tokens (a repeat of its shape), torch.profiler:")
    print(table.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    one()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumtime").print_stats(30)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="triton")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--seconds", type=float, default=4.0, help="each level's time, its settling included")
    p.add_argument("--settle-steps", type=int, default=200,
                   help="steps of each level left out first (128-token requests: a 64- or "
                        "256-stream level's opening burst lasts ~130 steps)")
    p.add_argument("--max-prompt", type=int, default=768)
    p.add_argument("--profile-prefill", type=int, default=0, metavar="TOKENS",
                   help="first: torch.profiler over one prefill of this many tokens (a repeat)")
    p.add_argument("--burn", type=int, default=0,
                   help="also run each level again beside N processes that spin on the CPU "
                        "(the server's API and client processes, without their messages)")
    p.add_argument("--mixed-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="steps with a prefill chunk replay CUDA graphs (EngineConfig.mixed_graphs)")
    args = p.parse_args(argv)
    # fused_decode=False: the per-op path (ForwardTimer counts its forward and greedy_tokens;
    # the fused path's steps go through greedy_tokens too, but this tool reads per-op steps)
    engine = Engine(EngineConfig(config=args.config, backend=args.backend, dtype="bfloat16",
                                 max_num_pages=16384, overlap=False,
                                 mixed_graphs=args.mixed_graphs, fused_decode=False))
    start = engine.start_report
    print(f"mixed graphs {'on' if engine.runner.use_mixed_graphs else 'off'}: "
          f"{start.get('mixed_graphs', 0)} captured in {start.get('mixed_capture_s', 0.0):.2f} s; "
          f"{start.get('graphs', 0)} graphs in all")
    global VOCAB, MAX_PROMPT
    MAX_PROMPT = args.max_prompt
    VOCAB = min(VOCAB, RequestLimits.of_engine(engine).vocab_size)
    timer = ForwardTimer(engine)
    rng = random.Random(0)
    if args.profile_prefill:
        profile_prefill(engine, args.profile_prefill, rng)
    prefill_lengths(engine, timer, rng)
    print(f"\n{'level':>10} {'kind':>7} {'steps':>6} {'tokens':>8} {'launch ms':>10} {'device ms':>10}")
    for c in args.concurrency:
        closed_loop(engine, timer, c, args.seconds, rng, settle_steps=args.settle_steps)
    if args.burn:
        import multiprocessing as mp
        stop = mp.Event()
        burners = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.burn)]
        for b in burners:
            b.start()
        for c in args.concurrency:
            closed_loop(engine, timer, c, args.seconds, rng, label=f"c={c}+{args.burn}",
                        settle_steps=args.settle_steps)
        stop.set()
        for b in burners:
            b.join()
    import cProfile
    import pstats
    for _ in range(64):
        engine.add_request([rng.randrange(2, VOCAB) for _ in range(rng.randint(32, MAX_PROMPT))],
                           SamplingParams(max_new_tokens=128, ignore_eos=True))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(40):
        engine.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
