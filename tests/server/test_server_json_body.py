"""ModelBodyRoute (flashlet/server/json_body.py): the hot endpoints' bodies validated straight
from the bytes give the same request objects, the same error responses and the same OpenAPI
schema as FastAPI's own body path (an app built with plain APIRoutes, the reference)."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

pytest.importorskip("fastapi", reason="the server extra (fastapi) is not installed")

from fastapi.responses import JSONResponse  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashlet.server import ServerConfig, create_app  # noqa: E402
from flashlet.server.json_body import ModelBodyRoute  # noqa: E402
from flashlet.server.limits import HttpLimits  # noqa: E402

HOT = ["/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"]
MAX_BYTES = 64 * 1024


# What the stand-in endpoints return: a Response, or a value FastAPI serializes (/generate
# through its response_model, which drops the extra key).
RESULTS = {"/generate": {"text": "t", "token_ids": [1], "finish_reason": "stop", "usage": {
    "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}, "ttft_ms": None,
    "latency_ms": 1.5, "extra": "dropped"}, "/v1/completions": {"x": [1, 2.5, None, "é"]}}


class _Seen:
    """Stands in for the hot endpoints: records the bodies (and Requests) FastAPI hands them."""

    def __init__(self):
        self.bodies, self.requests = [], []

    def endpoint(self, path):
        async def endpoint(body, request=None):
            self.bodies.append(body)
            self.requests.append(request)
            return RESULTS.get(path, JSONResponse({"seen": True}))

        return endpoint


def _app(fast: bool, monkeypatch):
    loop = types.SimpleNamespace(on_step_message=None)
    with monkeypatch.context() as m:
        if not fast:  # the reference: FastAPI's own handler on every route
            m.setattr(ModelBodyRoute, "get_route_handler", APIRoute.get_route_handler)
        app = create_app(loop, ServerConfig(model_name="m",
                                            limits=HttpLimits(max_request_bytes=MAX_BYTES)))
    seen = _Seen()
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path in HOT:
            assert isinstance(route, ModelBodyRoute)
            route.dependant.call = seen.endpoint(route.path)  # what the handlers call
    return TestClient(app), seen


@pytest.fixture(scope="module")
def apps():
    mp = pytest.MonkeyPatch()
    try:
        yield _app(True, mp), _app(False, mp)
    finally:
        mp.undo()


def _post(client, path, body, content_type="application/json"):
    headers = {} if content_type is None else {"content-type": content_type}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=data, headers=headers)


def _same(apps, path, body, content_type="application/json"):
    (fast, fast_seen), (ref, ref_seen) = apps
    for seen in (fast_seen, ref_seen):
        seen.bodies.clear()
        seen.requests.clear()
    a, b = _post(fast, path, body, content_type), _post(ref, path, body, content_type)
    assert (a.status_code, a.content) == (b.status_code, b.content), (path, body)
    assert a.headers.get("content-type") == b.headers.get("content-type")
    assert len(fast_seen.bodies) == len(ref_seen.bodies)
    assert [r is None for r in fast_seen.requests] == [r is None for r in ref_seen.requests]
    for x, y in zip(fast_seen.bodies, ref_seen.bodies):
        assert type(x) is type(y)
        assert x == y and x.model_fields_set == y.model_fields_set
        assert x.model_dump() == y.model_dump()
    return a


def _chat(**more):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **more}


VALID = {
    "/generate": [
        {"prompt": "hello"}, {"prompt": [1, 2, 3], "max_new_tokens": 4},
        {"prompt": "x", "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
         "seed": -12345678901234567890, "stop": ["a", "b"], "ignore_eos": True},
        {"prompt": "é ☃ \U0001f600", "temperature": 1, "stop": "z"},
        {"prompt": "n", "temperature": 1e-300, "top_p": 0.30000000000000004},
    ],
    "/v1/completions": [
        {"model": "m", "prompt": "hi"}, {"prompt": "no model: the served one"},
        {"model": "m", "prompt": ["a", [1, 2]], "n": 2,
                                         "best_of": 3, "logprobs": 2, "echo": True},
        {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True},
         "logit_bias": {}, "stop_token_ids": [0, 7], "priority": -3, "min_p": 0.5,
         "response_format": {"type": "json_object"}, "user": "u", "max_tokens": 1},
        {"model": "m", "prompt": [[5], "b"], "max_tokens": 0, "echo": True, "logprobs": 0},
        {"model": "m", "prompt": "p", "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}},
    ],
    "/v1/chat/completions": [
        _chat(), _chat(logprobs=True, top_logprobs=3, max_completion_tokens=5),
        {"model": "m", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "call it"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}],
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {
             "type": "object", "properties": {"x": {"type": "number"}}}}}],
         "tool_choice": {"type": "function", "function": {"name": "f"}}},
        _chat(chat_template_kwargs={"enable_thinking": False, "n": [1, {"a": None}],
                                    "big": 10**30, "f": 1.5e300, "dup": 1}),
    ],
}
VALID["/generate_stream"] = VALID["/generate"]

BAD_BYTES = [b"", b"{", b"{}", b"[]", b"null", b"3", b'"s"', b"{\"prompt\": \"a\",}",
             b"{\"prompt\": \"a\"} x", b"\xff\xfe{", b"\xef\xbb\xbf{\"prompt\": \"a\"}",
             b"{\"prompt\": \"\\ud800\"}", b"{\"prompt\": \"a\x01\"}", b"{\"prompt\": NaN}",
             b"{\"prompt\": \"a\", \"temperature\": NaN}",
             b"{\"prompt\": \"a\", \"temperature\": Infinity}",
             b"{\"prompt\": \"a\", \"temperature\": 1e400}",
             b"{\"prompt\": \"a\", \"top_k\": 1e2}", b"{\"prompt\": \"a\", \"top_k\": 2.0}",
             b"{\"prompt\": \"a\", \"prompt\": [1]}", b"{\"prompt\": \"\xed\xa0\x80\"}",
             b"{\"prompt\": [1, 2, 99999999999999999999999999999999]}",
             b"{\"prompt\": \"a\", \"seed\": 1" + b"0" * 5000 + b"}",
             "{\"prompt\": \"a\"}".encode("utf-16"), b"  {\"prompt\": \"a\"}\n\t ",
             b"{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
             b"\"chat_template_kwargs\": {\"a\": 1, \"a\": [2], \"b\": 1E+2, \"c\": -0.0}}"]
BAD = {
    "/generate": [
        {"prompt": ""}, {"prompt": []}, {"prompt": [-1]}, {"prompt": "a", "max_tokens": "5"},
        {"prompt": "a", "ignore_eos": 1}, {"prompt": "a", "temperature": "0.5"},
        {"prompt": "a", "temperature": True}, {"prompt": "a", "temperature": 3},
        {"prompt": "a", "extra": 1}, {"max_tokens": 3}, {"prompt": "a", "max_tokens": 1,
                                                         "max_new_tokens": 1},
        {"prompt": "a", "stop": [""] * 20}, {"prompt": {"nested": [{"junk": [[[]]]}]}},
        {"prompt": "a", "top_k": 2**31}, {"prompt": "a", "seed": 1.5},
    ],
    "/v1/completions": [
        {"model": 5, "prompt": "a"}, {"model": "m", "prompt": "a", "n": 0},
        {"model": "m", "prompt": "a", "best_of": 1, "n": 2},
        {"model": "m", "prompt": "a", "stream_options": {"include_usage": True}},
        {"model": "m", "prompt": "a", "logit_bias": {"5": 101.0}},
        {"model": "m", "prompt": "a", "suffix": "s"}, {"model": "m", "prompt": [[]]},
        {"model": "m", "prompt": "a", "priority": 2**63},
        {"model": "m", "prompt": "a", "response_format": {"type": "xml"}},
        {"model": "m", "prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "nonsense"}}}},
    ],
    "/v1/chat/completions": [
        _chat(messages=[]), _chat(messages=[{"role": "robot", "content": "x"}]),
        _chat(messages=[{"content": "x"}]), _chat(messages=[{"role": "user"}]),
        _chat(messages=[{"role": "user", "content": [{"type": "image", "text": "x"}]}]),
        _chat(top_logprobs=2), _chat(tool_choice="required"),
        _chat(chat_template_kwargs={"messages": 1}), _chat(stream="yes"),
        _chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f",
                                                                           "arguments": "[1]"}}]}]),
    ],
}
BAD["/generate_stream"] = BAD["/generate"]


@pytest.mark.parametrize("path", HOT)
def test_valid_bodies_reach_the_endpoint_as_the_same_model(apps, path):
    for body in VALID[path]:
        assert _same(apps, path, body).status_code == 200


@pytest.mark.parametrize("path", HOT)
def test_the_endpoint_gets_the_model_validated_from_the_bytes(apps, path, monkeypatch):
    (fast, seen), _ = apps
    route = next(r for r in fast.app.routes if getattr(r, "path", None) == path)
    model = route.body_field.field_info.annotation
    built = []

    def spy(data, *args, **kwargs):
        built.append(validate_json(data, *args, **kwargs))
        return built[-1]

    validate_json = model.model_validate_json
    monkeypatch.setattr(model, "model_validate_json", spy)
    for body in VALID[path]:
        seen.bodies.clear()
        assert _post(fast, path, body).status_code == 200
        assert seen.bodies[0] is built[-1]  # not rebuilt from a dict


@pytest.mark.parametrize("path", HOT)
def test_bad_bodies_get_the_same_error_responses(apps, path):
    for body in BAD[path]:
        assert _same(apps, path, body).status_code == 400
    for raw in BAD_BYTES:
        _same(apps, path, raw)
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded",
                         "application/json; charset=utf-8", "application/vnd.x+json",
                         "application/jsonx", "multipart/form-data; boundary=x"):
        body = VALID[path][0]
        _same(apps, path, body, content_type)
        _same(apps, path, b"{oops", content_type)


def _asgi_post(app, path, messages):
    """Status and body of a POST whose body arrives as these ASGI receive messages."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")]}
    incoming, sent = list(messages), []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("path", HOT)
