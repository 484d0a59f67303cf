"""`--url`: load a running flashlet server through `POST /generate_stream` (SSE).

Closed loop (N clients per `--concurrency` level) or open loop (`--rate`: Poisson arrivals); or
`--workload long-prompt-gaps` (`long_prompt_gaps`): streams decoding while long prompts are sent
beside them, their token gaps and the long prompts' TTFT as one client process reads them.
The load generator must not be what limits: the streams are shared by `--client-procs` spawned
client processes (default: one per 32 streams, at most half the CPUs), each on the lean
httptools reader of sse.py (httpx costs several times more CPU per token,
lab/client_ceiling.py: one process of it capped the server's figures once). The closed loop's requests come from one queue shared by the
processes (a shared counter: requests go out in order, as from one process); the open loop's
schedule is dealt out round robin. Each process records with time.perf_counter, which is
CLOCK_MONOTONIC on Linux, one clock for every process of the host, and the parent merges their
records into one Trace. Connections are opened before the level's common start (the in-process
run has none to open).
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
Beside the client's TTFT, the server's own (the final event's `ttft_ms`: from its handler's start
to the first token in the API process) as `server_ttft_ms`, and with several API processes
(the `x-flashlet-api-server` header) both per process in `by_api_server`. Around each level
the server's own diagnostics (GET /debug/stats, server/diagnostics.py: each core's steps,
tokens per step and loop time split, the request turnaround, each API process's CPU busy
fraction, tokens per event and event-loop lag) go into `server_diag`.
Requests ask for `ignore_eos` so that output lengths are exact, as in-process. Prompts are
text: words from a fixed list, one word per requested token (about one token each in BPE
vocabularies; the server's usage.prompt_tokens gives the exact count).
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import traceback
from dataclasses import dataclass, field

import numpy as np

from flashlet.bench.common import (NO_PROGRESS, Progress, Spec, cpu_shares, gap_figures, machine_cpu,
                                   now, summarize)
from flashlet.bench.sse import Connection
from flashlet.bench.trace import Trace
from flashlet.server.diagnostics import level_figures

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


STREAMS_PER_PROCESS = 32  # the --client-procs default: one client process per this many streams
# The client processes' niceness above the bench's own: on a host the server shares, its engine
# core (whose loop sets the steps' pace) and API processes come first when CPUs are short, as
# the in-process run has none beside it; with CPUs to spare it changes nothing.
CLIENT_NICENESS = 5
OPEN_LOOP_PROCS = 4  # ... and for --rate (at most half the CPUs)
PREOPEN = 32  # open loop: connections each process opens before its schedule starts


@dataclass
class Partial:
    """What one client process saw of its requests (indices into the level's specs)."""

    submit: dict[int, float] = field(default_factory=dict)
    token_times: dict[int, list[float]] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)  # completed requests' output tokens
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    token_events: int = 0
    server_prompt_tokens: int = 0
    end: float = 0.0
    api_server: dict[int, str] = field(default_factory=dict)  # x-flashlet-api-server, if sent
    server_ttft: dict[int, float] = field(default_factory=dict)  # ms, the final event's ttft_ms


class _Events:
    """One response's SSE events, fed read by read: every token gets its read's arrival time."""

    def __init__(self):
        self.times: list[float] = []
        self.usage: dict | None = None
        self.server_ttft: float | None = None  # the server's own TTFT (ms), if it says
        self.events = 0
        self.done = False
        self._tail = b""

    def feed(self, t: float, piece: bytes) -> None:
        lines = (self._tail + piece).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            if self.done or not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            event = json.loads(data)
            if event.get("error"):
                raise RuntimeError(str(event["error"]))
            if event.get("finish_reason") is not None:
                self.usage = event.get("usage") or {}
                self.server_ttft = event.get("ttft_ms")
            elif "text" in event:  # a token event (one token unless it says otherwise)
                self.times.extend([t] * int(event.get("num_tokens", 1)))
                self.events += 1


