"""The in-process workloads. Each drives an Engine through `add_request` / `step` and returns
a JSON-ready dict; timings wrap `engine.step()`, which returns once the host holds the tokens
it reports (no extra device synchronize per step: that would undo the engine's overlap).

- closed-loop: N clients; when a client's request finishes it sends its next one before the
  next step. Per concurrency level: output tok/s, req/s, TTFT (queue wait included), ITL, step.
- decode-sat: B sequences prefilled, then only the pure-decode steps are timed (steady state);
  beside it, first, the end-to-end figure a user gets: T(D + 1 new tokens) - T(1 new token) of
  the same batch through add_request/step, from submission to the last token.
- single: one stream; decode tok/s against the memory-bandwidth limit (copy bandwidth measured
  here, on the same device), and end to end (submission to the last token).
- offline: every request submitted at once (nano-vllm's throughput workload): the first run
  straight after Engine start (no bench warm-up), then a repeat with fresh prompts.
- closed-loop: its figures are end to end already (first submission to the last token).
- long-prompt-gaps: N streams decoding while M long prompts arrive at once: the
  streams' token gaps (ITL) while the prompts are prefilled, against a pure-decode window
  before they arrive, and the long prompts' TTFT.
- scheduler: CPU cost of `scheduler.schedule()` + the step layout (`InputBatch.apply`,
  `StepBuffers.load`) for one step, no forward.
- kernels: `flashlet.kernels.bench.run_kernel_sweep`.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from flashlet.bench.common import (
    NO_PROGRESS,
    Progress,
    Spec,
    copy_bandwidth,
    cpu_shares,
    gap_figures,
    machine_cpu,
    make_specs,
    now,
    samples,
    summarize,
    synchronizer,
)
from flashlet.bench.engines import TINY_SCHED_CONFIG, hf_config_dict
from flashlet.bench.trace import Trace
from flashlet.config import EngineConfig
from flashlet.core.request import Request
from flashlet.core.sampling import SamplingParams
from flashlet.core.scheduler import Scheduler, prompt_tokens_beside
from flashlet.kvcache.kv_pool import PageAllocator
from flashlet.models.model import ModelConfig
from flashlet.runner.batch import InputBatch, StepBuffers

WARMUP_STREAM = 10_007  # token-content stream of warm-up prompts (never reused by a workload)
REPEAT_STREAM = 20_011  # offline's repeat: fresh prompts, same lengths
E2E_STREAMS = (20_021, 20_022)  # decode-sat's end-to-end runs: 1 new token, then D + 1


# ---- the engine loop -----------------------------------------------------------------------
def run_engine(engine, specs: list[Spec], concurrency: int, task=None, params=None) -> Trace:
    """Closed loop over `specs` with `concurrency` clients (len(specs) clients = all at once);
    params(max_new_tokens) -> SamplingParams (default: greedy, ignore_eos).

    A request's TTFT runs from its submission (so it includes time spent waiting to be
    scheduled) to the end of the step that produced its first token."""
    sync = synchronizer(engine.device)
    n = len(specs)
    trace = Trace(requested=[s.max_new_tokens for s in specs], prompt_lens=[s.prompt_len for s in specs])
    index_of: dict[int, int] = {}
    next_i = 0

    def submit(t: float) -> None:
        nonlocal next_i
        s = specs[next_i]
        rid = engine.add_request(s.prompt, params(s.max_new_tokens) if params is not None else
                                 SamplingParams(max_new_tokens=s.max_new_tokens, ignore_eos=True))
        index_of[rid] = next_i
        trace.submit[next_i] = t
        next_i += 1

    preempt0 = engine.stats()["num_preemptions"]
    done = 0
    sync()
    wait0, cpu0 = engine.device_wait_s, machine_cpu()
    trace.start = now()
    for _ in range(min(concurrency, n)):
        submit(trace.start)
    while done < n:
        if not engine.has_unfinished():
            raise RuntimeError(f"the engine went idle with {n - done} requests unfinished")
        t0 = now()
        outs = engine.step()  # returns once the host has read the tokens it reports
        t1 = now()
        trace.step_s.append(t1 - t0)
        for out in outs:
            i = index_of.get(out.request_id)
            if i is None:
                continue
            if out.finish_reason in ("abort", "error"):
                raise RuntimeError(f"request {out.request_id} failed: {out.error or out.finish_reason}")
            trace.token_times[i].extend([t1] * len(out.new_token_ids))
            if out.finished:
                trace.outputs[i] = list(out.token_ids)
                done += 1
                if task is not None:
                    task.advance()
                if next_i < n:
                    submit(t1)
    trace.end = now()
    trace.num_preemptions = engine.stats()["num_preemptions"] - preempt0
    # Of each step's time, the mean the host spent blocked on the device reading tokens
    # (Engine.device_wait_s): near the step's time, the device paces the loop; near 0, the host.
    trace.extra["device_wait_ms"] = (engine.device_wait_s - wait0) * 1e3 / max(len(trace.step_s), 1)
    trace.extra["machine_cpu"] = cpu_shares(cpu0, machine_cpu())  # what else ran beside it
    return trace


def warmup(engine, batch: int, prompt_len: int, seed: int) -> None:
    """Run a small untimed batch through every code path first (allocator, kernels, Triton
    compilation). Output lengths 2, 3, ..., batch + 1 make the decode batch shrink one by one
    from `batch` to 1, so that the CUDA graphs captured per (padded) decode batch size exist
    before the timed run rather than being captured inside it."""
    batch = max(1, min(batch, engine.config.max_num_seqs))
    specs = make_specs(batch, (prompt_len, prompt_len), (2, 2), engine.model_config.vocab_size,
                       seed, stream=WARMUP_STREAM)
    for i, s in enumerate(specs):
        s.max_new_tokens = 2 + i
    run_engine(engine, specs, len(specs))


def check_counts(trace: Trace, what: str) -> None:
    """ignore_eos makes lengths exact: every request must get exactly what it asked for."""
    for i, (want, got) in enumerate(zip(trace.requested, trace.outputs)):
        if got is None or len(got) != want:
            raise RuntimeError(f"{what}: request {i} got {None if got is None else len(got)} "
                               f"tokens, asked for {want}")


# ---- closed loop ---------------------------------------------------------------------------
def level_specs(args, vocab: int, level: int) -> list[Spec]:
    """The requests of concurrency level `level` (index): same lengths, fresh tokens."""
    return make_specs(args.level_requests[level], tuple(args.prompt_len_range),
                      tuple(args.output_len_range), vocab, args.seed, stream=level + 1)


def closed_loop(engine, args, progress: Progress = NO_PROGRESS) -> dict:
    vocab = engine.model_config.vocab_size
    levels, outputs = [], {}
    for li, c in enumerate(args.concurrency):
        specs = level_specs(args, vocab, li)
        if args.warmup:
            warmup(engine, min(c, len(specs)), min(16, args.prompt_len_range[0]), args.seed + li)
        task = progress.task(f"closed-loop c={c}", len(specs))
        trace = run_engine(engine, specs, c, task)
        check_counts(trace, f"closed-loop c={c}")
        outputs[c] = trace.outputs
        levels.append({"concurrency": c, **trace.metrics()})
    return {"levels": levels, "_outputs": outputs}


# ---- decode saturation ---------------------------------------------------------------------
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                  "frequency_penalty", "repetition_penalty")


def sampling_params(args, max_new_tokens: int) -> SamplingParams:
    """A request's sampling from the bench's --temperature etc. (greedy when none is given);
    ignore_eos keeps the lengths exact."""
    chosen = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k, None) is not None}
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **chosen)


def decode_sat_margin(args) -> int:
    """Extra output tokens per sequence beyond the timed decode steps: the steps it may decode
    while the rest of the batch is still being prefilled (chunked prefill, at the fewest prompt
    tokens a step beside decodes may carry), plus slack."""
    B, budget = args.decode_batch, args.max_num_batched_tokens
    cap = args.max_decode_step_tokens or budget
    per_step = min(min(prompt_tokens_beside(n, cap), budget - n) for n in range(1, B + 1))
    return math.ceil(B * args.decode_prompt_len / max(per_step, 1)) + 8


def decode_end_to_end(engine, B: int, P: int, D: int, seed: int, progress: Progress = NO_PROGRESS,
                      params=None) -> dict:
    """What a user gets from D decode steps of B sequences: T(D + 1 new) - T(1 new), each the
    wall clock from submitting the batch to its last token (fresh prompts each, so no prefix
    hits); whatever happens between prefill and steady decoding (graph captures, kernels
    compiled on first use, the ramp) is inside it, as it is for a user."""
    vocab = engine.model_config.vocab_size
    times, steps = [], []
    for stream, new in zip(E2E_STREAMS, (1, D + 1)):
        specs = make_specs(B, (P, P), (new, new), vocab, seed, stream=stream)
        trace = run_engine(engine, specs, B, progress.task(f"decode-sat end to end, {new} new", B),
                           params)
        check_counts(trace, f"decode-sat end to end ({new} new)")
        times.append(trace.duration)
        steps.append([round(t * 1e3, 3) for t in trace.step_s])
    t1, tn = times
    # Where T(D + 1) went, step by step: the slow ones say what a user waits for beyond the
    # steady steps (a collection, a compile, a plan, the prefill ramp).
    slowest = sorted(range(len(steps[1])), key=steps[1].__getitem__, reverse=True)[:6]
    return {"t_1_new_s": t1, "t_new_s": tn, "new_tokens": D + 1,
            "decode_tok_s": B * D / (tn - t1) if tn > t1 else None,
            "steps_ms": {"t_1_new": steps[0], "t_new": steps[1]},
            "slowest_steps_ms": [(i, steps[1][i]) for i in sorted(slowest)]}


def decode_sat(engine, args, progress: Progress = NO_PROGRESS) -> dict:
    B, P, D = args.decode_batch, args.decode_prompt_len, args.decode_tokens
    vocab = engine.model_config.vocab_size
    sync = synchronizer(engine.device)
    # First, before any bench warm-up: the end-to-end figure, as a fresh engine gives it.
    end_to_end = decode_end_to_end(engine, B, P, D, args.seed, progress,
                                   params=lambda n: sampling_params(args, n))
    if args.warmup:
        warmup(engine, B, min(P, 16), args.seed)
    specs = make_specs(B, (P, P), (D + decode_sat_margin(args),) * 2, vocab, args.seed, stream=1)
    ids = [engine.add_request(s.prompt, sampling_params(args, s.max_new_tokens)) for s in specs]
    preempt0 = engine.stats()["num_preemptions"]

    def all_decoding() -> bool:
        return engine.stats()["waiting"] == 0 and engine.num_decoding() == B

    # Phase 1 (untimed): prefill every sequence.
    sync()
    t0 = now()
    prefill_steps = 0
    while not all_decoding():
        if not engine.has_unfinished() or prefill_steps > 100_000:
            raise RuntimeError("decode-sat: the batch never reached pure decode")
        for out in engine.step():
            if out.finished:
                raise RuntimeError("decode-sat: a sequence finished during prefill (margin too small)")
        prefill_steps += 1
    engine.step()  # one untimed decode step: with overlap, it delivers the last prefill's tokens
    sync()
    prefill_s = now() - t0
    # Phase 2 (timed): D pure-decode steps of the whole batch. Each step() returns once the
    # host has read a whole step's tokens (with overlap: the step before the one it launches).
    task = progress.task(f"decode-sat B={B}", D)
    step_s, tokens = [], 0
    wait0, cpu0 = engine.device_wait_s, machine_cpu()
    for _ in range(D):
        t0 = now()
        outs = engine.step()
        step_s.append(now() - t0)
        got = sum(len(o.new_token_ids) for o in outs)
        if got != B or any(o.finished for o in outs):
            raise RuntimeError(f"decode-sat: a decode step returned {got} tokens for {B} sequences")
        tokens += got
        task.advance()
    wait, cpu = engine.device_wait_s - wait0, cpu_shares(cpu0, machine_cpu())
    for rid in ids:  # the margin tokens are not needed
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    total = sum(step_s)
    e2e = end_to_end["decode_tok_s"]
    end_to_end["over_steady"] = e2e * total / tokens if e2e else None
    return {
        "end_to_end": end_to_end,
        "batch": B, "prompt_len": P, "decode_steps": D, "decode_tokens": tokens,
        "decode_tokens_requested": B * D, "decode_time_s": total,
        "decode_tok_s": tokens / total, "ms_per_step": total / D * 1e3,
        "step_ms": summarize(step_s, 1e3), "prefill_steps": prefill_steps, "prefill_s": prefill_s,
        "device_wait_ms": wait / D * 1e3,  # of each timed step, blocked on the device (as run_engine's)
        "machine_cpu": cpu,
        "num_preemptions": engine.stats()["num_preemptions"] - preempt0,
        "samples": {"step_ms": samples(step_s, 1e3)},
    }


# ---- decode token gaps while long prompts arrive -------------------------------------------
def gap_stream_tokens(args, config) -> int:
    """Output tokens each decoding stream needs to outlast the long prompts' prefill: its own
    prefill steps, the baseline window, and the prefill steps of the long prompts at the
    prompt tokens a step with N decodes may carry (the scheduler's rule), doubled for slack."""
    per_step = prompt_tokens_beside(args.gap_streams, config.max_decode_step_tokens)
    prefill_steps = math.ceil(args.gap_long_prompts * args.gap_long_prompt_len / per_step)
    own = math.ceil(args.gap_streams * args.gap_stream_prompt_len / config.max_num_batched_tokens)
    return own + args.gap_baseline_steps + 2 * prefill_steps + 16


class _GapRecorder:
    """engine.step() with the time each stream's token and each long prompt's first token came."""

    def __init__(self, engine, stream_ids: list[int]):
        self.engine = engine
        self.stream_of = {rid: i for i, rid in enumerate(stream_ids)}
        self.token_times: list[list[float]] = [[] for _ in stream_ids]
        self.first_token: dict[int, float] = {}  # long prompt id -> time of its first token
        self.step_s: list[tuple[float, float]] = []  # (end time, duration)

    def step(self) -> None:
        t0 = now()
        outs = self.engine.step()
        t1 = now()
        self.step_s.append((t1, t1 - t0))
        for out in outs:
            if out.finish_reason in ("abort", "error"):
                raise RuntimeError(f"request {out.request_id} failed: {out.error or out.finish_reason}")
            i = self.stream_of.get(out.request_id)
            if i is not None:
                self.token_times[i].extend([t1] * len(out.new_token_ids))
                if out.finished:
                    raise RuntimeError("long-prompt-gaps: a stream finished inside the window "
                                       "(too few output tokens)")
            elif out.new_token_ids:
                self.first_token.setdefault(out.request_id, t1)

    def steps(self, start: float, end: float) -> list[float]:
        return [d for t, d in self.step_s if start < t <= end]


def long_prompt_gaps(engine, args, progress: Progress = NO_PROGRESS) -> dict:
    N, M, L = args.gap_streams, args.gap_long_prompts, args.gap_long_prompt_len
    vocab = engine.model_config.vocab_size
    if args.warmup:
        warmup(engine, N, 16, args.seed)
    streams = make_specs(N, (args.gap_stream_prompt_len,) * 2, (args.gap_stream_tokens,) * 2,
                         vocab, args.seed, stream=1)
    stream_ids = [engine.add_request(s.prompt, SamplingParams(max_new_tokens=s.max_new_tokens,
                                                              ignore_eos=True)) for s in streams]
    rec = _GapRecorder(engine, stream_ids)
    while engine.stats()["waiting"] or engine.num_decoding() < N:  # the streams' own prefill
        rec.step()
    rec.step()  # with overlap, this one delivers the last prefill's tokens (the first ones)
    baseline_start = now()
    for _ in range(args.gap_baseline_steps):
        rec.step()
    long_specs = make_specs(M, (L, L), (1, 1), vocab, args.seed, stream=2)
    arrival = now()
    long_ids = [engine.add_request(s.prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
                for s in long_specs]
    task = progress.task(f"long-prompt-gaps: {M} x {L} tokens beside {N} streams", M)
    while len(rec.first_token) < M:
        seen = len(rec.first_token)
        rec.step()
        for _ in range(len(rec.first_token) - seen):
            task.advance()
    end = max(rec.first_token.values())
    for rid in stream_ids:  # the tokens left are not needed
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    figures = gap_figures(rec.token_times, baseline_start, arrival, end,
                          [rec.first_token[rid] - arrival for rid in long_ids])
    return {**figures, "max_decode_step_tokens": engine.config.max_decode_step_tokens,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "window_steps": len(rec.steps(arrival, end)), "step_ms": summarize(rec.steps(arrival, end), 1e3)}


# ---- a single stream -----------------------------------------------------------------------
def bytes_per_token(engine, kv_len: float) -> dict:
    """Bytes one decode step of one sequence must read: every weight once (the embedding
    matrix only through the LM head when tied; one row of it otherwise) and the K/V of
    `kv_len` tokens."""
    cfg, model = engine.model_config, engine.model
    elem = next(model.parameters()).element_size()
    # fp8 weights (flashlet/models/quantization.py) are buffers: their codes and scales count too
    stored = [*model.parameters(), *(b for b in model.buffers() if b is not model.cos_sin_cache)]
    weights = sum(t.numel() * t.element_size() for t in stored)
    if not cfg.tie_word_embeddings:
        weights -= (cfg.vocab_size - 1) * cfg.hidden_size * elem
    kv_elem = engine.dtype.itemsize
    kv = 2 * cfg.num_layers * kv_len * cfg.num_kv_heads * cfg.head_dim * kv_elem
    return {"weights": int(weights), "kv": float(kv), "total": float(weights + kv),
            "kv_len_mean": kv_len, "param_dtype_bytes": elem}


def single(engine, args, progress: Progress = NO_PROGRESS) -> dict:
    P, T = args.single_prompt_len, args.single_tokens
    vocab = engine.model_config.vocab_size
    if args.warmup:
        warmup(engine, 1, min(P, 16), args.seed)
    bandwidth = copy_bandwidth(engine.device, args.bandwidth_mib)
    specs = make_specs(1, (P, P), (T, T), vocab, args.seed, stream=1)
    task = progress.task("single stream", 1)
    trace = run_engine(engine, specs, 1, task)
    check_counts(trace, "single")
    times = trace.token_times[0]
    result = single_figures(times, trace.submit[0], T, bytes_per_token(engine, P + T / 2), bandwidth)
    result.update(prompt_len=P, output_tokens=len(trace.outputs[0]), output_tokens_requested=T,
                  copy_bandwidth=bandwidth, num_steps=len(trace.step_s),
                  step_ms=summarize(trace.step_s, 1e3))
    # With --speculative-config: drafts, acceptance rate, mean accepted length.
    result.update({k: v for k, v in engine.stats().items() if k.startswith("spec_")})
    result["_outputs"] = {1: trace.outputs}
    return result


def single_figures(times: list[float], submit: float, T: int, nbytes: dict, bandwidth: dict) -> dict:
    """Decode tok/s (tokens 2..T over the time between the first and the last token) and the
    fraction of the copy-bandwidth limit it reaches."""
    decode_s = times[-1] - times[0]
    tok_s = (T - 1) / decode_s if decode_s > 0 else 0.0
    total_s = times[-1] - submit
    achieved = nbytes["total"] * tok_s / 1e9
    limit_tok_s = bandwidth["gb_per_s"] * 1e9 / nbytes["total"]
    itl = np.diff(times)
    return {
        "decode_tok_s": tok_s, "ms_per_token": 1e3 / tok_s if tok_s else None,
        "ttft_ms": (times[0] - submit) * 1e3, "decode_time_s": decode_s,
        "end_to_end_s": total_s, "end_to_end_tok_s": T / total_s if total_s > 0 else 0.0,
        "bytes_per_token": nbytes, "achieved_gb_per_s": achieved,
        "bandwidth_limit_tok_s": limit_tok_s,
        "fraction_of_bandwidth_limit": achieved / bandwidth["gb_per_s"],
        "itl_ms": summarize(itl, 1e3), "samples": {"itl_ms": samples(itl, 1e3)},
    }


# ---- offline batch -------------------------------------------------------------------------
def offline_specs(args, vocab: int) -> list[Spec]:
    return make_specs(args.num_requests, tuple(args.prompt_len_range),
                      tuple(args.output_len_range), vocab, args.seed, stream=1)


FIRST_RUN_KEYS = ("duration_s", "output_tok_s", "total_tok_s", "completed", "output_tokens",
                  "num_steps", "num_preemptions")


def offline(engine, args, progress: Progress = NO_PROGRESS) -> dict:
    """The first run comes straight after Engine start: no bench warm-up before it (--warmup
    does not apply), only what the engine does at start. The repeat, fresh prompts of the same
    lengths, is the steady figure (the top-level fields)."""
    vocab = engine.model_config.vocab_size
    specs = offline_specs(args, vocab)
    first = run_engine(engine, specs, len(specs), progress.task(f"offline {len(specs)} requests, first run", len(specs)))
    check_counts(first, "offline first run")
    repeat_specs = make_specs(args.num_requests, tuple(args.prompt_len_range), tuple(args.output_len_range),
                              vocab, args.seed, stream=REPEAT_STREAM)
    trace = run_engine(engine, repeat_specs, len(repeat_specs),
                       progress.task(f"offline {len(specs)} requests, repeat", len(specs)))
    check_counts(trace, "offline repeat")
    m = trace.metrics()
    m["total_time_s"] = m["duration_s"]
    f = first.metrics(keep_samples=False)
    m["first_run"] = {k: f[k] for k in FIRST_RUN_KEYS}
    m["first_over_repeat"] = f["output_tok_s"] / m["output_tok_s"] if m["output_tok_s"] else None
    m["_outputs"] = {len(specs): first.outputs}  # the prompts the peers run
    return m


# ---- the scheduler micro-benchmark ---------------------------------------------------------
def scheduler_bench(args, progress: Progress = NO_PROGRESS) -> dict:
    """CPU time of `scheduler.schedule()` + the step layout (`InputBatch.apply`, `StepBuffers.load`)
    per step, on a scheduler and step buffers of their own (no model, no forward pass; CPU
    tensors). Each step's made-up tokens go through the engine's own `on_launch` / `update`,
    untimed.

    - decode: `sched_running` running sequences, every one decoding;
    - mixed: `sched_running - sched_prefill_chunks` decodes plus `sched_prefill_chunks` new
      requests admitted each step, each a whole prefill chunk of `sched_chunk_len` tokens
      (so the step fills the default token budget). After the step they are finished (their
      pages go to the prefix cache) and as many fresh ones queued, outside the timed region.
      The pool has room for all of them: no eviction.
    - mixed-evict: the same with a pool full of cached pages, so admissions evict first."""
    R, K, ctx, steps = (args.sched_running, args.sched_prefill_chunks, args.sched_context,
                        args.sched_steps)
    chunk = args.sched_chunk_len
    ps = args.page_size
    warm = max(5, steps // 10)
    # Tokens a decode sequence may generate: while the others are prefilled, then every step.
    generated = math.ceil(R * ctx / max(1, args.sched_budget - R)) + 2 + warm + steps + 2
    decode_pages = R * math.ceil((ctx + generated) / ps)
    chunk_pages = K * math.ceil(chunk / ps)  # what one step's new requests hold
    vocab, max_len = TINY_SCHED_CONFIG["vocab_size"], TINY_SCHED_CONFIG["max_position_embeddings"]
    results = {}
    scenarios = (("decode", 0, decode_pages + 64),
                 # room for every finished request's pages: the prefix cache never evicts
                 ("mixed", K, decode_pages + (warm + steps + 4) * chunk_pages + 64),
                 # a pool full of cached pages: every step's admissions evict LRU leaves first
                 ("mixed-evict", K, decode_pages + 2 * chunk_pages + 16))
    for scenario, num_prefill, pages in scenarios:
        if scenario != "decode" and K == 0:
            continue
        sched = Scheduler(PageAllocator(pages), ps, R, args.sched_budget, args.enable_prefix_cache)
        buffers = StepBuffers(args.sched_budget, R, R * -(-max_len // ps), "cpu")
        batch = InputBatch(R, -(-max_len // ps), ps)  # the rows a model runner would keep
        results[scenario] = _sched_scenario(sched, buffers, batch, vocab, R - num_prefill,
                                            num_prefill, ctx, chunk, generated, steps, warm,
                                            args.seed, progress, scenario)
        results[scenario]["pool_pages"] = pages
    for r in results.values():
        r["target_us"] = 1000.0
        r["meets_target"] = r["us_per_step"]["mean"] < 1000.0
    return {"scenarios": results, "config": {"model": "tiny one-layer (no forward)",
                                             "page_size": ps, "context": ctx,
                                             "token_budget": args.sched_budget,
                                             "prefill_chunk_len": chunk, "steps": steps},
            "timer": "time.perf_counter_ns around schedule() + batch.apply() + buffers.load(), CPU tensors"}


def _sched_scenario(sched, buffers, batch, vocab, num_decodes, num_prefill, ctx, chunk,
                    generated, steps, warm, seed, progress, name) -> dict:
    rng = np.random.default_rng(seed)
    ids = itertools.count()

    def add(n_tokens: int, max_new: int):
        sched.add(Request(next(ids), rng.integers(0, vocab, size=n_tokens).tolist(),
                          SamplingParams(max_new_tokens=max_new, ignore_eos=True)))

    def complete(out):  # as the engine does once the step's tokens are read
        sched.on_launch(out)
        sched.update(out, [(r.num_tokens * 7 + 2) % vocab for r in out.sampling])

    for _ in range(num_decodes):
        add(ctx, generated)  # never reached: nothing here finishes a decode
    while sched.waiting or any(r.num_tokens_to_compute > 1 for r in sched.running):
        out = sched.schedule()
        buffers.load(batch.apply(out.batch_update))
        complete(out)
    task = progress.task(f"scheduler {name}", warm + steps)
    times, shapes, evicted = [], set(), 0
    for i in range(warm + steps):
        for _ in range(num_prefill):  # each lives one step: max_new_tokens=1 retires it
            add(chunk, 1)
        evicted_before = sched.cache.num_evicted_pages
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        _, meta = buffers.load(batch.apply(out.batch_update))
        t1 = time.perf_counter_ns()
        complete(out)
        n_pre = sum(1 for _, n in out.scheduled if n > 1)
        shapes.add((len(out.scheduled) - n_pre, n_pre, meta.num_tokens))
        if i >= warm:
            times.append((t1 - t0) / 1e3)
            evicted += sched.cache.num_evicted_pages - evicted_before
        task.advance()
    expected = (num_decodes, num_prefill, num_decodes + num_prefill * chunk)
    if shapes != {expected}:
        raise RuntimeError(f"scheduler {name}: steps were {sorted(shapes)}, expected {expected}")
    sched.check_integrity()
    return {"decodes": num_decodes, "prefill_chunks": num_prefill,
            "running": num_decodes + num_prefill, "tokens_per_step": expected[2],
            "steps": steps, "warmup_steps": warm, "evicted_pages_per_step": evicted / steps,
            "us_per_step": summarize(times),
            "samples": {"us_per_step": samples(times, digits=2)}}


# ---- the kernel sweep ----------------------------------------------------------------------
def kernels(args, progress: Progress = NO_PROGRESS, log=None) -> dict:
    """Delegate to `flashlet.kernels.bench.run_kernel_sweep`, passing the keyword arguments its
    signature takes: device, dtype, page size, seed, quick/smoke and, with --model/--config,
    the model's attention and MLP shapes (else the sweep's default, Qwen2.5-0.5B)."""
    import importlib
    import inspect

    mod = importlib.import_module("flashlet.kernels.bench")
    fn = mod.run_kernel_sweep
    offered = {"device": args.kernel_device, "dtype": args.dtype, "page_size": args.page_size,
               "seed": args.seed, "quick": args.kernels_quick, "smoke": args.kernels_smoke,
               "progress": progress, "log": log}
    if args.config is not None or args.model is not None:
        cfg = ModelConfig.from_hf(hf_config_dict(EngineConfig(model=args.model, config=args.config)))
        offered.update(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, hidden=cfg.hidden_size,
                       intermediate=cfg.intermediate_size)
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if (k in params or takes_any) and v is not None}
    rows = fn(**kwargs)
    called = {k: v for k, v in kwargs.items() if k not in ("progress", "log")}
    return {"sweep": _jsonable(rows), "called_with": _jsonable(called)}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "__dataclass_fields__"):
        import dataclasses

        return _jsonable(dataclasses.asdict(x))
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    return str(x)
