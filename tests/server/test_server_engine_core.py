"""The engine in its own processes: `CoreClient` with two engine cores behind one app (data
parallel, prefix-aware routing, nothing leaked). (What happens when a core dies, the last one
included, and the CLI's exit when none is left: test_server_core_faults.py.)
Admission counts what really waits in the cores. Tiny random model (no tokenizer: token ids
in, token ids out)."""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest
from concurrent.futures import ThreadPoolExecutor

from server_helpers import (ServerThread, parse_sse, run_slow_engine_core,
                            serving_core, wait_until)

from flashlet import EngineConfig
import flashlet.server.core_client
from flashlet.server import CoreClient, ServerConfig, create_app

pytestmark = pytest.mark.slow

PAGE = 16


def _config(path) -> EngineConfig:
    return EngineConfig(model=str(path), max_num_pages=512, page_size=PAGE)


@pytest.fixture(scope="module")
def tiny_long_qwen2(tmp_path_factory):
    """The tiny model with room for a 2,000-token system prompt."""
    from tests.conftest import save_tiny_model

    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2-4k"),
                           max_position_embeddings=4096)


# With --dist loadgroup the tests on dp_server run on one worker: one start of its two cores.
ON_DP_SERVER = pytest.mark.xdist_group("engine-core-dp-server")


@pytest.fixture(scope="module")
def dp_server(tiny_long_qwen2):
    client = CoreClient(_config(tiny_long_qwen2), data_parallel_size=2).start()
    with serving_core(client, model_name="tiny") as served:
        yield served


def assert_cores_idle(client: CoreClient) -> None:
    """Every core idle, its integrity checked, no page held but by its prefix cache."""
    wait_until(lambda: client.num_streams == 0, 60, "the requests to end")
    for stats in wait_until(lambda: (s := client.probe()) and
                            all(not c["has_unfinished"] for c in s) and s, 60, "idle cores"):
        assert stats["running"] == stats["waiting"] == stats["num_requests"] == 0, stats
        assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> list:
    body = {"prompt": prompt, "max_new_tokens": n, "ignore_eos": True}
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        assert r.status_code == 200, await r.aread()
        return parse_sse([line async for line in r.aiter_lines()])


@ON_DP_SERVER
def test_two_cores_serve_64_concurrent_streams(dp_server):
    client, srv = dp_server
    # everything this process sends each core goes over its request channel, none over zmq
    assert all(c.requests is not None and c.held is None for c in client.cores)
    routed_before = [c["routed"] for c in client.core_stats()]
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(5, 40))] for _ in range(64)]

    async def main():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(_stream(http, srv.url, p, 4) for p in prompts))

    results = asyncio.run(main())
    for events in results:
        assert events[-1] == "[DONE]", events
        assert sum(e.get("num_tokens", 1) for e in events[:-2]) == 4, events
        assert events[-2]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == 4
    routed = [c["routed"] - b for c, b in zip(client.core_stats(), routed_before)]
    assert sum(routed) == 64 and min(routed) >= 16, routed  # both cores took a fair share
    assert_cores_idle(client)
    text = httpx.get(srv.url + "/metrics").text
    for core in ("0", "1"):
        assert f'flashlet_kv_pages_total{{core="{core}"}} 512.0' in text
        assert re.search(rf'flashlet_requests_routed_total{{core="{core}"}} [1-9]', text)