async def _one(conn: Connection, spec: Spec, part: Partial, i: int, timeout: float,
               due: float | None = None) -> None:
    """Send request i and record its token arrivals. `due`: its scheduled arrival (open loop),
    so that a late send counts against TTFT."""
    payload = json.dumps({"prompt": spec.prompt, "max_new_tokens": spec.max_new_tokens,
                          "temperature": 0, "ignore_eos": True}).encode()
    part.submit[i] = now() if due is None else due
    events = _Events()
    try:
        await asyncio.wait_for(conn.post_stream("/generate_stream", payload, events.feed), timeout)
        if events.usage is None:
            raise RuntimeError("the stream ended without a final event")
    except Exception as e:  # one failed request is counted, not fatal
        conn.close()
        part.failed += 1
        part.errors.append(f"{type(e).__name__}: {e}"[:300])
        return
    part.token_times[i] = events.times
    if conn.api_server is not None:
        part.api_server[i] = conn.api_server
    if events.server_ttft is not None:
        part.server_ttft[i] = float(events.server_ttft)
    part.tokens[i] = events.usage.get("completion_tokens", len(events.times))
    part.token_events += events.events
    part.server_prompt_tokens += events.usage.get("prompt_tokens", 0)


# ---- one client process's share of a run ------------------------------------------------------
@dataclass
class Share:
    """A client process's part of a level: closed loop (`streams` clients taking requests from
    the level's one queue) or open loop (`indices` sent at `offsets` after the start)."""

    url: str
    specs: list[Spec]
    timeout: float
    streams: int = 0
    indices: list[int] = field(default_factory=list)
    offsets: list[float] = field(default_factory=list)


async def _run_share(share: Share, take, advance, start) -> Partial:
    """Open the connections, wait for the common start (`start()` -> its time), run the share.
    take() -> the next request index of the queue (None: empty); advance(): one done."""
    part = Partial()
    n_conns = share.streams or min(len(share.indices), PREOPEN)
    conns = [Connection(share.url) for _ in range(n_conns)]
    await asyncio.gather(*(c.open() for c in conns))
    if conns:  # this process's own first-use costs (imports, the parser) outside the timing
        await conns[0].get("/health")
    t0 = start()
    await asyncio.sleep(max(0.0, t0 - now()))
    if share.streams:
        async def client_loop(conn):
            while (i := take()) is not None:
                await _one(conn, share.specs[i], part, i, share.timeout)
                advance()

        await asyncio.gather(*(client_loop(c) for c in conns))
    else:
        idle = conns

        async def fire(i, offset):
            await asyncio.sleep(max(0.0, t0 + offset - now()))
            conn = idle.pop() if idle else Connection(share.url)
            await _one(conn, share.specs[i], part, i, share.timeout, t0 + offset)
            idle.append(conn)
            advance()

        await asyncio.gather(*(fire(i, o) for i, o in zip(share.indices, share.offsets)))
    part.end = now()
    for c in conns:
        c.close()
    return part


