"""Disconnects abort and free pages at once; backpressure answers 503 with Retry-After."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import assert_no_leaks, idle_stats, wait_until

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell me a very long story about a dragon.", "max_new_tokens": 400,
        "ignore_eos": True}


def _holds_private_pages(loop) -> bool:
    s = loop.snapshot
    return s["running"] == 1 and s["kv_pages_used"] > s["kv_pages_cached"]


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_disconnect_mid_stream_frees_pages(server, engine_loop, idle):
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", server.url + "/generate_stream", json=LONG) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data:")
                if got == 2:
                    break
            assert _holds_private_pages(engine_loop), engine_loop.snapshot
            steps_at_disconnect = engine_loop.snapshot["num_steps"]
        # Leaving the block closes the unfinished response: the connection is dropped.
    stats = idle_stats(engine_loop, timeout=60)
    assert_no_leaks(stats)
    # Aborted within a step or two (the one running at the time), not after 400 tokens.
    assert stats["num_steps"] - steps_at_disconnect <= 3, stats


def test_disconnect_before_answer_frees_pages(server, engine_loop, idle):
    steps_before = engine_loop.snapshot["num_steps"]
    sock = _raw_post(server.port, "/generate", LONG)
    try:
        wait_until(lambda: engine_loop.snapshot["num_steps"] >= steps_before + 2
                   and _holds_private_pages(engine_loop), 120, "the request to be generating")
        steps_at_disconnect = engine_loop.snapshot["num_steps"]
    finally:
        sock.close()
    stats = idle_stats(engine_loop, timeout=60)
    assert_no_leaks(stats)
    assert stats["num_steps"] - steps_at_disconnect <= 3, stats


def test_disconnect_while_queued(server, engine_loop, idle):
    engine_loop.pause()
    try:
        sock = _raw_post(server.port, "/generate_stream", LONG)
        wait_until(lambda: engine_loop.num_streams == 1, 30, "the request to be queued")
        sock.close()
        wait_until(lambda: engine_loop.num_streams == 0, 30, "the queued request to be aborted")
    finally:
        engine_loop.resume()
    assert_no_leaks(idle_stats(engine_loop))


def test_backpressure_503_beyond_max_waiting(small_queue_server, engine_loop, idle):
    url = small_queue_server.url
    body = {"prompt": "Hi", "max_new_tokens": 2}
    engine_loop.pause()  # test hook: nothing runs, so queued requests stay queued
    with ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(httpx.post, url + "/generate", json=body, timeout=300)
            wait_until(lambda: engine_loop.num_queued == 1, 30, "the first request to queue")
            for path in ("/generate", "/generate_stream"):
                r = httpx.post(url + path, json=body, timeout=30)
                assert r.status_code == 503, r.text
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "overloaded"
            r = httpx.get(url + "/metrics")
            assert 'flashlet_requests_rejected_total{reason="overloaded"} 2.0' in r.text
        finally:
            engine_loop.resume()
        assert first.result(300).status_code == 200
    r = httpx.post(url + "/generate", json=body, timeout=300)  # room again
    assert r.status_code == 200, r.text


def test_idle_loop_sleeps(server, engine_loop, idle):
    """With nothing to do, the engine thread waits on its condition: no busy spin."""
    idle_stats(engine_loop)
    before = engine_loop.num_iterations
    time.sleep(0.5)
    assert engine_loop.num_iterations == before
    r = httpx.post(server.url + "/generate", json={"prompt": "Hi", "max_new_tokens": 1},
                   timeout=300)
    assert r.status_code == 200
    deadline = time.monotonic() + 5  # the loop counts its iteration after sending the answer
    while engine_loop.num_iterations == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_loop.num_iterations > before  # woken by the submit
