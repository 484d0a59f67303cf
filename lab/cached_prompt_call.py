"""What a 1-token `LLM.generate` call on a cached prompt costs as the prompt grows, and where it
goes: the first token of a multi-turn chat whose history is in the prefix cache.

    PYTHONPATH=.:$CUTE python3 lab/cached_prompt_call.py [--config qwen3-0.6b] [--prompt-lens 32 1000 8000 30000]

One fresh process. For each length: the prompt is cached (one 8-token call), then --calls
1-token calls are timed (wall clock, synchronized), with the prefix cache's hit tokens, then one
more runs under torch.profiler: its device time by kernel (the top few) and in all, so the host's
part is the rest, and where in the call that rest falls (before the device's first event, in gaps
between its events, after its last); and one under cProfile: the host functions that took the most time of their
own. Why: `lab/one_stream_pair.py` on an H100 (session 43) read such a call at 2.0 ms after 32
tokens, 3.4 after 1,000 and 14.2 after 8,000 (Qwen3-0.6B), where only the last page's 16 tokens
are computed. One JSON line a length; on the CPU (tiny random model, `--model DIR`) the same
without the device part.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from flashlet import LLM, SamplingParams


def timed_call(llm, prompt) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def timeline(call: tuple[float, float], device: list[tuple[float, float]]) -> dict:
    """Where a call's wall clock went, from its span and its device events' spans (us, one
    clock): before the first device event (the host's work before it launches anything), the
    device busy (the union of its events), the gaps between them, and after the last one (the
    host's work after the device's). The four add up to the call."""
    start, end = call
    spans = sorted((max(a, start), min(b, end)) for a, b in device if b > start and a < end)
    if not spans:
        return {"before_device_ms": round((end - start) / 1e3, 3), "device_busy_ms": 0.0,
                "device_gaps_ms": 0.0, "after_device_ms": 0.0}
    busy, reach = 0.0, spans[0][0]
    for a, b in spans:
        busy += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    first, last = spans[0][0], reach
    return {"before_device_ms": round((first - start) / 1e3, 3), "device_busy_ms": round(busy / 1e3, 3),
            "device_gaps_ms": round((last - first - busy) / 1e3, 3),
            "after_device_ms": round((end - last) / 1e3, 3)}


def device_kernels(llm, prompt, top: int) -> dict:
    """One more call under torch.profiler: device ms in all, its `top` kernels by time, and the
    call's timeline (`timeline`): which part of the host's share comes before the device starts,
    between its kernels and after it ends."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("cached_prompt_call"):
            timed_call(llm, prompt)
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: -e.device_time_total)
    events = prof.events()
    call = next(e for e in events if e.name == "cached_prompt_call" and e.device_type.name == "CPU")
    device = [(e.time_range.start, e.time_range.end) for e in events  # (not the range's own GPU mark)
              if e.device_type.name == "CUDA" and e.name != "cached_prompt_call"]
    return {"device_ms": round(sum(e.device_time_total for e in kernels) / 1e3, 3),
            "top": [[e.key[:80], e.count, round(e.device_time_total / 1e3, 3)] for e in kernels[:top]],
            **timeline((call.time_range.start, call.time_range.end), device)}


def host_functions(llm, prompt, top: int) -> dict:
    """One more call under cProfile: the host functions that took the most time of their own
    (ms), what grows with the prompt besides the device's part."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    timed_call(llm, prompt)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"host_top": [[f"{Path(f).name}:{line}({name})", calls, round(own * 1e3, 3)]
                         for (f, line, name), (calls, _, own, _, _) in rows]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b", help="a preset (random weights at its shape)")
    p.add_argument("--model", default=None, help="a model folder instead of --config")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 1000, 8000, 30000])
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--top", type=int, default=6)
    args = p.parse_args(argv)
    kw = dict(max_num_pages=max(args.prompt_lens) // 16 * 2 + 256)
    if args.model:
        llm = LLM(args.model, **kw)
    else:
        llm = LLM(config=args.config, dtype="bfloat16", **kw)
    cache = llm.engine.scheduler.cache
    vocab = llm.engine.model_config.vocab_size
    for n in args.prompt_lens:
        rng = random.Random(n)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))  # cached
        hit0, queried0 = cache.hit_tokens, cache.queried_tokens
        calls = [timed_call(llm, prompt) for _ in range(args.calls)]
        row = {"config": args.model or args.config, "prompt_len": n,
               "call_ms": [round(t * 1e3, 3) for t in calls],
               "hit_tokens_a_call": (cache.hit_tokens - hit0) // args.calls,
               "queried_tokens_a_call": (cache.queried_tokens - queried0) // args.calls}
        if torch.cuda.is_available():
            row.update(device_kernels(llm, prompt, args.top))
        row.update(host_functions(llm, prompt, args.top))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
