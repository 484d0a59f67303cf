"""/health, /generate and /generate_stream against a real server on the demo model."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import parse_sse

from flashlet import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
N = 10


def _llm_generate(engine_loop, served_llm, prompt, **params) -> str:
    """LLM.generate on the very engine the server uses (on its loop thread, while idle)."""
    fut = engine_loop.call(lambda _: served_llm.generate(prompt, SamplingParams(**params))[0])
    return fut.result(300)


def _stream(url: str, body: dict, path: str = "/generate_stream") -> list:
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(r.iter_lines())


def test_health(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_generate_greedy_equals_llm_generate_and_stream(server, engine_loop, served_llm, idle):
    expected = _llm_generate(engine_loop, served_llm, PROMPT, max_new_tokens=N)
    assert expected.text

    r = httpx.post(server.url + "/generate", json={"prompt": PROMPT, "max_new_tokens": N},
                   timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == expected.text
    assert body["finish_reason"] == expected.finish_reason
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    assert body["usage"]["cached_tokens"] >= 0
    assert 0 < body["ttft_ms"] <= body["latency_ms"]

    events = _stream(server.url, {"prompt": PROMPT, "max_new_tokens": N})
    assert events[-1] == "[DONE]"
    final, tokens = events[-2], events[:-2]
    # one event per token, or one per batch saying how many (a handler behind the engine)
    assert sum(e.get("num_tokens", 1) for e in tokens) == len(expected.token_ids)
    assert all(set(e) <= {"text", "num_tokens"} for e in tokens)
    assert "".join(e["text"] for e in tokens) + final["text"] == expected.text
    assert final["finish_reason"] == expected.finish_reason
    assert final["usage"]["completion_tokens"] == len(expected.token_ids)
    assert final["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert 0 < final["ttft_ms"] <= final["latency_ms"]


def test_stop_string_is_never_streamed(server, engine_loop, served_llm, idle):
    full = _llm_generate(engine_loop, served_llm, PROMPT, max_new_tokens=N).text
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]  # cut the answer before its third word
    expected = full[: full.index(stop)]
    body = {"prompt": PROMPT, "max_new_tokens": N, "stop": [stop, "zzzz-never"]}

    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == expected
    assert r.json()["finish_reason"] == "stop"

    events = _stream(server.url, body)
    text = "".join(e["text"] for e in events[:-1])
    assert text == expected
    assert events[-2]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(server, idle):
    body = {"prompt": PROMPT, "max_new_tokens": 4, "temperature": 0.9, "top_p": 0.9,
            "top_k": 40, "seed": 1234}
    a = httpx.post(server.url + "/generate", json=body, timeout=300)
    b = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["text"] == b.json()["text"]
    assert a.json()["usage"]["completion_tokens"] == 4


def test_token_id_prompt(server, engine_loop, served_llm, idle):
    ids = served_llm.tokenizer.encode(PROMPT)
    r = httpx.post(server.url + "/generate", json={"prompt": ids, "max_new_tokens": 3},
                   timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_metrics(server, idle):
    r = httpx.post(server.url + "/generate", json={"prompt": PROMPT, "max_new_tokens": 3},
                   timeout=300)
    assert r.status_code == 200
    httpx.post(server.url + "/generate", json={"prompt": ""})  # a 400
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)

    def value(name, **labels):
        return sum(s.value for s in samples.get(name, ())
                   if all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("flashlet_http_requests_total", endpoint="/generate", status="200") >= 1
    assert value("flashlet_http_requests_total", endpoint="/generate", status="400") >= 1
    assert value("flashlet_requests_finished_total", finish_reason="length") >= 1
    assert value("flashlet_prompt_tokens_total") >= 5
    assert value("flashlet_generation_tokens_total") >= 3
    assert value("flashlet_time_to_first_token_seconds_count") >= 1
    assert value("flashlet_inter_token_latency_seconds_count") >= 2
    for gauge in ("flashlet_requests_running", "flashlet_requests_waiting",
                  "flashlet_kv_pages_used", "flashlet_kv_pages_total",
                  "flashlet_prefix_cache_hit_rate"):
        assert gauge in samples, gauge
    assert value("flashlet_kv_pages_total") > 0
    assert 0.0 <= value("flashlet_prefix_cache_hit_rate") <= 1.0


@pytest.mark.parametrize("params", [
    {"temperature": 0.65, "top_p": 5e-324},  # rounds to 0 in float32: must not empty the sampler
    {"temperature": 1e-9},  # numerically greedy
    {"temperature": 2.0, "top_k": 2**31 - 1},
    {"temperature": 1.0, "seed": -1},
    {"temperature": 1.0, "seed": 2**70},
    {"prompt": "\u0000\U0001F600 caf\u00e9 <|im_end|>", "stop": ["\U0001F600", "\n"]},
], ids=["tiny top_p", "tiny temperature", "hot, huge top_k", "negative seed", "huge seed",
        "odd text"])
def test_extreme_but_valid_params(server, params, idle):
    body = {"prompt": PROMPT, "max_new_tokens": 2, **params}
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["finish_reason"] in ("length", "stop")



def test_stream_events_skip_the_middlewares_but_start_and_end_pass_them(engine_loop, idle):
    """The events between an SSE response's start and end go straight to the HTTP server (the
    per-token cost of four middleware wrappers); the middlewares still see the start (status,
    headers) and the end (metrics, the connection's turnaround)."""
    import asyncio

    from server_helpers import MODEL_NAME

    from flashlet.server import ServerConfig, create_app
    from flashlet.server.warmup import asgi_post

    seen = []

    class Probe:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def probe_send(message):
                seen.append((message["type"], message.get("more_body", False)))
                await send(message)

            await self.app(scope, receive, probe_send)

    app = create_app(engine_loop, ServerConfig(model_name=MODEL_NAME))
    app.add_middleware(Probe)
    body = {"prompt": PROMPT, "max_new_tokens": N, "ignore_eos": True}
    status, events = asyncio.run(asgi_post(app, "/generate_stream", body, []))
    # A token an event, or several in one when the engine runs ahead of a loaded machine's
    # event loop; then the final event and [DONE].
    assert status == 200 and 3 <= events <= N + 2
    assert seen == [("http.response.start", False), ("http.response.body", False)]
    metrics = app.state.server.metrics
    assert metrics.http_requests.labels("/generate_stream", "POST", "200")._value.get() == 1
