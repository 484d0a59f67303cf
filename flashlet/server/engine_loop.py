"""The engine loop: one background thread owns the Engine and runs `Engine.step()` (the
in-thread engine client: tests and embedding use it; `python -m flashlet.server` runs the engine
in its own process instead, see core_client.py).

The engine is not thread-safe, so nothing else touches it. HTTP handlers (on asyncio event
loops, possibly several) talk to the loop through a command deque guarded by a condition
variable: `submit`, `abort`, `call`. Each request has a `RequestStream`; the loop pushes that
request's output deltas into it with `loop.call_soon_threadsafe`, so
tokens stream out as each step makes them. The engine's outputs are token ids; the handlers
give them their text (server/frontend.py), as they do for an engine-core process. With nothing
to do the thread sleeps on the condition (no busy spin).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from flashlet.core.request import FinishReason, RequestOutput
from flashlet.core.request_check import RequestLimits
from flashlet.core.sampling import SamplingParams
from flashlet.distributed.parallel import WorkerDiedError

log = logging.getLogger("flashlet.server")


class Overloaded(Exception):
    """Too many requests are queued already (maps to HTTP 503 with Retry-After)."""


class NotReady(Exception):
    """The model is still loading, failed to load, or the loop is shutting down (HTTP 503)."""


class StreamError:
    """Put on a stream instead of a RequestOutput when its request could not run."""

    def __init__(self, message: str, status: int = 500, param: str | None = None):
        self.message = message
        self.status = status
        self.param = param  # the request field at fault (a 400's), where known


class RequestStream:
    """One request's channel from the engine thread back to the asyncio handler: a deque and
    at most one waiting future (asyncio.Queue's bookkeeping costs several microseconds per
    streamed token, and a stream has exactly one reader)."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams):
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.aloop = asyncio.get_running_loop()
        self.items: deque[RequestOutput | StreamError] = deque()  # touched on aloop only
        self._waiter: asyncio.Future | None = None
        self.request_id: int | str | None = None  # set by the loop (or core client) on submit
        self.core = 0  # the engine core it was routed to (data parallel)
        self.leader: RequestStream | None = None  # the first sample of its prompt (n > 1)
        # The client request it is part of (prompts of one completion request share it: the
        # engine lets groups take turns); None: its own (an engine core is sent its first
        # sample's id), or the in-thread engine's common group.
        self.group: int | None = None
        # Prompt tokens its core was expected to compute for it (data parallel routing), held
        # in that core's pending count until its first output.
        self.routed_prefill = 0
        self.cancelled = False
        self.finished = False  # set by the handler when it has seen the last output

    def push(self, item: RequestOutput | StreamError) -> None:
        """On the event loop: queue an item and wake the reader."""
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def put(self, item: RequestOutput | StreamError) -> None:
        """Called on the engine thread."""
        try:
            self.aloop.call_soon_threadsafe(self.push, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    @staticmethod
    def put_all(items: list[tuple["RequestStream", object]]) -> None:
        """On the event loop: hand out one step's items (one wake-up for all of them)."""
        for stream, item in items:
            stream.push(item)

    async def get(self) -> RequestOutput | StreamError:
        while not self.items:
            self._waiter = self.aloop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.items.popleft()


class EngineClient:
    """What the server's front end shares between the engine owners (EngineLoop on a thread,
    CoreClient over engine-core processes): `ready` / `stopped` / `error`, and requests
    submitted one at a time or as a group (`submit_group`, in the subclass)."""

    ready: threading.Event
    stopped: threading.Event
    error: BaseException | None
    # Called with each step message's send time where steps arrive as messages (CoreClient).
    on_step_message: Callable[[float], None] | None = None

    def loop_stats(self, timeout: float = 30.0) -> list[dict]:
        """Each engine's stats with its loop's counters where it has them (GET /debug/stats);
        may block up to `timeout`."""
        return self.core_stats()

    def core_stats(self) -> list[dict]:
        """Each engine's stats as last known, without asking it (never blocks)."""
        raise NotImplementedError

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the engine runs; False if it failed, stopped, or `timeout` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.error is not None or self.stopped.is_set():
                return False
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def core_problems(self) -> list[str]:
        """Why each engine core that cannot take requests cannot (CoreClient: dead, stalled)."""
        return []

    def submit(self, stream: RequestStream, max_waiting: int | None = None) -> None:
        """Send one request; raises Overloaded when `max_waiting` requests wait already, or
        NotReady."""
        self.submit_group([stream], max_waiting)

    def submit_group(self, streams: list[RequestStream], max_waiting: int | None = None) -> None:
        raise NotImplementedError

    @property
    def max_running(self) -> int:
        """Requests that run at once (every core's max_num_seqs together)."""
        raise NotImplementedError

    @property
    def num_streams(self) -> int:
        """Requests of this process submitted and not finished (streaming their outputs)."""
        raise NotImplementedError

    def _admit(self, max_waiting: int | None) -> None:
        """Raise NotReady or Overloaded unless a new request may enter now (under the
        subclass's lock, which guards `is_ready`, `_stopping` and `num_waiting`)."""
        if not self.is_ready:
            raise NotReady("the engine is not ready" if not self._stopping
                           else "the server is shutting down")
        if max_waiting is not None and self.num_waiting >= max_waiting:
            raise Overloaded(f"{self.num_waiting} requests are waiting already "
                             f"(max_waiting={max_waiting})")


class EngineLoop(EngineClient):
    """Owns an Engine on a background thread. Thread-safe: every public method may be called
    from any thread. `engine_factory` runs on the loop thread (so loading does not block the
    caller); `ready` is set once the engine exists and the loop runs."""

    def __init__(self, engine=None, engine_factory: Callable[[], Any] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        if (engine is None) == (engine_factory is None):
            raise ValueError("pass exactly one of engine and engine_factory")
        self.engine = engine
        self._factory = engine_factory
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._cmds: deque[tuple] = deque()
        self._streams: dict[int, RequestStream] = {}  # engine request id -> stream
        self._num_pending_submits = 0
        self._engine_waiting = 0
        self._running = 0  # the engine's running requests after the latest step
        self._max_num_seqs = 0  # set once the engine exists
        self._paused = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.snapshot: dict = {}  # engine.stats() after the latest iteration (replaced whole)
        self.limits: RequestLimits | None = None  # set once the engine exists
        self.tokenizer = None
        self.num_iterations = 0

    # ---- life cycle -----------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="flashlet-engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort every request still in flight, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and not self.stopped.is_set() and not self._stopping

    # ---- commands (any thread) ------------------------------------------------------------
    def submit_group(self, streams: list[RequestStream], max_waiting: int | None = None) -> None:
        """Queue the samples of one prompt together (n > 1): all or none. The engine runs the
        others once the first has computed the prompt, so they share its KV pages."""
        with self._cond:
            self._admit(max_waiting)
            for i, stream in enumerate(streams):
                stream.leader = streams[0] if i else None
                self._num_pending_submits += 1
                self._cmds.append(("submit", stream))
            self._cond.notify()

    def abort(self, stream: RequestStream,
              finish_reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request (idempotent); its pages are freed before the next step. The front end
        ends it with `finish_reason` itself (e.g. "stop" for a stop string it found)."""
        with self._cond:
            if stream.cancelled or stream.finished:
                return
            stream.cancelled = True
            self._cmds.append(("abort", stream, finish_reason))
            self._cond.notify()

    def abort_all(self) -> None:
        with self._cond:
            self._cmds.append(("abort_all",))
            self._cond.notify()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the loop thread between two steps; returns a Future.

        fn may drive the engine itself (e.g. `LLM.generate` in tests) only while no server
        request is in flight: the outputs it steps out would not reach their streams."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self.stopped.is_set():
                raise NotReady("the engine loop has stopped")
            self._cmds.append(("call", fn, fut))
            self._cond.notify()
        return fut

    def pause(self) -> None:
        """Test hook: stop stepping (commands are still applied, so submits queue up)."""
        with self._cond:
            self._paused = True
            self._cond.notify()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet admitted by the scheduler."""
        return self._num_pending_submits + self._engine_waiting

    def core_stats(self) -> list[dict]:
        """The one engine's latest stats, as CoreClient gives one per core."""
        s = self.snapshot or {}
        return [{**s, "waiting": s.get("waiting", 0) + self._num_pending_submits,
                 "in_flight": len(self._streams) + self._num_pending_submits}]

    @property
    def num_waiting(self) -> int:
        """Queued requests that will not run at the next step: those beyond the running
        slots left free (an idle server with N free slots takes a burst of N + max_waiting).
        Read under the condition; `_running` is from the latest step."""
        free = 0 if self._paused else max(0, self._max_num_seqs - self._running)
        return max(0, self.num_queued - free)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def max_running(self) -> int:
        return self._max_num_seqs

    # ---- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.engine is None:
                self.engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to the server, which exits
            self.error = e
            log.error("engine failed to start: %s", e)
            self.stopped.set()
            if self._on_fatal is not None:
                self._on_fatal(e)
            return
        self.snapshot = self.engine.stats()
        self._max_num_seqs = self.engine.config.max_num_seqs
        self.limits = RequestLimits.of_engine(self.engine)
        self.tokenizer = self.engine.tokenizer
        self.ready.set()
        try:
            self._serve()
        finally:
            shutdown = getattr(self.engine, "shutdown", None)  # tensor-parallel workers
            if shutdown is not None:
                shutdown()
            self.stopped.set()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._cmds or self._stopping
                           or (not self._paused and engine.has_unfinished())):
                    self._cond.wait()
                cmds, self._cmds = self._cmds, deque()
                stopping = self._stopping
            for cmd in cmds:
                self._apply(cmd)
            if stopping:
                self._abort_all()
                self._step()  # deliver the abort outputs
                self._update_counts()
                self._fail_leftovers("the server shut down")
                return
            if not self._paused and engine.has_unfinished():
                steps = engine.num_steps
                if not self._step() and engine.num_steps == steps:
                    # Unfinished work but nothing could be scheduled (it should not happen:
                    # add_request refuses what can never fit): do not spin, wait a little.
                    with self._cond:
                        if not self._cmds:
                            self._cond.wait(0.01)
            self._update_counts()
            self.num_iterations += 1

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "submit":
            stream = cmd[1]
            rid = None
            try:
                if not stream.cancelled:
                    leader = stream.leader.request_id if stream.leader is not None else None
                    rid = self.engine.add_request(stream.prompt_token_ids, stream.params,
                                                  after=leader)
            except ValueError as e:  # the API checked all but its format: a RequestError names it
                stream.put(StreamError(str(e), status=400, param=getattr(e, "param", None)))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
                log.exception("add_request failed")
                stream.put(StreamError(f"could not queue the request: {e}", status=500))
            with self._cond:  # moves from "pending" to the engine's waiting queue atomically
                self._num_pending_submits -= 1
                if rid is not None:
                    self._engine_waiting += 1
            if rid is not None:
                stream.request_id = rid
                self._streams[rid] = stream
        elif kind == "abort":
            stream, finish_reason = cmd[1], cmd[2]
            if stream.request_id is not None:  # the pages are freed now, whatever else runs
                self.engine.abort(stream.request_id, finish_reason)
                self._streams.pop(stream.request_id, None)  # its reader is gone
        elif kind == "abort_all":
            self._abort_all()
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self.engine.abort(rid)

    def _step(self) -> int:
        """One engine step; delivers its outputs and returns how many there were."""
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
            log.exception("engine step failed")
            for rid, stream in list(self._streams.items()):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
                stream.put(StreamError(f"engine step failed: {e}", status=500))
            self._streams.clear()
            if isinstance(e, WorkerDiedError):  # the engine is down for good: stop serving
                self._fatal(e)
            return 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
        return len(outputs)

    def _fatal(self, error: BaseException) -> None:
        self.error = error
        with self._cond:
            self._stopping = True
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _fail_leftovers(self, message: str) -> None:
        for stream in self._streams.values():
            stream.put(StreamError(message, status=503))
        self._streams.clear()
        with self._cond:  # nothing queued after this point will ever run
            cmds, self._cmds = self._cmds, deque()
            self._num_pending_submits = 0
        for cmd in cmds:
            if cmd[0] == "submit":
                cmd[1].put(StreamError(message, status=503))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(NotReady(message))

    def _update_counts(self) -> None:
        stats = self.engine.stats()
        with self._cond:
            self._engine_waiting = stats["waiting"]
            self._running = stats["running"]
        self.snapshot = stats
