"""Per-request sampling data through the engine-core process (msgspec over ZMQ): n samples
held in the core until the first has computed the prompt, logprobs on the way back, and
response_format grammars compiled on the core's worker thread (invalid ones a 400). (A core
on random weights compiles with the --tokenizer it is given: test_server_structured_bounds.py,
on the core it stops mid-compile.)"""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import serving_core, wait_until

from flashlet import EngineConfig
from flashlet.server import CoreClient

pytestmark = pytest.mark.slow

NAME = "demo"


# With --dist loadgroup the tests on core_server run on one worker: one core start.
ON_CORE_SERVER = pytest.mark.xdist_group("core-sampling-core-server")


@pytest.fixture(scope="module")
def core_server(demo_model_dir):
    client = CoreClient(EngineConfig(model=str(demo_model_dir), max_num_pages=256),
                        data_parallel_size=1).start()
    with serving_core(client, model_name=NAME) as served:
        yield served


def assert_idle(client: CoreClient) -> None:
    wait_until(lambda: client.num_streams == 0, 60, "the requests to end")
    stats = wait_until(lambda: (s := client.probe()[0]) and not s["has_unfinished"] and s, 60,
                       "an idle core")
    assert stats["running"] == stats["waiting"] == stats["num_requests"] == 0, stats
    assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                      json={"model": NAME, "max_tokens": 6, "temperature": 0,
                            "messages": [{"role": "user", "content": "Say hi. " + "x" * 60}],
                            **body})


@ON_CORE_SERVER
def test_n_samples_share_the_prompt_and_bring_logprobs(core_server):
    client, srv = core_server
    r = post(srv, {"n": 3, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1  # greedy
    for choice in body["choices"]:
        entries = choice["logprobs"]["content"]
        assert len(entries) == 6 and all(len(e["top_logprobs"]) == 2 for e in entries)
        assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    # The prompt was computed once: the two later samples found its pages cached.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert_idle(client)


@ON_CORE_SERVER
def test_json_schema_compiles_in_the_core(core_server):
    client, srv = core_server
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    r = post(srv, {"max_tokens": 20, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["ok"], bool)
    # A schema the meta-schema allows but xgrammar cannot compile: refused by the core, 400.
    bad = {"type": "string", "pattern": "(unclosed"}
    r = post(srv, {"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "bad", "schema": bad}}})
    assert r.status_code == 400, r.text
    assert "json_schema" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format", r.text
    assert_idle(client)


@ON_CORE_SERVER
def test_a_format_no_token_can_write_is_the_requests_own_400_through_the_core(core_server):
    """No token of the demo vocabulary spells U+40000 (no token for the UTF-8 byte 0xF1): a
    format that must begin with it is refused by the core's compile, one an output reaches ends
    there part-way; both answer 400 naming response_format (the core says which field, in its
    output, not in the words of its message), streamed or not."""
    client, srv = core_server
    for pattern, word in [("\U00040000", "can begin"), ("a\U00040000", "can continue")]:
        r = post(srv, {"guided_regex": pattern})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert word in error["message"] and error["param"] == "response_format", error
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=300, json={
            "model": NAME, "max_tokens": 6, "temperature": 0, "stream": True,
            "guided_regex": "a\U00040000",
            "messages": [{"role": "user", "content": "Say hi."}]}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    errors = [json.loads(e[6:])["error"] for e in events if e.startswith("data: {\"error\"")]
    assert len(errors) == 1 and errors[0]["param"] == "response_format", events
    assert '"finish_reason":"error"' in events[-2] and errors[0]["message"] in events[-1]
    # The Responses API names its own field (text), whole and streamed (an error event, failed)
    fmt = {"format": {"type": "json_schema", "name": "x",
                      "schema": {"type": "string", "pattern": "^a\U00040000$"}}}
    body = {"model": NAME, "input": "Say hi.", "max_output_tokens": 6, "text": fmt}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    with httpx.stream("POST", srv.url + "/v1/responses", timeout=300,
                      json={**body, "stream": True}) as r:
        kinds_and_data = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
    kinds = [event["type"] for event in kinds_and_data]
    assert kinds.count("error") == 1 and kinds[-1] == "response.failed", kinds
    error = kinds_and_data[kinds.index("error")]
    assert error["param"] == "text" and "can continue" in error["message"], error
    assert_idle(client)
