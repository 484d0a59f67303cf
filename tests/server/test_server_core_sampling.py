"""Per-request sampling data through the engine-core process (msgspec over ZMQ): n samples
held in the core until the first has computed the prompt, logprobs on the way back, and
response_format grammars compiled on the core's worker thread (invalid ones a 400)."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import ServerThread, serving_core, wait_until

from flashlet import EngineConfig
from flashlet.server import CoreClient, ServerConfig, create_app

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


def test_random_weights_get_the_tokenizer_for_grammars(demo_model_dir, tmp_path):
    """--config (random weights, no tokenizer) + --tokenizer: the core compiles grammars with
    the tokenizer it is given."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
              "tie_word_embeddings": True, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    client = CoreClient(EngineConfig(config=str(tmp_path / "config.json"), max_num_pages=64),
                        tokenizer=str(demo_model_dir)).start()
    srv = None
    try:
        assert client.wait_ready(180), client.error
        srv = ServerThread(create_app(client, ServerConfig(model_name=NAME))).start()
        r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
            "model": NAME, "prompt": "Some JSON:", "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].lstrip().startswith("{")
        assert_idle(client)
    finally:
        if srv is not None:
            srv.stop()
        client.stop()
