"""Engine start: compile every kernel variant and capture every CUDA graph before the first request.

A kernel that compiles (Triton, FlashInfer's JIT) or a graph captured in the middle of the work
costs the first requests seconds. What a step compiles is a function of shapes fixed at start
and of two small sets of buckets (`flashlet/kernels/tuning.py`), never of a KV length:

- steps with a chunk: the prefill variant of the step's longest chunk (`backend.prefill_variant`),
  and a second where a long context splits the keys (`backend.warm_contexts`); with
  mixed-step graphs, one graph per token bucket (`runner.token_buckets`), prefill variant and
  context that a step can reach (`mixed_graph_steps`), each capturing that variant; without
  them (FlashInfer), on CUDA, one eager step more at each token bucket's length, for the GEMMs'
  kernels (`eager_chunk_steps`);
- pure-decode steps: with CUDA graphs, one graph per padded batch size (`runner.graph_sizes`),
  each capturing its decode variant, and a second, the one that ends in the greedy tokens
  (`runner.greedy_tokens`, `runner.greedy_token_sizes`); without, the decode variant of the
  batch size (`decode_backend.decode_variant`); each of them again past a context length that
  takes another graph (`decode_contexts`: a one-launch long-context entry's);
- the fused elementwise kernels and the LM head, in every step; sampling (top-k/top-p);
- on CUDA, the LM head's GEMM outside any graph (a step with a chunk computes its sampled rows'
  logits eagerly) at every row count such a step samples (`logits_row_counts`): cuBLAS picks its
  kernel by shape, and CUDA loads a kernel's module on its first launch (lazy loading), a
  several-ms host stall that, met mid-serving, drains the overlapped steps;
- with the fused decode path (`runner.fused`: asked for, or on by default where it applies): its
  CuTe GEMVs (compiled at the decode steps of its row counts, the graph sizes up to 4), and its
  greedy-token graphs at every size a step of requests pads to, eagerly where graphs are off;
  where the engine speculates, both graphs again at each fused size of 2+ rows for verify steps
  laid out as decode rows (`runner.verify_graph_sizes`: their attention looks back over the
  step's rows of one sequence, which a plain decode step's does not).

`warm_up(engine)` runs one synthetic step per variant through `ModelRunner.forward`, on the
pool's scratch page only (no page is allocated, the prefix cache is untouched), then samples
once. The torch backend's decode graphs also depend on a power-of-two page-table width; only
the narrowest is captured here (it is the reference, not a serving path).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from flashlet.core.sampling import SamplingParams, make_generator, sample_one
from flashlet.kernels import cute_disk_cache
from flashlet.runner.batch import StepLayout, StepRow, build_layout

log = logging.getLogger("flashlet")


def representatives(variant_of, values) -> list[int]:
    """The first value of each distinct variant_of(value), in order: one step per variant."""
    seen: dict = {}
    for v in values:
        seen.setdefault(variant_of(v), v)
    return sorted(seen.values())


def chunk_lengths(backend, max_chunk: int) -> list[int]:
    """Longest-chunk lengths whose steps together compile every prefill variant. A step whose
    chunks are all one token long is a pure-decode step, so the lengths start at 2."""
    if backend.prefill_variant(2) is None:  # one variant serves every length
        return [min(16, max_chunk)]
    return representatives(backend.prefill_variant, range(2, max_chunk + 1))


def decode_sizes(runner, max_num_seqs: int) -> list[int]:
    """Pure-decode batch sizes whose steps together capture every graph (with CUDA graphs) or
    compile every decode variant (without)."""
    if runner.use_graphs:
        return list(runner.graph_sizes)
    if runner.decode_backend.decode_variant(1) is None:
        return [1]
    return representatives(runner.decode_backend.decode_variant, range(1, max_num_seqs + 1))


def mixed_graph_steps(runner, max_chunk: int, max_num_seqs: int,
                      max_model_len: int = 1 << 30) -> list[tuple[int, int, int]]:
    """(token bucket, longest chunk, longest KV before it) of one step per mixed graph a step can
    replay: each prefill variant's first chunk length, in each bucket that a step of that
    variant can fill past the bucket below (at most max_num_seqs sequences of at most the
    variant's longest chunk), at each context that keys a graph apart
    (`backend.warm_contexts`) within max_model_len."""
    if not runner.use_mixed_graphs:
        return []
    firsts = chunk_lengths(runner.backend, max_chunk)
    lasts = [n - 1 for n in firsts[1:]] + [max_chunk]  # each variant's longest chunk
    budget = runner.token_buckets[-1]
    steps, below = [], 0
    for bucket in runner.token_buckets:
        for first, last in zip(firsts, lasts):
            if first <= bucket and min(max_num_seqs * last, budget) > below:
                steps += [(bucket, first, context) for context in chunk_contexts(
                    runner.backend, bucket, first, max_model_len)]
        below = bucket
    return steps


def eager_chunk_steps(runner, max_chunk: int, max_model_len: int) -> list[tuple[int, int]]:
    """(chunk length, KV before it) of the warm-up's eager chunk steps where no mixed graph
    captures them: one per prefill variant at each context that picks a kernel apart, then one
    of each token bucket's length (a step's GEMMs run at its token count, and cuBLAS picks its
    kernel by shape, loaded at first launch as `_warm_logits` says; the mixed graphs' captures
    do this for the triton backend)."""
    steps = [(q_len, context) for q_len in chunk_lengths(runner.backend, max_chunk)
             for context in chunk_contexts(runner.backend, q_len, q_len, max_model_len)]
    if runner.device.type == "cuda":
        lengths = {q_len for q_len, _ in steps}
        steps += [(n, 0) for n in runner.token_buckets if n <= min(max_chunk, max_model_len) and n not in lengths]
    return steps


def chunk_contexts(backend, num_tokens: int, q_len: int, max_model_len: int) -> list[int]:
    """The tokens before a q_len chunk in one step per variant that a step of num_tokens rows
    takes by its context length (`backend.warm_contexts`, those that fit max_model_len)."""
    return [max(0, c - q_len) for c in backend.warm_contexts(num_tokens, q_len)
            if max(c, q_len) <= max_model_len]


def decode_contexts(runner, size: int, max_model_len: int) -> list[int]:
    """The cached lengths of the warm-up's decode steps of `size` rows: one per graph (or kernel
    variant) the step's attention picks by its context length (`decode_warm_contexts` of the
    backend that step attends through: a long-context entry's), those within max_model_len."""
    backend = runner.decode_attention(size)
    return [c for c in backend.decode_warm_contexts(size) if c + 1 <= max_model_len]


