"""`--url` against the real flashlet server (the demo model behind uvicorn on a free port)."""

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server extra (fastapi) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")
pytest.importorskip("httpx", reason="--url mode needs httpx")


@pytest.fixture(scope="module")  # one server for the module's tests: each leaves it idle
def live_server(demo_llm):
    from flashlet.server import EngineLoop, ServerConfig, create_app

    loop = EngineLoop(engine=demo_llm.engine).start()
    assert loop.wait_ready(30)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(loop, ServerConfig(model_name="demo")),
                                           host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        loop.stop()


def test_url_against_the_real_server(run_bench, live_server):
    out, _, rec = run_bench("--url", live_server, "--concurrency", 1, 2, "--num-requests", 3,
                            "--prompt-len-range", 4, 12, "--max-new-tokens", 4)
    for lv in rec["results"]["levels"]:
        assert lv["failed"] == 0, lv.get("errors")
        assert lv["completed"] == 3
        assert lv["output_tokens"] == lv["output_tokens_requested"] == 12  # ignore_eos: exact
        assert lv["ttft_ms"]["n"] == 3 and lv["ttft_ms"]["min"] > 0
        assert lv["itl_ms"]["n"] == 3 * 3  # one event per token
        assert lv["server_prompt_tokens"] >= 3 * 4  # at least one token per word
        # "mean step": the level's time over the server's engine steps in it (not 0)
        assert lv["num_steps"] >= 4 and 0 < lv["step_ms"]["mean"] <= lv["duration_s"] * 1e3
    assert "| 2 | server |" in out


def test_client_processes_send_what_one_process_sends(run_bench, live_server):
    """--client-procs 2: the level's requests are shared between two spawned processes (one
    queue), and the merged record counts what one process counts."""
    flags = ("--url", live_server, "--concurrency", 1, 3, "--num-requests", 5,
             "--prompt-len-range", 4, 12, "--max-new-tokens", 4)
    _, _, one = run_bench(*flags, "--client-procs", 1)
    _, _, two = run_bench(*flags, "--client-procs", 2)
    for a, b in zip(one["results"]["levels"], two["results"]["levels"]):
        assert (a["client_procs"], b["client_procs"]) == (1, min(2, a["concurrency"]))
        for lv in (a, b):
            assert lv["failed"] == 0, lv.get("errors")
            assert lv["completed"] == 5 and lv["output_tokens"] == 5 * 4
            assert lv["ttft_ms"]["n"] == 5 and lv["itl_ms"]["n"] == 5 * 3
            assert lv["ttft_ms"]["min"] > 0 and lv["itl_ms"]["min"] >= 0
        # the same prompts (exact server-side token counts) whichever process sent them
        assert a["server_prompt_tokens"] == b["server_prompt_tokens"]
        for lv in (a, b):  # an event may carry several tokens when the server fell behind
            assert 5 <= lv["token_events"] <= 5 * 4


def test_open_loop_schedule_shared_by_client_processes(run_bench, live_server):
    _, _, rec = run_bench("--url", live_server, "--rate", 50, "--num-requests", 6,
                          "--prompt-len-range", 4, 8, "--max-new-tokens", 3, "--client-procs", 2)
    res = rec["results"]
    assert res["mode"] == "open-loop" and res["client_procs"] == 2
    assert res["failed"] == 0 and res["completed"] == 6 and res["output_tokens"] == 18
    assert res["ttft_ms"]["n"] == 6 and res["ttft_ms"]["min"] > 0


def _server_idle(url: str, timeout: float = 30.0) -> bool:
    """The server's core has no request left (its /metrics gauges read 0 running and waiting)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("flashlet_requests_running", "flashlet_requests_waiting"))
                  and len(line.split()) == 2}
        if gauges and not any(gauges.values()):
            return True
        time.sleep(0.05)
    return False


def test_long_prompt_gaps_through_the_server(run_bench, live_server):
    """--url with the long-prompt-gaps workload: streams decode through the server, long prompts
    are sent beside them, and the gaps and TTFTs come from the client's reads; the streams'
    requests end when their connections close (the server aborts them: it is left idle)."""
    out, _, rec = run_bench("--url", live_server, "--workload", "long-prompt-gaps", "--gap-streams", 4,
                            "--gap-stream-prompt-len", 8, "--gap-long-prompts", 2, "--gap-long-prompt-len", 200,
                            "--gap-baseline-steps", 5)
    r, p = rec["results"], rec["params"]
    assert rec["workload"] == "long-prompt-gaps" and rec["url"] == live_server and "model" not in rec
    assert r["mode"] == "long-prompt-gaps" and r["streams"] == 4
    assert p["gap_stream_tokens"] == 2 + 5 + 2 * 4 + 64 == r["stream_tokens_requested"]
    assert r["baseline_itl_ms"]["n"] >= 4 * 4  # 5 tokens a stream after its 2nd: 4 gaps or more
    assert r["itl_ms"]["n"] >= 4 and r["itl_ms"]["min"] >= 0 and r["long_ttft_ms"]["n"] == 2
    assert all(t > 0 for t in r["long_ttft_ms_each"]) and r["window_s"] > 0
    assert r["itl_p99_over_p50"] is None or r["itl_p99_over_p50"] >= 1
    assert "| server | 4 | – |" in out and "words (about a token each)" in out
    assert _server_idle(live_server), "the closed streams' requests were not aborted"


def test_long_prompt_gaps_through_the_server_says_when_streams_run_out(run_bench, live_server, monkeypatch):
    """Streams too short for the window (the server's steps carry fewer prompt tokens than the
    length assumes) end the run with that reason, not figures over a partial window."""
    from flashlet.bench import remote

    # the streams' last token is their baseline's last: they end as the long prompts are sent
    monkeypatch.setattr(remote, "gap_stream_tokens", lambda args: 2 + args.gap_baseline_steps)
    with pytest.raises(RuntimeError, match="a stream finished before the window ended"):
        run_bench("--url", live_server, "--workload", "long-prompt-gaps", "--gap-streams", 2,
                  "--gap-stream-prompt-len", 8, "--gap-long-prompts", 2, "--gap-long-prompt-len", 400,
                  "--gap-baseline-steps", 3)
    assert _server_idle(live_server)
