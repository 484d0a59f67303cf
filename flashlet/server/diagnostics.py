"""Where the server's time goes, measured by the server itself, read at `GET /debug/stats`.

Two sources, both cumulative counters (a reader takes two readings and their difference):
- each engine core's loop (`LoopCounters`, engine_core.py): steps, the tokens they made, and the
  loop's wall time split into running steps, sending their outputs, receiving and applying new
  messages (decode + add_request) and waiting idle for one; with the turnaround, the time from a
  request finishing in the core to the next request arriving there (finishes and arrivals
  matched first in, first out: in a closed loop, a client's next request follows its last one's
  finish); the host's wait on the device inside the steps (`Engine.device_wait_s`); and, read
  at the probe, the process's CPU time (every thread) and the times the kernel took its CPU
  away while it could still run (involuntary context switches: other processes wanting the
  CPU). Kept in the core's loop at a few clock reads per step and sent only in a probe's
  reply (never in the per-step messages).
- each API process (`ApiCounters`): its CPU time (process_time: every thread) over wall time
  and its involuntary context switches (as the core's),
  the SSE events it sent and the tokens they carried, the lateness of a periodic event-loop
  timer (the event loop's lag: what a step's tokens wait for once the reader thread hands them
  over) and the delay from a core sending a step's message to this process's reader thread
  decoding it (zmq and the interpreter lock), a request's intake (its handler's start to its
  submission to a core: validation, tokenizing), the client's own turnaround (on a keep-alive
  connection, from a response's end to the next request's start: what the load generator
  adds to the core's turnaround; a monitor's probes, `metrics.PROBE_PATHS`, apart), and the time in the garbage collector (also
  counted in each core). Kept in shared memory, one row per API process,
  so that whichever process answers /debug/stats reports all of them.

Latencies go into `LogHistogram`s (fixed geometric buckets, so that counts subtract) and come
out as quantiles of the difference of two readings (`quantiles`).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import gc
import multiprocessing
import resource
import time

# Bucket upper edges, seconds: 25 us to ~2.6 s in steps of x1.25 (quantiles to within 25%).
EDGES = tuple(25e-6 * 1.25 ** i for i in range(53))
NUM_BUCKETS = len(EDGES) + 1  # the last: beyond the last edge
LAG_TICK_S = 0.01  # the event-loop timer's period (~100 wake-ups/s: ~0.1% of a core)
TOTALS_EVERY_TICKS = 5  # CPU, wall and GC totals every 50 ms (a level lasts seconds)


def bucket_of(seconds: float) -> int:
    return bisect.bisect_left(EDGES, seconds)


def quantiles(before: list[float] | None, after: list[float],
              qs=(0.5, 0.99)) -> dict[str, float | int | None]:
    """{"n", "p50", "p99", "max"} (ms) of the samples counted between two readings of a
    histogram's buckets: each figure is its bucket's upper edge (the last bucket's: its lower
    edge)."""
    counts = [a - b for a, b in zip(after, before)] if before else list(after)
    n = sum(counts)
    out: dict[str, float | int | None] = {"n": int(n)}
    top = max((i for i, c in enumerate(counts) if c > 0), default=None)
    out["max"] = None if top is None else EDGES[min(top, len(EDGES) - 1)] * 1e3
    for q in qs:
        key = f"p{round(q * 100)}"
        if n <= 0:
            out[key] = None
            continue
        seen, rank = 0.0, q * n
        for i, c in enumerate(counts):
            seen += c
            if seen >= rank and c > 0:
                out[key] = EDGES[min(i, len(EDGES) - 1)] * 1e3
                break
    return out


class LogHistogram:
    def __init__(self):
        self.counts = [0] * NUM_BUCKETS

    def add(self, seconds: float) -> None:
        self.counts[bucket_of(seconds)] += 1


class GcTimer:
    """The CPU time this process spends in the garbage collector (a gc.callbacks pair per
    collection, ~1 us each; the collecting thread's CPU time, so that a preempted collection
    does not count the time spent waiting for a CPU): total seconds, full (generation 2)
    collections, and the collections over 5 ms (what stalls every stream at once)."""

    LONG_S = 0.005

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self.full = 0
        self.long = 0
        self._t = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.thread_time()
            return
        took = time.thread_time() - self._t
        self.seconds += took
        self.collections += 1
        self.full += info.get("generation") == 2
        self.long += took > self.LONG_S

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class LoopCounters:
    """An engine core loop's cumulative figures (engine_core.EngineCore owns one)."""

    PARTS = ("step", "send", "receive", "idle")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.steps = 0
        self.tokens = 0  # output tokens the steps made
        self.device_wait = 0.0  # of the steps' seconds, those blocked reading tokens (Engine.device_wait_s)
        self.requests = 0  # requests added
        self.turnaround = LogHistogram()
        self.step_time = LogHistogram()
        self._finishes: collections.deque[float] = collections.deque()
        self.gc = GcTimer()

    def add_time(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def step_done(self, seconds: float, num_tokens: int, num_finished: int,
                  device_wait: float = 0.0) -> None:
        """A step of `seconds` (device_wait of them blocked on the device's tokens) made
        num_tokens tokens and finished num_finished requests."""
        self.seconds["step"] += seconds
        self.device_wait += device_wait
        self.step_time.add(seconds)
        self.steps += 1
        self.tokens += num_tokens
        if num_finished:
            self._finishes.extend([time.monotonic()] * num_finished)

    def request_arrived(self) -> None:
        self.requests += 1
        if self._finishes:
            self.turnaround.add(time.monotonic() - self._finishes.popleft())

    def snapshot(self) -> dict:
        """The counters as of now; it starts a new turnaround window (finishes seen so far
        are not matched with later arrivals: a reader probes between its measurements)."""
        self._finishes.clear()
        return {"steps": self.steps, "tokens": self.tokens, "requests": self.requests,
                "seconds": dict(self.seconds), "device_wait_s": self.device_wait,
                "cpu_s": time.process_time(),
                "preempted": preemptions(), "turnaround": list(self.turnaround.counts),
                "step_time": list(self.step_time.counts),
                "gc_s": self.gc.seconds, "gc_full": self.gc.full, "gc_long": self.gc.long}


def preemptions() -> int:
    """This process's involuntary context switches so far (every thread): the kernel took a
    CPU from it while it could still run."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


# ---- the API processes' row in shared memory -------------------------------------------------
_CPU, _WALL, _EVENTS, _TOKENS, _GC_S, _GC_FULL, _GC_LONG, _PREEMPTED = range(8)
_LAG = 8
_DELIVERY = _LAG + NUM_BUCKETS
_INTAKE = _DELIVERY + NUM_BUCKETS
_CLIENT_GAP = _INTAKE + NUM_BUCKETS
ROW = _CLIENT_GAP + NUM_BUCKETS
MAX_CONNECTIONS_TRACKED = 100_000  # client_gap's open connections (a closed one's entry stays)


def shared_rows(count: int):
    """One row of counters per API process, shared by every process (spawn-safe)."""
    return multiprocessing.get_context("spawn").RawArray("d", count * ROW)


class ApiCounters:
    """This API process's row (`rows`: from shared_rows, or None for a private one)."""

    def __init__(self, index: int = 0, count: int = 1, rows=None):
        self.index, self.count = index, count
        self.rows = rows if rows is not None else shared_rows(count)
        self.base = index * ROW
        self._started: tuple[float, float] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._ended: dict = {}  # connection -> when its last response ended

    # Written by this process only (the event loop, and the reader thread for delivery: one
    # float += at a time, under the interpreter lock).
    def sent(self, num_tokens: int) -> None:
        """One SSE event carrying num_tokens tokens went out."""
        self.rows[self.base + _EVENTS] += 1
        self.rows[self.base + _TOKENS] += num_tokens

    def delivered(self, sent_at: float) -> None:
        """A core's step message that it sent at sent_at (time.monotonic) was decoded here."""
        self.rows[self.base + _DELIVERY + bucket_of(time.monotonic() - sent_at)] += 1

    def submitted(self, arrived_at: float) -> None:
        """A request whose handler started at arrived_at went to the engine (its intake:
        validation, tokenizing, routing)."""
        self.rows[self.base + _INTAKE + bucket_of(time.monotonic() - arrived_at)] += 1

    def request_started(self, connection) -> None:
        """A request came on `connection` (the client's address): the time since the last
        response on it ended is the client's own turnaround (keep-alive connections)."""
        ended = self._ended.pop(connection, None)
        if ended is not None:
            self.rows[self.base + _CLIENT_GAP + bucket_of(time.monotonic() - ended)] += 1

    def response_ended(self, connection) -> None:
        if len(self._ended) >= MAX_CONNECTIONS_TRACKED:
            self._ended.clear()
        self._ended[connection] = time.monotonic()

    def start(self) -> None:
        """Start the event-loop timer on the running loop (idempotent)."""
        if self._timer is None:
            self._started = (time.process_time(), time.monotonic())
            self._preempted0 = preemptions()
            self._gc = GcTimer()
            self._ticks = 0
            self._arm(asyncio.get_running_loop())

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._gc.close()
            self._timer = None

    def _arm(self, loop) -> None:
        # A plain callback, not a task sleeping in a loop: ~100 wake-ups a second are a
        # visible share of an idle API process's CPU, and a task's each costs several times
        # a callback's.
        self._due = time.monotonic() + LAG_TICK_S
        self._timer = loop.call_later(LAG_TICK_S, self._tick, loop)

    def _tick(self, loop) -> None:
        now = time.monotonic()
        self.rows[self.base + _LAG + bucket_of(max(now - self._due, 0.0))] += 1
        self._ticks += 1
        if self._ticks % TOTALS_EVERY_TICKS == 0:
            self._write_totals(now)
        self._arm(loop)

    def _write_totals(self, now: float) -> None:
        """CPU, wall and GC totals into this process's row (process_time sums every thread's
        time: not every tick)."""
        rows, base = self.rows, self.base
        cpu0, wall0 = self._started
        rows[base + _CPU] = time.process_time() - cpu0
        rows[base + _WALL] = now - wall0
        gc_timer = self._gc
        rows[base + _GC_S], rows[base + _GC_FULL] = gc_timer.seconds, gc_timer.full
        rows[base + _GC_LONG] = gc_timer.long
        rows[base + _PREEMPTED] = preemptions() - self._preempted0

    def snapshot(self) -> list[dict]:
        """Every API process's counters (those that have not started read zero; this
        process's totals as of now, the others' as of their latest totals tick)."""
        if self._timer is not None:
            self._write_totals(time.monotonic())
        out = []
        for k in range(self.count):
            row = self.rows[k * ROW:(k + 1) * ROW]
            out.append({"api_server": k, "cpu_s": row[_CPU], "wall_s": row[_WALL],
                        "events": row[_EVENTS], "tokens": row[_TOKENS], "gc_s": row[_GC_S],
                        "gc_full": row[_GC_FULL], "gc_long": row[_GC_LONG],
                        "preempted": row[_PREEMPTED],
                        "loop_lag": row[_LAG:_LAG + NUM_BUCKETS],
                        "delivery": row[_DELIVERY:_DELIVERY + NUM_BUCKETS],
                        "intake": row[_INTAKE:_INTAKE + NUM_BUCKETS],
                        "client_gap": row[_CLIENT_GAP:_CLIENT_GAP + NUM_BUCKETS]})
        return out


# ---- a reader's side: two readings -> a level's figures ------------------------------------
def _rate(before: dict, after: dict, key: str, wall: float) -> float | None:
    return (after[key] - before[key]) / wall if key in before and key in after else None


def level_figures(before: dict, after: dict, duration: float) -> dict:
    """What happened between two /debug/stats readings taken around a level of `duration`
    seconds (the level's own wall time: the readings' interval also holds the load generator's
    start-up, which would count as idle), per core and per API process."""
    wall = max(duration, 1e-9)
    cores = []
    for b, a in zip(before.get("cores", []), after.get("cores", [])):
        if "loop" not in a or "loop" not in b:
            continue
        lb, la = b["loop"], a["loop"]
        seconds = {p: la["seconds"][p] - lb["seconds"][p] for p in LoopCounters.PARTS}
        # idle: the rest of the level (the loop's own count also holds the time before it)
        seconds["idle"] = max(wall - seconds["step"] - seconds["send"] - seconds["receive"], 0.0)
        steps, tokens = la["steps"] - lb["steps"], la["tokens"] - lb["tokens"]
        cores.append({
            "steps": steps, "tokens": tokens, "requests": la["requests"] - lb["requests"],
            "steps_per_s": steps / wall,
            "tokens_per_step": tokens / steps if steps else None,
            "step_ms_mean": seconds["step"] * 1e3 / steps if steps else None,
            # of it, blocked reading the tokens (a reading without the field: None)
            "device_wait_ms_mean": ((la["device_wait_s"] - lb["device_wait_s"]) * 1e3 / steps
                                    if steps and "device_wait_s" in la and "device_wait_s" in lb
                                    else None),
            "step_ms": quantiles(lb["step_time"], la["step_time"]),
            "loop_share": {p: s / wall for p, s in seconds.items()},
            "turnaround_ms": quantiles(lb["turnaround"], la["turnaround"]),
            # the core process's CPU seconds a second, and the kernel's preemptions of it a
            # second (None from a reading without them)
            "cpu_busy": _rate(lb, la, "cpu_s", wall),
            "preempted_per_s": _rate(lb, la, "preempted", wall),
            **_gc_figures(lb, la, wall)})
    api = []
    for b, a in zip(before.get("api_servers", []), after.get("api_servers", [])):
        events, tokens = a["events"] - b["events"], a["tokens"] - b["tokens"]
        api.append({
            "api_server": a["api_server"], "busy": (a["cpu_s"] - b["cpu_s"]) / wall,
            "preempted_per_s": _rate(b, a, "preempted", wall),
            "events": int(events), "tokens": int(tokens),
            "tokens_per_event": tokens / events if events else None,
            "loop_lag_ms": quantiles(b["loop_lag"], a["loop_lag"]),
            "delivery_ms": quantiles(b["delivery"], a["delivery"]),
            "intake_ms": quantiles(b["intake"], a["intake"]),
            "client_gap_ms": quantiles(b["client_gap"], a["client_gap"]),
            **_gc_figures(b, a, wall)})
    return {"cores": cores, "api_servers": api}


def _gc_figures(before: dict, after: dict, wall: float) -> dict:
    return {"gc_share": (after["gc_s"] - before["gc_s"]) / wall,
            "gc_full": int(after["gc_full"] - before["gc_full"]),
            "gc_long": int(after["gc_long"] - before["gc_long"])}