def synthetic_layout(num_seqs: int, q_len: int, kv_pool, vocab: int, context: int = 0) -> StepLayout:
    """`num_seqs` sequences of `q_len` new tokens after `context` cached ones, every token on
    the pool's scratch page: built like every step (`batch.build_layout`), so the same kernels
    specialise."""
    pages = [kv_pool.scratch_page] * -(-(context + q_len) // kv_pool.page_size)
    rows = [StepRow([(7 * (b * q_len + i)) % vocab for i in range(q_len)], context, pages)
            for b in range(num_seqs)]
    return build_layout(rows, kv_pool.page_size)


def warm_up(engine) -> dict:
    """Run one step of every kernel variant and capture every graph; returns {"warmup_s",
    "capture_s", "chunk_lengths", "decode_sizes", "mixed_graphs", "mixed_capture_s", "graphs",
    "triton_compiles"} and, with the fused path, "cute_gemvs", "cute_compile_s" and
    "cute_from_disk" (its GEMVs ready, the seconds they took to compile or load, how many were
    loaded from the disk cache; capture_s includes those and mixed_capture_s), and where worker
    processes compiled them, "cute_precompile" (Precompile.report)."""
    runner, cfg = engine.runner, engine.config
    vocab = engine.model_config.vocab_size
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    max_chunk = min(cfg.max_num_batched_tokens, engine.max_model_len)
    chunks = chunk_lengths(runner.backend, max_chunk)
    sizes = decode_sizes(runner, cfg.max_num_seqs)
    mixed = mixed_graph_steps(runner, max_chunk, cfg.max_num_seqs, engine.max_model_len)
    with count_triton_compiles() as compiles:
        t0 = time.perf_counter()
        # One sequence with a chunk of q_len tokens, eagerly; with mixed graphs every chunk
        # step replays one, and their captures below compile the same prefill variants.
        for q_len, context in [] if mixed else eager_chunk_steps(runner, max_chunk, engine.max_model_len):
            runner.forward(*runner.load(synthetic_layout(1, q_len, engine.kv_pool, vocab, context)))
        _warm_sampling(engine)
        _warm_logits(engine)
        sync()
        t1 = time.perf_counter()
        for size in sizes:
            for context in decode_contexts(runner, size, engine.max_model_len):
                runner.forward(*runner.load(synthetic_layout(size, 1, engine.kv_pool, vocab, context)))
        for size in runner.greedy_token_sizes():  # the graphs that end in the greedy tokens
            for context in decode_contexts(runner, size, engine.max_model_len):
                runner.greedy_tokens(*runner.load(synthetic_layout(size, 1, engine.kv_pool, vocab, context)))
        for size in runner.verify_graph_sizes():  # a verify step's decode rows: both graphs again
            for context in decode_contexts(runner, size, engine.max_model_len):
                for step in (runner.forward, runner.greedy_tokens):
                    layout = synthetic_layout(size, 1, engine.kv_pool, vocab, context)
                    layout.verify_as_decode_rows = True
                    step(*runner.load(layout))
        sync()
        t2 = time.perf_counter()
        for bucket, q_len, context in reversed(mixed):  # the largest first: the rest reuse its pool memory
            layout = synthetic_layout(1, q_len, engine.kv_pool, vocab, context)
            runner.forward(*runner.load(layout, token_bucket=bucket))
        sync()
        t3 = time.perf_counter()
    report = {"warmup_s": t1 - t0, "capture_s": t3 - t1, "mixed_capture_s": t3 - t2,
              "chunk_lengths": chunks, "decode_sizes": sizes, "mixed_graphs": len(mixed),
              "graphs": len(runner.graphs), "triton_compiles": compiles.count}
    if runner.fused is not None:
        if runner.fused.precompile is not None:  # every GEMV is ready: its workers have ended
            runner.fused.precompile.close()
            report["cute_precompile"] = workers = runner.fused.precompile.report()
            log.info("warm-up: %d of %d CuTe GEMV(s) compiled in %d worker process(es), their files "
                     "from %.1f to %.1f s after the workers started; the engine waited %.2f s for them",
                     workers["files"], workers["plans"], workers["workers"], workers["first_file_s"] or 0,
                     workers["last_file_s"] or 0, workers["waited_s"])
        report["cute_gemvs"], report["cute_compile_s"], report["cute_from_disk"] = runner.fused.compiled()
        log.info("warm-up: the fused decode path's rows %s: %d CuTe GEMV(s) ready in %.2f s (%d "
                 "loaded from %s)", runner.fused.row_counts, report["cute_gemvs"],
                 report["cute_compile_s"], report["cute_from_disk"], cute_disk_cache.usable_dir() or "no disk cache")
    log.info("warm-up: %d chunk step(s) %s and sampling in %.2f s; %d decode size(s) in %.2f s, "
             "%d mixed-step graph(s) in %.2f s (%d CUDA graphs); %s Triton kernel(s) compiled "
             "or loaded", len(chunks), chunks, report["warmup_s"], len(sizes), t2 - t1,
             len(mixed), report["mixed_capture_s"], report["graphs"],
             compiles.count if compiles.count is not None else "?")
    return report


def logits_row_counts(engine) -> range:
    """The row counts an eagerly computed LM head meets: a mixed step samples one row per decode
    and per chunk that ends its prompt, at most the step buffers' rows."""
    return range(1, engine.runner.buffers.max_seqs + 1)


def _warm_logits(engine) -> None:
    """The LM head once at each of `logits_row_counts` (CUDA, one device: each kernel cuBLAS
    picks for a shape is loaded now). Measured on the H200 (qwen2.5-0.5b, 64 streams, eight
    8,000-token prompts arriving, `lab/gap_outliers.py`): the first step that sampled 65 rows
    took 10.2 ms where its neighbours took 3-5, once per process."""
    model = engine.model
    if engine.device.type != "cuda" or model.tp is not None:
        return
    counts = logits_row_counts(engine)
    hidden = torch.zeros(counts[-1], model.config.hidden_size, dtype=engine.dtype,
                         device=engine.device)
    for n in counts:
        model.compute_logits(hidden[:n])


def _warm_sampling(engine) -> None:
    """The sampler's first top-k/top-p/multinomial call (library set-up) and, on CUDA, its
    Triton sampling kernel's compilation."""
    params = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=20, top_p=0.9, seed=0)
    logits = torch.randn(engine.model_config.vocab_size, device=engine.device)
    sample_one(logits, params, make_generator(params, engine.device))
    engine.sampler.warm_up(engine.model_config.vocab_size, max_seen=engine.max_model_len + 2)


# ---- counting Triton compilations ---------------------------------------------------------
class CompileCount:
    """Triton kernels compiled (or loaded from the disk cache) while counting; `count` is None
    where this Triton has no compile hook. `names` lists them."""

    def __init__(self):
        self.count: int | None = 0
        self.names: list[str] = []

    def __call__(self, *args, **kwargs):
        self.count += 1
        fn = kwargs.get("fn")
        self.names.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?"))[:80])
        return None  # (a truthy value from a cache hook would skip the compilation)


@contextlib.contextmanager
def count_triton_compiles():
    """Count Triton's in-process compilations (a kernel variant seen for the first time in this
    process, compiled or read from its disk cache) through `triton.knobs.runtime
    .jit_post_compile_hook` (Triton >= 3.4), chaining any hook already set."""
    counter = CompileCount()
    try:
        import triton

        runtime = triton.knobs.runtime
        runtime.jit_post_compile_hook  # noqa: B018 (probe: older Triton has no knobs)
    except (ImportError, AttributeError):
        counter.count = None
        yield counter
        return
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        counter(*args, **kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield counter
    finally:
        runtime.jit_post_compile_hook = previous
