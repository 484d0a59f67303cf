"""The endpoints beyond completions: /tokenize and /detokenize (vLLM's shapes), /v1/responses
(OpenAI's Responses API: a thin translation onto /v1/chat/completions, whole and streamed;
responses_api.py) and /v1/embeddings (the engine pools a prompt's final hidden states:
flashlet/runner/pooling.py)."""

from __future__ import annotations

import base64
import time

import numpy as np

from fastapi import FastAPI, Request

from flashlet.server.errors import ApiError, error_responses, sse_response
from flashlet.server.frontend import Generation, ModelContext, Server, client_gone
from flashlet.server.protocol import template_ending
from flashlet.server.protocol_extra import (DetokenizeRequest, EmbeddingRequest,
                                            ResponsesRequest, TokenizeRequest)
from flashlet.server.responses_api import (chat_body, response_of_chat, responses_error,
                                            stream_of_chat)
from flashlet.text.tokenizing import PromptTooLong


def add_extra_routes(app: FastAPI, server: Server) -> None:
    add_tokenize_routes(app, server)
    add_responses_route(app, server)
    add_embeddings_route(app, server)


def add_tokenize_routes(app: FastAPI, server: Server) -> None:
    @app.post("/tokenize", responses=error_responses(400, 401, 404, 503))
    async def tokenize(body: TokenizeRequest):
        ctx = await _context(server, body.model)
        if body.messages is not None:
            messages = [m.as_template_dict() for m in body.messages]
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            kwargs = {**(body.chat_template_kwargs or {}), **template_ending(body)}
            ids = await ctx.chat_ids(messages, tools, kwargs, server.alone)
        else:
            ids = await _encode(ctx, body.prompt, body.add_special_tokens is not False)
        reply = {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}
        if body.return_token_strs:
            reply["token_strs"] = ctx.decoder.convert_ids_to_tokens(ids)
        return reply

    @app.post("/detokenize", responses=error_responses(400, 401, 404, 503))
    async def detokenize(body: DetokenizeRequest):
        ctx = await _context(server, body.model)
        if ctx.decoder is None:
            raise ApiError(400, "tokens: this model has no tokenizer", "tokens")
        if body.tokens:
            ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": ctx.ids_text(body.tokens)}


async def _context(server: Server, model: str | None) -> ModelContext:
    server.check_model(model)
    return await server.context()


async def _encode(ctx: ModelContext, text: str, add_special_tokens: bool) -> list[int]:
    """Text -> ids as a prompt is encoded (empty text: no ids, not an error here)."""
    if ctx.encoder is None:
        raise ApiError(400, "prompt: this model has no tokenizer", "prompt")
    try:
        return await ctx.encoder.encode_async(text, "prompt", add_special_tokens)
    except PromptTooLong as e:
        raise ApiError(400, f"prompt: {e}", "prompt", "context_length_exceeded") from None


def add_responses_route(app: FastAPI, server: Server) -> None:
    chat = next(r.endpoint for r in app.routes if getattr(r, "path", None)
                == "/v1/chat/completions")

    @app.post("/v1/responses", responses={
        **sse_response("A response, or with stream=true Server-Sent Events of its events"),
        **error_responses(400, 401, 404, 503)})
    async def responses(body: ResponsesRequest, request: Request):
        created = int(time.time())
        if body.model is None:  # left out: the served model, named in the response
            body = body.model_copy(update={"model": server.config.model_name})
        try:
            reply = await chat(chat_body(body), request)
        except ApiError as e:
            raise responses_error(e) from None
        if not body.stream:
            return reply if not isinstance(reply, dict) else response_of_chat(body, reply,
                                                                             created)
        return stream_of_chat(body, reply, created)


def add_embeddings_route(app: FastAPI, server: Server) -> None:
    @app.post("/v1/embeddings", responses=error_responses(400, 401, 404, 503))
    async def embeddings(body: EmbeddingRequest, request: Request):
        t0 = time.monotonic()
        server.check_model(body.model)
        ctx = await server.context()
        inputs = body.inputs
        prompts = []  # all checked before any is queued
        for i, item in enumerate(inputs):
            param = "input" if len(inputs) == 1 else f"input[{i}]"
            ids = await server.prompt_ids(ctx, item, param)
            ctx.budget(len(ids), 1, 1, param, "input")  # the context and the KV pool
            prompts.append(ids)
        # One token after the prompt, never read: the request ends there.
        params = server.sampling_params(1, 0.0, 1.0, 0, None, None, True,
                                        pooling=server.config.pooling)
        gens: list[Generation] = []
        try:
            for ids in prompts:
                gens.append(server.start(ctx, ids, params, "embeddings", t0))
        except BaseException:
            for gen in gens:
                gen.abort()
            raise
        if await server.run_all_to_end(request, gens) is None:
            return client_gone()
        data = []
        for i, gen in enumerate(gens):
            gen.check_error()
            data.append({"object": "embedding", "index": i,
                         "embedding": _encoded(gen.embedding, body.encoding_format)})
        num_tokens = sum(len(ids) for ids in prompts)
        return {"object": "list", "data": data, "model": server.config.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _encoded(vector: list[float] | None, encoding_format: str):
    """OpenAI's encodings: a list of floats, or base64 of little-endian float32s."""
    if vector is None:
        raise ApiError(500, "the engine returned no embedding")
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
