"""The API path's warm-up at server start, before /health says "ok".

The engine warms itself (kernels, graphs: flashlet/core/warmup.py), but the API process has
first-use costs of its own, measured at ~0.6 s on the first request after /health turned 200:
the request context's tokenizer copies, each encoder thread's own copy and the event loop's
(each made on that thread's first prompt), the chat template's compilation, and the first pass through FastAPI, pydantic,
the engine client, the detokenizer and SSE formatting. So the server sends a few real requests
through its own ASGI app in this process (one per OpenAI endpoint and /generate_stream, two
tokens each, side by side so that several engine cores each take one) and only then answers
/health with 200. Like SGLang's start-up request, they count in /metrics as any request does.
Then the process's start-up heap is frozen and the collector's thresholds raised (see
SERVER_GC_THRESHOLDS).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from dataclasses import dataclass, field

from flashlet.core.engine import settle_heap

log = logging.getLogger("flashlet.server")

WARM_UP_TOKENS = 2
# A server process's collector thresholds once warm (Python's default: 700, 10, 10): the API
# processes' after their warm-up, the engine cores' before their loop. Serving allocates a few
# dozen objects per token, so at the default a young collection runs every ~20 tokens and a
# full one (every object not frozen: all the requests' state) several times a second, each a
# stall of every stream the process serves (the collector's share of wall time, before and
# after, is in BENCHMARKS.md). Cycles are still collected; full collections come ~100x less
# often. The offline `LLM` runs in the user's process and leaves its collector alone.
SERVER_GC_THRESHOLDS = (50_000, 20, 100)


@dataclass
class WarmUpReport:
    """What the warm-up ran: (path, HTTP status, SSE events received) per request."""

    requests: list[tuple[str, int, int]] = field(default_factory=list)
    encoder_copies: int = 0  # tokenizer copies the encoder holds afterwards (threads + loop)
    frozen: int = 0  # objects moved out of the collector's reach afterwards (gc.freeze)
    gc_s: float = 0.0  # the full collection before that freeze
    seconds: float = 0.0
    error: str | None = None


def warm_up_requests(model_name: str, has_text: bool, has_chat: bool) -> list[tuple[str, dict]]:
    """(path, body) of the warm-up requests: text prompts when there is a tokenizer."""
    prompt = "Hello, how are you?" if has_text else [1, 2, 3]
    common = {"model": model_name, "max_tokens": WARM_UP_TOKENS, "temperature": 0,
              "ignore_eos": True, "stream": True}
    requests = [("/v1/completions", {**common, "prompt": prompt}),
                ("/generate_stream", {"prompt": prompt, "max_new_tokens": WARM_UP_TOKENS,
                                      "ignore_eos": True})]
    if has_chat:
        requests.append(("/v1/chat/completions",
                         {**common, "messages": [{"role": "user", "content": "Hello!"}]}))
    return requests


async def warm_up(app) -> WarmUpReport:
    """Run the warm-up requests through `app` (its engine client must be ready)."""
    server = app.state.server
    report = WarmUpReport()
    t0 = time.monotonic()
    try:
        ctx = await server.context()
        encoder = ctx.encoder
        if encoder is not None:
            await encoder.warm_up_async()
            report.encoder_copies = encoder.num_copies
        requests = warm_up_requests(server.config.model_name, encoder is not None,
                                    encoder is not None and encoder.has_chat_template)
        headers = ([(b"authorization", f"Bearer {server.config.api_key}".encode())]
                   if server.config.api_key else [])
        results = await asyncio.gather(*(asgi_post(app, path, body, headers)
                                         for path, body in requests))
        for (path, _), (status, events) in zip(requests, results):
            report.requests.append((path, status, events))
            if status != 200:
                raise RuntimeError(f"{path} answered {status}")
        # As the engine does after its own warm-up: collect start-up's garbage now and freeze
        # what stays, so this process's first full collection (a stall of every stream it
        # serves) does not come in the middle of the first requests.
        report.gc_s = settle_heap()
        report.frozen = gc.get_freeze_count()
        gc.set_threshold(*SERVER_GC_THRESHOLDS)
        log.info("API warm-up: %d objects frozen after a %.0f ms full collection; collector "
                 "thresholds %s", report.frozen, report.gc_s * 1e3, SERVER_GC_THRESHOLDS)
    except Exception as e:  # noqa: BLE001 - the server still serves; the log says why
        report.error = f"{type(e).__name__}: {e}"
        log.warning("the API warm-up failed (%s); the first requests may be slower",
                    report.error)
    report.seconds = time.monotonic() - t0
    return report


async def asgi_messages(app, path: str, body: dict, headers: list = ()) -> list[dict]:
    """POST `body` to the ASGI app in this process: every message the app sends back."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 0),
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode()), *headers]}
    sent = False
    never = asyncio.Event()  # the client never disconnects
    messages = []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await never.wait()

    async def send(message):
        messages.append(message)

    await app(scope, receive, send)
    return messages


async def asgi_post(app, path: str, body: dict, headers: list) -> tuple[int, int]:
    """POST `body` to the ASGI app in this process: (status, number of SSE data events)."""
    messages = await asgi_messages(app, path, body, headers)
    status = next((m["status"] for m in messages if m["type"] == "http.response.start"), 0)
    data = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return status, data.count(b"data: ")