@ON_DP_SERVER
def test_a_shared_prefix_goes_to_the_core_that_cached_it(dp_server):
    client, srv = dp_server
    rng = random.Random(1)
    prefix = [rng.randrange(2, 256) for _ in range(4 * PAGE)]
    before = [c["routed"] for c in client.core_stats()]
    first = httpx.post(srv.url + "/generate", timeout=120, json={
        "prompt": prefix + [7], "max_new_tokens": 2, "ignore_eos": True}).json()
    assert first["usage"]["cached_tokens"] == 0
    after = [c["routed"] for c in client.core_stats()]
    home = [a - b for a, b in zip(after, before)].index(1)
    for i in range(6):
        r = httpx.post(srv.url + "/generate", timeout=120, json={
            "prompt": prefix + [9, i + 3], "max_new_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["cached_tokens"] >= 4 * PAGE, r.json()  # a cache hit there
    final = [c["routed"] for c in client.core_stats()]
    assert final[home] - after[home] == 6 and sum(final) - sum(after) == 6
    assert_cores_idle(client)


def _routed_of(client, send) -> list[int]:
    """Requests each core was sent while `send()` ran."""
    before = [c["routed"] for c in client.core_stats()]
    send()
    return [c["routed"] - b for c, b in zip(client.core_stats(), before)]


def _generate_all(url: str, prompts: list[list[int]], max_new_tokens: int = 4) -> list[dict]:
    """The prompts sent side by side (one client's connection pool: a fresh client per request
    costs tens of ms on a loaded 2-core machine, and the requests then barely overlap)."""
    limits = httpx.Limits(max_connections=len(prompts))
    with httpx.Client(timeout=300, limits=limits) as http, \
            ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: http.post(url + "/generate", json={
            "prompt": p, "max_new_tokens": max_new_tokens, "ignore_eos": True}), prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


@ON_DP_SERVER
def test_requests_sharing_only_a_template_prefix_go_to_both_cores(dp_server):
    """A ~30-token prefix (a chat template's) is worth less than an idle core (issue 32). Each
    request decodes 64 tokens, so the 32 are in flight together and the split reads the rule, not
    which core finished its first few sooner (with 4 tokens a loaded machine once routed 21 / 11)."""
    client, srv = dp_server
    rng = random.Random(2)
    template = [rng.randrange(2, 256) for _ in range(30)]
    prompts = [template + [rng.randrange(2, 256) for _ in range(rng.randrange(8, 24))]
               for _ in range(32)]
    routed = _routed_of(client, lambda: _generate_all(srv.url, prompts, max_new_tokens=64))
    assert sum(routed) == 32 and min(routed) >= 0.35 * 32, routed
    assert_cores_idle(client)


@ON_DP_SERVER
def test_a_2000_token_system_prompt_keeps_its_requests_on_its_core(dp_server):
    client, srv = dp_server
    rng = random.Random(3)
    system = [rng.randrange(2, 256) for _ in range(2000)]
    first = _routed_of(client, lambda: _generate_all(srv.url, [system + [5]]))
    home = first.index(1)
    results = []
    routed = _routed_of(client, lambda: results.extend(_generate_all(
        srv.url, [system + [rng.randrange(2, 256) for _ in range(6)] for _ in range(8)])))
    assert routed[home] == 8 and sum(routed) == 8, routed
    assert all(r["usage"]["cached_tokens"] >= 2000 for r in results), results
    assert_cores_idle(client)


def test_an_idle_core_takes_a_burst_of_free_slots_plus_max_waiting(tiny_qwen2, monkeypatch):
    """As the in-thread test of test_server_hardening.py, through an engine-core process:
    --max-num-seqs 2 --max-waiting 2 on an idle server take a burst of 4 (2 run, 2 wait); with
    2 running and 2 waiting in the core, the next is refused. The count is the core's per-step
    stats plus the requests in flight to it (a burst lands before any step reports)."""
    monkeypatch.setattr(flashlet.server.core_client, "run_engine_core", run_slow_engine_core)
    config = EngineConfig(model=str(tiny_qwen2), max_num_pages=64, max_num_seqs=2)
    client = CoreClient(config).start()
    srv = None
    body = {"prompt": [5, 6, 7], "max_new_tokens": 3, "ignore_eos": True}
    try:
        assert client.wait_ready(180), client.error
        srv = ServerThread(create_app(client, ServerConfig(model_name="tiny",
                                                           max_waiting=2))).start()
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda _: httpx.post(srv.url + "/generate", json=body,
                                                       timeout=120).status_code, range(4)))
        assert codes == [200] * 4, codes
        # Now really full: 2 running and 2 waiting in the core (two long requests, slow steps:
        # they run 20 steps, 4 s, while the test looks and is refused; the two after them
        # only wait meanwhile, so they need no more than a few tokens).
        long = {**body, "max_new_tokens": 20}
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, srv.url + "/generate", json=long, timeout=120)
                       for _ in range(2)]
            wait_until(lambda: client.core_stats()[0].get("running") == 2, 60,
                       "the 2 long requests to run")
            futures += [pool.submit(httpx.post, srv.url + "/generate", json=body, timeout=120)
                        for _ in range(2)]
            wait_until(lambda: client.core_stats()[0].get("running") == 2
                       and client.core_stats()[0].get("waiting") == 2, 60,
                       "2 requests running and 2 waiting")
            r = httpx.post(srv.url + "/generate", json=body, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            assert [f.result().status_code for f in futures] == [200] * 4
        assert_cores_idle(client)
    finally:
        if srv is not None:
            srv.stop()
        client.stop()


def test_busy_poll_streams_every_token_of_concurrent_requests(tiny_qwen2):
    """--busy-poll-ms through a real engine core and its step channel: streamed greedy tokens
    are those of the same prompts unstreamed, nothing is left in the core, and the reading
    loop stops spinning once no request is in flight."""
    client = CoreClient(_config(tiny_qwen2), busy_poll_s=0.05).start()
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    with serving_core(client, model_name="tiny") as (client, srv):
        async def main():
            async with httpx.AsyncClient(timeout=300) as http:
                return await asyncio.gather(*(_stream(http, srv.url, p, 12) for p in prompts))

        streamed = [events[-2]["token_ids"] for events in asyncio.run(main())]
        whole = [httpx.post(srv.url + "/generate", timeout=120, json={
            "prompt": p, "max_new_tokens": 12, "ignore_eos": True}).json()["token_ids"]
            for p in prompts]
        assert streamed == whole and all(len(ids) == 12 for ids in streamed), streamed
        assert_cores_idle(client)
        wait_until(lambda: client._kept_awake is None, 10, "the reading loop to sleep again")