def _event_loop_run(coro):
    """asyncio.run, on uvloop when it is installed (less event-loop cost per read)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _client_process(pipe, next_request, num_done) -> None:
    """A spawned client process: run each Share the parent sends (None: exit). The shared
    counters: the closed loop's queue head, and requests done (the parent's progress bar)."""
    if hasattr(os, "nice"):
        os.nice(CLIENT_NICENESS)
    def take():
        with next_request.get_lock():
            i = next_request.value
            next_request.value = i + 1
        return i

    def advance():
        with num_done.get_lock():
            num_done.value += 1

    def start():
        pipe.send(("ready", None))
        t0 = pipe.recv()
        if t0 is None:  # another process failed before the start: the parent closes the pool
            raise SystemExit(0)
        return t0

    while (share := pipe.recv()) is not None:
        n = len(share.specs)
        try:
            part = _event_loop_run(_run_share(share, lambda: (i if (i := take()) < n else None),
                                              advance, start))
            pipe.send(("done", part))
        except SystemExit:
            return
        except BaseException:  # noqa: BLE001 - the parent reports it
            pipe.send(("error", traceback.format_exc()))


class ClientPool:
    """`size` spawned client processes, kept for the whole run (started once: each imports
    flashlet). Timestamps are time.perf_counter, CLOCK_MONOTONIC on Linux: one clock for every
    process of the host, so the parent merges them as they are."""

    def __init__(self, size: int):
        ctx = multiprocessing.get_context("spawn")
        self.next_request = ctx.Value("q", 0)
        self.num_done = ctx.Value("q", 0)
        self.pipes, self.procs = [], []
        for k in range(size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_process, name=f"flashlet-bench-client{k}",
                               args=(theirs, self.next_request, self.num_done), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    @property
    def size(self) -> int:
        return len(self.procs)

    def run(self, shares: list[Share], task) -> tuple[float, list[Partial]]:
        """Run one share per process (the first len(shares)) from one common start: (start,
        partials)."""
        self.next_request.value = 0
        self.num_done.value = 0
        pipes = self.pipes[:len(shares)]
        for pipe, share in zip(pipes, shares):
            pipe.send(share)
        for pipe in pipes:  # every process has its connections open
            self._receive(pipe, "ready")
        start = now() + 0.01
        for pipe in pipes:
            pipe.send(start)
        parts, shown = [], 0
        for pipe in pipes:
            while not pipe.poll(0.05):
                shown = self._show(task, shown)
                self._check_alive()
            parts.append(self._receive(pipe, "done"))
        self._show(task, shown)
        return start, parts

    def _receive(self, pipe, kind: str):
        while not pipe.poll(1.0):
            self._check_alive()
        what, value = pipe.recv()
        if what == "error":
            raise RuntimeError(f"a client process failed:\n{value}")
        assert what == kind, (what, kind)
        return value

    def _show(self, task, shown: int) -> int:
        done = self.num_done.value
        if done > shown:
            task.advance(done - shown)
        return done

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.exitcode is not None:
                raise RuntimeError(f"client process {proc.name} exited ({proc.exitcode})")

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_shares(shares: list[Share], pool: ClientPool | None, task) -> tuple[float, list[Partial]]:
    """One share here, in this process (no pool), or each share in its own client process."""
    if pool is None:
        assert len(shares) == 1
        share, queue = shares[0], iter(range(len(shares[0].specs)))
        t0 = []

        def start():
            t0.append(now())
            return t0[0]

        part = _event_loop_run(_run_share(share, lambda: next(queue, None), task.advance, start))
        return t0[0], [part]
    return pool.run(shares, task)


def merge(specs: list[Spec], start: float, parts: list[Partial]) -> Trace:
    """The client processes' records as one Trace (their clocks are one clock)."""
    trace = Trace(requested=[s.max_new_tokens for s in specs], prompt_lens=[s.prompt_len for s in specs])
    trace.start, trace.end = start, max((p.end for p in parts), default=start)
    events = prompt_tokens = 0
    for part in parts:
        for i, t in part.submit.items():
            trace.submit[i] = t
        for i, times in part.token_times.items():
            trace.token_times[i] = times
            trace.outputs[i] = [0] * part.tokens[i]  # only the count is known on this side
        trace.failed += part.failed
        if part.errors:
            trace.extra.setdefault("errors", []).extend(part.errors)
        events += part.token_events
        prompt_tokens += part.server_prompt_tokens
    if events:
        trace.extra["token_events"] = events
        trace.extra["server_prompt_tokens"] = prompt_tokens
    server_ttft = {i: t for part in parts for i, t in part.server_ttft.items()}
    if server_ttft:  # from the handler's start to the first token in the API process
        trace.extra["server_ttft_ms"] = summarize(server_ttft.values())
    served = {i: k for part in parts for i, k in part.api_server.items()}
    if served:  # several API processes: TTFT by the process that served
        trace.extra["by_api_server"] = {
            k: {"requests": sum(1 for v in served.values() if v == k),
                "ttft_ms": summarize([trace.token_times[i][0] - trace.submit[i]
                                      for i, v in served.items() if v == k and trace.token_times[i]],
                                     1e3),
                "server_ttft_ms": summarize([t for i, t in server_ttft.items()
                                             if served.get(i) == k])}
            for k in sorted(set(served.values()))}
    return trace


