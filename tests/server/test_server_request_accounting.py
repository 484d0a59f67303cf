"""Issue 35, item 1: whatever stage of a request fails, what it counted is uncounted. A request
the engine-core message cannot carry leaves nothing in flight (CoreClient, no process needed);
through the server, a failure injected at each stage (tokenize, check, submit, the engine's add,
the compile, after the submit, mid-stream) leaves no stream, no queued request and no KV page."""

from __future__ import annotations

import asyncio
import os
import shutil

import httpx
import msgspec
import pytest
import zmq
from server_helpers import MODEL_NAME, assert_no_leaks, idle_stats

from flashlet import EngineConfig, SamplingParams
from flashlet.server.core_client import CoreClient, CoreProcess
from flashlet.server.engine_core import AddRequests, CoreInput
from flashlet.server.engine_loop import RequestStream
from flashlet.server.router import PrefixRouter

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
    from flashlet.tokenizing import TextEncoder

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
