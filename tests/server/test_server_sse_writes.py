"""What a streamed response costs in writes: one per token event but the last, and one that
carries the last token's event, the final event (or usage), `data: [DONE]` and the end of the
body together (each write the HTTP server makes is a packet and a wake-up of the client; a
closed-loop client sends its next request only after the last)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading

import pytest

from flashlet.core.request import FinishReason, RequestOutput
from flashlet.core.request_check import RequestLimits
from flashlet.server.app import ServerConfig, create_app
from flashlet.server.engine_loop import EngineClient
from flashlet.server.frontend import DONE
from flashlet.server.warmup import asgi_messages


class OneTokenPerStep(EngineClient):
    """Answers each request with `max_new_tokens` outputs of one token, each handed over once
    the one before was taken (as engine steps come)."""

    max_running, num_waiting, num_streams = 64, 0, 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.limits = RequestLimits(4096, len(tokenizer), 16, 1024)
        self.ready, self.stopped, self.error = threading.Event(), threading.Event(), None
        self.ready.set()
        self.is_ready, self._stopping = True, False
        self.ids = itertools.count()

    def submit_group(self, streams, max_waiting=None):
        self.feeders = [asyncio.ensure_future(self._feed(stream)) for stream in streams]

    async def _feed(self, stream):
        stream.request_id = next(self.ids)
        n = stream.params.max_new_tokens
        for k in range(n):
            while stream.items:
                await asyncio.sleep(0)
            stream.push(RequestOutput(stream.request_id, [300 + k], k == n - 1,
                                      FinishReason.LENGTH if k == n - 1 else None))

    def abort(self, stream, finish_reason=FinishReason.ABORT):
        stream.cancelled = True

    def core_stats(self):
        return [{}]


@pytest.fixture(scope="module")
def app(demo_model_dir):
    from flashlet.models.weights import load_tokenizer

    return create_app(OneTokenPerStep(load_tokenizer(demo_model_dir)),
                      ServerConfig(model_name="m"))


def _post(app, path: str, body: dict) -> list[dict]:
    """The body messages of one POST's response, as the HTTP server would write them."""
    return [m for m in asyncio.run(asgi_messages(app, path, body)) if m["type"] == "http.response.body"]


@pytest.mark.parametrize("path, body", [
    ("/generate_stream", {"prompt": "hello there", "max_new_tokens": 3, "ignore_eos": True}),
    ("/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 3,
                         "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 3,
                         "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 3, "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True}}),
])
def test_the_last_write_carries_done_and_ends_the_body(app, path, body):
    writes = _post(app, path, body)
    *events, last = writes
    assert all(w["more_body"] for w in events) and last["more_body"] is False
    assert last["body"].endswith(DONE) and not any(DONE in w["body"] for w in events)
    # an event a token but the last (chat's first: the assistant's role)
    assert len(events) == 2 + (path == "/v1/chat/completions")
    in_last = [json.loads(e.removeprefix(b"data: ")) for e in last["body"].split(b"\n\n")[:-2]]
    if path == "/generate_stream":  # the last token's event, the final one (usage)
        token, final = in_last
        assert "text" in token and "finish_reason" not in token
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 3
        return
    choice, *usage = in_last  # the last token's chunk says finish_reason; then usage if asked
    assert choice["choices"][0]["finish_reason"] == "length"
    if "stream_options" in body:
        assert usage[0]["choices"] == [] and usage[0]["usage"]["completion_tokens"] == 3
    else:
        assert usage == []
