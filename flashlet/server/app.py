"""The FastAPI app: /health, /generate, /generate_stream, the OpenAI-compatible /v1 API, /metrics.

Handlers validate everything they can before queueing (pydantic for the body; tokenization,
context length and KV-pool fit with the engine's own limits), so a bad request is a 400 that
names the field and never reaches the engine thread. Errors use OpenAI's body shape
`{"error": {"message", "type", "param", "code"}}` on every endpoint.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashlet.request import RequestOutput
from flashlet.sampling import SamplingParams
from flashlet.server.engine_loop import (EngineLoop, NotReady, Overloaded, RequestStream,
                                         StreamError)
from flashlet.server.metrics import Metrics, MetricsMiddleware
from flashlet.server.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                      GenerateRequest, GenerateResponse, ModelList)

log = logging.getLogger("flashlet.server")

MIN_TEMPERATURE = 1e-5  # below this, sampling is numerically greedy: treat it as greedy
# top_p below this keeps only the top token anyway (its probability is >= 1/vocab); smaller
# values (e.g. 5e-324) round to 0 in float32 inside the sampler, which then drops every token.
MIN_TOP_P = 1e-8
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               499: "client_closed_request", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclass
class ServerConfig:
    model_name: str = "flashlet"
    api_key: str | None = None
    max_waiting: int | None = 512  # queued (not yet running) requests before 503s
    max_tokens_cap: int | None = None  # clamp every request's token budget (e.g. for fuzzing)
    retry_after_s: int = 1


@dataclass
class ModelContext:
    """What handlers need from the engine, copied once on the loop thread: the engine's own
    tokenizer is used by the loop thread (decode) and HF fast tokenizers must not be used
    from two threads at once, so handlers get a private copy behind a lock."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    page_size: int
    num_pages: int
    lock: threading.Lock

    @classmethod
    def from_engine(cls, engine) -> "ModelContext":
        return cls(tokenizer=copy.deepcopy(engine.tokenizer), max_model_len=engine.max_model_len,
                   vocab_size=engine.model_config.vocab_size, page_size=engine.config.page_size,
                   num_pages=engine.stats()["kv_pages_total"], lock=threading.Lock())

    def encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, f"{param}: this model has no tokenizer: send token ids, not text",
                           param)
        with self.lock:
            ids = list(self.tokenizer.encode(text) or [])
        if not ids:
            raise ApiError(400, f"{param}: encodes to no tokens", param)
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "messages: this model has no chat template", "messages")
        try:
            with self.lock:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages
            raise ApiError(400, f"messages: the chat template rejected them: {e}",
                           "messages") from None
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if not ids:
            raise ApiError(400, "messages: the chat template produced no tokens", "messages")
        return ids

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise ApiError(400, f"{param}: token ids must be in [0, {self.vocab_size})", param)

    def budget(self, num_prompt: int, max_tokens: int | None, default: int | None,
               prompt_param: str, tokens_param: str) -> int:
        """The request's max new tokens, checked against the context and the KV pool."""
        limit = min(self.max_model_len, self.num_pages * self.page_size)
        if num_prompt >= limit:
            raise ApiError(400, f"{prompt_param}: the prompt is {num_prompt} tokens but the "
                           f"model's context is {self.max_model_len} tokens (KV pool "
                           f"{self.num_pages * self.page_size}); leave room for at least one "
                           f"new token", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt if default is None else min(default, limit - num_prompt)
        if num_prompt + max_tokens > self.max_model_len:
            raise ApiError(400, f"{tokens_param}: prompt ({num_prompt} tokens) + {tokens_param} "
                           f"({max_tokens}) = {num_prompt + max_tokens} exceeds the model's "
                           f"context of {self.max_model_len} tokens", tokens_param,
                           "context_length_exceeded")
        pages = -(-(num_prompt + max_tokens) // self.page_size)
        if pages > self.num_pages:
            raise ApiError(400, f"{tokens_param}: the request needs {pages} KV pages but the "
                           f"pool has only {self.num_pages}", tokens_param)
        return max_tokens


class Generation:
    """One queued request seen from the handler: its deltas, timing and metrics."""

    def __init__(self, server: "Server", stream: RequestStream, endpoint: str, t0: float):
        self.server, self.stream, self.endpoint, self.t0 = server, stream, endpoint, t0
        self.ttft: float | None = None
        self.final: RequestOutput | None = None

    async def deltas(self) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Yield (new text, output) per engine delta, ending with the finished output.

        The engine cuts stop strings before it emits and holds back any tail that could still
        become one, so its `new_text` can be streamed as it is."""
        metrics, last = self.server.metrics, None
        while True:
            item = await self.stream.get()
            if isinstance(item, StreamError):
                self.stream.finished = True
                raise ApiError(item.status, item.message)
            now = time.monotonic()
            if item.new_token_ids:
                if self.ttft is None:
                    self.ttft = now - self.t0
                    metrics.ttft.observe(self.ttft)
                else:
                    metrics.itl.observe(now - last)
                last = now
            if item.finished:
                self.stream.finished = True
                self.final = item
                metrics.observe_finished(self.endpoint, item, now - self.t0)
            yield item.new_text, item
            if item.finished:
                return

    async def collect(self) -> RequestOutput:
        async for _ in self.deltas():
            pass
        return self.final

    def abort(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.stream.finished and not self.stream.cancelled:
            self.server.loop.abort(self.stream)
            self.server.metrics.requests_finished.labels(self.endpoint, "abort").inc()

    @property
    def latency_ms(self) -> float:
        return (time.monotonic() - self.t0) * 1000

    def usage(self) -> dict:
        out = self.final
        return {"prompt_tokens": len(out.prompt_token_ids or ()),
                "completion_tokens": len(out.token_ids or ()),
                "cached_tokens": out.num_cached_tokens}

    def openai_usage(self) -> dict:
        u = self.usage()
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def check_error(self) -> None:
        if self.final.finish_reason == "error":
            raise ApiError(500, f"generation failed: {self.final.error}")


class EventStream(StreamingResponse):
    """SSE response that aborts its request when it ends early (client gone, cancelled)."""

    def __init__(self, content, generation: Generation):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.abort()


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Server:
    """Holds the app's state: the engine loop, its config, metrics and the model context."""

    def __init__(self, loop: EngineLoop, config: ServerConfig):
        self.loop = loop
        self.config = config
        self.metrics = Metrics(loop)
        self.draining = False
        self._ctx: ModelContext | None = None
        self._ctx_lock = threading.Lock()
        self.created = int(time.time())

    async def context(self) -> ModelContext:
        self.check_accepting()
        if self._ctx is None:
            ctx = await asyncio.wrap_future(self.loop.call(ModelContext.from_engine))
            with self._ctx_lock:
                if self._ctx is None:
                    self._ctx = ctx
        return self._ctx

    def check_accepting(self) -> None:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down", headers=retry)
        if not self.loop.is_ready:
            why = ("the model failed to load" if self.loop.error is not None
                   else "the model is still loading")
            raise ApiError(503, why, code="not_ready", headers=retry)

    def sampling_params(self, max_tokens: int, temperature: float, top_p: float, top_k: int,
                        seed: int | None, stop, ignore_eos: bool) -> SamplingParams:
        if self.config.max_tokens_cap is not None:
            max_tokens = min(max_tokens, self.config.max_tokens_cap)
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0
        top_p = max(top_p, MIN_TOP_P)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if seed is not None:
            seed %= 2**64  # torch generators take [0, 2**64)
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, top_k=max(top_k, 0), seed=seed, stop=stop,
                                  ignore_eos=ignore_eos)
        except ValueError as e:  # names the field
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def start(self, token_ids: list[int], params: SamplingParams, endpoint: str,
              t0: float) -> Generation:
        stream = RequestStream(token_ids, params)
        try:
            self.loop.submit(stream, self.config.max_waiting)
        except Overloaded as e:
            self.metrics.requests_rejected.labels("overloaded").inc()
            raise ApiError(503, f"server overloaded: {e}; retry later", code="overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except NotReady as e:
            self.metrics.requests_rejected.labels("not_ready").inc()
            raise ApiError(503, str(e), code="not_ready",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        return Generation(self, stream, endpoint, t0)

    async def run_to_end(self, request: Request, gen: Generation) -> RequestOutput | None:
        """Wait for the whole answer; None if the client went away first (request aborted)."""
        collector = asyncio.ensure_future(gen.collect())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collector.done():
                return collector.result()
            return None
        finally:
            for task in (collector, watcher):
                task.cancel()
            gen.abort()  # a no-op once finished

    def check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise ApiError(404, f"model: the model `{model}` does not exist; this server serves "
                           f"`{self.config.model_name}`", "model", "model_not_found")

    async def prompt_ids(self, ctx: ModelContext, prompt, param: str = "prompt") -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # OpenAI's list-of-prompts form, with one prompt
        if isinstance(prompt, str):
            return await run_in_threadpool(ctx.encode, prompt, param)
        ctx.check_token_ids(prompt, param)
        return list(prompt)


def _client_gone() -> Response:
    return Response(status_code=499)


# ---- validation errors -> OpenAI error bodies -------------------------------------------------
_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "constrained", "function",
               "literal", "tagged", "json")
_MESSAGE_TAGS = ("system", "developer", "user", "assistant")


def _field_path(loc) -> str:
    """pydantic's error location -> `messages[0].content`, without union-branch labels."""
    parts: list[str] = []
    after_index = False
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
            after_index = True
            continue
        p, was_after_index, after_index = str(p), after_index, False
        if p == "body" and not parts:
            continue
        if was_after_index and p in _MESSAGE_TAGS:
            continue  # the discriminated union's tag (a message's role), not a field
        if any(p.startswith(t) for t in _UNION_TAGS) and ("[" in p or "-" in p or p in _UNION_TAGS):
            continue  # pydantic's union-branch labels (str, list[int], ...), not field names
        parts.append(("." if parts else "") + p)
    return "".join(parts)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    messages, param = [], None
    for err in errors:
        path = _field_path(err.get("loc", ()))
        kind = err.get("type", "")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "invalid JSON")
            messages.append(f"request body is not valid JSON: {detail}")
            continue
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if kind in ("union_tag_invalid", "union_tag_not_found"):  # e.g. a message's role
            tag = str((err.get("ctx") or {}).get("discriminator", "")).strip("'\"")
            path = f"{path}.{tag}" if tag else path
        named = re.match(r"([A-Za-z_]\w*): ", msg)
        if kind == "value_error" and named:  # our validators name the field they check
            path = f"{path}.{named.group(1)}" if path else named.group(1)
            msg = msg[named.end():]
        if param is None and path:
            param = path
        if kind == "missing":
            msg = "field required" if path else "a JSON object body is required"
        elif kind == "extra_forbidden":
            msg = "unknown field (not allowed)"
        line = f"{path or 'request body'}: {msg}"
        if line not in messages:
            messages.append(line)
    message = "; ".join(messages[:5]) or "invalid request"
    if len(messages) > 5:
        message += f" (and {len(messages) - 5} more)"
    return ApiError(400, message, param).response()


# ---- the app ----------------------------------------------------------------------------------
def _error_responses(*codes: int) -> dict:
    desc = {400: "Invalid request (the message names the field)", 401: "Missing or wrong API key",
            404: "Unknown model", 503: "Overloaded, loading or shutting down (see Retry-After)",
            500: "Internal error"}
    return {c: {"model": ErrorResponse, "description": desc[c]} for c in codes}


SSE_EVENT_SCHEMA = {  # one event, as OpenAPI 3.2's itemSchema for text/event-stream has it
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON object, or [DONE]"},
                   "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}}}


def _sse_response(description: str) -> dict:
    return {200: {"description": description,
                  "content": {"text/event-stream": {"itemSchema": SSE_EVENT_SCHEMA}}}}


def create_app(loop: EngineLoop, config: ServerConfig | None = None) -> FastAPI:
    """Build the app around a (started) EngineLoop. Several apps may share one loop."""
    config = config or ServerConfig()
    server = Server(loop, config)
    app = FastAPI(title="flashlet", version="0.1.0",
                  description="flashlet inference server: /generate and an OpenAI-compatible API")
    app.state.server = server
    gen_errors = _error_responses(400, 401, 503)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
            message = f"request body is not valid UTF-8: {exc.__cause__.reason} at byte " \
                      f"{exc.__cause__.start}"
        elif exc.status_code == 400 and exc.__cause__ is not None:
            message = f"request body could not be parsed: {exc.__cause__}"
        return ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    # ---- health, models, metrics ---------------------------------------------------------
    @app.get("/health", responses={503: {"description": "Loading, failed or shutting down"}})
    async def health():
        if server.draining or not loop.is_ready:
            if loop.error is not None:
                status = "failed"
            elif server.draining or loop.ready.is_set():
                status = "shutting down"
            else:
                status = "loading"
            return JSONResponse({"status": status}, status_code=503,
                                headers={"Retry-After": str(config.retry_after_s)})
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList, responses=_error_responses(401, 503))
    async def models():
        ctx = await server.context()
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": server.created,
            "owned_by": "flashlet", "max_model_len": ctx.max_model_len}]}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {}}},
        **_error_responses(401)})
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- /generate ------------------------------------------------------------------------
    async def _start_generate(body: GenerateRequest, endpoint: str) -> Generation:
        t0 = time.monotonic()
        ctx = await server.context()
        ids = await server.prompt_ids(ctx, body.prompt)
        max_tokens = ctx.budget(len(ids), body.max_new_tokens, None, "prompt", "max_new_tokens")
        params = server.sampling_params(max_tokens, body.temperature, body.top_p, body.top_k,
                                        body.seed, body.stop, body.ignore_eos)
        return server.start(ids, params, endpoint, t0)

    @app.post("/generate", response_model=GenerateResponse, responses=gen_errors)
    async def generate(body: GenerateRequest, request: Request):
        gen = await _start_generate(body, "generate")
        out = await server.run_to_end(request, gen)
        if out is None:
            return _client_gone()
        gen.check_error()
        return {"text": out.text, "finish_reason": out.finish_reason, "usage": gen.usage(),
                "ttft_ms": None if gen.ttft is None else round(gen.ttft * 1000, 3),
                "latency_ms": round(gen.latency_ms, 3)}

    @app.post("/generate_stream", response_class=StreamingResponse,
              responses={**_sse_response("Server-Sent Events: one `data: {\"text\"}` per token, "
                                         "a final event with finish_reason and usage, then "
                                         "`data: [DONE]`"), **gen_errors})
    async def generate_stream(body: GenerateRequest):
        gen = await _start_generate(body, "generate_stream")

        async def events():
            try:
                async for delta, out in gen.deltas():
                    if out.new_token_ids:  # one event per token (its text may be held back)
                        yield sse({"text": delta})
                        delta = ""
                    if out.finished:  # text left here only when it ended without a token
                        final = {"text": delta, "finish_reason": out.finish_reason,
                                 "usage": gen.usage(),
                                 "ttft_ms": None if gen.ttft is None else round(gen.ttft * 1000, 3),
                                 "latency_ms": round(gen.latency_ms, 3)}
                        if out.finish_reason == "error":
                            final["error"] = out.error
                        yield sse(final)
                    elif delta:
                        yield sse({"text": delta})
            except ApiError as e:
                yield sse(e.body())
            yield DONE

        return EventStream(events(), gen)

    # ---- OpenAI-compatible ----------------------------------------------------------------
    def _openai_params(body, max_tokens: int) -> SamplingParams:
        return server.sampling_params(max_tokens, body.temperature, body.top_p, body.top_k,
                                      body.seed, body.stop, body.ignore_eos)

    def _include_usage(body) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    @app.post("/v1/completions", responses={
        **_sse_response("A completion, or with stream=true Server-Sent Events of chunks"),
        **_error_responses(400, 401, 404, 503)})
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.monotonic()
        server.check_model(body.model)
        ctx = await server.context()
        ids = await server.prompt_ids(ctx, body.prompt)
        max_tokens = ctx.budget(len(ids), body.max_tokens, 16, "prompt", "max_tokens")
        gen = server.start(ids, _openai_params(body, max_tokens), "completions", t0)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "text_completion", "created": created,
                "model": config.model_name}

        if not body.stream:
            out = await server.run_to_end(request, gen)
            if out is None:
                return _client_gone()
            gen.check_error()
            return {**base, "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                         "finish_reason": out.finish_reason}],
                    "usage": gen.openai_usage()}

        include_usage = _include_usage(body)
        extra = {"usage": None} if include_usage else {}

        async def events():
            try:
                async for delta, out in gen.deltas():
                    if out.finished:
                        yield sse({**base, "choices": [{"index": 0, "text": delta, "logprobs": None,
                                                        "finish_reason": out.finish_reason}],
                                   **extra})
                        if include_usage:
                            yield sse({**base, "choices": [], "usage": gen.openai_usage()})
                    elif delta:
                        yield sse({**base, "choices": [{"index": 0, "text": delta, "logprobs": None,
                                                        "finish_reason": None}], **extra})
            except ApiError as e:
                yield sse(e.body())
            yield DONE

        return EventStream(events(), gen)

    @app.post("/v1/chat/completions", responses={
        **_sse_response("A chat completion, or with stream=true Server-Sent Events of chunks"),
        **_error_responses(400, 401, 404, 503)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        t0 = time.monotonic()
        server.check_model(body.model)
        ctx = await server.context()
        messages = [m.as_template_dict() for m in body.messages]
        ids = await run_in_threadpool(ctx.chat_ids, messages)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = ctx.budget(len(ids), requested, None, "messages", tokens_param)
        gen = server.start(ids, _openai_params(body, max_tokens), "chat", t0)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "chat.completion", "created": created,
                "model": config.model_name}

        if not body.stream:
            out = await server.run_to_end(request, gen)
            if out is None:
                return _client_gone()
            gen.check_error()
            return {**base, "choices": [{
                "index": 0, "message": {"role": "assistant", "content": out.text},
                "logprobs": None, "finish_reason": out.finish_reason}],
                "usage": gen.openai_usage()}

        include_usage = _include_usage(body)
        extra = {"usage": None} if include_usage else {}
        chunk = {**base, "object": "chat.completion.chunk"}

        def choice(delta: dict, finish_reason=None) -> dict:
            return {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason}], **extra}

        async def events():
            yield sse(choice({"role": "assistant", "content": ""}))
            try:
                async for delta, out in gen.deltas():
                    if out.finished:
                        yield sse(choice({"content": delta} if delta else {}, out.finish_reason))
                        if include_usage:
                            yield sse({**chunk, "choices": [], "usage": gen.openai_usage()})
                    elif delta:
                        yield sse(choice({"content": delta}))
            except ApiError as e:
                yield sse(e.body())
            yield DONE

        return EventStream(events(), gen)

    _customize_openapi(app)
    app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.add_middleware(MetricsMiddleware, metrics=server.metrics)
    return app


def _customize_openapi(app: FastAPI) -> None:
    """FastAPI documents validation errors as 422 with its own body; ours are 400 with the
    OpenAI error body (already documented on each route)."""
    original = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = original()
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class AuthMiddleware:
    """With an API key set, every endpoint but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if (self.api_key is None or scope["type"] != "http" or scope.get("path") == "/health"
                or self._authorized(scope)):
            return await self.app(scope, receive, send)
        error = ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    token.strip().encode(), self.api_key.encode())
        return False
