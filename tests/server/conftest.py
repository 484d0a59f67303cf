"""Server test fixtures: one engine (the demo model, loaded once per session through the
shared `demo_llm` fixture) driven by one EngineLoop, and several small apps on it, each
served by a real uvicorn on 127.0.0.1 in a background thread."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")

from server_helpers import (API_KEY, MODEL_NAME, ServerThread, assert_no_leaks,  # noqa: E402
                            idle_stats)

from flashlet.server import EngineLoop, ServerConfig, create_app  # noqa: E402


@pytest.fixture(scope="package")
def engine_loop(demo_llm):
    """The demo model's engine, owned by a loop thread for the server tests (and handed back
    idle afterwards, so demo_llm stays usable by other tests)."""
    loop = EngineLoop(engine=demo_llm.engine).start()
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
