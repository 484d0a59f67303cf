"""FlashInfer backend: one ragged `BatchPrefillWithPagedKVCacheWrapper.plan()` per step and one
`run()` per layer serve prefill chunks and decodes together.

Pure-decode steps that the model runner replays as CUDA graphs get a wrapper of their own per
padded batch size, built with `use_cuda_graph=True` over fixed index buffers: `plan()` runs
outside the graph (it cannot be captured) and the captured `run()` reads those buffers. The
wrappers, their graphs and the JIT-compiled kernel module all come into being at engine start
(`flashlet/core/warmup.py`): built lazily, they cost the first decode steps after a prefill hundreds
of milliseconds, which the harness (warmed up) never saw but every user did. `plan()` reads
only pinned host arrays and copies the page indices device to device: no step waits for the GPU. Decode
uses the same prefill kernel with one query row per sequence, which handles any GQA group size
(Qwen2.5-0.5B's is 7, which FlashInfer's CUDA-core decode kernels do not support). FA2 is asked
for explicitly: on Hopper `auto` picks FA3, which suits single-row queries poorly.

Precision: when plan() splits a sequence's KV into chunks (it does for small batches, to fill
the SMs), FA2 writes each chunk's partial output in the output dtype (bf16) and merges them in
fp32: one bf16 rounding more than an unsplit run. `split_kv=False` (FlashInfer's
`disable_split_kv`) trades that parallelism for the single rounding; `scripts/fidelity.py
--diagnose` measures both.

An fp8 pool is planned with `kv_data_type` float8_e4m3fn (q stays in the model's dtype) and
run with the layer's `k_scale` / `v_scale`, FlashInfer's own per-tensor scales.
"""

from __future__ import annotations

import logging
import os

import torch

import flashinfer

from flashlet.attention.base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 * 2**20
SPLIT_WARM_CONTEXT = 4096  # tokens of context that make plan() split a short chunk's KV
log = logging.getLogger("flashlet")


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, kv_pool, num_q_heads, scale=None, max_batch_size: int = 256,
                 max_pages_per_seq: int | None = None, split_kv: bool = True, **_):
        super().__init__(kv_pool, num_q_heads, scale)
        self.split_kv = split_kv
        self.q_dtype = kv_pool.model_dtype  # the cache's own, or fp8 beside it
        device = kv_pool.k_cache.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self.max_pages_per_seq = max_pages_per_seq or kv_pool.num_pages
        self.graph_wrappers: dict[int, flashinfer.BatchPrefillWithPagedKVCacheWrapper] = {}
        self.active = self.wrapper
        cache = os.environ.get("FLASHINFER_WORKSPACE_BASE", "~")
        log.info("flashinfer %s: kernels are compiled on first use (engine start warms them up) "
                 "and kept under %s/.cache/flashinfer (FLASHINFER_WORKSPACE_BASE moves them)",
                 flashinfer.__version__, cache)

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        self.active = self.wrapper
        self._plan(self.wrapper, meta)

    def plan_graph(self, meta: AttentionMetadata, batch_size: int) -> None:
        """Plan a padded pure-decode step into the fixed buffers of that batch size's wrapper."""
        super().plan(meta)
        if batch_size not in self.graph_wrappers:
            self.graph_wrappers[batch_size] = self._graph_wrapper(batch_size)
        self.active = self.graph_wrappers[batch_size]
        self._plan(self.active, meta)

    def graph_key(self, meta: AttentionMetadata) -> tuple:
        return ()

    def prefill_variant(self, max_q_len: int) -> tuple:
        """FA2's query tile for a step whose longest chunk is max_q_len tokens: plan() picks 16,
        64 or 128 query rows a CTA from the packed query length (rows x GQA group;
        `FA2DetermineCtaTileQ`, head_dim < 256), and each tile is a kernel of its own, which
        CUDA loads at its first launch (lazy loading), so the warm-up runs one step per tile. A
        first 1,000-token prompt's step still took 18-27 ms on Qwen3-0.6B (H200, 2ddbba1)
        against 3 warm: the eager step's GEMMs at a new token count are the next suspect
        (`warmup.eager_chunk_steps`)."""
        packed = max_q_len * (self.num_q_heads // self.num_kv_heads)
        return ("cta_tile_q", 16 if packed <= 16 else 64 if packed <= 64 else 128)

    def warm_contexts(self, num_tokens: int, max_q_len: int) -> tuple[int, ...]:
        """The warm-up's contexts for a chunk step (no mixed graphs here): none and a long one,
        where plan() splits the KV and a second kernel merges the partial outputs (also loaded
        at its first launch)."""
        return (0, SPLIT_WARM_CONTEXT)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        cache = (self.kv_pool.k_cache[layer], self.kv_pool.v_cache[layer])
        if not self.kv_pool.is_fp8:
            return self.active.run(q, cache)
        k_scale, v_scale = self.kv_pool.scales(layer)
        return self.active.run(q, cache, k_scale=k_scale, v_scale=v_scale)

    def _plan(self, wrapper, meta: AttentionMetadata) -> None:
        host = meta.host  # pinned CPU copies: plan() schedules on the host
        # Passing the longest query spares plan() a Python loop over tensor elements. (Passing
        # max_sequence_kv too trips an unbound variable in flashinfer 0.6.18's plan().)
        max_q = host.max_query_len
        # The page indices go in as the device copy: plan() copies them into the graph
        # wrapper's buffer, and from host memory that copy would block until the GPU is idle
        # (no overlap). The small arrays stay on the host, where plan() reads them.
        wrapper.plan(
            host.qo_indptr, host.paged_kv_indptr, meta.paged_kv_indices,
            host.paged_kv_last_page_len, self.num_q_heads, self.num_kv_heads, self.head_dim,
            self.kv_pool.page_size, causal=True, sm_scale=self.scale,
            q_data_type=self.q_dtype, kv_data_type=self.kv_pool.dtype,
            max_token_per_sequence=max_q, seq_lens=host.kv_lens.as_subclass(KvLens),
            disable_split_kv=not self.split_kv)

    def _graph_wrapper(self, batch_size: int):
        device = self.workspace.device
        int32 = dict(dtype=torch.int32, device=device)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.arange(batch_size + 1, **int32),
            paged_kv_indptr_buf=torch.zeros(batch_size + 1, **int32),
            paged_kv_indices_buf=torch.zeros(batch_size * self.max_pages_per_seq, **int32),
            paged_kv_last_page_len_buf=torch.zeros(batch_size, **int32),
            backend="fa2")


class KvLens(torch.Tensor):
    """A step's KV lengths (the pinned host array itself, no copy) as FlashInfer's plan() gets
    them. plan() takes their maximum with Python's max(), which iterates the tensor: per
    sequence a 0-d tensor, a comparison and a truth test: host time that grows with the batch
    (flashinfer 0.6.18; passing max_sequence_kv instead leaves a variable unbound there). Iterating a KvLens yields its maximum alone, so that max() is one
    reduction; every other use (len, copy_, the kernel's plan) sees the plain tensor."""

    def __iter__(self):
        return iter((self.max(),))
