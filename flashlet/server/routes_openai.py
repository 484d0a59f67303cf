"""The OpenAI-compatible endpoints: /v1/completions and /v1/chat/completions.

A request of n samples (and best_of on completions) is n engine requests queued together on
one engine core (Server.start_samples); their choices are streamed interleaved, each chunk
naming its choice's index. Logprobs, penalties, min_p, min_tokens, stop_token_ids, logit_bias and
seeds are SamplingParams fields; response_format and forced tool calls become an xgrammar grammar that
the engine core compiles (flashlet/text/structured.py). Tool calls and reasoning come back parsed
from the reply's text by the parsers of parsers.py (`--tool-call-parser`, `--reasoning-parser`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import FastAPI, Request

from flashlet.core.request_check import RequestError
from flashlet.core.sampling import SamplingParams, TokenLogprob
from flashlet.server.errors import ApiError, error_responses, sse_response
from flashlet.server.frontend import (DONE, EventStream, Generation, ModelContext, Server,
                                      client_gone, sse)
from flashlet.server.json_body import model_body_post
from flashlet.server.parsers import reply_parsers
from flashlet.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from flashlet.text import structured

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM's floor too)


def add_openai_routes(app: FastAPI, server: Server) -> None:
    config = server.config

    @model_body_post(app, "/v1/completions", responses={
        **sse_response("A completion, or with stream=true Server-Sent Events of chunks"),
        **error_responses(400, 401, 404, 503)})
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.monotonic()
        server.check_model(body.model)
        ctx = await server.context()
        num_samples = body.best_of or body.n
        server.check_fits(len(body.prompts), num_samples)
        # max_tokens 0 scores the prompt: the engine samples one token, which is dropped.
        score_only = body.max_tokens == 0
        prompt_k = body.engine_prompt_logprobs
        if body.stream and prompt_k is not None and num_samples > 1:
            raise ApiError(400, "prompt_logprobs: streaming a prompt's logprobs (echo with "
                           "logprobs, or prompt_logprobs) needs n == 1", "prompt_logprobs")
        prompts = []  # (token ids, max tokens) per prompt, all checked before any is queued
        for i, prompt in enumerate(body.prompts):
            param = "prompt" if len(body.prompts) == 1 else f"prompt[{i}]"
            ids = await server.prompt_ids(ctx, prompt, param)
            prompts.append((ids, ctx.budget(len(ids), 1 if score_only else body.max_tokens, 16,
                                            param, "max_tokens")))
        response_format = body.structured_format
        gens: list[Generation] = []
        try:
            for ids, max_tokens in prompts:
                params = _params(server, ctx, body, max_tokens, body.logprobs, response_format,
                                 best_of=body.best_of, prompt_logprobs=prompt_k)
                # One group for all its prompts: other requests take turns with them.
                group = gens[0].stream.request_id if gens else None
                gens += server.start_samples(ctx, ids, params, "completions", t0, num_samples,
                                             group)
        except BaseException:
            for gen in gens:
                gen.abort()
            raise
        echoes = [ctx.ids_text(ids) if body.echo else "" for ids, _ in prompts]
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": config.model_name}
        want_logprobs = body.logprobs is not None

        if not body.stream:
            finals = await server.run_all_to_end(request, gens)
            if finals is None:
                return client_gone()
            for gen in gens:
                gen.check_error()
            choices = []
            for p, echo in enumerate(echoes):
                group = gens[p * num_samples:(p + 1) * num_samples]
                scored = group[0].prompt_logprobs  # the first sample scores the prompt
                for j, gen in enumerate(_best_of(group, body.n)):
                    choice = _completion_choice(ctx, body, echo, scored, gen, score_only)
                    choices.append({"index": p * body.n + j, **choice})
            usage = _usage(gens, prompts, num_samples, score_only)
            return {**base, "choices": choices, "usage": usage}

        include_usage = _include_usage(body)
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, text: str, finish_reason=None, logprobs=None, **more) -> str:
            return sse({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish_reason, **more}], **extra})

        def echo_chunk(i: int, scored) -> str:
            """The echoed prompt, with its logprobs once the engine scored it."""
            more = ({"prompt_logprobs": _vllm_prompt_logprobs(ctx, scored, body.prompt_logprobs)}
                    if body.prompt_logprobs is not None else {})
            lp = (_completion_logprobs(ctx, scored, 0, body.logprobs,
                                       gens[i].stream.prompt_token_ids[0], generated=False)
                  if want_logprobs and body.echo else None)
            return chunk(i, echoes[i // num_samples], logprobs=lp, **more)

        async def events():
            sent = [len(echoes[i // num_samples]) for i in range(len(gens))]  # text offsets
            if prompt_k is None:  # else each echo goes out with the first delta (scored)
                for i in range(len(gens)):
                    if echoes[i // num_samples]:
                        yield chunk(i, echoes[i // num_samples])
            tail = b""  # the last events, sent with [DONE] (_last_event)
            try:
                async for i, text, delta in _interleave(gens):
                    if delta.prompt_logprobs is not None:
                        yield echo_chunk(i, delta.prompt_logprobs)
                    lp = (_completion_logprobs(ctx, delta.logprobs, sent[i])
                          if want_logprobs and delta.logprobs else None)
                    sent[i] += len(text)
                    if delta.finished or text or lp:
                        event = chunk(i, text, delta.finish_reason if delta.finished else None, lp)
                        if _last_event(delta, gens):
                            tail = event
                        else:
                            yield event
                tail += _error_events(gens)
                if include_usage:
                    tail += sse({**base, "choices": [], "usage": _usage(gens, prompts, num_samples)})
            except ApiError as e:
                tail += sse(e.body())
            yield tail + DONE

        return EventStream(events(), gens)

    @model_body_post(app, "/v1/chat/completions", responses={
        **sse_response("A chat completion, or with stream=true Server-Sent Events of chunks"),
        **error_responses(400, 401, 404, 503)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        t0 = time.monotonic()
        server.check_model(body.model)
        ctx = await server.context()
        tool_choice = body.effective_tool_choice
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.uses_tools else None
        if tool_choice == "auto" and not await ctx.supports_tools():
            raise ApiError(400, "tool_choice: 'auto' needs a chat template that shows the model "
                           "its tools, and this model's has no tool support (use tool_choice "
                           "'required' or a named function, which a grammar enforces, or give "
                           "--chat-template)", "tool_choice")
        messages = [m.as_template_dict() for m in body.messages]
        ids = await ctx.chat_ids(messages, tools, body.template_kwargs, server.alone)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = ctx.budget(len(ids), requested, None, "messages", tokens_param)
        response_format = (_tool_call_format(tools, tool_choice, body.parallel_tool_calls is not False)
                           if tool_choice not in ("none", "auto") else body.structured_format)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(server, ctx, body, max_tokens, logprobs, response_format,
                         prompt_logprobs=body.prompt_logprobs)
        gens = server.start_samples(ctx, ids, params, "chat", t0, body.n)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": config.model_name}
        parsers = reply_parsers(config.tool_call_parser, config.reasoning_parser,
                                ctx.chat_template, tool_choice, body.parallel_tool_calls)
        prompts = [(ids, max_tokens)]

        if not body.stream:
            finals = await server.run_all_to_end(request, gens)
            if finals is None:
                return client_gone()
            choices = []
            for i, gen in enumerate(gens):
                gen.check_error()
                message, finish_reason = parsers.message(gen.text, gen.final.finish_reason)
                choices.append({"index": i, "message": message, "finish_reason": finish_reason,
                                "logprobs": _chat_logprobs(ctx, gen.logprobs, logprobs,
                                                           body.skip_special_tokens)})
            scored = ({"prompt_logprobs": _vllm_prompt_logprobs(ctx, gens[0].prompt_logprobs,
                                                                body.prompt_logprobs)}
                      if body.prompt_logprobs is not None else {})  # vLLM's place for them
            return {**base, "choices": choices, "usage": _usage(gens, prompts, body.n), **scored}

        include_usage = _include_usage(body)
        extra = {"usage": None} if include_usage else {}
        head = {**base, "object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict, finish_reason=None, logprobs=None) -> str:
            return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish_reason}], **extra})

        async def events():
            for i in range(len(gens)):
                yield chunk(i, {"role": "assistant", "content": ""})
            replies = [parsers.stream() for _ in gens] if parsers.active else None
            tail = b""  # the last events, sent with [DONE] (_last_event)
            try:
                async for i, text, delta in _interleave(gens):
                    if delta.prompt_logprobs is not None and body.prompt_logprobs is not None:
                        yield sse({**head, "choices": [], "prompt_logprobs": _vllm_prompt_logprobs(
                            ctx, delta.prompt_logprobs, body.prompt_logprobs)})
                    lp = (_chat_logprobs(ctx, delta.logprobs, logprobs, body.skip_special_tokens)
                          if delta.logprobs else None)
                    if replies is not None:  # tool calls and reasoning taken out as they come
                        message = replies[i].push(text, delta.finished)
                        reason = delta.finish_reason
                        if delta.finished and replies[i].called and reason == "stop":
                            reason = "tool_calls"
                        says = bool(message or lp)
                    else:
                        message = {"content": text} if text or not delta.finished else {}
                        reason, says = delta.finish_reason, bool(text or lp)
                    if delta.finished:
                        event = chunk(i, message, reason, lp)
                        if _last_event(delta, gens):
                            tail = event
                        else:
                            yield event
                    elif says:
                        yield chunk(i, message, None, lp)
                tail += _error_events(gens)
                if include_usage:
                    tail += sse({**head, "choices": [], "usage": _usage(gens, prompts, body.n)})
            except ApiError as e:
                tail += sse(e.body())
            yield tail + DONE

        return EventStream(events(), gens)


# ---- request -> SamplingParams -------------------------------------------------------------
def _params(server: Server, ctx: ModelContext, body, max_tokens: int, logprobs: int | None,
            response_format: dict | None, best_of: int | None = None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    if response_format is not None and body.ignore_eos:
        raise ApiError(400, "ignore_eos: cannot be combined with response_format or forced tool "
                       "calls (the grammar ends the output)", "ignore_eos")
    if body.priority and server.config.scheduling_policy != "priority":
        raise ApiError(400, f"priority: {body.priority} needs the priority scheduling policy "
                       "(start the server with --scheduling-policy priority)", "priority")
    stop_token_ids = list(body.stop_token_ids or [])
    params = server.sampling_params(
        max_tokens, body.temperature, body.top_p, body.top_k, body.seed, body.stop,
        body.ignore_eos, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0, stop_token_ids=stop_token_ids, logprobs=logprobs,
        n=body.n, best_of=best_of, response_format=response_format, priority=body.priority,
        prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias={int(t): b for t, b in body.logit_bias.items()} if body.logit_bias else None)
    try:
        ctx.limits.check_stop_token_ids(params)
    except RequestError as e:
        raise ApiError(400, e.message, e.param) from None
    return params


def _tool_call_format(tools: list[dict], tool_choice, parallel: bool) -> dict:
    choice = (tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice)
              else tool_choice)
    try:
        return structured.tool_call_format(tools, choice, parallel=parallel)
    except ValueError as e:
        raise ApiError(400, f"tools: {e}", "tools") from None


def _error_events(gens: list[Generation]) -> bytes:
    """After the finish chunks of a stream, the error of a sample that ended part-way with one
    (finish_reason "error"), as an error event: the client learns why, as a 400 or a 500 would
    have told it had the request not streamed."""
    return next((sse(error.body()) for gen in gens if (error := gen.error()) is not None), b"")


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _last_event(delta, gens: list[Generation]) -> bool:
    """Whether a choice's event is the stream's last but the usage (its one choice finished):
    it then goes out with [DONE] in the body's last write (one packet and one wake-up of the
    client fewer). With several choices their events keep the order they came in."""
    return delta.finished and len(gens) == 1


# ---- results -> OpenAI's shapes --------------------------------------------------------------
async def _interleave(gens: list[Generation]):
    """(choice index, new text, delta) from every generation as they come; the first error
    ends the whole stream."""
    if len(gens) == 1:  # the usual n = 1: no task and queue in between (a hop per event)
        async with contextlib.aclosing(gens[0].deltas()) as deltas:
            async for text, delta in deltas:
                yield 0, text, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for text, delta in gen.deltas():
                queue.put_nowait((i, text, delta))
        except ApiError as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def _best_of(group: list[Generation], n: int) -> list[Generation]:
    """The n samples of highest cumulative logprob (all of them when best_of == n)."""
    if len(group) == n:
        return group
    return sorted(group, key=lambda g: g.cumulative_logprob, reverse=True)[:n]


def _usage(gens: list[Generation], prompts: list, num_samples: int,
           score_only: bool = False) -> dict:
    """OpenAI's usage: every prompt once, every sample's completion (none when scoring)."""
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    completion_tokens = 0 if score_only else sum(len(g.token_ids) for g in gens)
    cached = sum(max(g.num_cached_tokens for g in gens[p * num_samples:(p + 1) * num_samples])
                 for p in range(len(prompts)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _shown(ctx: ModelContext, entries: list[TokenLogprob] | None,
           skip_special: bool = True) -> list[TokenLogprob] | None:
    """The generated tokens' entries whose tokens are in the text (OpenAI's logprob tokens
    concatenate to the text: an EOS the text leaves out is left out here too, unless the
    request keeps special tokens in its text: skip_special False)."""
    if entries is None or ctx.decoder is None or not skip_special:
        return entries
    return [e for e in entries if ctx.shown_in_text(e.token_id)]


def _chat_logprobs(ctx: ModelContext, entries: list[TokenLogprob] | None,
                   top: int | None, skip_special: bool = True) -> dict | None:
    if entries is None or top is None:
        return None
    entries = _shown(ctx, entries, skip_special)

    def item(token_id: int, logprob: float) -> dict:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top[:top]]}
                        for e in entries], "refusal": None}


def _completion_logprobs(ctx: ModelContext, entries: list[TokenLogprob | None] | None,
                         offset: int, top: int | None = None,
                         first_token: int | None = None, generated: bool = True) -> dict | None:
    """The legacy completions shape; text_offset counts from the start of the choice's text.
    An entry of None is the prompt's first token, `first_token` (nothing before it scores
    it: null logprobs). top: how many alternatives to show (None: all the entries have).
    A generated token the text leaves out (an EOS) keeps its entry, with the text it adds,
    "": the tokens concatenate to the text, and harnesses that index the entries (prompt
    tokens, then max_tokens more: lm-eval's loglikelihood) find each where they expect it."""
    if entries is None:
        return None
    tokens, offsets, token_logprobs, top_logprobs = [], [], [], []
    for e in entries:
        if e is None:
            token, value, alternatives = ctx.token_text(first_token), None, None
        else:
            shown = not generated or ctx.decoder is None or ctx.shown_in_text(e.token_id)
            token, value = ctx.token_text(e.token_id) if shown else "", _logprob(e.logprob)
            alternatives = {ctx.token_text(t): _logprob(lp) for t, lp in e.top[:top]}
        tokens.append(token)
        offsets.append(offset)
        token_logprobs.append(value)
        top_logprobs.append(alternatives)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _completion_choice(ctx: ModelContext, body, echo: str, scored, gen: Generation,
                       score_only: bool) -> dict:
    """One /v1/completions choice: the echo, the generated text (none when only scoring),
    their logprobs (the prompt's first when echoing) and vLLM's prompt_logprobs if asked."""
    text = "" if score_only else gen.text
    choice = {"text": echo + text, "logprobs": None,
              "finish_reason": "length" if score_only else gen.final.finish_reason}
    if body.logprobs is not None:
        prompt_part = (_completion_logprobs(ctx, scored, 0, body.logprobs,
                                            gen.stream.prompt_token_ids[0], generated=False)
                       if body.echo else _completion_logprobs(ctx, [], 0))
        generated = _completion_logprobs(ctx, [] if score_only else gen.logprobs, len(echo))
        choice["logprobs"] = {key: prompt_part[key] + generated[key] for key in prompt_part}
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(ctx, scored, body.prompt_logprobs)
    return choice


def _vllm_prompt_logprobs(ctx: ModelContext, scored, top: int) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the token itself and the `top` most likely there."""
    if scored is None:
        return None

    def entry(token_id: int, logprob: float, rank: int) -> tuple[str, dict]:
        return str(token_id), {"logprob": _logprob(logprob), "rank": rank,
                               "decoded_token": ctx.token_text(token_id)}

    result = []
    for e in scored:
        if e is None:
            result.append(None)
            continue
        ranked = dict(entry(t, lp, r) for r, (t, lp) in enumerate(e.top[:top], start=1))
        ranked.setdefault(*entry(e.token_id, e.logprob, e.rank))
        result.append(ranked)
    return result

