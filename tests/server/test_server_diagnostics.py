"""The server's own diagnostics (GET /debug/stats, server/diagnostics.py): bucketed quantiles
against a sorted reference, the turnaround matching, and the figures of real traffic (the
in-thread app; the CLI with two API processes) counted exactly and within plausible bounds."""

from __future__ import annotations

import os
import threading
import time

import httpx
import numpy as np
import pytest
from server_helpers import ON_TWO_API_SERVERS

from flashlet.server.diagnostics import (EDGES, LogHistogram, LoopCounters, level_figures,
                                         quantiles)


def _histogram(samples) -> list[float]:
    h = LogHistogram()
    for s in samples:
        h.add(float(s))
    return list(h.counts)


def test_bucketed_quantiles_bracket_the_exact_ones():
    rng = np.random.default_rng(0)
    first = rng.lognormal(np.log(2e-3), 1.0, 500)  # seconds
    second = rng.lognormal(np.log(20e-3), 0.7, 700)
    before = _histogram(first)
    after = _histogram(np.concatenate([first, second]))
    for counts_before, samples in ((None, first), (before, second)):
        got = quantiles(counts_before, before if counts_before is None else after)
        assert got["n"] == len(samples)
        for q in (0.5, 0.99):
            exact = np.quantile(samples, q, method="inverted_cdf")
            edge = got[f"p{round(q * 100)}"] / 1e3  # the upper edge of the sample's bucket
            assert edge in EDGES
            assert edge / 1.25 < exact <= edge * (1 + 1e-9), (q, exact, edge)
        assert got["max"] / 1e3 / 1.25 < max(samples) <= got["max"] / 1e3 * (1 + 1e-9)
    assert quantiles(before, before) == {"n": 0, "max": None, "p50": None, "p99": None}


def test_turnaround_matches_finishes_with_the_next_arrivals_in_order():
    counters = LoopCounters()
    try:
        counters.request_arrived()  # no finish before it: no turnaround
        counters.step_done(0.001, 3, 2)  # three tokens, two requests finished
        time.sleep(0.02)
        counters.request_arrived()
        counters.request_arrived()
        counters.request_arrived()  # a third arrival has no finish left to match
        snap = counters.snapshot()
        assert (snap["steps"], snap["tokens"], snap["requests"]) == (1, 3, 4)
        turnaround = quantiles(None, snap["turnaround"])
        assert turnaround["n"] == 2 and 20 <= turnaround["p99"] < 1000
        # A snapshot starts a new window: a finish before it is not matched after it.
        counters.step_done(0.001, 1, 1)
        counters.snapshot()
        counters.request_arrived()
        assert sum(counters.snapshot()["turnaround"]) == 2
    finally:
        counters.gc.close()


def test_a_levels_device_wait_is_its_steps_waits_over_their_count():
    """The core's steps' device wait (Engine.device_wait_s deltas, EngineCore._step) reaches a
    level's figures as a mean per step, its CPU time and preemptions as rates; a reading from
    before those fields reads None."""
    counters = LoopCounters()
    try:
        counters.step_done(0.004, 1, 0, device_wait=0.001)
        before = {"cores": [{"loop": counters.snapshot()}]}
        counters.step_done(0.004, 1, 0, device_wait=0.003)
        counters.step_done(0.002, 1, 0)  # a step that never waited (the host paced it)
        after = {"cores": [{"loop": counters.snapshot()}]}
        (core,) = level_figures(before, after, 0.01)["cores"]
        assert core["steps"] == 2 and core["step_ms_mean"] == pytest.approx(3.0)
        assert core["device_wait_ms_mean"] == pytest.approx(1.5)
        assert core["cpu_busy"] == pytest.approx(
            (after["cores"][0]["loop"]["cpu_s"] - before["cores"][0]["loop"]["cpu_s"]) / 0.01)
        assert core["preempted_per_s"] >= 0
        for key in ("device_wait_s", "cpu_s", "preempted"):
            del before["cores"][0]["loop"][key]
        (core,) = level_figures(before, after, 0.01)["cores"]
        assert core["device_wait_ms_mean"] is core["cpu_busy"] is core["preempted_per_s"] is None
    finally:
        counters.gc.close()


