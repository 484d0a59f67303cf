"""Start-up (503 until the model is loaded), models without a tokenizer, the command line,
and shutdown on SIGINT/SIGTERM (in-flight requests end, exit code 0). Tiny random models."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from server_helpers import (ServerProcess, ServerThread, assert_no_leaks, idle_stats, parse_sse,
                            wait_until)

from flashlet import Engine, EngineConfig
from flashlet.models.weights import EMBEDDED_MODEL_NAME
from flashlet.server import EngineLoop, ServerConfig, create_app
from flashlet.server.cli import build_parser, default_model_name

REPO = Path(__file__).resolve().parents[2]


def _tiny_engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), max_num_pages=64))


def test_health_is_503_until_the_model_is_loaded(tiny_qwen2):
    gate = threading.Event()

    def load():
        assert gate.wait(60)
        return _tiny_engine(tiny_qwen2)

    loop = EngineLoop(engine_factory=load).start()
    srv = ServerThread(create_app(loop, ServerConfig(model_name="tiny"))).start()
    try:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        assert "retry-after" in r.headers
        r = httpx.post(srv.url + "/generate", json={"prompt": [1, 2, 3]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert httpx.get(srv.url + "/metrics").status_code == 200  # metrics work while loading

        gate.set()
        assert loop.wait_ready(60)
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/generate", json={"prompt": [5, 6, 7], "max_new_tokens": 4,
                                                    "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                     "cached_tokens": 0}
        assert r.json()["text"] == ""  # no tokenizer: token ids in, no text out
        with httpx.stream("POST", srv.url + "/generate_stream", timeout=60,
                          json={"prompt": [5, 6, 7], "max_new_tokens": 3,
                                "ignore_eos": True}) as s:
            events = parse_sse(s.iter_lines())
        assert events[-1] == "[DONE]" and sum(e.get("num_tokens", 1) for e in events[:-2]) == 3
        assert events[-2]["usage"]["completion_tokens"] == 3
        # Text needs a tokenizer, chat a template: 400s that say so.
        r = httpx.post(srv.url + "/generate", json={"prompt": "hello"})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 300]})
        assert r.status_code == 400 and "[0, 256)" in r.json()["error"]["message"]
        assert_no_leaks(idle_stats(loop))
    finally:
        gate.set()
        srv.stop()
        loop.stop()


def test_health_reports_a_failed_load():
    def load():
        raise ValueError("no such model")

    loop = EngineLoop(engine_factory=load).start()
    srv = ServerThread(create_app(loop, ServerConfig())).start()
    try:
        assert not loop.wait_ready(30)
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "failed"}
        r = httpx.post(srv.url + "/generate", json={"prompt": [1]})
        assert r.status_code == 503 and "failed" in r.json()["error"]["message"]
    finally:
        srv.stop()
        loop.stop()


def test_cli_flags_come_from_engine_config():
    args = build_parser().parse_args(["--model", "m", "--backend", "triton", "--page-size", "32",
                                      "--max-waiting", "3", "--api-key", "k",
                                      "--no-enable-prefix-cache"])
    cfg = EngineConfig.from_cli(args)
    assert (cfg.model, cfg.backend, cfg.page_size, cfg.enable_prefix_cache) == \
        ("m", "triton", 32, False)
    assert (args.max_waiting, args.api_key, args.host, args.port) == (3, "k", "127.0.0.1", 8000)
    assert default_model_name(EngineConfig()) == EMBEDDED_MODEL_NAME  # no --model: the demo
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--backend", "nope"])


@pytest.mark.slow
def test_cli_serves_and_shuts_down_cleanly(tiny_qwen2):
    # SIGTERM here; SIGINT reaches the same handler (cli.py installs one for both), and both
    # are sent during the model load in test_server_cli.py: one server start fewer.
    sig = signal.SIGTERM
    p = ServerProcess("--model", str(tiny_qwen2), "--max-num-pages", "64",
                      "--shutdown-timeout", "1", "--no-access-log")
    try:
        p.wait_serving(120)
        ready = next(line for line in p.lines if "serving on" in line)
        for part in (f"model {Path(tiny_qwen2).name}", "backend torch", "KV pool 64 pages",
                     f"http://127.0.0.1:{p.port}"):
            assert part in ready, ready
        health = httpx.get(p.url + "/health")
        assert health.status_code == 200
        assert "x-flashlet-api-server" not in health.headers  # one API process: no header
        models = httpx.get(p.url + "/v1/models").json()
        assert models["data"][0]["id"] == Path(tiny_qwen2).name

        # A long stream is in flight when the signal comes: it ends (aborted after the
        # 1 s grace, or finished), with its final event, and the process exits 0.
        events, errors = [], []

        def consume():
            try:
                with httpx.stream("POST", p.url + "/generate_stream", timeout=120, json={
                        "prompt": [3, 4, 5], "max_new_tokens": 500, "ignore_eos": True}) as r:
                    events.extend(parse_sse(r.iter_lines()))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=consume)
        t.start()
        wait_until(lambda:
                   'flashlet_requests_running{core="0"} 1.0' in httpx.get(p.url + "/metrics").text,
                   60, "the stream to be running", interval=0.05)
        p.proc.send_signal(sig)
        assert p.proc.wait(60) == 0, p.log
        t.join(30)
        assert not errors, errors
        assert events and events[-1] == "[DONE]", events[-3:]
        assert events[-2]["finish_reason"] in ("abort", "length")
        assert "server stopped" in p.log
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(p.url + "/health")
    finally:
        p.kill()


@pytest.mark.slow
def test_cli_exits_nonzero_when_the_model_cannot_load(tmp_path):
    p = ServerProcess("--model", str(tmp_path / "missing-model"))
    try:
        assert p.proc.wait(120) != 0
        assert "could not start the engine" in p.log
    finally:
        p.kill()


def test_engine_does_not_import_the_server_stack():
    code = ("import sys, flashlet; from flashlet import LLM, Engine, SamplingParams; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'prometheus_client', 'starlette') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