def split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal counts, larger first."""
    return [total // parts + (k < total % parts) for k in range(parts)]


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def client_procs(requested: int | None, streams: int) -> int:
    """Client processes for `streams` concurrent streams: --client-procs (at most one per
    stream), else one per STREAMS_PER_PROCESS streams, at most half the CPUs this process may
    use (the server under test usually shares the host)."""
    if requested:
        return max(1, min(requested, streams))
    return max(1, min(math.ceil(streams / STREAMS_PER_PROCESS), usable_cpus() // 2))


def _closed(url, specs, concurrency, timeout, procs, pool, task) -> Trace:
    streams = min(concurrency, len(specs))
    shares = [Share(url, specs, timeout, streams=k) for k in split(streams, procs)]
    return merge(specs, *run_shares(shares, pool if procs > 1 else None, task))


def _open(url, specs, rate, seed, timeout, procs, pool, task) -> Trace:
    gaps = np.random.default_rng([seed, 31337]).exponential(1.0 / rate, size=len(specs))
    arrivals = np.cumsum(gaps) - gaps[0]
    procs = min(procs, len(specs))
    shares = [Share(url, specs, timeout, indices=list(range(k, len(specs), procs)),
                    offsets=[float(a) for a in arrivals[k::procs]]) for k in range(procs)]
    trace = merge(specs, *run_shares(shares, pool if procs > 1 else None, task))
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


def server_debug_stats(url: str) -> dict | None:
    """The server's diagnostics counters (GET /debug/stats; None if it has none)."""
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/debug/stats", timeout=60)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _server_figures(before: dict | None, after: dict | None, duration: float) -> dict | None:
    if before is None or after is None:
        return None
    return level_figures(before, after, duration)


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


# ---- long prompts arriving beside decoding streams, through the server --------------------------
def gap_stream_tokens(args) -> int:
    """Output tokens each stream asks for, enough to outlast the window whatever the server's
    step bounds: its baseline, then the long prompts' tokens at no fewer than 128 a step
    (the server's default carries ~450 beside 64 decodes), doubled for slack."""
    return 2 + args.gap_baseline_steps + 2 * math.ceil(args.gap_long_prompts * args.gap_long_prompt_len / 128) + 64


async def _stream_into(conn: Connection, spec: Spec, events: _Events) -> None:
    payload = json.dumps({"prompt": spec.prompt, "max_new_tokens": spec.max_new_tokens,
                          "temperature": 0, "ignore_eos": True}).encode()
    await conn.post_stream("/generate_stream", payload, events.feed)


async def _long_prompt_gaps(args) -> dict:
    """N streams decode; once every one has its first token, gap_baseline_steps more tokens
    each make the baseline window; then M long prompts (one output token) are sent at once,
    and the window runs to the last one's first token. The streams' connections are closed
    then (the server aborts their requests). Token times are the client's reads."""
    N, M, L = args.gap_streams, args.gap_long_prompts, args.gap_long_prompt_len
    streams = text_specs(N, (args.gap_stream_prompt_len,) * 2, (args.gap_stream_tokens,) * 2, args.seed, 1)
    longs = text_specs(M, (L, L), (1, 1), args.seed, 2)
    conns = [Connection(args.url) for _ in range(N + M)]
    await asyncio.gather(*(c.open() for c in conns))
    await conns[0].get("/health")
    events = [_Events() for _ in streams]
    tasks = [asyncio.create_task(_stream_into(conns[i], spec, events[i])) for i, spec in enumerate(streams)]

    async def until(least: int) -> None:  # every stream has `least` tokens (a failed one raises)
        deadline = now() + args.request_timeout
        while min(len(e.times) for e in events) < least:
            for t in tasks:
                if t.done():
                    t.result()  # its error, if it failed
                    raise RuntimeError("long-prompt-gaps: a stream finished before the window "
                                       "ended (too few output tokens for this server's steps)")
            if now() > deadline:
                raise TimeoutError(f"long-prompt-gaps: the streams had fewer than {least} tokens "
                                   f"after --request-timeout {args.request_timeout} s")
            await asyncio.sleep(0.0005)

    try:
        await until(2)
        baseline_start = now()
        await until(2 + args.gap_baseline_steps)
        arrival = now()
        long_events = [_Events() for _ in longs]
        await asyncio.wait_for(asyncio.gather(*(_stream_into(conns[N + j], spec, long_events[j])
                                                for j, spec in enumerate(longs))), args.request_timeout)
        if any(t.done() for t in tasks):
            await until(10**9)  # says which stream ended, or how
        ends = [e.times[0] for e in long_events if e.times]
        if len(ends) < M:
            raise RuntimeError(f"long-prompt-gaps: {M - len(ends)} long prompt(s) gave no token")
        end = max(ends)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            c.close()
    return {"mode": "long-prompt-gaps", "max_decode_step_tokens": None, "max_num_batched_tokens": None,
            **gap_figures([e.times for e in events], baseline_start, arrival, end, [t - arrival for t in ends]),
            "stream_tokens_requested": args.gap_stream_tokens}


