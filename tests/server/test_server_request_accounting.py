"""Issue 35, item 1: whatever stage of a request fails, what it counted is uncounted. A request
the engine-core message cannot carry leaves nothing in flight (CoreClient, no process needed);
through the server, a failure injected at each stage (tokenize, check, submit, the engine's add,
the compile, after the submit, mid-stream) leaves no stream, no queued request and no KV page."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import zmq
from server_helpers import MODEL_NAME, assert_no_leaks, idle_stats

from flashlet import EngineConfig, SamplingParams
from flashlet.server.core_client import CoreClient, CoreProcess
from flashlet.server.engine_core import EngineCore
from flashlet.server.engine_loop import RequestStream
from flashlet.server.messages import AbortRequests, AddRequests, CoreInput
from flashlet.server.router import PrefixRouter
from flashlet.text.structured import CompileCancelled

POISON_FORMAT = {"type": "json_schema", "json_schema": {"schema": {
    "type": "integer", "maximum": 2**70}}}


@pytest.fixture
def socket_client(tmp_path):
    """A CoreClient whose one core is a socket this test reads (no engine process)."""
    client = CoreClient(EngineConfig(), ipc_dir=str(tmp_path))
    inbox = client._zmq.socket(zmq.PUSH)
    inbox.bind(client._input_addr(0, 0))
    core_end = client._zmq.socket(zmq.PULL)
    core_end.connect(client._input_addr(0, 0))
    client.cores = [CoreProcess(0, None, inbox, pid=os.getpid())]
    client.router = PrefixRouter(1, 16)
    client.ready.set()
    yield client, core_end
    core_end.close(linger=0)
    client._stopping = True
    client._close()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_request_the_core_message_cannot_carry_leaves_nothing_in_flight(socket_client):
    client, core_end = socket_client

    async def submit_all():
        for _ in range(100):  # n = 16 each: 1,600 samples, far past max_waiting
            poison = [RequestStream([1, 2, 3], SamplingParams(response_format=POISON_FORMAT))
                      for _ in range(16)]
            with pytest.raises(ValueError, match="cannot be sent to the engine core"):
                client.submit_group(poison, max_waiting=1)
            assert all(s.request_id is None for s in poison)
        assert client.num_streams == client.num_waiting == client.num_queued == 0
        assert client.cores[0].num_in_flight == 0
        client.submit_group([RequestStream([1, 2, 3], SamplingParams())], max_waiting=1)
        assert client.num_streams == client.cores[0].num_in_flight == 1

    asyncio.run(submit_all())
    frames = []
    while core_end.poll(100):
        frames.append(msgspec.msgpack.decode(core_end.recv(), type=CoreInput))
    assert len(frames) == 1 and isinstance(frames[0], AddRequests)  # the poison never left


# ---- through the server: a failure at each stage -------------------------------------------
CHAT = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _fail(*_args, **_kwargs):
    raise RuntimeError("injected failure")


async def _fail_async(*_args, **_kwargs):
    raise RuntimeError("injected failure")


def _stages(engine_loop):
    """(stage, what to patch, the request, the statuses it may answer) per stage."""
    from flashlet.server import frontend
    from flashlet.text.tokenizing import TextEncoder

    # Long enough to be still running when the counters are read, unless it was released.
    completion = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1000, "n": 3,
                  "ignore_eos": True}
    return [
        ("tokenize", (TextEncoder, "chat_async", _fail_async), CHAT, {400}),
        ("check", (frontend.ModelContext, "budget", _fail), CHAT, {500}),
        ("submit", (type(engine_loop), "submit_group", _fail), CHAT, {500}),
        ("engine add", (engine_loop.engine, "add_request", _fail), {**CHAT, "n": 4}, {500}),
        ("compile", (engine_loop.engine.structured, "compile",
                     lambda fmt: (_ for _ in ()).throw(ValueError("injected compile failure"))),
         {**CHAT, "response_format": {"type": "json_object"}}, {400}),
        ("after submit", (frontend.ModelContext, "ids_text", _fail),
         {**completion, "echo": True}, {500}),
        ("mid-stream", (frontend.IncrementalDetokenizer, "push", _fail),
         {**completion, "stream": True}, {200}),
        ("mid-answer", (frontend.IncrementalDetokenizer, "push", _fail),
         completion, {500}),
    ]


@pytest.mark.slow
def test_a_failure_at_any_stage_leaves_every_counter_at_zero(server, engine_loop, monkeypatch):
    for stage, (target, name, replacement), body, statuses in _stages(engine_loop):
        with monkeypatch.context() as patch:
            patch.setattr(target, name, replacement)
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            r = _post(server, path, body)
        assert r.status_code in statuses, (stage, r.status_code, r.text)
        stats = idle_stats(engine_loop, timeout=15)  # a leak would run for ~1,000 steps
        assert engine_loop.num_streams == engine_loop.num_queued == 0, stage
        assert_no_leaks(stats)
    assert _post(server, "/v1/chat/completions", CHAT).status_code == 200


# ---- the engine core's compile queue -------------------------------------------------------
class FakeStructured:
    """StructuredOutputs' interface to the core: one format cached, one past a static limit,
    compiles that run until cancelled."""

    def __init__(self):
        self.started, self.stop = threading.Event(), threading.Event()
        self.cancelled: list[dict] = []

    def is_cached(self, fmt: dict) -> bool:
        return fmt["type"] == "json_object"

    def check(self, fmt: dict) -> None:
        if fmt.get("grammar") == "huge":
            raise ValueError("response_format has more than 8192 enum and const values: over "
                             "the limit of 8192 (--structured-output-max-enum)")

    def compile(self, fmt: dict):
        self.started.set()
        self.stop.wait(30)
        raise CompileCancelled()

    def cancel(self, fmt: dict) -> bool:
        self.cancelled.append(fmt)
        self.stop.set()
        return True


class ConstrainedEngine:
    config = SimpleNamespace(max_num_batched_tokens=100)

    def __init__(self):
        self.structured = FakeStructured()
        self.added, self.aborted = [], []

    def add_request(self, prompt, params, request_id, after=None, group=None):
        self.added.append(request_id)

    def abort(self, request_id, finish_reason="abort"):
        self.aborted.append(request_id)


def test_the_core_compiles_off_its_loop_refuses_past_a_limit_and_cancels_on_abort():
    engine = ConstrainedEngine()
    core = EngineCore(engine, 0, None, [], os.getpid())
    try:
        slow = {"type": "grammar", "grammar": "root ::= \"a\""}
        core._apply(AddRequests.of([1], [5, 6], [SamplingParams(response_format=slow)]))
        core._apply(AddRequests.of([2], [5, 6], [SamplingParams(
            response_format={"type": "grammar", "grammar": "huge"})]))
        core._apply(AddRequests.of([3], [5, 6], [SamplingParams(
            response_format={"type": "json_object"})]))
        assert list(core.compiling) == [1]  # compiling on the worker thread
        assert [(e.request_id, e.status) for e in core.errors] == [(2, 400)]  # at once
        assert "--structured-output-max-enum" in core.errors[0].error
        assert engine.added == [3]  # cached: not queued behind the compile
        assert engine.structured.started.wait(10)
        core._apply(AbortRequests([1]))
        assert core.compiling == {} and engine.structured.cancelled == [slow]
        assert engine.aborted == [1]
    finally:
        core.compiler.shutdown()
        core.counters.gc.close()


def test_an_abort_leaves_a_compile_that_another_request_waits_for():
    engine = ConstrainedEngine()
    core = EngineCore(engine, 0, None, [], os.getpid())
    try:
        slow = {"type": "grammar", "grammar": "root ::= \"a\""}
        for rid in (1, 2):  # two clients, one format: the second waits for the first's compile
            core._apply(AddRequests.of([rid], [5, 6], [SamplingParams(response_format=slow)]))
        assert engine.structured.started.wait(10)
        core._apply(AbortRequests([1]))
        assert list(core.compiling) == [2] and engine.structured.cancelled == []
        core._apply(AbortRequests([2]))  # nobody waits for it any more: stopped
        assert core.compiling == {} and engine.structured.cancelled == [slow]
    finally:
        engine.structured.stop.set()
        core.compiler.shutdown()
        core.counters.gc.close()
