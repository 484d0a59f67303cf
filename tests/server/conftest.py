"""Server test fixtures: one engine (the demo model, `served_llm`: its own, not the session's
`demo_llm`, which tests elsewhere step from the main thread while this package's loop thread
may still own its engine on the same xdist worker) driven by one EngineLoop, and several small
apps on it, each served by a real uvicorn on 127.0.0.1 in a background thread."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")

import re  # noqa: E402
import signal  # noqa: E402

import httpx  # noqa: E402
from server_helpers import (API_KEY, MODEL_NAME, ServerProcess, ServerThread,  # noqa: E402
                            assert_no_leaks, idle_stats, wait_until)

from flashlet.server import EngineLoop, ServerConfig, create_app  # noqa: E402


@pytest.fixture(scope="package")
def served_llm(demo_model_dir):
    """The demo model, for the server tests' loop alone (a test that compares with it runs
    its LLM calls on the loop thread: `engine_loop.call`)."""
    from flashlet import LLM

    return LLM(str(demo_model_dir))


@pytest.fixture(scope="package")
def engine_loop(served_llm):
    """The served model's engine, owned by a loop thread for the server tests."""
    loop = EngineLoop(engine=served_llm.engine).start()
    assert loop.wait_ready(30)
    yield loop
    try:
        assert_no_leaks(idle_stats(loop))
    finally:
        loop.stop()


def _serve(loop, **config):
    app = create_app(loop, ServerConfig(model_name=MODEL_NAME, **config))
    return ServerThread(app).start()


@pytest.fixture(scope="package")
def server(engine_loop):
    srv = _serve(engine_loop)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def auth_server(engine_loop):
    srv = _serve(engine_loop, api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def small_queue_server(engine_loop):
    srv = _serve(engine_loop, max_waiting=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def fuzz_server(engine_loop):
    """Generation capped at 1 token so the fuzzer's valid requests are cheap."""
    srv = _serve(engine_loop, max_tokens_cap=1)
    yield srv
    srv.stop()


@pytest.fixture
def idle(engine_loop):
    """Assert after the test that nothing leaked: no requests, pages only in the cache."""
    yield
    assert_no_leaks(idle_stats(engine_loop))


def _warm_up_counted(metrics: str) -> bool:
    """This process's HTTP counters show its warm-up's stream (no test sent one yet)."""
    return re.search(r'^flashlet_http_requests_total\{endpoint="/generate_stream",method="POST",'
                     r'status="200"\} (\S+)$', metrics, re.M) is not None


@pytest.fixture(scope="package")
def two_api_servers(tiny_qwen2):
    """`python -m flashlet.server --api-server-count 2` on the tiny model, as its /health first
    said ok: yields (server, what was seen then: the warm flags in /metrics at the first 200,
    and, before any test's request, whether each process's counters show its warm-up). Stopped
    with SIGTERM after its tests: it must exit 0, with no traceback."""
    p = ServerProcess("--model", str(tiny_qwen2), "--max-num-pages", "128", "--no-access-log",
                      "--api-server-count", "2", "--served-model-name", "m")
    try:
        def healthy():
            assert p.proc.poll() is None, p.log
            try:
                return httpx.get(p.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 180, "/health to say ok", interval=0.05)
        seen = {"warm_flags": httpx.get(p.url + "/metrics", timeout=10).text, "warm_up_ran": {}}
        for _ in range(200):  # fresh connections, until each process answered one
            r = httpx.get(p.url + "/metrics", timeout=10)
            assert r.status_code == 200
            seen["warm_up_ran"][r.headers["x-flashlet-api-server"]] = _warm_up_counted(r.text)
            if len(seen["warm_up_ran"]) == 2:
                break
        yield p, seen
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(60) == 0, p.log
        assert "Traceback" not in p.log, p.log
    finally:
        p.kill()
