"""Helpers for the server tests: a real uvicorn server on a background thread, SSE parsing,
and the "engine is idle and leaks nothing" check."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
import zmq

from flashlet import Engine
from flashlet.models.weights import EMBEDDED_MODEL_NAME
from flashlet.server import ServerConfig, create_app
from flashlet.server.limits import uvicorn_options

# The tests on the CLI with two API processes share one server (conftest's two_api_servers) and,
# by this group with --dist loadgroup, one worker.
ON_TWO_API_SERVERS = pytest.mark.xdist_group("two-api-servers")

MODEL_NAME = EMBEDDED_MODEL_NAME  # what the server calls the demo model on /v1
API_KEY = "test-key-123"
REPO = Path(__file__).resolve().parents[2]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 and a free port (the socket is bound here, so no
    other process can take the port in between), on a daemon thread."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False, lifespan="off",
                                **uvicorn_options(app.state.limit_stats))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


@contextlib.contextmanager
def serving_core(client, **server_config):
    """A started CoreClient, once ready, served over HTTP on a thread: yields (client, server),
    and stops both after."""
    srv = None
    try:
        assert client.wait_ready(180), client.error
        srv = ServerThread(create_app(client, ServerConfig(**server_config))).start()
        yield client, srv
    finally:
        if srv is not None:
            srv.stop()
        client.stop()


def parse_sse(lines) -> list:
    """`data:` payloads of an SSE stream: dicts, and the string "[DONE]"."""
    events = []
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode()
        line = line.strip()
        if not line.startswith("data:"):
            assert not line, f"unexpected SSE line {line!r}"
            continue
        data = line[len("data:"):].strip()
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _check(engine) -> dict:
    engine.check_integrity()
    stats = engine.stats()
    return {**stats, "has_unfinished": engine.has_unfinished(), "num_requests": stats["requests"]}


def idle_stats(loop, timeout: float = 60.0) -> dict:
    """Wait until the engine loop has nothing in flight, then (on the loop thread) check the
    scheduler/allocator integrity and return engine.stats()."""
    wait_until(lambda: loop.num_streams == 0 and loop.num_queued == 0, timeout,
               "the engine loop to go idle")
    stats = loop.call(_check).result(timeout)
    if stats["has_unfinished"]:  # an abort's output is still to be stepped out
        stats = wait_until(lambda: (s := loop.call(_check).result(timeout)) and
                           not s["has_unfinished"] and s, timeout, "the engine to finish")
    return stats


def assert_no_leaks(stats: dict) -> None:
    assert stats["running"] == 0, stats
    assert stats["waiting"] == 0, stats
    assert stats["num_requests"] == 0, stats
    # Every page still in use belongs to the prefix cache: no request holds any.
    assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m flashlet.server` in a subprocess, its log collected on a thread."""

    def __init__(self, *args):
        # One API process unless a test asks for more: the default follows the machine's CPUs,
        # and the tests' expectations (metrics, logs) are one process's.
        if "--api-server-count" not in args:
            args = ("--api-server-count", "1", *args)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashlet.server", "--port", str(self.port), *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 180) -> "ServerProcess":
        """Wait until the server logs that it serves (or exits: then fail with its log)."""
        wait_until(lambda: "serving on" in self.log or self.proc.poll() is not None, timeout,
                   "the server to load its model", interval=0.1)
        assert self.proc.poll() is None, self.log
        return self

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


STEP_DELAY_S = 0.2


def run_slow_engine_core(*args) -> None:
    """An engine-core process whose steps each take STEP_DELAY_S longer (so that a burst of
    requests lands while the first ones run). CoreClient spawns it by reference: tests set
    `flashlet.server.core_client.run_engine_core` to this function."""
    from flashlet.core.engine import Engine
    from flashlet.server.engine_core import run_engine_core

    step = Engine.step
    Engine.step = lambda self: (time.sleep(STEP_DELAY_S), step(self))[1]
    run_engine_core(*args)


def wait_push_connected(client, core_inbox, timeout: float = 10.0) -> None:
    """Until the client's zmq socket into core 0 has its peer (a fake core's PULL socket): a
    PUSH socket without one refuses a NOBLOCK send, and a fake core connects in the same instant
    it says it is ready (a real core connects before it loads the model). An empty frame is the
    probe, read back from `core_inbox` here."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.cores[0].inbox.send(b"", zmq.NOBLOCK)
            break
        except zmq.Again:
            assert time.monotonic() < deadline, "the fake core never connected"
            time.sleep(0.005)
    assert core_inbox.poll(5000) and core_inbox.recv() == b""


def engine_greedy_tokens(config, prompt: list[int], params) -> list[int]:
    """One request's tokens from an in-process Engine: the reference a served stream must match."""
    engine = Engine(config)
    engine.add_request(prompt, params, request_id=0)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens
