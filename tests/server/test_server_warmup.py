"""The API path's warm-up at start (server/warmup.py): /health says ok only after it ran every
piece of a request's path, so the first user request pays no first-use cost (checked by what
it did, not by timing)."""

from __future__ import annotations

import gc

import httpx
from server_helpers import MODEL_NAME, ServerThread, wait_until

from flashlet.server import ServerConfig, create_app
from flashlet.server.warmup import SERVER_GC_THRESHOLDS, WARM_UP_TOKENS


def test_health_waits_for_the_warm_up_that_runs_every_piece(engine_loop, idle):
    app = create_app(engine_loop, ServerConfig(model_name=MODEL_NAME, warm_up=True))
    thresholds = gc.get_threshold()
    srv = ServerThread(app).start()
    server = app.state.server
    try:
        first = httpx.get(srv.url + "/health")
        assert first.status_code == 503 and first.json()["status"] == "warming up"
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, 60,
                   "the warm-up to end", interval=0.05)
        report = server.warm_up_report
        assert report.error is None, report.error
        paths = {path for path, _, _ in report.requests}
        assert paths == {"/v1/completions", "/v1/chat/completions", "/generate_stream"}
        for path, status, events in report.requests:
            assert status == 200 and events >= WARM_UP_TOKENS, (path, status, events)
        encoder = server._ctx.encoder
        # one copy per pool thread, and the event loop's own for short prompts (encoded inline)
        assert report.encoder_copies == encoder.num_threads + 1 == encoder.num_copies
        assert report.frozen > 0  # start-up's heap is out of the collector's reach
        assert gc.get_threshold() == SERVER_GC_THRESHOLDS  # and the collector runs less often

        # The first user requests use the copies made already: no tokenizer copy on their path.
        for _ in range(2 * encoder.num_threads):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi there"}],
                "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert encoder.num_copies == encoder.num_threads + 1
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'flashlet_api_server_warm{api_server="0"} 1.0' in metrics

        # With several API processes (their flags shared by the CLI): /health waits for all.
        server.api_servers_warm = [1, 0]
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        assert 'flashlet_api_server_warm{api_server="1"} 0.0' in httpx.get(srv.url + "/metrics").text
        server.api_servers_warm = [1, 1]
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()
        gc.set_threshold(*thresholds)  # the test process's own

