"""The engine-core process: one Engine and its step loop, fed over Unix sockets (or ZeroMQ),
never waiting on HTTP.

The first API-server process (core_client.py) starts one of these per data-parallel rank with
multiprocessing's spawn context. Messages are msgspec msgpack structs (messages.py's). In:
requests (one message per prompt: its token ids as int32 bytes, and the sampling params of each
of its samples), aborts, probes, shutdown, each API process's over its one connection to this
core's request listener (step_channel.py: the API process's thread writes to the socket, this
loop reads it, no zmq I/O thread between), in the order sent; an API process that could not
connect sends over its PUSH socket into this core's one PULL socket instead (zmq, for that
process's whole life). Out: ONE message per engine step to each API process with outputs in it,
carrying that process's requests' new token ids and finish info (a request that only got tokens
as a three-element array: output_rows), with the engine's stats (every API process gets them:
its admission control reads them), written by this loop's thread to the process's step channel
(step_channel.py: a Unix socket, no zmq I/O thread to wake) from the process's first request
on; before that, and everything else (start-up, probe replies, heartbeats), over one PUSH
socket per API process. What the core does per step and per request
beside the engine's step is timed by lab/bench_core_path.py. The core
never sees text: tokenizing, detokenizing and stop strings are the API processes' job, so a
stop string found there comes back in as an abort.

Several API processes (`--api-server-count N`): API process k numbers its requests k, k + N,
k + 2N... so ids are unique across processes and the core sends a request's outputs to API
process `request_id % N` (`api_server_of`) without keeping a map. A probe names its sender.

The loop: when the engine has work, read everything that arrived (without waiting: aborts act
at once, even behind a burst of queued prompts), add a step's token budget of the requests,
step, send the step's outputs; when idle, block on the socket
(waking every second to check that the first API process, its parent, is still alive: an
orphaned core exits; busy or not, exit_with_parent ends a core whose parent died, at once on
Linux, even by kill -9). The loop counts where its time goes (diagnostics.LoopCounters: a few
clock reads per step), sent only in the reply to a Probe that asks for them (GET
/debug/stats), never with the steps.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import faulthandler
import gc
import itertools
import logging
import os
import signal
import sys
import threading
import time
from operator import attrgetter
from typing import Callable

import msgspec
import numpy as np

from flashlet.core.engine import Engine
from flashlet.core.sampling import SamplingParams
from flashlet.models.weights import load_tokenizer
from flashlet.server.diagnostics import LoopCounters
from flashlet.server.messages import (TOKEN_DTYPE, AbortRequests, AddRequests, CoreInput,
                                      CoreOutput, CoreReady, Probe, ProbeReply, Shutdown,
                                      StepOutputs, Heartbeat, api_server_of, output_rows,
                                      output_rows_by_api_server)
from flashlet.server.step_channel import FrameListener, FrameWriter
from flashlet.server.warmup import SERVER_GC_THRESHOLDS

log = logging.getLogger("flashlet.server")

# zmq.POLLIN's value (1 in every libzmq) as a plain int: `&` with pyzmq's enum builds an enum
# member, ~0.7 us, and each side checks its socket once a step (this module imports zmq only
# in the core process).
POLLIN = 1
IDLE_POLL_MS = 1000  # how often an idle core checks that its parent is alive
PARENT_POLL_S = 0.5  # how often any core checks it (exit_with_parent), busy or not
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# A step longer than both is logged with what it ran (_log_slow_step): rare on a GPU, and
# never every step of a slow device.
SLOW_STEP_S = 0.03
SLOW_STEP_TIMES_MEAN = 5
COMPILE_POLL_MS = 2  # how long an idle core waits for a message while a grammar compiles
# Several API processes: a step's message goes to those with outputs in it; the others get the
# stats alone at most this often (and when the core goes idle), not every step: an API process
# with nothing to stream would otherwise wake, decode and spend CPU on every step.
STATS_EVERY_S = 0.025
# A core that waits on grammar compiles still sends its stats this often; and its heartbeat
# thread says it is alive this often.
HEARTBEAT_S = 1.0
# A busy core whose API processes all send over their request channels asks its zmq inbox
# (unused then, kept as a backstop) once in this many reads.
ZMQ_CHECK_EVERY = 64
# Queued requests looked at for one prompt of each client request before the rest in order.
QUEUE_SCAN_DEPTH = 256
# Sent by an API process that sees this core stalled: each thread's Python stack, to stderr.
STACKS_SIGNAL = signal.SIGUSR1


_new_token_ids = attrgetter("new_token_ids")


def _start_grammar_worker(structured) -> None:
    """On the grammar thread at start-up; a worker that fails to start now is started again by
    the first compile (which then reports why)."""
    try:
        structured.start_worker()
    except Exception as e:  # noqa: BLE001 - said, not raised: the server serves without it
        log.warning("the grammar compile worker did not start ahead of use: %s", e)


def engine_info(engine) -> dict:
    stats = engine.stats()
    return {"max_model_len": engine.max_model_len,
            "vocab_size": engine.model_config.vocab_size,
            "page_size": engine.config.page_size, "num_pages": stats["kv_pages_total"],
            "context_note": engine.context_note(), "backend": engine.backend_name,
            "model_dir": str(engine.model_dir) if engine.model_dir else None,
            "kv_mib": stats["kv_pool_bytes"] / 2**20, "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": stats["kv_cache_dtype"]}


def core_stats(engine, text_keys: tuple[str, ...] | None = None) -> dict[str, float]:
    """The engine's numeric stats (a step message carries numbers; the KV dtype, a name, goes
    once in engine_info). text_keys: the stats that are names (text_stat_keys), if known:
    removed by key (on the CPU 2.4 us a step against 4.4 for a filtered copy) from the dict
    engine.stats() returns, which must be a new one each call."""
    stats = engine.stats()
    for key in text_stat_keys(engine, stats) if text_keys is None else text_keys:
        del stats[key]
    stats["num_requests"] = stats["requests"]
    return stats


def text_stat_keys(engine, stats: dict | None = None) -> tuple[str, ...]:
    """The keys of engine.stats() whose values are names, not numbers (the same every step)."""
    return tuple(k for k, v in (engine.stats() if stats is None else stats).items()
                 if isinstance(v, str))


# ---- the process ---------------------------------------------------------------------------------
def build_engine(config, tokenizer: str | None = None):
    engine = Engine(config)
    if engine.tokenizer is None and tokenizer is not None:  # random weights + --tokenizer
        engine.use_tokenizer(load_tokenizer(tokenizer))
    return engine


def run_engine_core(config, core: int, input_addrs: list[str], output_addrs: list[str],
                    parent_pid: int, tokenizer: str | None = None,
                    build: Callable = build_engine, parent_death_signal: bool = True,
                    step_paths: list[str] | None = None,
                    request_path: str | None = None) -> None:
    """The spawned process's entry point: build the Engine, say ready, serve until Shutdown.
    input_addrs / output_addrs: one of each per API process, in API-process order; step_paths:
    where each API process listens for its step channel (step_channel.py), if it does;
    request_path: where this core listens for the API processes' messages (else zmq only).
    (`build`: what makes the engine; scripts/api_overhead.py gives a trivial token source.
    parent_death_signal: see exit_with_parent.)"""
    import zmq

    # A stalled core's threads' Python stacks, into the server's log when an API process that
    # sees the stall asks (core_client.STACKS_SIGNAL): where a step of many seconds spends them.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    exit_with_parent(parent_pid, parent_death_signal)

    # Ctrl-C reaches the whole process group, and a supervisor's SIGTERM may reach every
    # process of the server: the API process decides when cores stop (it kills a core that
    # is still loading).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s core{core}: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    for address in input_addrs:  # the API processes may bind theirs later: zmq reconnects
        inbox.connect(address)
    outboxes = []
    for address in output_addrs:  # one socket each: a PUSH socket with several peers would
        outbox = ctx.socket(zmq.PUSH)  # deal its messages round-robin
        outbox.setsockopt(zmq.SNDHWM, 0)  # a step's message is never dropped
        outbox.connect(address)  # queued until that API process binds it
        outboxes.append(outbox)
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = build(config, tokenizer)
    except BaseException as e:  # noqa: BLE001 - reported to the API processes, which exit
        ready = encoder.encode(CoreReady(core, {}, f"{type(e).__name__}: {e}", os.getpid()))
        for outbox in outboxes:
            outbox.send(ready)
            outbox.close(linger=5000)
        ctx.term()
        return
    gc.set_threshold(*SERVER_GC_THRESHOLDS)  # the engine has settled its start-up heap
    if os.environ.get("FLASHLET_SYNC_DEBUG") and str(getattr(engine, "device", "")).startswith("cuda"):
        # A diagnostic: every implicit device synchronization the loop makes from now on (the
        # warm-up's are over) is warned about once per code location, into the server's log.
        # The token read's event wait is explicit and not among them (Engine.device_wait_s).
        import torch

        torch.cuda.set_sync_debug_mode("warn")
        log.warning("FLASHLET_SYNC_DEBUG: implicit device synchronizations are reported")
    info = engine_info(engine)
    # Listening before it says it is ready: each API process connects on that message, before
    # it sends this core anything.
    requests = FrameListener.open(request_path) if request_path is not None else None
    if requests is not None:
        info["request_path"] = request_path
    ready = encoder.encode(CoreReady(core, info, None, os.getpid()))
    for outbox in outboxes:
        outbox.send(ready)
    stop_beating = threading.Event()
    beats = threading.Thread(target=_send_heartbeats,
                             args=(ctx, output_addrs, core, stop_beating),
                             name="flashlet-heartbeat", daemon=True)
    beats.start()
    engine_core = EngineCore(engine, core, inbox, outboxes, parent_pid, step_paths, requests)
    try:
        engine_core.run()
    finally:
        engine_core.close_step_channels()
        stop_beating.set()
        beats.join()
        inbox.close(linger=0)
        for outbox in outboxes:
            outbox.close(linger=2000)
        ctx.term()


def _send_heartbeats(ctx, output_addrs: list[str], core: int, stop: threading.Event) -> None:
    """A Heartbeat to every API process every HEARTBEAT_S until `stop` is set (sockets of its
    own: a zmq socket belongs to one thread)."""
    import zmq

    frame = msgspec.msgpack.encode(Heartbeat(core))
    sockets = [ctx.socket(zmq.PUSH) for _ in output_addrs]
    for sock, address in zip(sockets, output_addrs):
        sock.setsockopt(zmq.SNDHWM, 4)  # an API process that reads nothing needs no backlog
        sock.connect(address)
    try:
        while True:
            for sock in sockets:
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            if stop.wait(HEARTBEAT_S):
                return
    finally:
        for sock in sockets:
            sock.close(linger=0)


def exit_with_parent(parent_pid: int, parent_death_signal: bool) -> None:
    """End this process when the API process that started it dies, even by SIGKILL and in the
    middle of a long step: on Linux the kernel sends SIGKILL at once (PR_SET_PDEATHSIG; only
    when the parent started us from its main thread, as the signal follows the thread that
    forked, not the process, and without worker processes of our own to end first);
    everywhere, a thread checks the parent every PARENT_POLL_S."""
    if parent_death_signal and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="flashlet-parent-watch",
                     daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    """Exit the process (os._exit: the main thread may be inside a step) once the parent is
    gone; a dead parent's children are handed to another process, so getppid() changes."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    log.error("the API server process %d is gone: this engine core exits", parent_pid)
    import multiprocessing

    for child in multiprocessing.active_children():  # tensor parallelism's ranks
        child.kill()
    os._exit(1)


