"""The OpenAI-compatible endpoints: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from flashlet.sampling import SamplingParams
from flashlet.server.errors import ApiError, error_responses, sse_response
from flashlet.server.frontend import DONE, EventStream, Server, client_gone, sse
from flashlet.server.protocol import ChatCompletionRequest, CompletionRequest


def add_openai_routes(app: FastAPI, server: Server) -> None:
    config = server.config

    # ---- OpenAI-compatible ----------------------------------------------------------------
    def _openai_params(body, max_tokens: int) -> SamplingParams:
        return server.sampling_params(max_tokens, body.temperature, body.top_p, body.top_k,
                                      body.seed, body.stop, body.ignore_eos)

    def _include_usage(body) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    @app.post("/v1/completions", responses={
        **sse_response("A completion, or with stream=true Server-Sent Events of chunks"),
        **error_responses(400, 401, 404, 503)})
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.monotonic()
        server.check_model(body.model)
        ctx = await server.context()
        ids = await server.prompt_ids(ctx, body.prompt)
        max_tokens = ctx.budget(len(ids), body.max_tokens, 16, "prompt", "max_tokens")
        gen = server.start(ctx, ids, _openai_params(body, max_tokens), "completions", t0)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "text_completion", "created": created,
                "model": config.model_name}

        if not body.stream:
            out = await server.run_to_end(request, gen)
            if out is None:
                return client_gone()
            gen.check_error()
            return {**base, "choices": [{"index": 0, "text": gen.text, "logprobs": None,
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
        **sse_response("A chat completion, or with stream=true Server-Sent Events of chunks"),
        **error_responses(400, 401, 404, 503)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        t0 = time.monotonic()
        server.check_model(body.model)
        ctx = await server.context()
        messages = [m.as_template_dict() for m in body.messages]
        ids = await ctx.chat_ids(messages)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = ctx.budget(len(ids), requested, None, "messages", tokens_param)
        gen = server.start(ctx, ids, _openai_params(body, max_tokens), "chat", t0)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "chat.completion", "created": created,
                "model": config.model_name}

        if not body.stream:
            out = await server.run_to_end(request, gen)
            if out is None:
                return client_gone()
            gen.check_error()
            return {**base, "choices": [{
                "index": 0, "message": {"role": "assistant", "content": gen.text},
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
