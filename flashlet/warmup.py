"""Engine start: compile every kernel variant and capture every CUDA graph before the first request.

A kernel that compiles (Triton, FlashInfer's JIT) or a graph captured in the middle of the work
costs the first requests seconds. What a step compiles is a function of shapes fixed at start
and of two small sets of buckets (`flashlet/kernels/tuning.py`), never of a KV length:

- steps with a chunk: the prefill variant of the step's longest chunk (`backend.prefill_variant`);
- pure-decode steps: with CUDA graphs, one graph per padded batch size (`runner.graph_sizes`),
  each capturing its decode variant; without, the decode variant of the batch size
  (`backend.decode_variant`);
- the fused elementwise kernels and the LM head, in every step; sampling (top-k/top-p).

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

from flashlet.attention.base import AttentionMetadata
from flashlet.sampling import SamplingParams, make_generator, sample_one

log = logging.getLogger("flashlet")


def representatives(variant_of, values) -> list[int]:
    """The first value of each distinct variant_of(value), in order: one step per variant."""
    seen: dict = {}
    for v in values:
        seen.setdefault(variant_of(v), v)
    return sorted(seen.values())


def chunk_lengths(backend, max_chunk: int) -> list[int]:
    """Longest-chunk lengths whose steps together compile every prefill variant."""
    variant = getattr(backend, "prefill_variant", None)
    if variant is None:
        return [min(16, max_chunk)]
    return representatives(variant, range(1, max_chunk + 1))


def decode_sizes(runner, max_num_seqs: int) -> list[int]:
    """Pure-decode batch sizes whose steps together capture every graph (with CUDA graphs) or
    compile every decode variant (without)."""
    if runner.use_graphs:
        return list(runner.graph_sizes)
    variant = getattr(runner.backend, "decode_variant", None)
    if variant is None:
        return [1]
    return representatives(variant, range(1, max_num_seqs + 1))


def synthetic_step(num_seqs: int, q_len: int, kv_pool, device, vocab: int,
                   pure_decode: bool) -> tuple[torch.Tensor, AttentionMetadata]:
    """`num_seqs` sequences of `q_len` new tokens (no cached prefix), every token on the pool's
    scratch page: the dtypes and layout of `batch.StepBuffers`, so the same kernels specialise."""
    ps, scratch = kv_pool.page_size, kv_pool.scratch_page
    pages = -(-q_len // ps)
    qo = [i * q_len for i in range(num_seqs + 1)]
    kv_ptr = [i * pages for i in range(num_seqs + 1)]
    last = [q_len - (pages - 1) * ps] * num_seqs
    positions = list(range(q_len)) * num_seqs
    slots = [scratch * ps + p % ps for p in positions]
    ints = dict(input_ids=[(7 * i) % vocab for i in range(len(positions))], positions=positions,
                slot_mapping=slots, logits_indices=[qo[b + 1] - 1 for b in range(num_seqs)])
    int32 = dict(qo_indptr=qo, paged_kv_indptr=kv_ptr,
                 paged_kv_indices=[scratch] * (pages * num_seqs), paged_kv_last_page_len=last,
                 kv_lens=[q_len] * num_seqs)
    pin = torch.device(device).type == "cuda"
    host = {k: torch.tensor(v, dtype=torch.int32).pin_memory() if pin else torch.tensor(v, dtype=torch.int32)
            for k, v in int32.items()}
    dev = {k: v.to(device) for k, v in host.items()}
    dev.update({k: torch.tensor(v, dtype=torch.int64, device=device) for k, v in ints.items()})
    meta = AttentionMetadata(
        num_tokens=len(positions), num_seqs=num_seqs, positions=dev["positions"],
        slot_mapping=dev["slot_mapping"], qo_indptr=dev["qo_indptr"],
        paged_kv_indptr=dev["paged_kv_indptr"], paged_kv_indices=dev["paged_kv_indices"],
        paged_kv_last_page_len=dev["paged_kv_last_page_len"], kv_lens=dev["kv_lens"],
        logits_indices=dev["logits_indices"], qo_indptr_host=qo, paged_kv_indptr_host=kv_ptr,
        kv_lens_host=[q_len] * num_seqs, is_pure_decode=pure_decode, host_tensors=host)
    return dev["input_ids"], meta


def warm_up(engine) -> dict:
    """Run one step of every kernel variant and capture every decode graph; returns
    {"warmup_s", "capture_s", "chunk_lengths", "decode_sizes", "graphs", "triton_compiles"}."""
    runner, cfg = engine.runner, engine.config
    vocab = engine.model_config.vocab_size
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    max_chunk = min(cfg.max_num_batched_tokens, engine.max_model_len)
    chunks = chunk_lengths(runner.backend, max_chunk)
    sizes = decode_sizes(runner, cfg.max_num_seqs)
    with count_triton_compiles() as compiles:
        t0 = time.perf_counter()
        for q_len in chunks:  # one sequence with a chunk of q_len tokens
            runner.forward(*synthetic_step(1, q_len, engine.kv_pool, engine.device, vocab, False))
        _warm_sampling(engine)
        sync()
        t1 = time.perf_counter()
        for size in sizes:
            runner.forward(*synthetic_step(size, 1, engine.kv_pool, engine.device, vocab, True))
        sync()
        t2 = time.perf_counter()
    report = {"warmup_s": t1 - t0, "capture_s": t2 - t1, "chunk_lengths": chunks,
              "decode_sizes": sizes, "graphs": len(runner.graphs),
              "triton_compiles": compiles.count}
    log.info("warm-up: %d chunk step(s) %s and sampling in %.2f s; %d decode size(s) in %.2f s "
             "(%d CUDA graphs); %s Triton kernel(s) compiled or loaded", len(chunks), chunks,
             report["warmup_s"], len(sizes), report["capture_s"], report["graphs"],
             compiles.count if compiles.count is not None else "?")
    return report


def _warm_sampling(engine) -> None:
    """The sampler's first top-k/top-p/multinomial call (library set-up, not compiled code)."""
    params = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=20, top_p=0.9, seed=0)
    logits = torch.randn(engine.model_config.vocab_size, device=engine.device)
    sample_one(logits, params, make_generator(params, engine.device))


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
