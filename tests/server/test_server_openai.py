"""The official `openai` client against the OpenAI-compatible /v1 API."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import API_KEY, MODEL_NAME, parse_sse

from flashlet import SamplingParams

openai = pytest.importorskip("openai", reason="the openai client is not installed")
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_models_list(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"
    one = client.models.retrieve(MODEL_NAME)  # OpenAI's retrieve: GET /v1/models/{model}
    assert one.id == MODEL_NAME and one.model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")
    import flashlet
    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": flashlet.__version__}


def test_chat_completion_matches_llm_chat(client, engine_loop, served_llm, idle):
    expected = engine_loop.call(
        lambda _: served_llm.chat(MESSAGES, SamplingParams(max_new_tokens=6))[0]).result(300)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                       temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL_NAME
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == expected.finish_reason and not any(finals[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    # The shared chat-template prefix is served from the prefix cache the second time.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0


def test_completions(client, idle):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                  max_tokens=5, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    text = r.choices[0].text
    assert text

    stream = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                       max_tokens=5, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stop_and_seed(client, idle):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=1.0,
              top_p=0.95, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    r = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=8,
                                  temperature=0, stop=[","])
    assert "," not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_openai_errors_use_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    assert e.value.status_code == 400
    assert "messages" in e.value.body["message"]
    assert e.value.body["param"] == "messages"
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=100_000)
    assert e.value.body["param"] == "max_tokens"


def test_raw_chat_stream_shape(server, idle):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])


def test_api_key(auth_server, idle):
    url = auth_server.url
    assert httpx.get(url + "/health", timeout=60).status_code == 200  # /health needs no key
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/generate", {"prompt": "hi", "max_new_tokens": 1}),
                               ("POST", "/generate_stream", {"prompt": "hi"}),
                               ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "x"}),
                               ("POST", "/v1/chat/completions", {}),
                               ("GET", "/openapi.json", None), ("GET", "/nope", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    ok = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(url + "/v1/models", headers=ok, timeout=60).status_code == 200
    assert httpx.get(url + "/metrics", headers=ok, timeout=60).status_code == 200
    authed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    assert [m.id for m in authed.models.list().data] == [MODEL_NAME]
    r = authed.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
    assert r.usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
