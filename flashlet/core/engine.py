"""The engine: requests in, tokens out, one `step()` at a time.

A step is: schedule -> the runner applies the scheduler's update to its persistent batch and
builds the step's layout (batch.py) -> load it into the step buffers ->
backend.plan() -> model forward (backend.run_rope() in every layer) -> sample on the device ->
read the tokens -> `scheduler.update` (stop checks, pages, retiring) -> outputs. The engine
deals in token ids only: text and stop strings belong to the front end (detokenizer.py), which
ends a request on a stop string with `abort(request_id, finish_reason="stop")`.

Overlap (`EngineConfig.overlap`, on by default): `step()` launches step N on the device and
only then reads step N-1's tokens and does its bookkeeping, so the host's Python runs while the
GPU computes. Step N is scheduled before step N-1's tokens are known: each request that sampled
in step N-1 holds a placeholder as its newest token, its decode row in step N takes the real
token straight from step N-1's device tensor, and the host writes the value in when it reads
it. A request that stops on step N-1's token (EOS, a stop string) has run one row too many in
step N; that row's token is dropped. A request that reached max_new_tokens is not scheduled.
A step that sampled a grammar-constrained request is read before the next one is scheduled
(its next token mask needs the token; see structured.py).

Speculative decoding (`EngineConfig.speculative_config`, flashlet/spec/speculative.py): before
scheduling, the proposer guesses tokens for decoding requests; the scheduler gives such a row
its newest token and the guesses, and `verify` turns the step's logits into each request's
accepted tokens. A guess needs the newest token, so a step in flight is read before proposing;
but a step stays in flight while the caller takes the previous outputs, whether it has no
proposals or is a verify step of plain greedy requests (its rows' argmax tokens are verified
when read); a verify step with sampled rows is verified as it is launched. Speculation turns
off while more than disable_by_batch_size requests run.

Prompt logprobs (flashlet/runner/prompt_logprobs.py): a step with prompt positions of a request that
asked for them runs `forward_hidden`, which also returns the step's hidden states (never the
fused path: such a step has a prefill chunk); the scored rows' LM head, log-softmax and
top k run apart from the sampled rows, and their values reach the request before the step's
outputs are made. Steps without such rows do nothing more.

Tensor parallelism (`EngineConfig.tensor_parallel_size` > 1, see flashlet/distributed/parallel.py): this
engine is rank 0, the only one that schedules and samples; every step's batch update and input
ids go to the workers just before the forward. On the other ranks (spawned by rank 0, or started
by torchrun) the constructor returns an engine whose owner runs the worker loop on it
(`tp_worker.serve`; `LLM` and the server do so under torchrun). `shutdown()`, or the engine
being collected, stops the workers and leaves the process group, so another tensor-parallel
engine can start in the same process.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import logging
import time
import weakref
from pathlib import Path
from typing import Callable

import torch

from flashlet.config import EngineConfig
from flashlet.core.request import FinishReason, Request, RequestOutput
from flashlet.core.request_check import RequestLimits
from flashlet.core.sampling import SamplingParams, make_generator
from flashlet.core.scheduler import Scheduler, SchedulerOutput
from flashlet.core.warmup import warm_up
from flashlet.distributed import parallel, tp_worker
from flashlet.kernels import cute_precompile
from flashlet.kvcache.kv_pool import KVPool
from flashlet.models.model import ModelConfig
from flashlet.models.weights import model_config_path, model_from, ops_for
from flashlet.runner.fused_decode import FusedParts
from flashlet.runner.model_runner import CurrentStream, ModelRunner
from flashlet.runner.pooling import Pooler
from flashlet.runner.prompt_logprobs import PromptScoring
from flashlet.runner.sampler import Sampler, SamplerOutput, StepLogprobs
from flashlet.spec.speculative import (SpeculativeDecoding, advance_verified_grammars,
                                       all_plain_greedy, make_proposer, verify,
                                       verify_greedy)
from flashlet.text.structured import StructuredLimits, StructuredOutputs, advance_grammars

log = logging.getLogger("flashlet")

def settle_heap() -> float:
    """Collect start-up's garbage now and move everything still alive out of the collector's
    reach (gc.freeze), returning the seconds it took. Loading a model and warming it up leaves
    ~200k tracked objects (modules, compiled kernels, graphs); the first full collection would
    otherwise come in the middle of the first requests and stall one step for tens of ms
    (BENCHMARKS.md). An earlier engine's frozen objects are unfrozen first,
    so engines built one after another in a process do not pin each other's garbage."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - started


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig(), fused_parts: FusedParts | None = None):
        """fused_parts: name the fused decode path's parts on or off (tests, measurements);
        by default each is on where it applies."""
        started = time.perf_counter()
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        if config.device and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but CUDA is not available")
        self.tp = None
        if config.tensor_parallel_size > 1:
            self.tp = parallel.start(config, self.device,
                                     ModelConfig.from_file(model_config_path(config)),
                                     functools.partial(tp_worker.worker_main, type(self)))
        if self.tp is not None:
            self.device = self.tp.device  # this rank's GPU
        elif config.fused_decode is not False:  # a first start's CuTe compile workers, importing
            cute_precompile.prestart(config, self.device)  # while the weights load
        ops = ops_for(config, self.device)
        self.model, self.tokenizer, self.model_dir = model_from(
            config.config, config.model, self.device, self.dtype, config.weights_seed, ops=ops,
            tp=self.tp, quantization=config.quantization)
        self.model_config = cfg = self.model.config
        self.max_model_len = min(config.max_model_len or cfg.max_context_len, cfg.max_context_len)
        if cfg.sliding_window and cfg.sliding_window == cfg.max_context_len:
            log.info("context capped at the sliding window, %d tokens (there the window attends "
                     "to every token: exact)", cfg.sliding_window)
        self.kv_pool = KVPool(cfg.num_layers, self._num_pages(), config.page_size,
                              self.model.local.num_kv_heads, cfg.head_dim, self.dtype,
                              self.device, cache_dtype=config.resolved_kv_cache_dtype(),
                              fused_rope=config.fused_ops and self.device.type == "cuda")
        self.scheduler = Scheduler(self.kv_pool.allocator, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_cache,
                                   self._eos_ids(), config.max_decode_step_tokens,
                                   config.scheduling_policy)
        self.sampler = Sampler(self.device, self.eos_token_ids)
        self.structured = (StructuredOutputs(self.tokenizer, cfg.vocab_size, self.eos_token_ids,
                                             limits=StructuredLimits.of(config))
                           if self.tokenizer is not None else None)
        max_pages_per_seq = -(-self.max_model_len // config.page_size)
        self.runner = ModelRunner(self.model, self.kv_pool, config, self.device, max_pages_per_seq,
                                  fused_parts)
        cute_precompile.release_prestarted()  # those the fused path's plans did not take
        # What runs, not what was asked: the fused path's auto (None) resolved by the runner.
        self.config = config.replace(fused_decode=self.runner.fused is not None)
        spec = config.speculative_config
        self.spec = (SpeculativeDecoding(spec, make_proposer(spec, self))
                     if spec is not None else None)
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs of aborts, sent with the next step
        self._held: dict[int, list[Request]] = {}  # request id -> samples waiting for its prompt
        self.pooler = Pooler()  # embedding requests (SamplingParams.pooling)
        self._in_flight: LaunchedStep | None = None  # launched, tokens not read yet (overlap)
        self._scoring: set[Request] = set()  # requests whose prompt logprobs are not all in
        # A greedy verify step stages a token for each of its query rows (its token and proposals).
        rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        self._token_buffers = [TokenBuffer(rows, self.device, self.runner.current_stream)
                               for _ in range(2)]
        self.num_steps = 0
        self._step_observers: list = []  # fn(meta, logits) after each forward (tests, tools)
        # A function, not a method: the finalizer must not keep the engine alive.
        self._group_finalizer = (weakref.finalize(self, _release_group, self.runner, self.tp)
                                 if self.tp is not None else None)
        self.start_report = self._warm_up(time.perf_counter() - started)
        if self.tp is None:  # later starts of this configuration start no workers ahead
            cute_precompile.mark_started(config, self.device)

    def _warm_up(self, load_s: float) -> dict:
        """Compile every kernel variant and capture every graph now, not in the first requests
        (flashlet/core/warmup.py); returns the start time split into load / warm-up / capture.
        Under tensor parallelism the warm-up's synthetic steps would bypass the step channel
        to the workers, so it is skipped there (graphs are then captured on first use)."""
        report = {"load_s": load_s, "warmup_s": 0.0, "capture_s": 0.0, "warmed_up": False}
        if self.config.warmup_at_start and self.device.type == "cuda" and self.tp is None:
            report.update(warm_up(self), warmed_up=True)
            if self.spec is not None:
                self.spec.proposer.warm_up()
        if self.device.type == "cuda":
            report["gc_s"] = settle_heap()
        log.info("engine start: load %.2f s, warm-up %.2f s, graph capture %.2f s (backend %s)",
                 report["load_s"], report["warmup_s"], report["capture_s"], self.backend_name)
        return report

    @property
    def backend_name(self) -> str:
        """The attention backend that runs (what "auto" resolved to): one name, or the step
        backend's and the decode backend's where they differ."""
        prefill, decode = self.runner.backend.name, self.runner.decode_backend.name
        return prefill if prefill == decode else f"{prefill} (prefill) + {decode} (decode)"

    def use_tokenizer(self, tokenizer) -> None:
        """Give a model built without one (random weights) a tokenizer, which structured output
        needs (its grammars are compiled against the vocabulary)."""
        self.tokenizer = tokenizer
        self.structured = StructuredOutputs(tokenizer, self.model_config.vocab_size,
                                            self.eos_token_ids,
                                            limits=StructuredLimits.of(self.config))

    # ---- requests in ----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: int | None = None, after: int | None = None,
                    group: object = None, checked: bool = False) -> int:
        """Queue a request (under `request_id` if given, else a fresh id); raises ValueError
        (allocating nothing) if it can never run or the id is in use.

        `after`: another sample of the same prompt (n > 1). This one is held until that request
        has computed the prompt (its first output), so it finds the prompt's pages in the
        prefix cache instead of computing them again. `group`: the client request it belongs
        to (the scheduler lets groups take turns with their prompts; None: the common one).
        `checked`: `prompt` is a list that `encode` returned, so its ids are not checked again
        (LLM.generate checks every prompt before it queues any: a second pass over a 30,000-token
        prompt cost ~1 ms of a cached prompt's call)."""
        params = params or SamplingParams()
        token_ids = prompt if checked else self.encode(prompt)
        self.check_request(len(token_ids), params)
        if request_id is None:
            request_id = next(i for i in self._ids if not self._id_in_use(i))
        elif self._id_in_use(request_id):
            raise ValueError(f"request id {request_id} is in use")
        # The sampling kernel keys a seeded request's noise by its seed and position instead.
        generator = None if self.sampler.use_kernel else make_generator(params, self.device)
        req = Request(request_id, token_ids, params, generator, group=group)
        if params.is_constrained:
            req.grammar = self.structured.matcher(params.response_format)
        if params.logprobs is not None:
            req.output_logprobs = []
        if params.pooling is not None:
            self.pooler.add(request_id, params.pooling)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first token has no context to score it
            self._scoring.add(req)
        leader = self.scheduler.requests.get(after) if after is not None else None
        if leader is not None and not leader.output_token_ids:
            self._held.setdefault(after, []).append(req)
        else:
            self.scheduler.add(req)
        return request_id

    def _id_in_use(self, request_id: int) -> bool:
        return request_id in self.scheduler.requests or any(
            r.request_id == request_id for held in self._held.values() for r in held)

    def _release_held(self, outputs: list[RequestOutput]) -> None:
        """Queue the samples held for a request that has computed its prompt (or ended)."""
        for out in outputs:
            for req in self._held.pop(out.request_id, ()):
                self.scheduler.add(req)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError if a request of this size could never run (a last defensive check:
        LLM and the server check first, with the same `request_check` rules)."""
        params.validate()
        if params.priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: {params.priority} needs the priority scheduling "
                             "policy (--scheduling-policy priority)")
        if params.prompt_logprobs is not None and self.tp is not None:
            raise ValueError("prompt_logprobs is not supported under tensor parallelism (the "
                             "workers would need the extra LM-head rows too)")
        if params.is_constrained:
            if self.structured is None:
                raise ValueError("response_format needs a model with a tokenizer")
            if params.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a response_format: "
                                 "the grammar ends the output")
            self.structured.compile(params.response_format)  # ValueError if invalid; cached
        limits = RequestLimits.of_engine(self)
        limits.check_stop_token_ids(params)
        limits.check_fits(num_prompt_tokens, params.max_new_tokens)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids, not text")
            token_ids = list(self.tokenizer.encode(prompt))  # (a tokenizer passed in may give a tuple)
            if not token_ids:
                raise ValueError("prompt encodes to no tokens")
            # Its ints are checked against the vocabulary too: a tokenizer can hold ids the
            # embedding does not.
            return RequestLimits.of_engine(self).check_prompt_ids(token_ids, typed=True)
        return RequestLimits.of_engine(self).check_prompt_ids(prompt)

    def abort(self, request_id: int, finish_reason: FinishReason | str = FinishReason.ABORT) -> bool:
        """End a request and free its pages now (with finish_reason "stop", as for a stop
        string the front end found, its full computed pages go to the prefix cache); its final
        output comes with the next step. False (a no-op) if it is unknown or finished."""
        if finish_reason not in (FinishReason.ABORT, FinishReason.STOP):
            raise ValueError(f"finish_reason must be 'abort' or 'stop', got {finish_reason!r}")
        finish_reason = FinishReason(finish_reason)
        output = self.scheduler.abort(request_id, finish_reason) or self._abort_held(request_id)
        if self.spec is not None:
            self.spec.release_finished([request_id])
        if output is None:
            log.info("abort of request %s is a no-op: unknown or already finished", request_id)
            return False
        self._pending.append(output)
        return True

    def _abort_held(self, request_id: int) -> RequestOutput | None:
        for held in self._held.values():
            for req in held:
                if req.request_id == request_id:
                    held.remove(req)
                    return RequestOutput(request_id, [], True, FinishReason.ABORT, req.prompt_token_ids,
                                         token_ids=[])
        return None

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending)
                or self._in_flight is not None or any(self._held.values()))

    def take_pending(self) -> list[RequestOutput]:
        """The outputs waiting for the next step (an abort's final one: a stop string's), now,
        as that step would hand them over: for a caller done with its requests (LLM.generate),
        so that whoever steps next gets none of them. A step still in flight (overlap launches
        one past a request's last token) stays for the next step: waiting for it here would
        cost the caller a step of latency for a row whose token is dropped anyway."""
        outputs, self._pending = self._pending, []
        return self._hand_over(outputs)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the previous one (overlap) or this one."""
        if self.tp is None:
            return self._step()
        self.tp.check()  # a worker died: every later step fails the same way
        try:
            return self._step()
        except Exception as e:
            failure = self.tp.failure_from(e)
            if failure is None:
                raise
            raise failure from e

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group (a no-op on one device; also
        done when the engine is collected)."""
        if self._group_finalizer is not None:
            self._group_finalizer()

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        previous, self._in_flight = self._in_flight, None
        speculating = self.spec is not None and self.spec.active(len(self.scheduler.running))
        if previous is not None and (previous.constrained or speculating or previous.verifying):
            # A grammar's next mask needs the token in flight (see structured.py), and so does
            # a proposal; a verify step's rows feed no next step: the step in flight is read
            # before this one is scheduled.
            outputs += self._finish(previous)
            previous = None
        proposals = self.spec.propose(self.scheduler.running) if speculating else None
        sched = self.scheduler.schedule(proposals)
        launched = self._launch(sched, previous) if sched.scheduled else None
        if previous is not None:
            outputs += self._finish(previous)
        if launched is not None:
            # A step stays in flight while the caller takes the previous outputs, but one whose
            # verification read the device already (sampled rows: _launch).
            if self.config.overlap and launched.verified is None:
                self._in_flight = launched
            else:
                outputs += self._finish(launched)
        if self.spec is not None:
            self.spec.release_finished([r.request_id for r in sched.preempted])
        return self._hand_over(outputs)

    def _hand_over(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """What every batch of outputs goes through on its way out: the finished requests'
        speculation state released, held samples whose first one is done released, pooled
        embeddings attached."""
        if self.spec is not None:
            self.spec.release_finished([out.request_id for out in outputs if out.finished])
        if self._held:
            self._release_held(outputs)
        if self.pooler.modes:
            self.pooler.attach(outputs)
        return outputs

    def _launch(self, sched: SchedulerOutput, previous: "LaunchedStep | None") -> "LaunchedStep":
        """Run the model and sample on the device; nothing here waits for the device."""
        layout = self.runner.prepare(sched.batch_update)
        # Decode rows whose input is the previous step's token take it from the device.
        fed = previous.tokens if previous is not None else None
        input_ids, meta = self.runner.load(layout, fed)
        if self.tp is not None:  # the workers apply the same update to their batches
            self.tp.send_step(sched.batch_update, input_ids)
        pooling = self.pooler.wants(sched)
        scoring = PromptScoring.of(sched.scheduled) if self._scoring_prompts else None
        wants_hidden = pooling or scoring is not None
        verifying = bool(sched.proposals)
        if verifying and not wants_hidden:
            tokens = self._greedy_tokens(sched, input_ids, meta)
            if tokens is not None:  # every row plain greedy: the argmax epilogue decides
                return self._launched_verify(sched, scoring, tokens=tokens)
        sampled = (None if wants_hidden or verifying
                   else self._greedy_decode(sched, input_ids, meta))
        if sampled is None:
            if wants_hidden:  # embedding rows and scored prompt rows read the hidden states
                hidden, logits = self.runner.forward_hidden(input_ids, meta)
                if pooling:
                    self.pooler.pool(sched, hidden)
                if scoring is not None:
                    scoring.compute(self.model, hidden[scoring.row_tensor(self.device)])
            else:
                logits = self.runner.forward(input_ids, meta)
            for observe in self._step_observers:
                observe(meta, logits)
            if verifying:
                if all_plain_greedy(sched.sampling):  # each row's argmax decides, read later
                    return self._launched_verify(sched, scoring, tokens=logits.argmax(dim=-1))
                verified = verify(logits, sched.sampling, sched.proposals, self.eos_token_ids)
                return self._launched_verify(sched, scoring, verified=verified)
            sampled = self.sampler.sample(logits, sched.sampling, self.runner.batch)
        self.scheduler.on_launch(sched)
        buffer = self._token_buffers[self.num_steps % 2]
        self.num_steps += 1
        return LaunchedStep(sched, sampled, buffer.stage(sampled.tokens), scoring)

    def _launched_verify(self, sched: SchedulerOutput, scoring: PromptScoring | None,
                         tokens: torch.Tensor | None = None,
                         verified: list | None = None) -> "LaunchedStep":
        """A verify step: its rows' argmax `tokens` on their way to the host (verified when
        read), or its requests' results decided already (`verified`)."""
        # Tokens were sampled outside the sampler: its penalty rows and seeded positions are
        # rebuilt from the requests' tokens when it next samples.
        self.sampler.forget()
        self.scheduler.on_launch(sched)
        # tokens: one per sampled row, each sampling request's token and proposals
        staged = self._token_buffers[self.num_steps % 2].stage(tokens) if tokens is not None else None
        self.num_steps += 1
        return LaunchedStep(sched, None, staged, scoring, verified, verifying=True)

    @property
    def _scoring_prompts(self) -> bool:
        """Does a request still score its prompt (the steps of others skip the look)."""
        if self._scoring:
            self._scoring = {r for r in self._scoring if not r.is_finished
                             and len(r.prompt_logprobs) < r.num_prompt_tokens}
        return bool(self._scoring)

    def _greedy_decode(self, sched: SchedulerOutput, input_ids, meta) -> SamplerOutput | None:
        """A pure-decode step whose requests are all plain greedy takes their tokens from the
        argmax at the end of its graph (the fused path's LM head epilogue, or the per-op graph's
        argmax of the bf16 logits: `runner.greedy_tokens`); None where that does not apply
        (observers want logits; the sampler has work to do; a step no such graph serves)."""
        tokens = self._greedy_tokens(sched, input_ids, meta)
        return None if tokens is None else SamplerOutput(tokens, {}, None)

    def _greedy_tokens(self, sched: SchedulerOutput, input_ids, meta) -> torch.Tensor | None:
        """Each row's argmax token, no logits kept, where every request is plain greedy and no
        observer wants logits: from the fused path (a decode step, or a verify step loaded as
        decode rows) or a per-op decode graph (`runner.greedy_tokens`)."""
        if self._step_observers:
            return None
        if not all_plain_greedy(sched.sampling):
            return None
        return self.runner.greedy_tokens(input_ids, meta)

    def _finish(self, launched: "LaunchedStep") -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for the device) and update its requests."""
        if launched.verifying:
            if launched.scoring is not None:
                launched.scoring.deliver()
            sched = launched.sched
            verified = launched.verified
            if verified is None:  # plain greedy rows (no grammar to advance): their argmax, read now
                verified = verify_greedy(launched.staged.read(), sched.sampling, sched.proposals)
            else:
                verified = advance_verified_grammars(sched.sampling, verified, self.eos_token_ids,
                                                     self.model_config.vocab_size)
            self.spec.accepted(sched.proposals, sched.sampling, verified)
            return self.scheduler.update(sched, verified)
        tokens = launched.read()
        if launched.errors:  # a row whose sampling failed gets its error instead of a token
            tokens = [launched.errors.get(row, v) for row, v in enumerate(tokens)]
        if launched.constrained:
            advance_grammars(launched.sched.sampling, tokens, self.model_config.vocab_size)
        if launched.scoring is not None:  # before the outputs, which carry them
            launched.scoring.deliver()
        return self.scheduler.update(launched.sched, tokens, launched.logprobs)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a request (unless ignore_eos); the scheduler applies them."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.scheduler.eos_token_ids = frozenset(ids)
        self.sampler.eos_token_ids = sorted(ids)  # min_tokens keeps them from being sampled

    @property
    def device_wait_s(self) -> float:
        """Seconds the host has spent blocked on the device reading steps' tokens (cumulative):
        a loop whose steps show about none of it is paced by its host (the next step launches
        when the host gets to it); one whose steps wait most of their time, by the device. The
        waits that a step's other reads make (a sampled verify step's, prompt logprobs') are
        not in it."""
        return sum(buffer.wait_s for buffer in self._token_buffers)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.scheduler.check_batch(self.runner.batch)

    def observe_steps(self, fn) -> Callable[[], None]:
        """Call fn(meta, logits) after each step's forward pass (logits: the sampled rows',
        not to be changed); returns a function that stops it. For tests and tools."""
        self._step_observers.append(fn)
        return lambda: self._step_observers.remove(fn)

    def reset_prefix_cache(self) -> int:
        """Free every prefix-cache page no request uses; returns how many were freed."""
        return self.scheduler.cache.reset()

    def num_decoding(self) -> int:
        """Running requests whose next step is a decode (one token to compute)."""
        return sum(r.num_tokens_to_compute == 1 for r in self.scheduler.running)

    def stats(self) -> dict:
        cache = self.scheduler.cache
        return {
            "requests": len(self.scheduler.requests),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": self.kv_pool.num_pages,
            "kv_tokens_total": self.kv_pool.num_tokens,
            "kv_pool_bytes": self.kv_pool.num_bytes,
            "kv_cache_dtype": str(self.kv_pool.dtype).removeprefix("torch."),
            "kv_pages_used": self.kv_pool.allocator.num_used,
            "kv_pages_cached": cache.num_pages,
            "prefix_cache_hit_rate": cache.hit_tokens / max(cache.queried_tokens, 1),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "cuda_graphs": len(self.runner.graphs),
            **(self.spec.stats.as_dict() if self.spec is not None else {}),
        }

    def context_note(self) -> str:
        """Added to context-overflow errors: why max_model_len is what it is, if not obvious."""
        window = self.model_config.sliding_window
        if window and self.max_model_len == window:
            return (" (capped at the model's sliding window: longer sequences would need "
                    "sliding-window attention, which flashlet does not implement)")
        return ""

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_cfg = self.model_dir and Path(self.model_dir) / "generation_config.json"
        if gen_cfg and gen_cfg.exists():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    def _num_pages(self) -> int:
        cfg, c = self.model_config, self.config
        if c.max_num_pages is not None:
            return c.max_num_pages
        per_page = KVPool.bytes_per_page(cfg.num_layers, c.page_size,
                                         self.model.local.num_kv_heads, cfg.head_dim,
                                         c.resolved_kv_cache_dtype())
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = round_pool_budget(free * c.gpu_memory_utilization)
        else:
            budget = c.kv_memory_gb * 2**30
        # Never more than every sequence at full length needs.
        cap = c.max_num_seqs * -(-self.max_model_len // c.page_size)
        num_pages = max(1, min(int(budget // per_page), cap))
        if self.tp is not None:  # page ids are shared: every rank's pool must hold them all
            num_pages = self.tp.agree_min(num_pages)
        return num_pages


POOL_BUDGET_STEP = 256 * 2**20  # bytes: see round_pool_budget


def round_pool_budget(budget: float) -> float:
    """A KV budget taken from free GPU memory, rounded down to whole POOL_BUDGET_STEPs (when it
    holds at least 8 of them: under 0.4% lost, never a small GPU's whole pool), so that a
    process gets the same page count as the last one although free memory moves by a few MB.
    The fused path's compiled GEMVs are keyed on the pool's size (their RoPE epilogue writes
    into it), and only an unchanged size finds them in cute_disk_cache."""
    if budget < 8 * POOL_BUDGET_STEP:
        return budget
    return budget - budget % POOL_BUDGET_STEP


def _release_group(runner: ModelRunner, tp) -> None:
    runner.graphs.clear()  # captured collectives go before their communicator
    tp.shutdown()


class TokenBuffer:
    """Pinned host memory that a step's sampled tokens are copied into without blocking, and the
    event that says the copy is done. The engine alternates two: with overlap, one step's tokens
    are read while the next step's copy is queued. On the CPU too the tokens are copied: a step's
    token tensor may be a buffer the next step writes again (the fused path's argmax output)."""

    def __init__(self, size: int, device: torch.device, stream: CurrentStream | None):
        """stream: the runner's reader of the current stream, which the copy's event records
        on (None off CUDA)."""
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=on_cuda)
        self.count = 0
        self.event = torch.cuda.Event() if on_cuda else None
        self.stream = stream
        self.wait_s = 0.0  # the host's time blocked in read() on the copy (seconds, cumulative)

    def stage(self, tokens: torch.Tensor) -> "TokenBuffer":
        self.count = tokens.numel()  # what `read` returns unless told fewer
        self.host[: self.count].copy_(tokens, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record(self.stream())
        return self

    def read(self, n: int | None = None) -> list[int]:
        if self.event is not None:
            t = time.perf_counter()
            self.event.synchronize()
            self.wait_s += time.perf_counter() - t
        return self.host[: self.count if n is None else n].tolist()


class LaunchedStep:
    """A step on its way through the device: what ran, who samples, and where their tokens
    will be."""

    def __init__(self, sched: SchedulerOutput, sampled: SamplerOutput | None,
                 staged: TokenBuffer | None, scoring: PromptScoring | None = None,
                 verified: list | None = None, verifying: bool = False):
        self.scoring = scoring  # its prompt-logprob rows, if any
        self.sched = sched  # its `sampling` requests sample, in row order
        # A verify step: its results (speculative.Verified per sampling row) where they were
        # decided at launch, else its rows' argmax tokens are `staged`. It has no sampled
        # tensor, so no step takes its tokens: it is read before the next step is scheduled.
        self.verifying = verifying
        self.verified = verified
        self.tokens = sampled.tokens if sampled else None  # [len(sampling)]: next step's inputs
        self.staged = staged
        self.errors = sampled.errors if sampled else {}
        self.logprobs: StepLogprobs | None = sampled.logprobs if sampled else None
        self.constrained = sampled.constrained if sampled else False

    def read(self) -> list[int]:
        return self.staged.read(len(self.sched.sampling))
