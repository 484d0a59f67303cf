"""Schemathesis fuzzes the server from its own OpenAPI schema: no input may yield a 5xx."""

from __future__ import annotations

import collections

import pytest
from server_helpers import MODEL_NAME

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 250  # bounded: the whole test stays well under a minute on 2 cores


def test_openapi_schema_documents_the_api(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    ops = {(op.method.upper(), op.path) for op in
           (r.ok() for r in schema.get_all_operations())}
    assert {("GET", "/health"), ("POST", "/generate"), ("POST", "/generate_stream"),
            ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
            ("POST", "/v1/embeddings"), ("POST", "/v1/responses")} <= ops


def test_fuzz_finds_no_server_errors(fuzz_server, idle):
    url = fuzz_server.url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                      schema.as_strategy(GenerationMode.NEGATIVE))
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(case=cases, use_served_model=st.booleans())
    def check(case, use_served_model):
        body = case.body
        if use_served_model and isinstance(body, dict) and "model" in body:
            body["model"] = MODEL_NAME  # reach generation, not only the unknown-model 404
        response = case.call(base_url=url, timeout=120)
        seen[(case.method.upper(), case.path, response.status_code)] += 1
        assert response.status_code < 500, (case.method, case.path, body, response.text)
        if response.status_code >= 400 and case.path != "/health":
            error = response.json()["error"]
            assert error["message"] and error["type"], error

    check()
    print(sorted(seen.items()))  # shown with -s or on failure
    statuses = collections.Counter(code for *_, code in seen.elements())
    assert statuses[400] > 0, seen  # it sent invalid requests
    generated = sum(n for (method, path, code), n in seen.items()
                    if method == "POST" and code == 200)
    assert generated > 0, seen  # and valid ones that reached the model
