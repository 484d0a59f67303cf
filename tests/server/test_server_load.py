"""Load: 64 concurrent streaming clients (asyncio + httpx), bounded in time. Every response
is complete, requests were batched, and afterwards nothing is running and no page is held
beyond the prefix cache."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from server_helpers import MODEL_NAME, assert_no_leaks, idle_stats, parse_sse

pytestmark = pytest.mark.slow

CLIENTS = 64
NEW_TOKENS = 3
TIME_LIMIT_S = 200


async def _one(client: httpx.AsyncClient, url: str, i: int) -> None:
    if i % 4 == 3:  # a quarter through the OpenAI API
        path = "/v1/completions"
        body = {"model": MODEL_NAME, "prompt": f"Client {i} says", "max_tokens": NEW_TOKENS,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    else:
        path = "/generate_stream"
        body = {"prompt": f"Client {i} says", "max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                "temperature": 0.7 if i % 2 else 0.0, "seed": i}
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = parse_sse([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]", (i, events)
    if path == "/generate_stream":
        final = events[-2]
        assert final["finish_reason"] == "length", (i, final)
        assert final["usage"]["completion_tokens"] == NEW_TOKENS
        tokens = sum(e.get("num_tokens", 1) for e in events[:-2])  # token events, then final
        assert tokens == NEW_TOKENS, events
    else:
        assert events[-3]["choices"][0]["finish_reason"] == "length", (i, events)
        assert events[-2]["usage"]["completion_tokens"] == NEW_TOKENS


def test_64_concurrent_streams(server, engine_loop, idle):
    peak, done = [0], threading.Event()

    def watch():  # how many ran at once: the clients must be batched, not serialized
        while not done.wait(0.01):
            peak[0] = max(peak[0], engine_loop.snapshot.get("running", 0))

    async def main():
        limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=TIME_LIMIT_S, limits=limits) as client:
            await asyncio.wait_for(
                asyncio.gather(*(_one(client, server.url, i) for i in range(CLIENTS))),
                TIME_LIMIT_S)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    errors = []

    def run_clients():  # its own thread, so no event loop of another test can be in the way
        try:
            asyncio.run(main())
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    clients = threading.Thread(target=run_clients)
    try:
        clients.start()
        clients.join()
        if errors:
            raise errors[0]
    finally:
        done.set()
        watcher.join()
    assert peak[0] >= 8, peak
    stats = idle_stats(engine_loop)
    assert_no_leaks(stats)
