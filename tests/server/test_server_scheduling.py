"""vLLM's `priority` through the OpenAI API on a server whose engine runs the priority policy:
a waiting request of lower priority value runs first (the fcfs default refuses the field: see
test_server_bad_input.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import MODEL_NAME, ServerThread

from flashlet import Engine, EngineConfig
from flashlet.server import EngineLoop, ServerConfig, create_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def priority_server(demo_model_dir):
    """One running slot, so every other request waits and the policy decides who is next."""
    engine = Engine(EngineConfig(model=str(demo_model_dir), max_num_seqs=1,
                                 scheduling_policy="priority"))
    loop = EngineLoop(engine=engine).start()
    assert loop.wait_ready(60)
    srv = ServerThread(create_app(loop, ServerConfig(model_name=MODEL_NAME,
                                                     scheduling_policy="priority"))).start()
    yield srv, loop
    srv.stop()
    loop.stop()


def _complete(url: str, max_tokens: int, priority: int) -> float:
    """A completion -> the monotonic time it ended."""
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": "Count: one, two,", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "priority": priority})
    assert r.status_code == 200, r.text
    return time.monotonic()


def _wait_for(loop, stat: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while loop.call(lambda e: e.stats()[stat]).result(10) < n:
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.01)


def test_a_priority_request_jumps_the_queue(priority_server):
    srv, loop = priority_server
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_complete, srv.url, 48, 0)  # holds the one slot meanwhile
        _wait_for(loop, "running", 1)
        low = pool.submit(_complete, srv.url, 2, 5)
        _wait_for(loop, "waiting", 1)
        high = pool.submit(_complete, srv.url, 2, -5)  # arrives last, runs second
        _wait_for(loop, "waiting", 2)
        assert high.result() < low.result()
        first.result()