def test_a_body_cut_short_answers_alike(apps, path):
    (fast, _), (ref, _) = apps
    part = {"type": "http.request", "body": b'{"prompt": ', "more_body": True}
    for messages in ([part], [part, {"type": "http.disconnect"}], []):
        assert _asgi_post(fast.app, path, messages) == _asgi_post(ref.app, path, messages)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_body_size_cap_still_applies(apps, path):
    body = {"prompt": "x" * MAX_BYTES} if path == "/generate" else _chat(user="x" * MAX_BYTES)
    assert _same(apps, path, body).status_code == 413  # by its Content-Length
    # In chunks with no Content-Length: counted as they arrive, refused as the cap is passed.
    data = json.dumps(body).encode()
    chunks = [{"type": "http.request", "body": data[i:i + 4096], "more_body": True}
              for i in range(0, len(data), 4096)]
    (fast, _), (ref, _) = apps
    status, content = _asgi_post(fast.app, path, chunks)
    assert status == 413 and (status, content) == _asgi_post(ref.app, path, chunks)


def test_openapi_schema_is_unchanged(apps):
    (fast, _), (ref, _) = apps
    assert fast.get("/openapi.json").json() == ref.get("/openapi.json").json()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
FIELDS = ["prompt", "model", "messages", "max_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "seed", "stream", "logprobs", "echo", "role", "content", "tools"]


@settings(max_examples=100, deadline=None)
@given(path=st.sampled_from(HOT), base=st.integers(0, 3),
       changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=3))
