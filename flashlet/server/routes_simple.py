"""The simple endpoints: /health, /v1/models (and one model's card), /version, /metrics,
/generate and /generate_stream."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import flashlet
from flashlet.core.request import FinishReason
from flashlet.server.errors import ApiError, error_responses, sse_response
from flashlet.server.frontend import DONE, EventStream, Generation, Server, client_gone, sse
from flashlet.server.json_body import model_body_post
from flashlet.server.protocol import (DEFAULT_MAX_NEW_TOKENS, GenerateRequest, GenerateResponse,
                                      ModelCard, ModelList)


def add_simple_routes(app: FastAPI, server: Server) -> None:
    loop, config = server.loop, server.config
    gen_errors = error_responses(400, 401, 503)

    # ---- health, models, metrics ---------------------------------------------------------
    health_responses = {503: {"description": "Loading, warming up, failed, stalled or "
                                             "shutting down (`reason` says why where it can)"}}

    @app.head("/health", operation_id="health_head", responses=health_responses)
    @app.get("/health", responses=health_responses)
    async def health():
        if loop.is_ready and not server.warm and not server.draining:
            server.start_warm_up(app)  # (the CLI starts it as soon as the engine is ready)
            return JSONResponse({"status": "warming up"}, status_code=503,
                                headers={"Retry-After": str(config.retry_after_s)})
        problems = loop.core_problems()  # dead or stalled engine cores
        if server.draining or not loop.is_ready:
            body = {"status": "loading"}
            if loop.error is not None:  # (its text may name paths: the log has it)
                body = {"status": "failed"}
            elif server.draining:
                body = {"status": "shutting down"}
            elif loop.ready.is_set():
                body = ({"status": "stalled", "reason": "; ".join(problems)} if problems
                        else {"status": "shutting down"})
            return JSONResponse(body, status_code=503,
                                headers={"Retry-After": str(config.retry_after_s)})
        if problems:  # data parallel: the other cores serve, so stay in the balancer's pool
            return {"status": "degraded", "reason": "; ".join(problems)}
        return {"status": "ok"}

    async def model_card() -> dict:
        ctx = await server.context()
        return {"id": config.model_name, "object": "model", "created": server.created,
                "owned_by": "flashlet", "max_model_len": ctx.max_model_len}

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401, 503))
    async def models():
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(401, 404, 503))
    async def model(model: str):
        """OpenAI's model retrieve: the served model's card (a name with a slash, as a hub id
        has, is one path)."""
        server.check_model(model)
        return await model_card()

    @app.get("/version")
    async def version():
        """vLLM's /version: this server's version."""
        return {"version": flashlet.__version__}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {}}},
        **error_responses(401)})
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/stats", include_in_schema=False)
    async def debug_stats():
        """Where the time goes (diagnostics.py): cumulative counters of every engine core's
        loop and every API process; a reader takes two and subtracts."""
        return await server.debug_stats()

    # ---- /generate ------------------------------------------------------------------------
    async def _start_generate(body: GenerateRequest, endpoint: str) -> Generation:
        t0 = time.monotonic()
        ctx = await server.context()
        ids = await server.prompt_ids(ctx, body.prompt)
        # Not sent: the default, cut to what the context leaves (never a 400 about it).
        requested, tokens_param = body.token_budget
        max_tokens = ctx.budget(len(ids), requested, DEFAULT_MAX_NEW_TOKENS, "prompt",
                                tokens_param)
        params = server.sampling_params(max_tokens, body.temperature, body.top_p, body.top_k,
                                        body.seed, body.stop, body.ignore_eos)
        return server.start(ctx, ids, params, endpoint, t0)

    @model_body_post(app, "/generate", response_model=GenerateResponse, responses=gen_errors)
    async def generate(body: GenerateRequest, request: Request):
        gen = await _start_generate(body, "generate")
        out = await server.run_to_end(request, gen)
        if out is None:
            return client_gone()
        gen.check_error()
        return {"text": gen.text, "token_ids": list(gen.token_ids),
                "finish_reason": out.finish_reason, "usage": gen.usage(),
                "ttft_ms": None if gen.ttft is None else round(gen.ttft * 1000, 3),
                "latency_ms": round(gen.latency_ms, 3)}

    @model_body_post(app, "/generate_stream", response_class=StreamingResponse,
              responses={**sse_response("Server-Sent Events: one `data: {\"text\"}` per token (or "
                                         "per batch of tokens, with `num_tokens`), "
                                         "a final event with finish_reason and usage, then "
                                         "`data: [DONE]`"), **gen_errors})
    async def generate_stream(body: GenerateRequest):
        gen = await _start_generate(body, "generate_stream")

        async def events():
            # What ends the body: [DONE], after the final event and the last token's event if
            # they came (one write: the client reads them at once, and sends its next request)
            last = DONE
            try:
                async for delta, out in gen.deltas():
                    n = len(out.new_token_ids)
                    event = b""
                    if n:  # an event per token, or per batch of n saying so (text may be held back)
                        event = sse({"text": delta} if n == 1 else {"text": delta, "num_tokens": n})
                        delta = ""
                    if out.finished:  # text left here only when it ended without a token
                        final = {"text": delta, "token_ids": list(gen.token_ids),
                                 "finish_reason": out.finish_reason,
                                 "usage": gen.usage(),
                                 "ttft_ms": None if gen.ttft is None else round(gen.ttft * 1000, 3),
                                 "latency_ms": round(gen.latency_ms, 3)}
                        if out.finish_reason == FinishReason.ERROR:
                            final["error"] = out.error
                        last = event + sse(final) + DONE
                    elif event:
                        yield event
                    elif delta:
                        yield sse({"text": delta})
            except ApiError as e:
                yield sse(e.body())
            yield last

        return EventStream(events(), gen)
