"""The API process's request path: tokenize and check a request, send its token ids to the
engine (an engine-core process through CoreClient, or the in-thread EngineLoop), then turn the
token ids that come back into text (IncrementalDetokenizer: stop strings are found here and end
the request in the engine), SSE events and metrics."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from flashlet.core.request import FinishReason
from flashlet.core.request_check import RequestError, RequestLimits
from flashlet.core.sampling import SamplingParams, TokenLogprob, sample_params
from flashlet.server.diagnostics import ApiCounters
from flashlet.server.engine_loop import NotReady, Overloaded, RequestStream, StreamError
from flashlet.server.errors import ApiError
from flashlet.server.limits import HttpLimits
from flashlet.server.metrics import Metrics, WarmCollector
from flashlet.server.protocol import echo
from flashlet.server.warmup import warm_up
from flashlet.text.detokenizer import IncrementalDetokenizer
from flashlet.text.tokenizing import PromptTooLong, TextEncoder

# top_p below this keeps only the top token anyway (its probability is >= 1/vocab); smaller
# values (e.g. 5e-324) round to 0 in float32 inside the sampler, which then drops every token.
MIN_TOP_P = 1e-8
DEBUG_STATS_WAIT_S = 5.0  # how long GET /debug/stats waits for a core's own answer


@dataclass
class ServerConfig:
    model_name: str = "flashlet"
    api_key: str | None = None
    max_waiting: int | None = 512  # requests waiting for a running slot before 503s
    max_tokens_cap: int | None = None  # clamp every request's token budget (e.g. for fuzzing)
    retry_after_s: int = 1
    allow_special_tokens: bool = False  # parse control tokens in user text (trusted callers)
    limits: HttpLimits = field(default_factory=HttpLimits)  # body size/time, connections
    chat_template: str | None = None  # a Jinja template used instead of the tokenizer's
    allowed_origins: tuple[str, ...] = ()  # CORS: origins whose pages may call this server
    warm_up: bool = False  # /health says "ok" only after the API path's warm-up (warmup.py)
    pooling: str = "last"  # /v1/embeddings: "last" or "mean" (flashlet/runner/pooling.py)
    tool_call_parser: str | None = None  # parsers.py's name; None: the chat template's own
    reasoning_parser: str | None = None  # parsers.py's name; None: no reasoning split
    scheduling_policy: str = "fcfs"  # the engine's: a request's `priority` needs "priority"


@dataclass
class ModelContext:
    """What handlers need to check and run requests: the text encoder, a decoder and the
    request limits.

    Text is encoded by a TextEncoder (flashlet/text/tokenizing.py): on its own threads and tokenizer
    copies (a long prompt must not block the event loop; HF fast tokenizers must not be used
    from two threads at once), user text never becoming control tokens, over-long text refused
    before it is tokenized. Decoding runs on the app's event loop with a copy of its own."""

    encoder: TextEncoder | None
    decoder: Any  # a tokenizer copy, used on the event loop only (IncrementalDetokenizer)
    limits: RequestLimits
    _shown: dict[int, bool] = field(default_factory=dict, repr=False)  # shown_in_text's

    @classmethod
    def of(cls, loop, allow_special_tokens: bool = False,
           chat_template: str | None = None) -> "ModelContext":
        """An encoder and a decoder over a started engine client's tokenizer (with
        `chat_template` instead of its own, if given), and its limits."""
        tokenizer, limits = loop.tokenizer, loop.limits
        if tokenizer is None:
            return cls(encoder=None, decoder=None, limits=limits)
        tokenizer = copy.deepcopy(tokenizer)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        encoder = TextEncoder(tokenizer, limits.max_tokens, allow_special=allow_special_tokens)
        return cls(encoder=encoder, decoder=copy.deepcopy(tokenizer), limits=limits)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def shown_in_text(self, token_id: int) -> bool:
        """Whether a generated token has text in the output: the detokenizer skips special
        tokens (an EOS such as <|im_end|>), so their logprobs are left out too."""
        shown = self._shown.get(token_id)
        if shown is None:
            shown = self._shown[token_id] = bool(
                self.decoder.decode([token_id], skip_special_tokens=True)
                or not self.decoder.decode([token_id]))
        return shown

    def detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        """A request's text maker: its stop strings and how the text is made."""
        return None if self.decoder is None else IncrementalDetokenizer.for_request(self.decoder, params)

    async def encode(self, text: str, param: str, alone: bool = False) -> list[int]:
        """`alone`: the caller serves nothing else now, so a long text need not leave the
        event loop (TextEncoder.encode_async)."""
        if self.encoder is None:
            raise ApiError(400, f"{param}: this model has no tokenizer: send token ids, not text",
                           param)
        try:
            ids = await self.encoder.encode_async(text, param, alone=alone)
        except PromptTooLong as e:
            raise ApiError(400, f"{param}: {e}", param, "context_length_exceeded") from None
        if not ids:
            raise ApiError(400, f"{param}: encodes to no tokens", param)
        return ids

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs (on the event loop, as the detokenizer)."""
        return "" if self.decoder is None else self.decoder.decode([token_id])

    def ids_text(self, token_ids: list[int]) -> str:
        return "" if self.decoder is None else self.decoder.decode(token_ids)

    @property
    def chat_template(self) -> str | None:
        template = None if self.encoder is None else self.encoder.tokenizer.chat_template
        return template if isinstance(template, str) else None

    async def supports_tools(self) -> bool:
        """Whether the chat template shows the model its tools (see tokenizing.py)."""
        return (self.encoder is not None and self.encoder.has_chat_template
                and await self.encoder.supports_tools_async())

    async def chat_ids(self, messages: list[dict], tools: list[dict] | None = None,
                       template_kwargs: dict | None = None, alone: bool = False) -> list[int]:
        if self.encoder is None or not self.encoder.has_chat_template:
            raise ApiError(400, "messages: this model has no chat template", "messages")
        try:
            ids = await self.encoder.chat_async(messages, tools, template_kwargs, alone)
        except PromptTooLong as e:
            raise ApiError(400, f"messages: {e}", "messages", "context_length_exceeded") from None
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages
            raise ApiError(400, f"messages: the chat template rejected them: {e}",
                           "messages") from None
        if not ids:
            raise ApiError(400, "messages: the chat template produced no tokens", "messages")
        return ids

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        try:
            return self.limits.check_prompt_ids(ids, param, typed=True)  # protocol.TokenIds
        except RequestError as e:
            raise ApiError(400, e.message, e.param, e.code) from None

    def budget(self, num_prompt: int, max_tokens: int | None, default: int | None,
               prompt_param: str, tokens_param: str) -> int:
        """The request's max new tokens, checked against the context and the KV pool."""
        try:
            return self.limits.max_new_tokens(num_prompt, max_tokens, default, prompt_param,
                                              tokens_param)
        except RequestError as e:
            raise ApiError(400, e.message, e.param, e.code) from None


