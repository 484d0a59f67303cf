"""The API process's side of the engine cores: start them, route requests, read their steps.

`CoreClient` has EngineLoop's interface (submit / abort / abort_all / is_ready / stop ...), so
the app serves either: the in-thread EngineLoop (tests, embedding) or engine-core processes
(`python -m flashlet.server`, one per data-parallel rank). It binds the ipc sockets, spawns the
cores (engine_core.py), and runs one reader thread that receives every core's per-step message
and hands each request's outputs to its stream, one event-loop wake-up per step and loop. The
same thread watches the processes: when a core dies, every request in flight ends with a 500
error, /health turns 503 ("failed") and `on_fatal` runs (the CLI exits non-zero: restarting a
core would drop its cache and its requests anyway, and a supervisor restarts servers better).

Several API processes (`--api-server-count N`, cli.py): each has its own CoreClient, with its
index k. Client 0 owns the cores: it makes the ipc folder, spawns the cores (telling each the
sockets of all N clients) and alone sends them Shutdown. Every client binds its own sockets
(in<core>.<k> into each core, out<k> for the steps), numbers its requests k, k + N, ... (the
cores send a request's outputs back by `request_id % N`), aborts and probes its own requests,
and routes with its own PrefixRouter: each router sees only the prompts, in-flight counts and
pending prompt tokens of its own process (prefix routing still sends a process's repeated prefixes to the core that
cached them; the cores' running/waiting stats, which every client gets each step, are shared).
A client that does not own the cores cannot wait on them: it watches their pids (a dead or
zombie pid is a dead core) and client 0's (the cores' parent): either gone is fatal.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import itertools
from pathlib import Path
from collections import defaultdict
from typing import Callable

import msgspec
import zmq

from flashlet.config import EngineConfig
from flashlet.request_check import RequestLimits
from flashlet.server.engine_core import (AbortRequests, AddRequests, CoreOutput, CoreReady,
                                         Probe, ProbeReply, Shutdown, StepOutputs, build_engine,
                                         run_engine_core)
from flashlet.server.engine_loop import (EngineClient, NotReady, RequestStream,
                                         StreamError)
from flashlet.server.router import PrefixRouter

log = logging.getLogger("flashlet.server")

READER_POLL_MS = 100  # how often the reader checks the processes when no message comes


class CoreProcess:
    """One engine-core process and what the API process knows of it."""

    def __init__(self, index: int, process, inbox, pid: int | None = None):
        self.index = index
        self.process = process  # None in an API process that does not own the cores
        self.pid = process.pid if process is not None else pid
        self.inbox = inbox  # PUSH socket into the core (guarded by CoreClient._send_lock)
        self.info: dict | None = None  # from CoreReady
        self.stats: dict = {}  # from its latest message
        self.num_in_flight = 0  # requests routed here and not finished
        self.pending_prefill = 0  # prompt tokens routed here that have no output yet (router)
        self.num_routed = 0


class CoreClient(EngineClient):
    def __init__(self, config: EngineConfig, data_parallel_size: int = 1,
                 tokenizer: str | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 build_engine: Callable = build_engine, api_server_index: int = 0,
                 api_server_count: int = 1, ipc_dir: str | None = None,
                 core_pids: list[int] | None = None, owner_pid: int | None = None):
        """api_server_index > 0: attach to the cores that client 0 started (its ipc_dir, the
        cores' pids and its own pid, owner_pid) instead of starting them."""
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if api_server_count < 1 or not 0 <= api_server_index < api_server_count:
            raise ValueError(f"api server {api_server_index} of {api_server_count}: out of range")
        if api_server_index > 0 and (ipc_dir is None or core_pids is None or owner_pid is None
                                     or len(core_pids) != data_parallel_size):
            raise ValueError("an API server other than the first needs the cores' ipc folder, "
                             "their pids and the first API server's pid")
        self.config = config
        self.num_cores = data_parallel_size
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
        self._probes: dict[int, concurrent.futures.Future] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ipc_dir = ipc_dir if ipc_dir is not None else tempfile.mkdtemp(prefix="flashlet-")
        self._zmq = zmq.Context()
        self._outbox = self._zmq.socket(zmq.PULL)  # every core's step messages
        self._outbox.setsockopt(zmq.RCVHWM, 0)
        self._outbox.bind(self._output_addr(api_server_index))
        self._decoder = msgspec.msgpack.Decoder(StepOutputs | CoreReady | ProbeReply)
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
                self.cores.append(CoreProcess(i, None, inbox, self._core_pids[i]))
                continue
            # Daemonic unless it must start processes itself (tensor parallelism's ranks): it
            # stops with this process either way (stop(), or it notices its parent is gone).
            process = spawn.Process(
                target=run_engine_core, name=f"flashlet-core{i}",
                daemon=self.config.tensor_parallel_size == 1,
                args=(self.config, i, [self._input_addr(i, k) for k in api_servers],
                      [self._output_addr(k) for k in api_servers], os.getpid(),
                      self.tokenizer_source, self._build_engine))
            with _cuda_visible(self._device_for(i)):
                process.start()
            self.cores.append(CoreProcess(i, process, inbox))
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
        for core in self.cores:
            core.inbox.close(linger=linger_ms)
        self._outbox.close(linger=0)
        self._zmq.term()
        self.stopped.set()

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.error is None and not self._stopping

    # ---- requests (any thread) ------------------------------------------------------------
    def submit_group(self, streams: list[RequestStream], max_waiting: int | None = None) -> None:
        """Route the samples of one prompt (n > 1) to one core together, all or none; the core
        runs the others once the first has computed the prompt, so they share its KV pages."""
        with self._lock:
            self._admit(max_waiting)
            index, prefill = self.router.route_request(
                streams[0].prompt_token_ids, [c.num_in_flight for c in self.cores],
                [c.pending_prefill for c in self.cores])
            core = self.cores[index]
            core.pending_prefill += prefill  # the first sample computes the prompt for all
            streams[0].routed_prefill = prefill
            ids = [next(self._ids) for _ in streams]
            group = streams[0].group
            message = AddRequests.of(ids, streams[0].prompt_token_ids,
                                     [stream.params for stream in streams],
                                     ids[0] if group is None else group)
            for stream, rid in zip(streams, ids):
                stream.request_id, stream.core = rid, core.index
            core.num_in_flight += len(streams)
            core.num_routed += len(streams)
            if not self._send_locked(core, message):
                core.num_in_flight -= len(streams)
                self._prefill_done(core, streams[0])
                raise NotReady(f"engine core {core.index} cannot take requests")
            for stream in streams:
                self._streams[stream.request_id] = stream

    def abort(self, stream: RequestStream, finish_reason: str = "abort") -> None:
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
        self._end_all(lambda rid: CoreOutput(rid, [], finished=True, finish_reason="abort"))

    def _abort_in_cores(self) -> None:
        """Tell the cores to drop every request of this process (their streams stay open)."""
        with self._lock:
            by_core = defaultdict(list)
            for rid, stream in self._streams.items():
                by_core[stream.core].append(rid)
            for index, rids in by_core.items():
                self._send_locked(self.cores[index], AbortRequests(rids))

    def probe(self, timeout: float = 30.0, loop: bool = False) -> list[dict]:
        """Each core's engine stats after an integrity check (raises if one fails); loop:
        with its loop's counters under "loop" instead of the check (diagnostics.py)."""
        futures = []
        for core in self.cores:
            fut = concurrent.futures.Future()
            with self._lock:
                self._probes[core.index] = fut
                self._send_locked(core, Probe(self.api_server_index, loop))
            futures.append(fut)
        return [f.result(timeout) for f in futures]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

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

    def core_stats(self) -> list[dict]:
        return [{**c.stats, "routed": c.num_routed, "in_flight": c.num_in_flight,
                 "pending_prefill": c.pending_prefill} for c in self.cores]

    def _send(self, core: CoreProcess, msg) -> None:
        with self._lock:
            self._send_locked(core, msg)

    def _send_locked(self, core: CoreProcess, msg) -> bool:
        """Send a message to a core (queued without limit); False if the socket is closed."""
        try:
            core.inbox.send(self._encoder.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            log.error("could not send to engine core %d: %s", core.index, e)
            return False

    # ---- the reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outbox, zmq.POLLIN)
        next_check = 0.0
        while not self._stopping:  # stop() ends every stream itself
            try:
                events = dict(poller.poll(READER_POLL_MS))
            except zmq.ZMQError:
                return  # the context was closed by stop()
            if self._outbox in events and not self._drain():
                return  # the socket was closed by stop()
            if (not self._stopping and self.error is None
                    and time.monotonic() >= next_check):  # a waitpid per core: not every step
                self._check_processes()
                next_check = time.monotonic() + READER_POLL_MS / 1000

    def _drain(self) -> bool:
        """Handle every message waiting (poll saw one); False if the socket is closed.

        It asks the socket whether another message waits instead of letting recv raise
        zmq.Again: building that exception (5-13 us measured here) costs as much as the rest of
        a one-request step's delivery, once per step."""
        try:
            while True:
                self._handle_frame(self._outbox.recv(zmq.NOBLOCK))
                if not self._outbox.get(zmq.EVENTS) & zmq.POLLIN:
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
        if isinstance(msg, StepOutputs):
            self._deliver(msg)
        elif isinstance(msg, CoreReady):
            self._core_ready(msg)
        elif isinstance(msg, ProbeReply):
            fut = self._probes.pop(msg.core, None)
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
        with self._lock:
            for out in msg.outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:  # aborted here already
                    continue
                if stream.routed_prefill:  # its first output: the prompt is computed
                    self._prefill_done(core, stream)
                if out.finished:
                    del self._streams[out.request_id]
                    core.num_in_flight -= 1
                if out.finish_reason == "error" and not out.new_token_ids and out.status == 400:
                    by_loop[stream.aloop].append((stream, StreamError(out.error, 400)))
                else:
                    by_loop[stream.aloop].append((stream, out))
        for aloop, items in by_loop.items():  # one wake-up per event loop and step
            try:
                aloop.call_soon_threadsafe(RequestStream.put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _core_ready(self, msg: CoreReady) -> None:
        if msg.error is not None:
            self._fatal(RuntimeError(f"engine core {msg.core} could not start: {msg.error}"))
            return
        self.cores[msg.core].info = msg.info
        log.info("engine core %d ready (pid %d)", msg.core, msg.pid)
        if all(c.info is not None for c in self.cores):
            try:
                self._load_front_end(self.cores[0].info)
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer folder that is not one
                self._fatal(RuntimeError(f"could not load the tokenizer: {e}"))
                return
            self.ready.set()

    def _load_front_end(self, info: dict) -> None:
        from flashlet.weights import load_tokenizer

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
            if code is not None:
                self._fatal(RuntimeError(f"engine core {core.index} died (exit code {code})"))
                return

    def _check_pids(self) -> None:
        """The cores are client 0's children: a dead one stays a zombie until client 0 reaps
        it, so a pid that is gone or a zombie is a dead core."""
        for core in self.cores:
            if not _pid_alive(core.pid):
                self._fatal(RuntimeError(f"engine core {core.index} died"))
                return
        if not _pid_alive(self._owner_pid):
            self._fatal(RuntimeError("the first API server process exited"))


    def _fatal(self, error: BaseException) -> None:
        log.error("%s", error)
        self.error = error
        self._fail_all(f"{error}; the server cannot serve any more", 500)
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _fail_all(self, message: str, status: int) -> None:
        self._end_all(lambda rid: StreamError(message, status))

    def _end_all(self, make_item: Callable) -> None:
        """End every request in flight with make_item(request id) as its last item."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            for core in self.cores:
                core.num_in_flight = core.pending_prefill = 0
        by_loop = defaultdict(list)
        for stream in streams:
            by_loop[stream.aloop].append((stream, make_item(stream.request_id)))
        for aloop, items in by_loop.items():
            try:
                aloop.call_soon_threadsafe(RequestStream.put_all, items)
            except RuntimeError:
                pass


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
