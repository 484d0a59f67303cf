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
    assert_idle(client)