@dataclass
class Delta:
    """What one engine step gave one request, as handlers see it."""

    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    error_param: str | None = None  # the request field at fault, where the error is its own
    logprobs: list[TokenLogprob] | None = None  # for new_token_ids, if asked for
    # The prompt's (first token's None), in the delta they arrived with, if asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Generation:
    """One queued request seen from the handler: its text (detokenized here, stop strings
    found here), its timing and its metrics."""

    def __init__(self, server: "Server", stream: RequestStream, endpoint: str, t0: float,
                 detokenizer: IncrementalDetokenizer | None):
        self.server, self.stream, self.endpoint, self.t0 = server, stream, endpoint, t0
        self.detokenizer = detokenizer
        self.ttft: float | None = None
        self.token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.final: Delta | None = None
        self.embedding: list[float] | None = None
        self._held: StreamError | None = None  # an error to raise after the tokens before it
        self.logprobs: list[TokenLogprob] | None = (
            [] if stream.params.logprobs is not None else None)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # once computed

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs or ())

    @property
    def text(self) -> str:
        return "" if self.detokenizer is None else self.detokenizer.text

    async def deltas(self) -> AsyncIterator[tuple[str, Delta]]:
        """Yield (new text, delta) per batch of engine outputs, ending with the finished one.
        A delta holds every token that arrived since the handler last looked (one, unless the
        handler fell behind the engine: then several go out in one event, which says how many).
        Text that could still become a stop string is held back until it cannot."""
        metrics, last = self.server.metrics, None
        while True:
            item, ids, logprobs, prompt_logprobs = await self._next_batch()
            if isinstance(item, StreamError):
                self.stream.finished = True
                self.server.metrics.requests_finished.labels(self.endpoint, FinishReason.ERROR).inc()
                raise ApiError(item.status, item.message, item.param)
            now = time.monotonic()
            if ids:
                gaps = len(ids)
                if self.ttft is None:
                    self.ttft = now - self.t0
                    metrics.ttft.observe(self.ttft)
                    gaps, last = gaps - 1, self.t0
                # tokens that came together share the wait evenly
                metrics.itl.observe((now - last) / len(ids), gaps)
                last = now
                self.server.api_counters.sent(len(ids))  # one SSE event when streaming
                self.token_ids.extend(ids)
                if self.logprobs is not None:
                    self.logprobs.extend(logprobs)
            text, stopped = self.detokenizer.push(ids) if self.detokenizer and ids else ("", False)
            delta = Delta(ids, item.finished, item.finish_reason, item.error,
                          item.error_param,
                          logprobs if self.logprobs is not None else None)
            if self.prompt_logprobs is None and prompt_logprobs is not None:
                self.prompt_logprobs = delta.prompt_logprobs = prompt_logprobs
            if stopped:  # a stop string: end the request in the engine too
                self.server.loop.abort(self.stream, FinishReason.STOP)
                delta.finished, delta.finish_reason = True, FinishReason.STOP
            elif item.finished and self.detokenizer is not None:
                text += self.detokenizer.finish()
                if self.detokenizer.stopped and delta.finish_reason == FinishReason.LENGTH:
                    delta.finish_reason = FinishReason.STOP  # a stop string in its last tokens
            if delta.finished:
                self._finish(delta, item, now)
            yield text, delta
            if delta.finished:
                return

    async def _next_batch(self):
        """The next output (waiting for it) merged with every one already queued behind it:
        (the last output or a StreamError, all their new token ids, their logprobs, the
        prompt logprobs if one carried them)."""
        item, self._held = self._held or await self.stream.get(), None
        if isinstance(item, StreamError):
            return item, [], [], None
        ids, logprobs = list(item.new_token_ids), list(item.new_logprobs or ())
        prompt_logprobs = item.prompt_logprobs
        queue = self.stream.items
        while not item.finished and queue:
            following = queue.popleft()
            if isinstance(following, StreamError):
                self._held = following  # after these tokens
                break
            ids += following.new_token_ids
            logprobs += following.new_logprobs or ()
            prompt_logprobs = prompt_logprobs or following.prompt_logprobs
            item = following
        return item, ids, logprobs, prompt_logprobs

    def _finish(self, delta: Delta, item, now: float) -> None:
        self.stream.finished = True
        self.final = delta
        self.num_cached_tokens = item.num_cached_tokens
        self.embedding = item.embedding  # an embedding request's vector
        self.server.metrics.observe_finished(self.endpoint, delta.finish_reason,
                                             len(self.stream.prompt_token_ids),
                                             self.num_cached_tokens, len(self.token_ids),
                                             now - self.t0)

    async def collect(self) -> Delta:
        async for _ in self.deltas():
            pass
        return self.final

    def abort(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.stream.finished and not self.stream.cancelled:
            self.server.loop.abort(self.stream)
            self.server.metrics.requests_finished.labels(self.endpoint, FinishReason.ABORT).inc()

    @property
    def latency_ms(self) -> float:
        return (time.monotonic() - self.t0) * 1000

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.stream.prompt_token_ids),
                "completion_tokens": len(self.token_ids),
                "cached_tokens": self.num_cached_tokens}

    def openai_usage(self) -> dict:
        u = self.usage()
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def error(self) -> ApiError | None:
        """What a request that ended part-way with an error answers: its own fault (a
        RequestError, naming its field) a 400, anything else a 500; None if it did not."""
        if self.final is None or self.final.finish_reason != FinishReason.ERROR:
            return None
        error = self.final.error or ""
        if self.final.error_param is not None:
            return ApiError(400, error, self.final.error_param)
        return ApiError(500, f"generation failed: {error}")

    def check_error(self) -> None:
        if (error := self.error()) is not None:
            raise error


