"""Faults between the API process and its engine cores (issue 35): cores that lose their API
process exit within seconds (kill -9 included, busy or idle); a core that stops stepping while
it has work turns /health 503 with the reason, its requests end with an error after a bound,
and it recovers when it steps again; with data parallel, a dead core's requests fail while the
live cores keep serving and /health says "degraded". Tiny random model (token ids in and out).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from server_helpers import REPO, ServerProcess, ServerThread, parse_sse, wait_until

import flashlet.server.core_client
from flashlet import EngineConfig
from flashlet.server import CoreClient, ServerConfig, create_app
from flashlet.server.core_client import _pid_alive
from flashlet.server.engine_core import HEARTBEAT_S

pytestmark = pytest.mark.slow

ORPHAN_EXIT_S = 5  # the bound: cores gone this long after their API process


def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), max_num_pages=128, page_size=16, **kw)


def _core_pids(log: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"engine core \d+ ready \(pid (\d+)\)", log)]


def _assert_gone_within(pids: list[int], seconds: float) -> None:
    wait_until(lambda: not any(_pid_alive(pid) for pid in pids), seconds,
               f"engine cores {pids} to exit", interval=0.1)


def _stream_in_background(url: str, body: dict) -> threading.Event:
    """Start a streaming request; the event is set once its first token arrived."""
    first = threading.Event()

    def run():
        try:
            with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        first.set()
        except httpx.HTTPError:  # the server was killed under it
            pass

    threading.Thread(target=run, daemon=True).start()
    return first


# ---- item 5: orphaned cores ------------------------------------------------------------------
def test_cores_exit_within_seconds_of_a_kill_9_of_the_api_process(tiny_qwen2):
    """Two cores, one busy with a long stream, one idle: both gone within 5 s."""
    p = ServerProcess("--model", str(tiny_qwen2), "--max-num-pages", "128",
                      "--data-parallel-size", "2", "--no-access-log")
    try:
        p.wait_serving(180)
        pids = _core_pids(p.log)
        assert len(pids) == 2, p.log
        body = {"prompt": [3, 4, 5], "max_new_tokens": 400, "ignore_eos": True}
        assert _stream_in_background(p.url, body).wait(60), "no token came"
        p.proc.kill()  # SIGKILL: the API process runs no clean-up at all
        p.proc.wait(10)
        _assert_gone_within(pids, ORPHAN_EXIT_S)
    finally:
        p.kill()


ORPHAN_SCRIPT = textwrap.dedent("""
    import asyncio, sys, threading
    from flashlet import EngineConfig, SamplingParams
    from flashlet.server import CoreClient
    from flashlet.server.engine_loop import RequestStream

    client = CoreClient(EngineConfig(model=sys.argv[1], max_num_pages=128))
    # Started from a thread that then ends: no parent-death signal (it would follow that
    # thread), so only the core's watch on its parent can end it.
    starter = threading.Thread(target=client.start)
    starter.start()
    starter.join()
    assert client.wait_ready(180), client.error

    async def main():
        stream = RequestStream([3, 4, 5], SamplingParams(max_new_tokens=400, ignore_eos=True))
        client.submit(stream)
        await stream.get()  # the core is busy stepping now
        print("pids", *[core.pid for core in client.cores], flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def test_a_busy_core_exits_on_its_parent_watch_alone(tiny_qwen2):
    """The backstop for where the kernel's signal does not apply: the core's own thread sees
    its parent gone, in the middle of its steps."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tiny_qwen2)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids "), line
        pids = [int(pid) for pid in line.split()[1:]]
        assert all(_pid_alive(pid) for pid in pids)
        proc.kill()
        proc.wait(10)
        _assert_gone_within(pids, ORPHAN_EXIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- item 6: a stalled core ------------------------------------------------------------------
def _serve(client: CoreClient) -> ServerThread:
    assert client.wait_ready(180), client.error
    return ServerThread(create_app(client, ServerConfig(model_name="tiny"))).start()


def _stream(url: str, body: dict, into: list, first: threading.Event | None = None) -> None:
    with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if first is not None and line.startswith("data:"):
                first.set()
        into.append(parse_sse(lines))


def _assert_idle(client: CoreClient) -> None:
    """Nothing in flight here; every live core idle, no page held but by its prefix cache."""
    wait_until(lambda: client.num_streams == 0, 60, "the requests to end")
    assert all(c["in_flight"] == 0 for c in client.core_stats())
    for stats in wait_until(lambda: (s := client.probe()) and
                            all(not c.get("has_unfinished") for c in s) and s, 60, "idle cores"):
        if "dead" not in stats:
            assert stats["running"] == stats["waiting"] == stats["num_requests"] == 0, stats
            assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats


def test_the_default_stall_bound_turns_health_503_within_10_s():
    from flashlet.server.core_client import CORE_STALL_TIMEOUT_S, READER_POLL_MS

    assert CORE_STALL_TIMEOUT_S + 2 * READER_POLL_MS / 1000 < 10


def test_a_stopped_core_turns_health_503_ends_its_requests_and_recovers(tiny_qwen2):
    """SIGSTOP the core while a stream runs: /health says 503 "stalled" with the reason after
    the stall bound, new requests get 503, the open stream ends with a 503 error after the
    request bound; after SIGCONT the core serves again and leaks nothing. The bounds are two
    and three heartbeats here, as in the long-step test below (the defaults, 8 and 60 s, would
    be waited out: test_the_default_stall_bound_turns_health_503_within_10_s checks them)."""
    client = CoreClient(_config(tiny_qwen2), stall_timeout_s=2.0 * HEARTBEAT_S,
                        stalled_request_timeout_s=3.0 * HEARTBEAT_S).start()
    srv = None
    try:
        srv = _serve(client)
        results: list = []
        first = threading.Event()
        body = {"prompt": [3, 4, 5], "max_new_tokens": 450, "ignore_eos": True}
        worker = threading.Thread(target=_stream, args=(srv.url, body, results, first))
        worker.start()
        assert first.wait(60)
        pid = client.cores[0].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            health = wait_until(lambda: (r := httpx.get(srv.url + "/health")).status_code == 503
                                and r, 10, "/health to turn 503", interval=0.1)
            assert health.json()["status"] == "stalled", health.json()
            assert "engine core 0 stalled" in health.json()["reason"]
            r = httpx.post(srv.url + "/generate", json={"prompt": [1, 2], "max_new_tokens": 2})
            assert r.status_code == 503 and "stalled" in r.json()["error"]["message"], r.text
            worker.join(30)
            assert not worker.is_alive(), "the stalled core's stream never ended"
            events = results[0]
            assert events[-1] == "[DONE]", events[-3:]
            assert "stalled" in events[-2]["error"]["message"], events[-2]
            text = httpx.get(srv.url + "/metrics").text
            assert 'flashlet_engine_core_up{core="0"} 0.0' in text
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: httpx.get(srv.url + "/health").json() == {"status": "ok"}, 10,
                   "/health to recover", interval=0.1)
        r = httpx.post(srv.url + "/generate", timeout=60,
                       json={"prompt": [1, 2], "max_new_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        _assert_idle(client)
    finally:
        if srv is not None:
            srv.stop()
        client.stop()


LONG_STEP_S = 4.0


def run_long_step_engine_core(*args) -> None:
    """An engine core whose third step takes LONG_STEP_S longer (a CPU step over a long
    prompt, say): spawned by reference, as server_helpers.run_slow_engine_core."""
    from flashlet.core.engine import Engine
    from flashlet.server.engine_core import run_engine_core

    step, calls = Engine.step, [0]

    def long_third_step(self):
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(LONG_STEP_S)
        return step(self)

    Engine.step = long_third_step
    run_engine_core(*args)


def test_a_core_in_one_long_step_is_reported_but_its_request_completes(tiny_qwen2,
                                                                       monkeypatch, capfd,
                                                                       caplog):
    """Its heartbeat goes on: /health says 503 with that reason during the step, the core's
    Python stacks reach the log (the step's frame among them), and the request (past the
    request bound) is not ended: it finishes when the step does. The stall timeout is two
    heartbeats (engine_core.HEARTBEAT_S): at one, a heartbeat a few ms late on a loaded
    machine made the core look frozen and its request was ended."""
    monkeypatch.setattr(flashlet.server.core_client, "run_engine_core",
                        run_long_step_engine_core)
    client = CoreClient(_config(tiny_qwen2), stall_timeout_s=2.0 * HEARTBEAT_S,
                        stalled_request_timeout_s=3.0 * HEARTBEAT_S).start()
    srv = None
    try:
        srv = _serve(client)
        results: list = []
        body = {"prompt": [3, 4, 5], "max_new_tokens": 8, "ignore_eos": True}
        worker = threading.Thread(target=_stream, args=(srv.url, body, results))
        worker.start()
        health = wait_until(lambda: (r := httpx.get(srv.url + "/health")).status_code == 503
                            and r, 30, "/health to see the long step", interval=0.1)
        assert "its process runs, but no step ended" in health.json()["reason"], health.json()
        worker.join(60)
        assert "its threads' Python stacks follow" in caplog.text
        err = capfd.readouterr().err  # the core's stderr is this process's
        assert "in long_third_step" in err, err[-2000:]  # where the stalled step was
        events = results[0]
        assert events[-2]["finish_reason"] == "length", events[-2]
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        _assert_idle(client)
    finally:
        if srv is not None:
            srv.stop()
        client.stop()


# ---- item 8: data parallel with a dead core --------------------------------------------------
def test_with_two_cores_a_dead_ones_requests_fail_and_the_other_serves_on(tiny_qwen2):
    """Core 1 dies under a stream: its stream fails, core 0's finishes, /health is degraded and
    core 0 takes every new request; then core 0, the last, dies under four requests: fatal,
    and every open request ends with an error."""
    fatal: list = []
    client = CoreClient(_config(tiny_qwen2), data_parallel_size=2,
                        on_fatal=fatal.append).start()
    srv = None
    try:
        srv = _serve(client)
        results: list = [[], []]
        firsts = [threading.Event(), threading.Event()]
        workers = []
        for i in range(2):  # the least loaded core gets each: one stream on each core
            body = {"prompt": [3, 4, 5 + 40 * i], "max_new_tokens": 450, "ignore_eos": True}
            workers.append(threading.Thread(target=_stream,
                                            args=(srv.url, body, results[i], firsts[i])))
            workers[-1].start()
            assert firsts[i].wait(60)
        assert [c["in_flight"] for c in client.core_stats()] == [1, 1]
        client.cores[1].process.kill()
        health = wait_until(lambda: (r := httpx.get(srv.url + "/health")).json()["status"]
                            == "degraded" and r, 5, "/health to say degraded", interval=0.1)
        assert health.status_code == 200 and "engine core 1 died" in health.json()["reason"]
        for worker in workers:
            worker.join(120)
            assert not worker.is_alive()
        lost, served = results[1][0], results[0][0]
        assert "engine core 1 died" in lost[-2]["error"]["message"], lost[-2]
        assert served[-2]["finish_reason"] == "length", served[-2]
        assert served[-2]["usage"]["completion_tokens"] == 450
        routed = [c["routed"] for c in client.core_stats()]
        for i in range(6):
            r = httpx.post(srv.url + "/generate", timeout=60, json={
                "prompt": [7, 8, i + 2], "max_new_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
        assert [c["routed"] for c in client.core_stats()] == [routed[0] + 6, routed[1]]
        text = httpx.get(srv.url + "/metrics").text
        assert 'flashlet_engine_core_up{core="1"} 0.0' in text
        assert 'flashlet_engine_core_up{core="0"} 1.0' in text
        assert fatal == [] and client.error is None
        _assert_idle(client)
        _kill_the_last_core_under_open_requests(client, srv.url)
        assert fatal
    finally:
        if srv is not None:
            srv.stop()
        client.stop()


def _kill_the_last_core_under_open_requests(client: CoreClient, url: str) -> None:
    """Three streams and a plain completion run on core 0, the last live core, when it is
    killed: every one ends with a 5xx error naming it, /health turns 503 "failed" (bounded, not
    instant: generous for a loaded machine; a hang would never end), a new request is 503."""
    streams: list = [None] * 3
    plain: list = [None]

    def stream(i):
        body = {"prompt": [3, 4, 5 + i], "max_new_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as r:
            streams[i] = parse_sse(r.iter_lines())

    def post():
        plain[0] = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [3, 9], "max_tokens": 400, "ignore_eos": True})

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=post))
    for t in threads:
        t.start()
    wait_until(lambda: client.num_streams == 4 and client.core_stats()[0].get("running") == 4,
               60, "the requests to run")
    client.cores[0].process.kill()
    wait_until(lambda: httpx.get(url + "/health").status_code == 503, 30, "/health to turn 503")
    assert httpx.get(url + "/health").json() == {"status": "failed"}
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a request hangs after its core died"
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "engine core 0 died" in error["message"]
    assert plain[0].status_code == 500
    assert "engine core 0 died" in plain[0].json()["error"]["message"]
    r = httpx.post(url + "/generate", json={"prompt": [1, 2]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


def test_exit_on_core_failure_makes_any_dead_core_fatal(tiny_qwen2):
    fatal: list = []
    client = CoreClient(_config(tiny_qwen2), data_parallel_size=2, on_fatal=fatal.append,
                        exit_on_core_failure=True).start()
    try:
        assert client.wait_ready(180), client.error
        client.cores[1].process.kill()
        wait_until(lambda: fatal, 5, "a dead core to be fatal")
        assert "engine core 1 died" in str(client.error) and not client.is_ready
    finally:
        client.stop()


def test_the_cli_serves_on_one_of_two_cores_and_exits_1_when_none_is_left(tiny_qwen2):
    p = ServerProcess("--model", str(tiny_qwen2), "--max-num-pages", "128",
                      "--data-parallel-size", "2", "--no-access-log")
    try:
        p.wait_serving(180)
        pids = _core_pids(p.log)
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: httpx.get(p.url + "/health").json()["status"] == "degraded", 5,
                   "/health to say degraded", interval=0.1)
        for i in range(3):
            r = httpx.post(p.url + "/generate", timeout=60, json={
                "prompt": [5, 6, i + 2], "max_new_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200, r.text
        assert p.proc.poll() is None
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()

        def failed_or_gone():
            try:
                return httpx.get(p.url + "/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                return p.proc.poll() is not None

        wait_until(failed_or_gone, 30, "/health to turn 503")
        assert p.proc.wait(60) == 1, p.log
        assert time.monotonic() - killed < 30
        assert "engine core 0 died" in p.log
    finally:
        p.kill()
