"""`--url`: load a running flashlet server through `POST /generate_stream` (SSE) with httpx.

Closed loop (N clients per `--concurrency` level) or open loop (`--rate`: Poisson arrivals).
The server sends one `data: {"text": ...}` event per generated token (its text may be empty
while the detokenizer holds bytes back), then a final event with `finish_reason` and `usage`,
then `data: [DONE]`. TTFT and inter-token latency are measured on the client, per token: every
token gets the arrival time of the event that carried it (an event may say it carries several
with `num_tokens`: the server sends several tokens in one event when it fell behind the
engine), so ITL is per token, not per SSE chunk. Tokens of one event, and events that arrive in
one network read, share one arrival time, as they would for any client: ITL 0 between them
(`token_events` counts the events, so output tokens / token_events shows how often). Output tokens
come from the final event's `usage.completion_tokens` (else one per token). "mean step" is the
server's: the level's duration over the engine steps its /metrics counted meanwhile (per core).
Requests ask for `ignore_eos` so that output lengths are exact, as in-process. Prompts are
text: words from a fixed list, one word per requested token (about one token each in BPE
vocabularies; the server's usage.prompt_tokens gives the exact count).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np

from flashlet.bench.common import NO_PROGRESS, Progress, Spec, now
from flashlet.bench.trace import Trace

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect use class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data "
    "picture practice piece land product doctor wall patient worker news test movie north love"
).split()


def text_specs(n: int, prompt_range, output_range, seed: int, stream: int = 0) -> list[Spec]:
    lengths = np.random.default_rng(seed)
    p_lens = lengths.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    o_lens = lengths.integers(output_range[0], output_range[1] + 1, size=n)
    rng = np.random.default_rng([seed, stream, 104729])
    return [Spec(" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=int(p))), int(o), int(p))
            for p, o in zip(p_lens, o_lens)]


async def _one(client, spec: Spec, trace: Trace, i: int, timeout: float,
               due: float | None = None) -> None:
    """Send request i and record its token arrivals. `due`: its scheduled arrival (open loop),
    so that a late send counts against TTFT."""
    payload = {"prompt": spec.prompt, "max_new_tokens": spec.max_new_tokens, "temperature": 0,
               "ignore_eos": True}
    trace.submit[i] = now() if due is None else due
    times, usage, events = [], None, 0
    try:
        async with client.stream("POST", "/generate_stream", json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:200]
                raise RuntimeError(f"HTTP {resp.status_code}: {body}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    raise RuntimeError(str(event["error"]))
                if event.get("finish_reason") is not None:
                    usage = event.get("usage") or {}
                elif "text" in event:  # a token event (one token unless it says otherwise)
                    times.extend([now()] * int(event.get("num_tokens", 1)))
                    events += 1
    except Exception as e:  # one failed request is counted, not fatal
        trace.failed += 1
        trace.extra.setdefault("errors", []).append(f"{type(e).__name__}: {e}"[:300])
        return
    if usage is None:
        trace.failed += 1
        trace.extra.setdefault("errors", []).append("the stream ended without a final event")
        return
    n_tokens = usage.get("completion_tokens", len(times))
    trace.token_times[i] = times
    trace.extra["token_events"] = trace.extra.get("token_events", 0) + events
    trace.outputs[i] = [0] * n_tokens  # only the count is known on this side
    trace.extra["server_prompt_tokens"] = (trace.extra.get("server_prompt_tokens", 0)
                                           + usage.get("prompt_tokens", 0))


async def _closed(url, specs, concurrency, timeout, task) -> Trace:
    import httpx

    trace = Trace(requested=[s.max_new_tokens for s in specs], prompt_lens=[s.prompt_len for s in specs])
    queue = list(range(len(specs)))[::-1]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        async def client_loop():
            while queue:
                i = queue.pop()
                await _one(client, specs[i], trace, i, timeout)
                task.advance()

        trace.start = now()
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(specs)))))
        trace.end = now()
    return trace


async def _open(url, specs, rate, seed, timeout, task) -> Trace:
    import httpx

    trace = Trace(requested=[s.max_new_tokens for s in specs], prompt_lens=[s.prompt_len for s in specs])
    gaps = np.random.default_rng([seed, 31337]).exponential(1.0 / rate, size=len(specs))
    arrivals = np.cumsum(gaps) - gaps[0]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        async def fire(i):
            due = trace.start + arrivals[i]
            await asyncio.sleep(max(0.0, due - now()))
            await _one(client, specs[i], trace, i, timeout, due)
            task.advance()

        trace.start = now()
        await asyncio.gather(*(fire(i) for i in range(len(specs))))
        trace.end = now()
    trace.extra["arrival_rate"] = rate
    return trace


def server_steps(url: str) -> list[float] | None:
    """The engine steps each core has run, from the server's /metrics (None if unreadable)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(url.rstrip("/") + "/metrics", timeout=30)
        if response.status_code != 200:
            return None
        for family in text_string_to_metric_families(response.text):
            if family.name == "flashlet_engine_steps":
                return [s.value for s in family.samples if s.name.endswith("_total")]
    except (httpx.HTTPError, ValueError):  # no server metrics here (not flashlet, or older)
        return None
    return None


def _mean_step(before, after, duration: float) -> dict | None:
    """step_ms from the server's step counters: its mean is the level's duration per step of a
    core (the cores step side by side); no distribution is known on this side."""
    if not before or not after or len(before) != len(after):
        return None
    steps = [b - a for a, b in zip(before, after) if b > a]
    if not steps:
        return None
    mean = duration * 1e3 / (sum(steps) / len(steps))
    return {"n": int(sum(steps)), "mean": mean, "p50": None, "p90": None, "p99": None,
            "min": None, "max": None}


def run(args, progress: Progress = NO_PROGRESS) -> dict:
    if args.rate:
        specs = text_specs(args.num_requests, args.prompt_len_range, args.output_len_range, args.seed, 1)
        task = progress.task(f"open loop {args.rate} req/s", len(specs))
        trace = asyncio.run(_open(args.url, specs, args.rate, args.seed, args.request_timeout, task))
        return {"mode": "open-loop", "rate": args.rate, **trace.metrics()}
    levels = []
    for li, c in enumerate(args.concurrency):
        specs = text_specs(args.level_requests[li], args.prompt_len_range, args.output_len_range,
                           args.seed, li + 1)
        task = progress.task(f"{args.url} c={c}", len(specs))
        before = server_steps(args.url)
        trace = asyncio.run(_closed(args.url, specs, c, args.request_timeout, task))
        level = {"concurrency": c, **trace.metrics()}
        step = _mean_step(before, server_steps(args.url), trace.duration)
        if step is not None:
            level["step_ms"], level["num_steps"] = step, step["n"]
        levels.append(level)
    return {"mode": "closed-loop", "levels": levels}