def test_fuzzed_bodies_answer_alike(apps, path, base, changes):
    body = {**VALID[path][base % len(VALID[path])], **changes}
    _same(apps, path, body)


@settings(max_examples=60, deadline=None)
@given(temperature=st.floats(0, 2) | st.integers(0, 2), top_p=st.floats(0, 1),
       kwargs=st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), JSON_VALUES,
                              max_size=4))
def test_fuzzed_valid_values_build_equal_models(apps, temperature, top_p, kwargs):
    """Floats and free-form JSON (Any) parsed by pydantic-core equal json.loads's."""
    _same(apps, "/v1/chat/completions", _chat(temperature=temperature, top_p=top_p,
                                              chat_template_kwargs=kwargs))


@pytest.mark.parametrize("cls, body", [
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}]}),
    ("CompletionRequest", {"prompt": "x"}), ("ResponsesRequest", {"input": "x"})])
def test_a_null_field_of_null_is_the_default_is_its_default(cls, body):
    """Each field NULL_IS_THE_DEFAULT names, sent as null, validates to the same request as
    with the field left out (from the bytes, as the server validates); other fields stay strict."""
    from flashlet.server import protocol, protocol_extra

    model = getattr(protocol, cls, None) or getattr(protocol_extra, cls)
    assert model.NULL_IS_THE_DEFAULT
    for name in model.NULL_IS_THE_DEFAULT:
        with_null = model.model_validate_json(json.dumps({**body, name: None}))
        assert getattr(with_null, name) == model.model_fields[name].default, name
        assert with_null.model_dump() == model.model_validate_json(json.dumps(body)).model_dump(), name
    with pytest.raises(ValueError):
        model.model_validate_json(json.dumps({**body, "temperature": "0.5"}))


def test_a_reply_sent_back_gives_the_template_its_reasoning_only():
    """An assistant message as a client got it: its reasoning_content goes to the chat template
    (HF's templates take it so), refusal / annotations / audio / an empty tool_calls do not."""
    from flashlet.server.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "assistant", "content": "Hi.", "reasoning_content": "think", "refusal": None,
                          "annotations": [], "audio": None, "function_call": None, "tool_calls": []}]}
    message = ChatCompletionRequest.model_validate_json(json.dumps(body)).messages[0]
    assert message.as_template_dict() == {"role": "assistant", "content": "Hi.", "reasoning_content": "think"}