# The scope key under which the app (app.py) keeps the HTTP server's own `send`.
DIRECT_SEND = "flashlet.direct_send"


class EventStream(StreamingResponse):
    """SSE response that aborts its requests when it ends early (client gone, cancelled).

    Its start and its end (the last event, `data: [DONE]`, with it: one write, one wake-up of
    the client fewer) go through the middlewares' `send` wrappers; the events between go
    straight to the HTTP server (`scope[DIRECT_SEND]`), as no middleware of this app acts on a
    body chunk that neither starts nor ends a response. Through their four wrappers (error
    handling, metrics, exceptions twice) an event cost 2.2 us, past them 0.6 us (an ASGI bench
    in one process; cProfile, which inflates each call, put the wrappers near 25 us)."""

    def __init__(self, content, generation: "Generation | list[Generation]"):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generations = generation if isinstance(generation, list) else [generation]
        self._direct_send = None

    async def __call__(self, scope, receive, send):
        self._direct_send = scope.get(DIRECT_SEND)
        try:
            await self._stream_until_disconnect(receive, send)
        finally:
            for gen in self.generations:
                gen.abort()

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        send_event = self._direct_send or send
        last = b""
        async for chunk in self.body_iterator:  # bytes: sse() and DONE
            if chunk.endswith(DONE):  # the last event: it ends the body in the same write
                last = chunk
                break
            await send_event({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _stream_until_disconnect(self, receive, send) -> None:
        """StreamingResponse's own behaviour (stream the body; stop when the client goes) with
        two asyncio tasks instead of an anyio task group, whose cancel formats the task's repr:
        ~10% of a streamed request's CPU in the API process."""
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        tasks = (streaming, watching)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # both ended, as a task group
        for task in tasks:  # an error in either is the response's, as in the task group
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()


_json = msgspec.json.Encoder()  # ~10x json.dumps for an SSE chunk; UTF-8, as ensure_ascii=False


def sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def _collect_all(gens: list[Generation]) -> list[Delta]:
    # A task around the gather: cancelling it cancels the gather and retrieves its outcome.
    return await asyncio.gather(*(g.collect() for g in gens))


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Server:
    """Holds the app's state: the engine client (CoreClient or EngineLoop), its config, metrics
    and the model context."""

    def __init__(self, loop, config: ServerConfig):
        self.loop = loop
        self.config = config
        self.metrics = Metrics(loop)
        self.draining = False
        self._ctx: ModelContext | None = None
        self._ctx_lock = threading.Lock()
        self.created = int(time.time())
        self.warm_up_report = None  # a WarmUpReport once the warm-up ran (config.warm_up)
        self._warm_up_task: asyncio.Task | None = None
        # --api-server-count N > 1: one flag per API process in shared memory (the CLI sets
        # it), each set by its process once warm and accepting; None: this process only.
        self.api_servers_warm = None
        self.api_server_index = 0
        self.metrics.registry.register(WarmCollector(self))
        self.api_counters = ApiCounters()
        self.use_api_counters(self.api_counters)

    def use_api_counters(self, counters: ApiCounters) -> None:
        """Count this process's figures (GET /debug/stats) in `counters` (the CLI gives each
        API process its row of the shared ones)."""
        self.api_counters = counters
        self.loop.on_step_message = counters.delivered

    async def debug_stats(self) -> dict:
        """Every core's loop counters (CoreClient; the engine's stats alone with an in-thread
        EngineLoop) and every API process's (diagnostics.py): cumulative, as of now."""
        self.api_counters.start()
        cores = await run_in_threadpool(self.loop.loop_stats, DEBUG_STATS_WAIT_S)
        return {"time": time.monotonic(), "cores": cores,
                "api_servers": self.api_counters.snapshot()}

    @property
    def warmed_up(self) -> bool:
        """This process's own API path has run its warm-up."""
        return not self.config.warm_up or self.warm_up_report is not None

    @property
    def warm(self) -> bool:
        """Every API process is warm (what /health waits for)."""
        return self.warmed_up and (self.api_servers_warm is None or all(self.api_servers_warm))

    def warm_flags(self) -> list[bool]:
        """Per API process: warm and accepting (this process alone without --api-server-count)."""
        if self.api_servers_warm is None:
            return [self.warmed_up]
        return [bool(flag) for flag in self.api_servers_warm]

    def start_warm_up(self, app) -> None:
        """Start the API path's warm-up on this event loop, once (the engine must be ready)."""
        if self.config.warm_up and self._warm_up_task is None:
            async def run():
                self.warm_up_report = await warm_up(app)

            self._warm_up_task = asyncio.ensure_future(run())

    async def context(self) -> ModelContext:
        self.check_accepting()
        if self._ctx is None:
            ctx = await run_in_threadpool(ModelContext.of, self.loop,
                                          self.config.allow_special_tokens,
                                          self.config.chat_template)
            with self._ctx_lock:
                if self._ctx is None:
                    self._ctx = ctx
        return self._ctx

    def check_accepting(self) -> None:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down", headers=retry)
        if not self.loop.is_ready:
            problems = self.loop.core_problems()
            why = ("the model failed to load" if self.loop.error is not None
                   else "; ".join(problems) if problems else "the model is still loading")
            raise ApiError(503, why, code="not_ready", headers=retry)

    def sampling_params(self, max_tokens: int, temperature: float, top_p: float, top_k: int,
                        seed: int | None, stop, ignore_eos: bool, **extra) -> SamplingParams:
        """SamplingParams from a request's fields (`extra`: more SamplingParams fields);
        ApiError 400 naming the field if they do not go together."""
        if self.config.max_tokens_cap is not None and max_tokens > self.config.max_tokens_cap:
            max_tokens = self.config.max_tokens_cap  # and a min_tokens over it, with it
            if extra.get("min_tokens"):
                extra["min_tokens"] = min(extra["min_tokens"], max_tokens)
        top_p = max(top_p, MIN_TOP_P)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if seed is not None:
            seed %= 2**64  # torch generators take [0, 2**64)
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, top_k=max(top_k, 0), seed=seed, stop=stop,
                                  ignore_eos=ignore_eos, **extra)
        except ValueError as e:  # names the field
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def check_fits(self, num_prompts: int, samples_per_prompt: int) -> None:
        """ApiError 400 for a request the server can never take (a 503 with Retry-After would
        have its client retry forever). Its prompts are queued one after another, each while
        fewer than max_waiting wait; on an idle server max_running run at once, so the last
        prompt is refused whenever those before it hold the running slots and max_waiting."""
        if self.config.max_waiting is None:
            return
        running, waiting = self.loop.max_running, self.config.max_waiting
        ahead = (num_prompts - 1) * samples_per_prompt  # queued before the last prompt's
        if ahead >= running + waiting:
            raise ApiError(400, f"prompt: {num_prompts} prompts x {samples_per_prompt} samples "
                                f"can never be taken at once: even on an idle server the first "
                                f"{num_prompts - 1} prompts' {ahead} samples fill the {running} "
                                f"running slots (--max-num-seqs, all engine cores together) and "
                                f"the {waiting} places to wait (--max-waiting); send fewer "
                                f"prompts per request", "prompt", "too_many_samples")

    def start(self, ctx: ModelContext, token_ids: list[int], params: SamplingParams,
              endpoint: str, t0: float) -> Generation:
        return self.start_samples(ctx, token_ids, params, endpoint, t0, 1)[0]

    def start_samples(self, ctx: ModelContext, token_ids: list[int], params: SamplingParams,
                      endpoint: str, t0: float, num_samples: int,
                      group: int | None = None) -> list[Generation]:
        """Queue `num_samples` samples of one prompt (n, best_of) together: one engine core
        runs them, the first computing the prompt and the others sharing its KV pages.
        `group`: the client request's (its first prompt's request id), for its other prompts."""
        # Stop strings are found here, on the text: the engine gets token ids only.
        samples = [sample_params(params, i, num_samples) for i in range(num_samples)]
        streams = [RequestStream(token_ids, dataclasses.replace(p, stop=[]) if p.stop else p)
                   for p in samples]
        for stream in streams:
            stream.group = group
        gens = [Generation(self, stream, endpoint, t0, ctx.detokenizer(params))
                for stream in streams]
        retry = {"Retry-After": str(self.config.retry_after_s)}
        try:
            self.loop.submit_group(streams, self.config.max_waiting)
        except Overloaded as e:
            self.metrics.requests_rejected.labels("overloaded").inc()
            raise ApiError(503, f"server overloaded: {e}; retry later", code="overloaded",
                           headers=retry) from None
        except NotReady as e:
            self.metrics.requests_rejected.labels("not_ready").inc()
            raise ApiError(503, str(e), code="not_ready", headers=retry) from None
        except ValueError as e:  # the engine client could not carry it (nothing was counted)
            self.metrics.requests_rejected.labels("invalid").inc()
            raise ApiError(400, str(e)) from None
        owned = _owned_generations.get()
        if owned is not None:  # the HTTP request's owner aborts them when it ends
            owned.extend(gens)
        self.api_counters.submitted(t0)
        return gens

    async def run_to_end(self, request: Request, gen: Generation) -> Delta | None:
        """Wait for the whole answer; None if the client went away first (request aborted)."""
        finals = await self.run_all_to_end(request, [gen])
        return None if finals is None else finals[0]

    async def run_all_to_end(self, request: Request, gens: list[Generation]) -> list | None:
        """Wait for every answer (their final deltas); None if the client went away first
        (all aborted). An error in one aborts the others and is raised."""
        collector = asyncio.ensure_future(_collect_all(gens))
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collector.done():
                return collector.result()
            return None
        finally:
            for task in (collector, watcher):
                task.cancel()
            for gen in gens:
                gen.abort()  # a no-op once finished

    @property
    def alone(self) -> bool:
        """No request of this process is streaming: its event loop has nobody else to serve."""
        return self.loop.num_streams == 0

    def check_model(self, model: str | None) -> None:
        """A request's `model`: the served model's name, or None (left out: the served model,
        as vLLM takes it); any other name is a 404."""
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"model: the model {echo(model)} does not exist; this server "
                           f"serves `{self.config.model_name}`", "model", "model_not_found")

    async def prompt_ids(self, ctx: ModelContext, prompt, param: str = "prompt") -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # OpenAI's list-of-prompts form, with one prompt
        if isinstance(prompt, str):
            return await ctx.encode(prompt, param, alone=self.alone)
        return ctx.check_token_ids(prompt, param)


def client_gone() -> Response:
    return Response(status_code=499)


# The generations the current HTTP request started (set by ReleaseGenerations per request).
_owned_generations: contextvars.ContextVar[list[Generation] | None] = contextvars.ContextVar(
    "flashlet_owned_generations", default=None)


class ReleaseGenerations:
    """ASGI middleware, the one owner of what a request holds in the engine: every generation
    an HTTP request started is aborted when its response ends, however it ends (an error at any
    stage after the submit, a handler bug, the client gone). A no-op for those that finished;
    so no path can leave samples counted in flight, queued or holding KV pages."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        owned: list[Generation] = []
        token = _owned_generations.set(owned)
        try:
            await self.app(scope, receive, send)
        finally:
            _owned_generations.reset(token)
            for gen in owned:
                gen.abort()