def long_prompt_gaps(args, progress: Progress = NO_PROGRESS) -> dict:
    task = progress.task(f"{args.url}: {args.gap_long_prompts} x {args.gap_long_prompt_len} words "
                         f"beside {args.gap_streams} streams", 1)
    before = server_steps(args.url)
    t0 = now()
    result = _event_loop_run(_long_prompt_gaps(args))
    task.advance()
    step = _mean_step(before, server_steps(args.url), now() - t0)
    if step is not None:  # the whole run's steps (streams' prefill and the window)
        result["run_step_ms"] = step
    return result


def run(args, progress: Progress = NO_PROGRESS) -> dict:
    if args.workload == "long-prompt-gaps":
        return long_prompt_gaps(args, progress)
    requested = getattr(args, "client_procs", None)
    if args.rate:
        procs = [requested or max(1, min(OPEN_LOOP_PROCS, usable_cpus() // 2))]
    else:
        procs = [client_procs(requested, min(c, n))
                 for c, n in zip(args.concurrency, args.level_requests)]
    pool = ClientPool(max(procs)) if max(procs) > 1 else None
    try:
        return _run_levels(args, progress, procs, pool)
    finally:
        if pool is not None:
            pool.close()


def _run_levels(args, progress, procs, pool) -> dict:
    if args.rate:
        specs = text_specs(args.num_requests, args.prompt_len_range, args.output_len_range, args.seed, 1)
        task = progress.task(f"open loop {args.rate} req/s", len(specs))
        trace = _open(args.url, specs, args.rate, args.seed, args.request_timeout, procs[0],
                      pool, task)
        return {"mode": "open-loop", "rate": args.rate, "client_procs": min(procs[0], len(specs)),
                **trace.metrics()}
    levels = []
    for li, c in enumerate(args.concurrency):
        specs = text_specs(args.level_requests[li], args.prompt_len_range, args.output_len_range,
                           args.seed, li + 1)
        task = progress.task(f"{args.url} c={c}", len(specs))
        before, debug_before = server_steps(args.url), server_debug_stats(args.url)
        cpu0 = machine_cpu()  # this machine's: the server's, where it runs here too
        trace = _closed(args.url, specs, c, args.request_timeout, procs[li], pool, task)
        level = {"concurrency": c, "client_procs": procs[li], **trace.metrics(),
                 "machine_cpu": cpu_shares(cpu0, machine_cpu())}
        step = _mean_step(before, server_steps(args.url), trace.duration)
        if step is not None:
            level["step_ms"], level["num_steps"] = step, step["n"]
        figures = _server_figures(debug_before, server_debug_stats(args.url), trace.duration)
        if figures is not None:
            level["server_diag"] = figures
        levels.append(level)
    return {"mode": "closed-loop", "levels": levels}