def test_a_probe_request_takes_no_part_in_the_client_turnaround():
    """The middleware marks a request's start and its response's end on its connection, but not
    a monitor's probe (/debug/stats, /metrics, /health): a probe's closed connection would leave
    an entry that a later connection reusing its port reads as a gap."""
    import asyncio
    from types import SimpleNamespace

    from flashlet.server.metrics import PROBE_PATHS, MetricsMiddleware

    marks = []
    counters = SimpleNamespace(request_started=lambda c: marks.append(("start", c)),
                               response_ended=lambda c: marks.append(("end", c)))

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):
        pass

    metrics = SimpleNamespace(observe_http=lambda path, method, status: None)
    middleware = MetricsMiddleware(app, metrics, server=SimpleNamespace(api_counters=counters))
    for path in ("/generate", *sorted(PROBE_PATHS)):
        scope = {"type": "http", "path": path, "method": "GET", "client": ("127.0.0.1", 5000)}
        asyncio.run(middleware(scope, None, send))
    assert marks == [("start", ("127.0.0.1", 5000)), ("end", ("127.0.0.1", 5000))]


def test_debug_stats_of_the_in_thread_app_count_its_events(server):
    body = {"prompt": [3, 5, 7], "max_new_tokens": 3, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:  # one keep-alive connection: client turnarounds
        # First a request of its own: a connection of an earlier test that this one's port
        # reuses left its last response's end, read as a gap here, before `before`.
        assert client.post(server.url + "/generate_stream", json=body).status_code == 200
        before = httpx.get(server.url + "/debug/stats", timeout=30).json()
        t0 = time.monotonic()
        for _ in range(2):
            assert client.post(server.url + "/generate_stream", json=body).status_code == 200
        time.sleep(0.05)  # a tick of the event-loop timer
        after = httpx.get(server.url + "/debug/stats", timeout=30).json()
    figures = level_figures(before, after, time.monotonic() - t0)
    (api,) = figures["api_servers"]
    assert api["tokens"] == 6 and 2 <= api["events"] <= 6
    assert 0 <= api["busy"] <= 1.5 and api["preempted_per_s"] >= 0
    assert api["intake_ms"]["n"] == 2 and api["client_gap_ms"]["n"] == 2  # the probes take no part
    assert api["loop_lag_ms"]["n"] >= 1 and api["loop_lag_ms"]["p50"] is not None
    assert figures["cores"] == []  # an in-thread engine has no core loop to report
    assert "/debug/stats" not in httpx.get(server.url + "/openapi.json").text


def _stream(url: str, prompt: list[int], tokens: int) -> int:
    r = httpx.post(url + "/generate_stream", timeout=120,
                   json={"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.text.count("data: ") - 2  # the final event and [DONE]


@pytest.mark.slow
@ON_TWO_API_SERVERS
def test_debug_stats_through_the_cli_with_two_api_processes(two_api_servers):
    """Closed loop: 4 streams x 3 requests of 16 tokens; every figure is the window's."""
    p, _ = two_api_servers
    before = httpx.get(p.url + "/debug/stats", timeout=30).json()
    t0 = time.monotonic()

    together = threading.Barrier(4)

    def client(k: int) -> None:
        together.wait(30)  # every first request before any finishes (turnaround's n)
        for i in range(3):
            _stream(p.url, [3 + k, 5 + i, 7, 9], 16)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    duration = time.monotonic() - t0
    time.sleep(0.05)
    after = httpx.get(p.url + "/debug/stats", timeout=30).json()
    figures = level_figures(before, after, duration)
    (core,) = figures["cores"]
    assert core["requests"] == 12 and core["tokens"] == 12 * 16
    assert core["steps"] >= 16 and 1 <= core["tokens_per_step"] <= 4
    assert core["step_ms_mean"] > 0 and core["steps_per_s"] > 0
    assert core["device_wait_ms_mean"] == 0.0  # the CPU: no device to wait on
    assert 0 < core["cpu_busy"] <= 2 * os.cpu_count() and core["preempted_per_s"] >= 0
    assert core["step_ms"]["n"] == core["steps"]
    assert core["step_ms"]["p50"] <= core["step_ms"]["p99"] <= core["step_ms"]["max"]
    shares = core["loop_share"]
    assert all(0 <= s <= 1 for s in shares.values())
    assert shares["step"] > 0 and sum(shares.values()) == pytest.approx(1.0, abs=0.02)
    # Each stream's second and third request arrives after a finish (8); a first request that
    # reaches the core only after another stream's request finished is matched too (a loaded
    # machine delays one API process), so up to 11 of the 12 arrivals count.
    assert 8 <= core["turnaround_ms"]["n"] <= 11
    assert 0 <= core["gc_share"] <= 1
    api = figures["api_servers"]
    assert [a["api_server"] for a in api] == [0, 1]
    assert sum(a["tokens"] for a in api) == 12 * 16
    for a in api:
        assert 0 <= a["busy"] <= 1.5 and a["loop_lag_ms"]["n"] > 0 and a["preempted_per_s"] >= 0
        if a["tokens"]:
            assert a["delivery_ms"]["n"] > 0 and a["tokens_per_event"] >= 1
