"""The API process's side of the engine cores: start them, route requests, read their steps.

`CoreClient` has EngineLoop's interface (submit / abort / abort_all / is_ready / stop ...), so
the app serves either: the in-thread EngineLoop (tests, embedding) or engine-core processes
(`python -m flashlet.server`, one per data-parallel rank). It binds the ipc sockets, spawns the
cores (engine_core.py) and receives every core's per-step message, handing each request's
outputs to its stream. The first event loop that submits a request reads the sockets itself
(add_reader on their FDs: the zmq socket, and each core's connection to this process's step
channel, step_channel.py): a token goes from the socket to its SSE writer with no
thread hand-off (a thread's call_soon_threadsafe wakes the loop through its self-pipe, and both
threads take the GIL in turn); with busy_poll_s (--busy-poll-ms) that loop does not sleep
between step messages while requests are in flight (_keep_loop_awake).
Until then, and again once that loop has closed, a reader thread
reads it and wakes each stream's loop once per step; streams of other loops are woken so
too. The thread always watches the processes: when a core dies, its requests in flight end
with a 500 error and the others serve on (/health: "degraded"); when the last one dies (or any,
with exit_on_core_failure), /health turns 503 ("failed") and `on_fatal` runs (the CLI exits
non-zero: restarting a core would drop its cache and its requests anyway, and a supervisor
restarts servers better). It also watches for silence (the messages it counts are read on the
loop: a loop blocked that long looks the same): a core with requests in flight that
ends no step for stall_timeout_s (stopped, hung, or in one step that long) is stalled until its
next step message: no request is routed to it, /health says why (503 if no core is left to
serve) and the core writes each of its threads' Python stacks into the log (faulthandler, on
engine_core.STACKS_SIGNAL from the API process that started it). Each core's heartbeat
thread says every second that its process runs: a core silent in both ways is stopped or
hung, and after stalled_request_timeout_s its requests end with a 503 error (and are aborted in
it, should it run again); one in a long step keeps them. A core that waits on grammar compiles
sends its stats every second, so that wait is not a stall.

What it sends a core (requests, aborts, probes, shutdown) goes over one Unix socket to that
core's request listener (step_channel.py), connected when the core says it is ready (what was
sent before waits for it), written by the sending thread itself under the lock without ever
blocking: what the socket does not take waits in a backlog that the reader thread writes as
the core reads. A core whose listener cannot be reached gets it all over zmq instead.

Several API processes (`--api-server-count N`, cli.py): each has its own CoreClient, with its
index k. Client 0 owns the cores: it makes the ipc folder, spawns the cores (telling each the
sockets of all N clients) and alone sends them Shutdown. Every client binds its own sockets
(in<core>.<k> into each core, out<k> for the steps), numbers its requests k, k + N, ... (the
cores send a request's outputs back by `request_id % N`), aborts and probes its own requests,
and routes with its own PrefixRouter: each router sees only the prompts, in-flight counts and
pending prompt tokens of its own process (prefix routing still sends a process's repeated
prefixes to the core that cached them; the cores' running/waiting stats, which every client
gets each step, are shared).
A client that does not own the cores cannot wait on them: it watches their pids (a dead or
zombie pid is a dead core, handled as client 0 handles it) and client 0's (the cores' parent):
that one gone is fatal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import select
import shutil
import tempfile
import threading
import time
import itertools
from pathlib import Path
from collections import defaultdict, deque
from typing import Callable

import msgspec
import zmq

from flashlet.config import EngineConfig
from flashlet.core.request import FinishReason
from flashlet.core.request_check import RequestLimits
from flashlet.models.weights import load_tokenizer
from flashlet.server.engine_core import (POLLIN, STACKS_SIGNAL, build_engine,  # the process's entry
                                         run_engine_core)
from flashlet.server.engine_loop import (EngineClient, NotReady, RequestStream,
                                         StreamError)
from flashlet.server.messages import (AbortRequests, AddRequests, CoreOutput, CoreReady,
                                      Heartbeat, Probe, ProbeReply, Shutdown, StepOutputs)
from flashlet.server.router import PrefixRouter
from flashlet.server.step_channel import (FrameReader, FrameWriter, listen, request_path,
                                          step_path)

log = logging.getLogger("flashlet.server")

READER_POLL_MS = 100  # how often the reader thread checks the processes (and the loop reading)
# A core with requests in flight that ends no step this long has stalled (stopped, hung, or in
# a step that long): /health says so and no request is routed to it until a step ends.
CORE_STALL_TIMEOUT_S = 8.0
# ... and this long with no heartbeat either (stopped or hung): its requests end with a 503
# error (their clients can retry elsewhere).
STALLED_REQUEST_TIMEOUT_S = 60.0
MAX_BUSY_POLL_S = 1.0  # the longest busy-poll window (busy_poll_s) taken


class CoreProcess:
    """One engine-core process and what the API process knows of it."""

    def __init__(self, index: int, process, inbox, pid: int | None = None,
                 awaits_channel: bool = False):
        """awaits_channel: hold what is sent to it until its CoreReady says whether it takes
        messages over a request channel (step_channel.py) or zmq (else zmq from the start)."""
        self.index = index
        self.process = process  # None in an API process that does not own the cores
        self.pid = process.pid if process is not None else pid
        self.inbox = inbox  # PUSH socket into the core (guarded by CoreClient._lock)
        # Everything sent to the core goes over `requests` once connected, else over `inbox`,
        # never both (an abort must not overtake its request); `held` keeps what is sent
        # before that is known (None once it is). Guarded by CoreClient._lock.
        self.requests: FrameWriter | None = None
        self.held: list[bytes] | None = [] if awaits_channel else None
        self.info: dict | None = None  # from CoreReady
        self.stats: dict = {}  # from its latest message
        self.num_in_flight = 0  # requests routed here and not finished
        self.pending_prefill = 0  # prompt tokens routed here that have no output yet (router)
        self.num_routed = 0
        self.last_heard = time.monotonic()  # its latest message, or when it was last given work
        self.last_alive = self.last_heard  # ... or heartbeat (its process runs)
        self.dead: str | None = None  # why it is gone (it takes no request again)
        self.stalled: str | None = None  # why it looks stuck (cleared by its next message)

    @property
    def usable(self) -> bool:
        """New requests may be routed here."""
        return self.dead is None and self.stalled is None


class CoreClient(EngineClient):
    def __init__(self, config: EngineConfig, data_parallel_size: int = 1,
                 tokenizer: str | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 build_engine: Callable = build_engine, api_server_index: int = 0,
                 api_server_count: int = 1, ipc_dir: str | None = None,
                 core_pids: list[int] | None = None, owner_pid: int | None = None,
                 exit_on_core_failure: bool = False,
                 stall_timeout_s: float = CORE_STALL_TIMEOUT_S,
                 stalled_request_timeout_s: float = STALLED_REQUEST_TIMEOUT_S,
                 busy_poll_s: float = 0.0):
        """api_server_index > 0: attach to the cores that client 0 started (its ipc_dir, the
        cores' pids and its own pid, owner_pid) instead of starting them.
        exit_on_core_failure: a dead core is fatal even while others live (by default only
        the last one is). busy_poll_s: see _keep_loop_awake (0: off)."""
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if api_server_count < 1 or not 0 <= api_server_index < api_server_count:
            raise ValueError(f"api server {api_server_index} of {api_server_count}: out of range")
        if api_server_index > 0 and (ipc_dir is None or core_pids is None or owner_pid is None
                                     or len(core_pids) != data_parallel_size):
            raise ValueError("an API server other than the first needs the cores' ipc folder, "
                             "their pids and the first API server's pid")
        if not 0 < stall_timeout_s <= stalled_request_timeout_s:
            raise ValueError("need 0 < stall_timeout_s <= stalled_request_timeout_s, got "
                             f"{stall_timeout_s} and {stalled_request_timeout_s}")
        if not 0 <= busy_poll_s <= MAX_BUSY_POLL_S:
            raise ValueError(f"busy_poll_s must be in [0, {MAX_BUSY_POLL_S}], got {busy_poll_s}")
        self.config = config
        self.num_cores = data_parallel_size
        self.exit_on_core_failure = exit_on_core_failure
        self.stall_timeout_s = stall_timeout_s
        self.busy_poll_s = busy_poll_s
        self._awake_until = 0.0  # time.monotonic() up to which the reading loop never sleeps
        self._kept_awake: asyncio.AbstractEventLoop | None = None  # runs _stay_awake
        self.stalled_request_timeout_s = stalled_request_timeout_s
        # Routers over each subset of usable cores met so far (all of them: self.router).
        self._routers: dict[tuple[int, ...], PrefixRouter] = {}
        self.api_server_index, self.api_server_count = api_server_index, api_server_count
        self.owns_cores = api_server_index == 0
        self._core_pids, self._owner_pid = core_pids, owner_pid
        self.tokenizer_source = tokenizer
        self._on_fatal = on_fatal
        self._build_engine = build_engine  # runs in the core process (picklable by name)
        self.cores: list[CoreProcess] = []
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count(api_server_index, api_server_count)  # see api_server_of
        self._lock = threading.Lock()  # _streams, the counts, the sockets' sends
        # Per core, the probes sent and not yet answered, oldest first (a core answers in order;
        # two readers at once each get their own answer).
        self._probes: dict[int, deque[concurrent.futures.Future]] = defaultdict(deque)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ipc_dir = ipc_dir if ipc_dir is not None else tempfile.mkdtemp(prefix="flashlet-")
        self._zmq = zmq.Context()
        self._outbox = self._zmq.socket(zmq.PULL)  # every core's step messages
        self._outbox.setsockopt(zmq.RCVHWM, 0)
        self._outbox.bind(self._output_addr(api_server_index))
        # Each core's step messages come over a connection to this socket once the core has
        # this process's first request (step_channel.py); everything else over _outbox. Read
        # by whoever reads _outbox, the same way.
        self._step_listener = listen(step_path(self.ipc_dir, api_server_index))
        self._step_readers: list[FrameReader] = []
        self._decoder = msgspec.msgpack.Decoder(StepOutputs | CoreReady | ProbeReply | Heartbeat)
        # Who reads _outbox: the reader thread while _reading_loop is None, else that event
        # loop (never both: a zmq socket is not thread-safe). A loop asks for it by setting
        # _loop_to_read and writing to the wake pipe; the thread drains the socket, then hands
        # over (see _hand_over_to_loop) and takes it back once that loop has closed.
        self._reading_loop: asyncio.AbstractEventLoop | None = None
        self._loop_to_read: asyncio.AbstractEventLoop | None = None
        self._delivering_on: asyncio.AbstractEventLoop | None = None  # while that loop reads
        self._loop_reading_unsupported = False
        self._outbox_fd = self._outbox.get(zmq.FD)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._encoder = msgspec.msgpack.Encoder()
        self.router: PrefixRouter | None = None
        self.limits: RequestLimits | None = None
        self.tokenizer = None
        self.ready = threading.Event()
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        # Called on the reader thread with each step message's send time (the core's
        # time.monotonic): the app's diagnostics.ApiCounters.delivered.
        self.on_step_message: Callable[[float], None] | None = None

    # ---- life cycle -----------------------------------------------------------------------
    def _input_addr(self, core: int, api_server: int) -> str:
        return f"ipc://{self.ipc_dir}/in{core}.{api_server}"

    def _output_addr(self, api_server: int) -> str:
        return f"ipc://{self.ipc_dir}/out{api_server}"

    def start(self) -> "CoreClient":
        spawn = multiprocessing.get_context("spawn")
        api_servers = range(self.api_server_count)
        for i in range(self.num_cores):
            inbox = self._zmq.socket(zmq.PUSH)
            inbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the core drains it each step
            inbox.bind(self._input_addr(i, self.api_server_index))
            if not self.owns_cores:
                self.cores.append(CoreProcess(i, None, inbox, self._core_pids[i], True))
                continue
            # Daemonic unless it must start processes itself (tensor parallelism's ranks): it
            # stops with this process either way (stop(), or it notices its parent is gone).
            process = spawn.Process(
                target=run_engine_core, name=f"flashlet-core{i}",
                daemon=self.config.tensor_parallel_size == 1,
                args=(self.config, i, [self._input_addr(i, k) for k in api_servers],
                      [self._output_addr(k) for k in api_servers], os.getpid(),
                      self.tokenizer_source, self._build_engine,
                      threading.current_thread() is threading.main_thread()
                      and self.config.tensor_parallel_size == 1,  # see exit_with_parent
                      [step_path(self.ipc_dir, k) for k in api_servers],
                      request_path(self.ipc_dir, i)))
            with _cuda_visible(self._device_for(i)):
                process.start()
            self.cores.append(CoreProcess(i, process, inbox, awaits_channel=True))
        self._thread = threading.Thread(target=self._read, name="flashlet-core-reader",
                                        daemon=True)
        self._thread.start()
        return self

    def _device_for(self, i: int) -> str | None:
        """CUDA_VISIBLE_DEVICES for core i: one GPU per core when there are several."""
        if self.num_cores == 1 or self.config.resolved_device().type != "cuda":
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(d) for d in range(self.num_cores)]
        if i >= len(devices):
            raise ValueError(f"--data-parallel-size {self.num_cores} needs {self.num_cores} GPUs; "
                             f"CUDA_VISIBLE_DEVICES lists {len(devices)}")
        return devices[i]

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop every core (aborting what is in flight) and the reader thread. A core still
        loading the model is ended at once: a load cannot be interrupted, nor waited for when
        the server is told to stop."""
        with self._lock:
            already, self._stopping = self._stopping, True
        if already:
            return
        if not self.owns_cores:  # client 0 stops the cores, once every API process has
            self._abort_in_cores()  # nobody would read what they make for this process
            self._fail_all("the server shut down", 503)
            self._close(linger_ms=1000)  # the aborts still go out
            return
        self._fail_all("the server shut down", 503)
        for core in self.cores:
            if core.info is None:
                core.process.kill()  # it ignores SIGTERM (see run_engine_core)
            else:
                self._send(core, Shutdown())
        self._drain_requests(5.0)  # the reader thread, which writes backlogs, is stopping
        deadline = time.monotonic() + (timeout or 30.0)
        for core in self.cores:
            core.process.join(max(deadline - time.monotonic(), 0.1))
            if core.process.is_alive():
                log.warning("engine core %d did not stop: killing it", core.index)
                core.process.kill()
                core.process.join(5)
        self._close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _close(self, linger_ms: int = 0) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._stop_loop_reading()
        self._drain_requests(linger_ms / 1000)
        for core in self.cores:
            if core.requests is not None:
                core.requests.close()
            core.inbox.close(linger=linger_ms)
        self._outbox.close(linger=0)
        for reader in self._step_readers:
            reader.close()
        self._step_listener.close()
        try:
            os.unlink(step_path(self.ipc_dir, self.api_server_index))
        except OSError:
            pass
        self._zmq.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.stopped.set()

    @property
    def is_ready(self) -> bool:
        return (self.ready.is_set() and self.error is None and not self._stopping
                and any(core.usable for core in self.cores))

    def core_problems(self) -> list[str]:
        """Why each core that cannot take requests cannot (dead or stalled)."""
        return [core.dead or core.stalled for core in self.cores if not core.usable]

    # ---- requests (any thread) ------------------------------------------------------------
    def submit_group(self, streams: list[RequestStream], max_waiting: int | None = None) -> None:
        """Route the samples of one prompt (n > 1) to one core together, all or none; the core
        runs the others once the first has computed the prompt, so they share its KV pages."""
        with self._lock:
            self._admit(max_waiting)
            ids = [next(self._ids) for _ in streams]
            # Encoded and sent before anything is counted: a request that cannot be sent
            # (ValueError) or that no core takes (NotReady) leaves no trace here.
            frame = self._encode_add(ids, streams)
            refused: set[int] = set()  # a core that just died takes nothing: try the others
            while True:
                core, prefill = self._route(streams[0].prompt_token_ids, refused)
                if self._send_frame_locked(core, frame):
                    break
                refused.add(core.index)
            if core.num_in_flight == 0:  # its silence counts from now (see _check_stalls)
                core.last_heard = time.monotonic()
            core.pending_prefill += prefill  # the first sample computes the prompt for all
            streams[0].routed_prefill = prefill
            for stream, rid in zip(streams, ids):
                stream.request_id, stream.core = rid, core.index
                self._streams[rid] = stream
            core.num_in_flight += len(streams)
            core.num_routed += len(streams)
            if (self._reading_loop is None and self._loop_to_read is None
                    and not self._loop_reading_unsupported):
                self._ask_to_read_on(streams[0].aloop)
        if self.busy_poll_s:
            self._keep_loop_awake()

    def _encode_add(self, ids: list[int], streams: list[RequestStream]) -> bytes:
        """The AddRequests frame for a prompt's samples; ValueError if msgpack cannot carry
        them (an integer beyond 64 bits that got past the checks, say)."""
        group = streams[0].group
        message = AddRequests.of(ids, streams[0].prompt_token_ids,
                                 [stream.params for stream in streams],
                                 ids[0] if group is None else group)
        try:
            return self._encoder.encode(message)
        except (OverflowError, RecursionError, TypeError, ValueError) as e:
            raise ValueError(f"the request cannot be sent to the engine core: {e}") from None

    def _admit(self, max_waiting: int | None) -> None:
        if self.ready.is_set() and not self.is_ready and self.error is None and not self._stopping:
            raise NotReady("; ".join(self.core_problems()))
        super()._admit(max_waiting)

    def _route(self, prompt_token_ids: list[int],
               refused: set[int] = frozenset()) -> tuple[CoreProcess, int]:
        """The core for a prompt, among those that can take it (and did not refuse it), and
        the prompt tokens it must compute there (under the lock); NotReady if none can."""
        usable = [core for core in self.cores if core.usable and core.index not in refused]
        if not usable:
            raise NotReady("no engine core can take requests")
        if len(usable) == len(self.cores):
            router = self.router
        else:  # a dead or stalled core: route over the others (their prefix hints start anew)
            key = tuple(core.index for core in usable)
            router = self._routers.get(key)
            if router is None:
                router = self._routers[key] = PrefixRouter(len(usable), self.limits.page_size)
        index, prefill = router.route_request(prompt_token_ids,
                                              [c.num_in_flight for c in usable],
                                              [c.pending_prefill for c in usable])
        return usable[index], prefill

    def abort(self, stream: RequestStream,
              finish_reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request in its core (idempotent); its pages are freed before the next step."""
        with self._lock:
            if stream.cancelled or stream.finished or stream.request_id is None:
                return
            stream.cancelled = True
            if self._streams.pop(stream.request_id, None) is None:
                return  # finished meanwhile
            core = self.cores[stream.core]
            core.num_in_flight -= 1
            self._prefill_done(core, stream)
            self._send_locked(core, AbortRequests([stream.request_id], finish_reason))

    @staticmethod
    def _prefill_done(core: CoreProcess, stream: RequestStream) -> None:
        """Its prompt is computed (or will never be): out of its core's pending tokens."""
        core.pending_prefill -= stream.routed_prefill
        stream.routed_prefill = 0

    def abort_all(self) -> None:
        self._abort_in_cores()
        # Their outputs are dropped by the cores: end the streams here.
        self._end_all(lambda rid: CoreOutput(rid, [], finished=True,
                                             finish_reason=FinishReason.ABORT))

    def _abort_in_cores(self, core: CoreProcess | None = None) -> None:
        """Tell the cores (or one) to drop every request of this process there (their streams
        stay open)."""
        with self._lock:
            by_core = defaultdict(list)
            for rid, stream in self._streams.items():
                if core is None or stream.core == core.index:
                    by_core[stream.core].append(rid)
            for index, rids in by_core.items():
                self._send_locked(self.cores[index], AbortRequests(rids))

    def probe(self, timeout: float = 30.0, loop: bool = False,
              late_ok: bool = False) -> list[dict]:
        """Each core's engine stats after an integrity check (raises if one fails); loop:
        with its loop's counters under "loop" instead of the check (diagnostics.py). A core
        answers between steps: one that has not within `timeout` (all cores together) raises
        TimeoutError, or with late_ok is given by its latest step's stats and "answered":
        False. It blocks: never call it on the event loop that reads the replies."""
        if self._on_reading_loop():
            raise RuntimeError("CoreClient.probe blocks the event loop that reads its replies: "
                               "call it on another thread (run_in_threadpool)")
        futures = []
        for core in self.cores:
            fut = concurrent.futures.Future()
            if core.dead is not None:  # it would never answer
                fut.set_result({"dead": 1.0})
                futures.append(fut)
                continue
            with self._lock:
                self._probes[core.index].append(fut)
                self._send_locked(core, Probe(self.api_server_index, loop))
            futures.append(fut)
        deadline = time.monotonic() + timeout
        replies = []
        for core, fut in zip(self.cores, futures):
            try:
                replies.append(fut.result(max(deadline - time.monotonic(), 0.0)))
            except concurrent.futures.TimeoutError:
                if not late_ok:
                    raise
                replies.append({**core.stats, "answered": False})
        return replies

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def max_running(self) -> int:
        return self.config.max_num_seqs * self.num_cores

    @property
    def num_queued(self) -> int:
        """Requests routed but not yet running (from the cores' latest stats)."""
        return sum(max(c.num_in_flight - int(c.stats.get("running", 0)), 0) for c in self.cores)

    @property
    def num_waiting(self) -> int:
        """Requests that will not run at their core's next step: per core, those queued there
        (in flight to it or in its waiting queue) beyond the running slots it has free, as of its
        latest step (an idle core with N free slots takes a burst of N + max_waiting). Read under
        the lock."""
        total = 0
        for core in self.cores:
            running = int(core.stats.get("running", 0))
            queued = max(core.num_in_flight - running, 0)
            free = max(self.config.max_num_seqs - running, 0)
            total += max(queued - free, 0)
        return total

    def loop_stats(self, timeout: float = 30.0) -> list[dict]:
        """A core in a long step answers late: it is then reported by its latest step's stats
        ("answered": false) rather than the reader waiting on it."""
        if not self.is_ready:  # nothing to ask: the stats each core last sent
            return self.core_stats()
        return self.probe(timeout, loop=True, late_ok=True)

    def core_stats(self) -> list[dict]:
        return [{**c.stats, "routed": c.num_routed, "in_flight": c.num_in_flight,
                 "pending_prefill": c.pending_prefill, "up": float(c.usable),
                 "kv_cache_dtype": (c.info or {}).get("kv_cache_dtype")}
                for c in self.cores]

    def _send(self, core: CoreProcess, msg) -> None:
        with self._lock:
            self._send_locked(core, msg)

    def _send_locked(self, core: CoreProcess, msg) -> bool:
        """Send a message to a core (queued without limit); False if the socket is closed."""
        return self._send_frame_locked(core, self._encoder.encode(msg))

    def _send_frame_locked(self, core: CoreProcess, frame: bytes) -> bool:
        """Over the core's request channel if it has one (what the socket does not take now
        waits in its backlog, which the reader thread writes), else over zmq."""
        if core.held is not None:  # not known yet how to reach it: sent once it is
            core.held.append(frame)
            return True
        writer = core.requests
        if writer is None:
            try:
                core.inbox.send(frame, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                log.error("could not send to engine core %d: %s", core.index, e)
                return False
        if writer.closed:
            log.error("could not send to engine core %d: its request channel is closed",
                      core.index)
            return False
        had_backlog = writer.pending
        writer.send(frame)
        if writer.pending and not had_backlog:  # the reader thread writes it when it can
            self._wake_reader()
        return True

    def _open_request_channel(self, core: CoreProcess, path: str | None) -> None:
        """On its CoreReady: connect to the core's request listener (before anything is sent
        there), or settle on zmq for its whole life; then send what was held meanwhile."""
        with self._lock:
            if core.held is None:  # decided already (a CoreReady twice)
                return
            if path is not None:
                core.requests = FrameWriter.connect(path, f"engine core {core.index}")
                if core.requests is None:
                    log.warning("cannot connect to engine core %d's request channel: what "
                                "this process sends it goes over zmq", core.index)
            held, core.held = core.held, None
            for frame in held:
                self._send_frame_locked(core, frame)

    def _pending_request_writers(self) -> list[FrameWriter]:
        return [core.requests for core in self.cores
                if core.requests is not None and core.requests.pending]

    def _flush_requests(self) -> list[int]:
        """Write what each request channel's socket takes now; the sockets still holding a
        backlog after it (their fds)."""
        with self._lock:
            for writer in self._pending_request_writers():
                writer.flush()
            return [writer.sock.fileno() for writer in self._pending_request_writers()]

    def _drain_requests(self, timeout: float) -> None:
        """Write every request channel's backlog, waiting up to `timeout` s for the cores to
        take it (stopping: the reader thread, which writes it otherwise, has stopped or is
        stopping). The lock is held to write, not while it waits."""
        deadline = time.monotonic() + timeout
        while True:
            fds = self._flush_requests()
            left = deadline - time.monotonic()
            if not fds or left <= 0:
                return
            # A writer closed meanwhile (a dead core) shows as POLLNVAL: looked at again above.
            waiting = select.poll()
            for fd in fds:
                waiting.register(fd, select.POLLOUT)
            waiting.poll(max(left * 1000, 1))

    def _wake_reader(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the thread has a wake-up pending already
            pass

    # ---- the reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        pipe_poller = zmq.Poller()
        pipe_poller.register(self._wake_r, zmq.POLLIN)
        socket_poller, watched = None, None
        next_check = 0.0
        while not self._stopping:  # stop() ends every stream itself
            loop = self._reading_loop
            if loop is not None and loop.is_closed():  # it reads no more: read here again
                self._reading_loop = loop = None
            if loop is None and watched != self._step_readers:  # a core connected or left
                socket_poller, watched = self._socket_poller(), list(self._step_readers)
            poller = socket_poller if loop is None else pipe_poller
            backlogs = self._pending_request_writers()
            if backlogs:  # a core's request channel is full: written as it takes more
                poller = _with_writers(poller, backlogs)
            try:
                events = dict(poller.poll(READER_POLL_MS))
            except zmq.ZMQError:
                return  # the context was closed by stop()
            if backlogs:
                self._flush_requests()
                for writer in backlogs:
                    events.pop(writer.sock, None)
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            if loop is None and self._outbox in events and not self._drain():
                return  # the socket was closed by stop()
            if loop is None and len(events) > (self._wake_r in events) + (self._outbox in events):
                self._read_step_channels()
            if loop is None and self._loop_to_read is not None:
                self._read_step_channels()  # everything that came before the loop takes over
                self._hand_over_to_loop()
            if (not self._stopping and self.error is None
                    and time.monotonic() >= next_check):  # a waitpid per core: not every step
                self._check_processes()
                self._check_stalls()
                next_check = time.monotonic() + READER_POLL_MS / 1000

    def _socket_poller(self) -> zmq.Poller:
        """What the reader thread waits on while it reads: the zmq socket, the wake pipe, the
        step channels' listener and connections."""
        poller = zmq.Poller()
        for fd in (self._outbox, self._wake_r, self._step_listener.fileno(),
                   *(reader.fileno() for reader in self._step_readers)):
            poller.register(fd, zmq.POLLIN)
        return poller

    def _read_step_channels(self) -> None:
        """Take new cores' connections and every whole step message waiting on each."""
        self._accept_cores()
        for reader in list(self._step_readers):
            self._read_steps(reader)

    def _accept_cores(self) -> None:
        while True:
            try:
                sock, _ = self._step_listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed by stop()
                return
            reader = FrameReader(sock)
            self._step_readers.append(reader)
            loop = self._reading_loop
            if loop is not None and self._on_reading_loop():
                loop.add_reader(reader.fileno(), self._deliver_on_loop, self._read_steps, reader)

    def _read_steps(self, reader: FrameReader) -> None:
        for frame in reader.read_frames():
            self._handle_frame(frame)
        if reader.eof:  # the core is gone (the process checks say what that means)
            if self._on_reading_loop():
                self._reading_loop.remove_reader(reader.fileno())
            self._step_readers.remove(reader)
            reader.close()

    def _keep_loop_awake(self) -> None:
        """Busy-poll (--busy-poll-ms): the event loop that reads the step channels does not
        sleep for busy_poll_s after a step message (or a submit) while requests are in
        flight: it runs a callback that only schedules itself again, so each of its
        iterations polls the sockets without waiting (asyncio's select with a zero timeout).
        The next step message then finds no sleeping reader to wake: the engine core's write
        wakes no process (on a CPU, the write costs the core's loop ~10 us less CPU with
        nobody asleep on the socket; scripts/api_overhead.py --busy-poll-ms), and the message
        is read at once. The price: this process spins a CPU while it streams. Only on the
        reading loop (after it read the sockets, or submitted: the prompt's step message
        finds it awake)."""
        loop = self._reading_loop
        if loop is None or not self._on_reading_loop():
            return
        self._awake_until = time.monotonic() + self.busy_poll_s
        if self._kept_awake is not loop:
            self._kept_awake = loop
            loop.call_soon(self._stay_awake, loop)

    def _stay_awake(self, loop: asyncio.AbstractEventLoop) -> None:
        if (self._stopping or not self._streams or loop is not self._reading_loop
                or time.monotonic() >= self._awake_until):
            if self._kept_awake is loop:
                self._kept_awake = None
            return
        loop.call_soon(self._stay_awake, loop)

    def _ask_to_read_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have `loop` read the step socket from now on (the thread hands it over)."""
        self._loop_to_read = loop
        self._wake_reader()

    def _hand_over_to_loop(self) -> None:
        """On the reader thread, which has read every message waiting: from now on the loop
        reads (its first callback runs after those messages' deliveries, so order holds)."""
        loop = self._reading_loop = self._loop_to_read  # set first: a submit asks no more
        self._loop_to_read = None
        try:
            loop.call_soon_threadsafe(self._start_loop_reading, loop)
        except RuntimeError:  # it closed meanwhile: the thread reads on
            self._reading_loop = None

    def _start_loop_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._stopping:
            return
        try:
            loop.add_reader(self._outbox_fd, self._deliver_on_loop, self._drain_waiting)
        except NotImplementedError:  # a loop without FD readers (Windows' proactor)
            self._loop_reading_unsupported = True
            self._reading_loop = None  # the thread reads again from its next poll
            return
        loop.add_reader(self._step_listener.fileno(), self._deliver_on_loop,
                        self._read_step_channels)
        for reader in self._step_readers:
            loop.add_reader(reader.fileno(), self._deliver_on_loop, self._read_steps, reader)
        # the FDs signal changes only: what came meanwhile is read now
        self._deliver_on_loop(self._drain_waiting)
        self._deliver_on_loop(self._read_step_channels)

    def _drain_waiting(self) -> None:
        """Every message waiting on the zmq socket (the event loop's reader callback)."""
        try:
            if self._outbox.get(zmq.EVENTS) & POLLIN:  # the FD also fires on no message
                self._drain()
        except zmq.ZMQError:  # the socket was closed by stop()
            pass

    def _deliver_on_loop(self, read: Callable, *args) -> None:
        """An event loop's reader callback: `read(*args)`, each stream of this loop given its
        outputs at once (no thread between the socket and the streams)."""
        self._delivering_on = self._reading_loop
        try:
            read(*args)
        finally:
            self._delivering_on = None

    def _on_reading_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._reading_loop
        except RuntimeError:  # no loop runs on this thread
            return False

    def _stop_loop_reading(self) -> None:
        """Before the sockets close: the loop that reads them stops watching their FDs (on the
        loop's own thread while it runs; the thread has stopped reading by now)."""
        loop = self._reading_loop
        if loop is None or loop.is_closed():
            return
        if self._on_reading_loop() or not loop.is_running():
            self._remove_readers(loop)
            return
        removed = threading.Event()

        def remove() -> None:
            self._remove_readers(loop)
            removed.set()

        try:
            loop.call_soon_threadsafe(remove)
        except RuntimeError:  # closed meanwhile
            return
        if not removed.wait(5):
            log.warning("the event loop reading the engine cores did not let go of the socket")

    def _remove_readers(self, loop: asyncio.AbstractEventLoop) -> None:
        for fd in (self._outbox_fd, self._step_listener.fileno(),
                   *(reader.fileno() for reader in self._step_readers)):
            loop.remove_reader(fd)

    def _drain(self) -> bool:
        """Handle every message waiting (poll saw one); False if the socket is closed.

        It asks the socket whether another message waits instead of letting recv raise
        zmq.Again: building that exception (5-13 us measured here) costs as much as the rest of
        a one-request step's delivery, once per step."""
        try:
            while True:
                self._handle_frame(self._outbox.recv(zmq.NOBLOCK))
                if not self._outbox.get(zmq.EVENTS) & POLLIN:
                    return True
        except zmq.Again:  # poll's word was stale
            return True
        except zmq.ZMQError:
            return False

    def _handle_frame(self, frame: bytes) -> None:
        try:
            self._handle(self._decoder.decode(frame))
        except Exception as e:  # noqa: BLE001 - never leave a request hanging
            log.exception("bad message from an engine core")
            self._fatal(RuntimeError(f"bad message from an engine core: {e}"))

    def _handle(self, msg) -> None:
        core = self.cores[msg.core]
        if core.dead is not None:  # sent before it died: its requests have ended here
            return
        core.last_alive = time.monotonic()
        if isinstance(msg, Heartbeat):
            return
        core.last_heard = core.last_alive
        if core.stalled is not None:
            log.warning("engine core %d steps again (%s)", core.index, core.stalled)
            core.stalled = None
        if isinstance(msg, StepOutputs):
            self._deliver(msg)
        elif isinstance(msg, CoreReady):
            self._core_ready(msg)
        elif isinstance(msg, ProbeReply):
            waiting = self._probes[msg.core]
            fut = waiting.popleft() if waiting else None
            if fut is not None:
                if msg.error is not None:
                    fut.set_exception(AssertionError(f"engine core {msg.core}: {msg.error}"))
                else:
                    fut.set_result(msg.stats if msg.loop is None
                                   else {**msg.stats, "loop": msg.loop})

    def _deliver(self, msg: StepOutputs) -> None:
        core = self.cores[msg.core]
        core.stats = msg.stats
        if self.on_step_message is not None:
            self.on_step_message(msg.stats["time"])
        by_loop = defaultdict(list)
        streams = self._streams
        with self._lock:
            for out in msg.outputs:
                stream = streams.get(out.request_id)
                if stream is None:  # aborted here already
                    continue
                if stream.routed_prefill:  # its first output: the prompt is computed
                    self._prefill_done(core, stream)
                if out.finished:  # (a refused request's output is finished too)
                    del streams[out.request_id]
                    core.num_in_flight -= 1
                    if (out.finish_reason == FinishReason.ERROR and not out.new_token_ids
                            and out.status == 400):
                        out = StreamError(out.error, 400, out.error_param)
                by_loop[stream.aloop].append((stream, out))
        for aloop, items in by_loop.items():  # one wake-up per event loop and step
            if aloop is self._delivering_on:  # read on that loop: no hand-off
                RequestStream.put_all(items)
                continue
            try:
                aloop.call_soon_threadsafe(RequestStream.put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass
        if self.busy_poll_s:  # a step message, not a heartbeat: a hung core's beats keep no CPU
            self._keep_loop_awake()

    def _core_ready(self, msg: CoreReady) -> None:
        if msg.error is not None:
            self._fatal(RuntimeError(f"engine core {msg.core} could not start: {msg.error}"))
            return
        core = self.cores[msg.core]
        core.info = msg.info
        self._open_request_channel(core, msg.info.get("request_path"))
        log.info("engine core %d ready (pid %d)", msg.core, msg.pid)
        if all(c.info is not None for c in self.cores):
            try:
                self._load_front_end(self.cores[0].info)
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer folder that is not one
                self._fatal(RuntimeError(f"could not load the tokenizer: {e}"))
                return
            self.ready.set()

    def _load_front_end(self, info: dict) -> None:
        source = self.tokenizer_source or info.get("model_dir")
        self.tokenizer = load_tokenizer(source) if source else None
        if self.tokenizer_source and self.tokenizer is None:
            raise ValueError(f"{self.tokenizer_source} holds no tokenizer files")
        self.limits = RequestLimits(int(info["max_model_len"]), int(info["vocab_size"]),
                                    int(info["page_size"]), int(info["num_pages"]),
                                    info.get("context_note", ""))
        self.router = PrefixRouter(self.num_cores, self.limits.page_size)

    def _check_processes(self) -> None:
        if not self.owns_cores:
            self._check_pids()
            return
        for core in self.cores:
            code = core.process.exitcode
            if code is not None and core.dead is None:
                self._core_died(core, f"engine core {core.index} died (exit code {code})")

    def _check_pids(self) -> None:
        """The cores are client 0's children: a dead one stays a zombie until client 0 reaps
        it, so a pid that is gone or a zombie is a dead core."""
        if not _pid_alive(self._owner_pid):
            self._fatal(RuntimeError("the first API server process exited"))
            return
        for core in self.cores:
            if core.dead is None and not _pid_alive(core.pid):
                self._core_died(core, f"engine core {core.index} died")

    def _core_died(self, core: CoreProcess, reason: str) -> None:
        """Fatal when it was the last core (or exit_on_core_failure); else its requests fail
        and the others serve on."""
        core.dead, core.stalled, core.stats = reason, None, {}
        with self._lock:
            if core.requests is not None:  # nobody reads it: a send to it now fails at once
                core.requests.close()
        if self.exit_on_core_failure or all(c.dead is not None for c in self.cores):
            self._fatal(RuntimeError(reason))
            return
        log.error("%s; its requests fail, the other engine cores serve on", reason)
        self._end_all(lambda rid: StreamError(f"{reason}; the request was lost with it", 500),
                      core)

    def _check_stalls(self) -> None:
        """A core with work that has sent no step for stall_timeout_s is stalled (it takes no
        new request); one whose process is silent too (no heartbeat: stopped or hung), after
        stalled_request_timeout_s, has its requests end with a 503."""
        now = time.monotonic()
        for core in self.cores:
            silent = now - core.last_heard
            if core.dead is not None or not core.num_in_flight or silent < self.stall_timeout_s:
                continue
            frozen = now - core.last_alive >= self.stall_timeout_s
            why = ("no step and no heartbeat (stopped or hung)" if frozen
                   else "its process runs, but no step ended")
            was_stalled, core.stalled = core.stalled, (
                f"engine core {core.index} stalled: {why} for {silent:.0f} s with "
                f"{core.num_in_flight} requests in flight")
            if was_stalled is None:
                self._report_stall(core)
            if frozen and silent >= self.stalled_request_timeout_s:
                log.error("ending the %d requests of stalled engine core %d",
                          core.num_in_flight, core.index)
                self._abort_in_cores(core)  # dropped there if it ever runs again
                message = f"{core.stalled}; the request was ended after {silent:.0f} s"
                self._end_all(lambda rid: StreamError(message, 503), core)

    def _report_stall(self, core: CoreProcess) -> None:
        """Log a core's stall once; the owning API process also has the core write each of its
        threads' Python stacks into the log (what a step of many seconds is doing)."""
        if core.process is None:  # a core this process did not start (another API process's)
            log.error("%s", core.stalled)
            return
        log.error("%s; its threads' Python stacks follow", core.stalled)
        try:
            os.kill(core.pid, STACKS_SIGNAL)
        except OSError:  # gone: the pid watch reports it
            pass

    def _fatal(self, error: BaseException) -> None:
        log.error("%s", error)
        self.error = error
        self._fail_all(f"{error}; the server cannot serve any more", 500)
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _fail_all(self, message: str, status: int) -> None:
        self._end_all(lambda rid: StreamError(message, status))

    def _end_all(self, make_item: Callable, core: CoreProcess | None = None) -> None:
        """End every request in flight (or every one on `core`) with make_item(request id) as
        its last item."""
        with self._lock:
            if core is None:
                streams, self._streams = list(self._streams.values()), {}
            else:
                streams = [s for s in self._streams.values() if s.core == core.index]
                for stream in streams:
                    del self._streams[stream.request_id]
            for c in self.cores if core is None else [core]:
                c.num_in_flight = c.pending_prefill = 0
        by_loop = defaultdict(list)
        for stream in streams:
            by_loop[stream.aloop].append((stream, make_item(stream.request_id)))
        for aloop, items in by_loop.items():
            try:
                aloop.call_soon_threadsafe(RequestStream.put_all, items)
            except RuntimeError:
                pass


def _with_writers(poller: zmq.Poller, writers: list[FrameWriter]) -> zmq.Poller:
    """`poller`'s sockets, and the writers' sockets for room to write."""
    both = zmq.Poller()
    for sock, flags in poller.sockets:
        both.register(sock, flags)
    for writer in writers:
        both.register(writer.sock, zmq.POLLOUT)
    return both


class _cuda_visible:
    """Set CUDA_VISIBLE_DEVICES while a spawned process starts (it copies the environment)."""

    _lock = threading.Lock()

    def __init__(self, devices: str | None):
        self.devices = devices

    def __enter__(self):
        if self.devices is not None:
            self._lock.acquire()
            self.saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = self.devices

    def __exit__(self, *exc):
        if self.devices is not None:
            if self.saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.saved
            self._lock.release()



def _pid_alive(pid: int) -> bool:
    """False for a pid that is gone or a zombie (Linux: its state in /proc; elsewhere a zombie
    counts as alive until its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