class EngineCore:
    """The busy loop around one Engine (which takes the API processes' request ids as its own)."""

    def __init__(self, engine, core: int, inbox, outboxes: list, parent_pid: int,
                 step_paths: list[str] | None = None, requests: FrameListener | None = None):
        self.engine, self.core = engine, core
        self.inbox, self.outboxes = inbox, outboxes  # outboxes[k]: to API process k
        # Each API process's messages come over its connection here (step_channel.py), or,
        # if it could not connect, over the inbox: read alike.
        self.requests = requests
        self.parent_pid = parent_pid
        # Step messages to API process k go over writers[k] once it is connected: at k's first
        # request (k listens before it sends one), so that a process's outputs never go over
        # both channels (the two are not ordered with each other); until then, and for a
        # process that does not listen, over outboxes[k].
        self.step_paths = step_paths
        self.writers: list[FrameWriter | None] = [None] * len(outboxes)
        self.step_channel_tried = [False] * len(outboxes)
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        # The stats left out of every step message (names: text_stat_keys), found at the first
        # send
        self.text_stats: tuple[str, ...] | None = None
        self.encoder = msgspec.msgpack.Encoder()
        self.unfinished: set[int] = set()  # ids added and not finished yet
        self.errors: list[CoreOutput] = []  # requests refused at add, sent with the next message
        self.stopping = False
        self.next_stats_to_all = 0.0  # several API processes: see STATS_EVERY_S
        self.last_sent = 0.0  # time.monotonic() of the latest step message
        # Constrained requests whose grammar compiles on a worker thread (off the step loop;
        # the thread waits on a compile process with a time limit, structured.py; compiled
        # grammars are cached), in arrival order: request id -> (future, prompt, params, the
        # request it waits for).
        self.compiling: dict[int, tuple[concurrent.futures.Future, np.ndarray, SamplingParams,
                                        int | None]] = {}
        self.compiler = concurrent.futures.ThreadPoolExecutor(1, "flashlet-grammar")
        if engine.structured is not None:  # the compile worker, started before any format needs it
            self.compiler.submit(_start_grammar_worker, engine.structured)
        self.counters = LoopCounters()
        # Requests received and not added yet, oldest first (_receive reads the whole inbox).
        self.queued_adds: collections.deque[AddRequests] = collections.deque()
        self.queued_ids: set[int] = set()
        # A burst of requests (a closed loop's clients come back together) is added a step's
        # worth at a time: a step starts no more prompt tokens than its budget, and the rest,
        # left queued, are added while the step just launched runs on the device, not before
        # its launch (at ~50 us an add, 256 at once would take ~13 ms before that launch).
        self.tokens_per_receive = engine.config.max_num_batched_tokens
        self.receives = 0  # _receive calls (a busy core asks the zmq inbox every ZMQ_CHECK_EVERY)

    def run(self) -> None:
        while not self.stopping:
            self.run_once()
        if self.engine.structured is not None:
            self.engine.structured.close()  # a compile under way ends now: nothing to wait for
        self.compiler.shutdown(wait=False, cancel_futures=True)
        self.counters.gc.close()

    def run_once(self) -> None:
        """Receive, add a step's worth of what arrived, step, send (or wait, when idle)."""
        engine = self.engine
        busy = engine.has_unfinished()
        self._receive(wait=not busy and not self.queued_adds,
                      timeout_ms=COMPILE_POLL_MS if self.compiling else None)
        if self.stopping:
            return
        self._add_queued()
        self._add_compiled()
        if engine.has_unfinished():
            outputs = self._step()
            t = time.perf_counter()
            self._send(outputs)
            self.counters.add_time("send", time.perf_counter() - t)
        elif self.errors or (busy and not self.compiling):
            # Went idle: say so (the stats show no page held).
            self._send([])
        elif self.compiling and time.monotonic() - self.last_sent > HEARTBEAT_S:
            self._send([])  # still here: a long compile is not a stalled core (core_client.py)

    def _receive(self, wait: bool, timeout_ms: int | None = None) -> None:
        """Read everything in the inbox: aborts, probes and shutdown act at once; requests are
        queued for _add_queued (an abort behind a burst of prompts must not wait for them)."""
        t = time.perf_counter()
        if wait and timeout_ms is not None:
            self._wait_for_inbox(timeout_ms)
        elif wait:
            while not self._wait_for_inbox(IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:  # the API process is gone
                    log.error("the API server process exited; engine core %d stops", self.core)
                    self.stopping = True
                    return
        if wait:
            waited, t = t, time.perf_counter()
            self.counters.add_time("idle", t - waited)
        try:
            # Asked before each read, not left to recv's zmq.Again: building that exception
            # costs more than the check. Once every API process has connected its request
            # channel none sends here any more (CoreClient._open_request_channel), so a busy
            # core asks only every ZMQ_CHECK_EVERY reads (the question costs ~20 us a step on
            # the H200 machine's CPU, a one-stream step's host part ~200-400).
            self.receives += 1
            if (wait or self.receives % ZMQ_CHECK_EVERY == 0 or self.requests is None
                    or len(self.requests.readers) < len(self.outboxes)):
                self._read_inbox()
            if self.requests is not None:
                for frame in self.requests.read_frames():
                    self._take(self.decoder.decode(frame))
        finally:
            self.counters.add_time("receive", time.perf_counter() - t)

    def _read_inbox(self) -> None:
        """Everything in the zmq inbox."""
        import zmq

        while self.inbox.get(zmq.EVENTS) & POLLIN:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:  # the check's word was stale
                break
            self._take(self.decoder.decode(frame))

    def _take(self, msg) -> None:
        """A message in: a request is queued, anything else acts now."""
        if isinstance(msg, AddRequests):
            self._connect_step_channel(msg)
            self.queued_adds.append(msg)
            self.queued_ids.update(msg.request_ids)
        else:
            self._apply(msg)

    def _add_queued(self) -> None:
        """Add queued requests up to a step's prompt-token budget (at least one): a burst is
        added a step's worth at a time (see tokens_per_receive). Client requests take turns:
        one prompt of each group first (the next QUEUE_SCAN_DEPTH queued looked at), so a
        request of many long prompts does not hold a short one behind all of them here; the
        scheduler then shares the steps between them."""
        if not self.queued_adds:  # most steps: nothing arrived
            return
        t = time.perf_counter()
        added = 0  # prompt tokens
        taken_groups = set()
        for msg in list(itertools.islice(self.queued_adds, QUEUE_SCAN_DEPTH)):
            if added >= self.tokens_per_receive:
                break
            if msg.group in taken_groups and msg.group is not None:
                continue
            taken_groups.add(msg.group)
            added += self._add_from_queue(msg)
        while self.queued_adds and added < self.tokens_per_receive:
            added += self._add_from_queue(self.queued_adds[0])
        self.counters.add_time("receive", time.perf_counter() - t)

    def _add_from_queue(self, msg: AddRequests) -> int:
        """Add one queued message; its prompt tokens."""
        self.queued_adds.remove(msg)
        self.queued_ids.difference_update(msg.request_ids)
        self._add_all(msg)
        return len(msg.prompt) // TOKEN_DTYPE.itemsize

    def _unqueue(self, rid: int) -> None:
        """Drop a request that was received but not added yet (aborted before it ran)."""
        self.queued_ids.discard(rid)
        for msg in self.queued_adds:
            if rid in msg.request_ids:
                i = msg.request_ids.index(rid)
                del msg.request_ids[i], msg.params[i]  # a removed first sample: the next leads
                if not msg.request_ids:
                    self.queued_adds.remove(msg)
                return

    def _apply(self, msg) -> None:
        if isinstance(msg, AddRequests):
            self._add_all(msg)
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:  # their pages are freed now
                if rid in self.queued_ids:
                    self._unqueue(rid)  # never added: nothing to free, nothing to send
                    continue
                self._cancel_compile(rid)
                self.engine.abort(rid, msg.finish_reason)
                self.unfinished.discard(rid)
        elif isinstance(msg, Probe):
            self._probe(msg.api_server, msg.loop)
        elif isinstance(msg, Shutdown):
            self.queued_adds.clear()
            self.queued_ids.clear()
            for rid in list(self.unfinished):
                self.engine.abort(rid)
            self.stopping = True

    def _add_all(self, msg: AddRequests) -> None:
        """Add a prompt's requests (the samples after the first wait for it to run the prompt)."""
        try:
            prompt = msg.prompt_token_ids()
            if len(msg.params) != len(msg.request_ids):
                raise ValueError(f"{len(msg.request_ids)} request ids but {len(msg.params)} "
                                 "sets of sampling parameters")
        except ValueError as e:
            for rid in msg.request_ids:
                self.counters.request_arrived()
                self.errors.append(CoreOutput.refused(rid, str(e)))
            return
        for i, (rid, fields) in enumerate(zip(msg.request_ids, msg.params)):
            self._add(rid, prompt, fields, msg.request_ids[0] if i else None, msg.group)

    def _add(self, rid: int, prompt: np.ndarray, fields: dict, after: int | None,
             group: int | None = None) -> None:
        self.counters.request_arrived()
        try:
            params = SamplingParams(**fields)
        except (TypeError, ValueError) as e:
            self.errors.append(CoreOutput.refused(rid, str(e)))
            return
        structured = self.engine.structured
        if (params.is_constrained and structured is not None
                and not structured.is_cached(params.response_format)):
            try:  # the static bounds, at once: a refused format never waits for a compile
                structured.check(params.response_format)
            except ValueError as e:  # a RequestError naming response_format
                self.errors.append(CoreOutput.refused(rid, str(e), param=getattr(e, "param", None)))
                return
            future = self.compiler.submit(structured.compile, params.response_format)
            self.compiling[rid] = (future, prompt, params, after, group)
            return
        self._add_now(rid, prompt, params, after, group)  # cached: no wait behind compiles

    def _cancel_compile(self, rid: int) -> None:
        """An aborted request's compile stops: dropped if queued, and the worker killed if it
        compiles that format for no other request still waiting."""
        entry = self.compiling.pop(rid, None)
        if entry is None:
            return
        entry[0].cancel()  # False once running: then the worker is what stops it
        fmt = entry[2].response_format
        if all(other[2].response_format != fmt for other in self.compiling.values()):
            self.engine.structured.cancel(fmt)  # a no-op unless the worker compiles `fmt`

    def _add_compiled(self) -> None:
        """Queue the constrained requests whose grammar is ready, in arrival order."""
        while self.compiling:
            rid, (future, prompt, params, after, group) = next(iter(self.compiling.items()))
            if not future.done():
                return
            del self.compiling[rid]
            error = future.exception()
            if error is not None:  # a ValueError (a RequestError) is the format's fault; else ours
                status = 400 if isinstance(error, ValueError) else 500
                self.errors.append(CoreOutput.refused(rid, str(error), status,
                                                      getattr(error, "param", None)))
            else:
                # the engine finds the grammar cached
                self._add_now(rid, prompt, params, after, group)

    def _add_now(self, rid: int, prompt: np.ndarray, params: SamplingParams,
                 after: int | None, group: int | None = None) -> None:
        try:
            self.engine.add_request(prompt, params, request_id=rid, after=after, group=group)
            self.unfinished.add(rid)
        except ValueError as e:
            self.errors.append(CoreOutput.refused(rid, str(e)))
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
            log.exception("add_request failed")
            self.errors.append(CoreOutput.refused(rid, f"could not queue the request: {e}", 500))

    def _step(self) -> list:
        """One engine step; its outputs (the engine's RequestOutputs; after a failed step none:
        its errors are in self.errors)."""
        gc_timer = self.counters.gc
        gc_before = (gc_timer.collections, gc_timer.seconds)
        wait_before = self.engine.device_wait_s
        t = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {e}")
            return []
        took = time.perf_counter() - t
        finished = [out.request_id for out in outputs if out.finished]
        self.unfinished.difference_update(finished)
        self.counters.step_done(took, sum(map(len, map(_new_token_ids, outputs))), len(finished),
                                self.engine.device_wait_s - wait_before)
        mean = self.counters.seconds["step"] / self.counters.steps
        if took > max(SLOW_STEP_S, SLOW_STEP_TIMES_MEAN * mean):
            self._log_slow_step(took, outputs, gc_before)
        return outputs

    def _log_slow_step(self, took: float, outputs, gc_before: tuple[int, float]) -> None:
        """What a step far over the usual ran (a TTFT outlier at concurrency 1 can be one such
        step): its requests and the collector's share of it."""
        stats, gc_timer = self.engine.stats(), self.counters.gc
        log.warning("slow step: %.1f ms, %d outputs (%d finished), %d running, %d waiting; "
                    "the collector ran %d times in it for %.1f ms", took * 1e3, len(outputs),
                    sum(out.finished for out in outputs), stats["running"], stats["waiting"],
                    gc_timer.collections - gc_before[0],
                    (gc_timer.seconds - gc_before[1]) * 1e3)

    def _fail_all(self, message: str) -> None:
        """End every request in the engine with a 500 error (sent with the next message)."""
        for rid in list(self.unfinished):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                pass
            self.errors.append(CoreOutput.refused(rid, message, 500))
        self.unfinished.clear()

    def _send(self, outputs: list) -> None:
        """The step's outputs (and the errors since the last message), each to the API process
        that sent its request, with the core's stats (every process reads them: /metrics,
        admission). Several API processes: those with outputs in the step first (a stream's
        token waits for no other process's message), then, every STATS_EVERY_S and once the
        core has nothing left to run (so that every process sees it idle), the stats alone to
        the others."""
        if self.errors:
            outputs, self.errors = self.errors + outputs, []
        if self.text_stats is None:
            self.text_stats = text_stat_keys(self.engine)
        stats = core_stats(self.engine, self.text_stats)
        now = self.last_sent = time.monotonic()
        stats["time"] = now
        count = len(self.outboxes)
        if count == 1:
            self._send_frame(0, self.encoder.encode(
                StepOutputs(self.core, output_rows(outputs), stats)))
            return
        everyone = now >= self.next_stats_to_all or not self.engine.has_unfinished()
        if everyone:
            self.next_stats_to_all = now + STATS_EVERY_S
        stats_only = []
        for k, rows in enumerate(output_rows_by_api_server(outputs, count)):
            if rows:
                self._send_frame(k, self.encoder.encode(StepOutputs(self.core, rows, stats)))
            elif everyone:
                stats_only.append(k)
        if stats_only:
            frame = self.encoder.encode(StepOutputs(self.core, [], stats))
            for k in stats_only:
                self._send_frame(k, frame)

    def _send_frame(self, api_server: int, frame: bytes) -> None:
        """A step message to one API process: over its step channel once connected."""
        writer = self.writers[api_server]
        if writer is not None and not writer.closed:
            writer.send(frame)
        else:
            self.outboxes[api_server].send(frame)

    def _connect_step_channel(self, msg: AddRequests) -> None:
        """At an API process's first request, connect to its step channel (it listens before
        it sends any): its step messages go there from now on, none of them before."""
        if self.step_paths is None or not msg.request_ids:
            return
        k = api_server_of(msg.request_ids[0], len(self.outboxes))
        if self.step_channel_tried[k]:
            return
        self.step_channel_tried[k] = True
        self.writers[k] = FrameWriter.connect(self.step_paths[k])
        if self.writers[k] is None:
            log.warning("API process %d has no step channel: its step messages go over zmq", k)

    def _wait_for_inbox(self, timeout_ms: int) -> bool:
        """Wait up to timeout_ms for a message in (zmq, or the request channels and their
        listener); meanwhile write what the step channels hold back (a core asleep on a
        backlog would hold its last tokens). True if something may be waiting."""
        pending = [w for w in self.writers if w is not None and w.pending]
        if not pending and self.requests is None:
            return bool(self.inbox.poll(timeout_ms))
        import zmq

        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        fds = self.requests.fds() if self.requests is not None else []
        for fd in fds:
            poller.register(fd, zmq.POLLIN)
        for writer in pending:
            poller.register(writer.sock, zmq.POLLOUT)
        ready = dict(poller.poll(timeout_ms))
        for writer in pending:
            writer.flush()
        return self.inbox in ready or any(fd in ready for fd in fds)

    def close_step_channels(self) -> None:
        """Close the step channels and the request listener with its connections."""
        for writer in self.writers:
            if writer is not None:
                writer.close()
        if self.requests is not None:
            self.requests.close()

    def _probe(self, api_server: int, loop: bool = False) -> None:
        """Reply with the engine's stats: after an integrity check, or (loop) with the loop's
        counters instead (diagnostics: no check, which would cost a busy core a step's time)."""
        error = None
        if not loop:
            try:
                self.engine.check_integrity()
            except Exception as e:  # noqa: BLE001 - reported to the caller
                error = f"{type(e).__name__}: {e}"
        stats = {**core_stats(self.engine), "has_unfinished": float(self.engine.has_unfinished())}
        reply = ProbeReply(self.core, stats, error, self.counters.snapshot() if loop else None)
        self.outboxes[api_server].send(self.encoder.encode(reply))
