"""The attention backend interface every backend implements, and the per-step metadata it reads.

A step is a ragged batch: request `b` contributes query rows `qo_indptr[b]:qo_indptr[b+1]`
(a prefill chunk, or one row for a decode) and attends over its KV pages
`paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]`, whose last page holds
`paged_kv_last_page_len[b]` tokens. The causal mask is aligned to the END of each KV sequence:
query row i of a chunk of length q over a KV length of n sees keys 0 .. n - q + i.

The engine calls `plan(meta)` once per step, then `run_rope(layer, q, k, v, positions,
cos_sin_cache)` in every layer (`run(layer, q, k, v)` for q/k already rotated). Both first have
the KV pool write the step's new K/V at `meta.slot_mapping` (`KVPool.write_rope` / `write`), so
that a chunk attends to itself, then attend. The one other writer is the fused decode path with
RoPE in its QKV epilogue: its QKV kernel stores K/V at the same slot, then calls
`attend(layer, q)` (or, where `supports_one_launch_decode`, `attend_one_launch(layer, q, pdl)`).
Names follow FlashInfer's so the backends read alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from flashlet.kvcache.kv_pool import KVPool


class HostLayout(Protocol):
    """What readers of AttentionMetadata use of a step's layout on the host (the runner's
    StepLayout is one): an interface here, so that attention imports no runner module."""

    qo_indptr: torch.Tensor  # [num_seqs + 1] int32
    paged_kv_indptr: torch.Tensor  # [num_seqs + 1] int32
    paged_kv_indices: torch.Tensor  # [num_pages_in_step] int32
    paged_kv_last_page_len: torch.Tensor  # [num_seqs] int32
    kv_lens: torch.Tensor  # [num_seqs] int32

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_seqs(self) -> int: ...

    @property
    def max_query_len(self) -> int: ...

    @property
    def max_kv_len(self) -> int: ...

    @property
    def is_pure_decode(self) -> bool: ...

    @property
    def num_sampled(self) -> int: ...

    # A verify step laid out as one decode row per query token: rows of one sequence, each
    # reading K/V rows the rows before it write (`fused_decode.verify_as_decode_rows`).
    verify_as_decode_rows: bool


@dataclass
class AttentionMetadata:
    """One step's batch layout on the device (views into persistent buffers, fixed addresses)
    and `host`, the same layout on the host (pinned on CUDA), which backends plan from."""

    host: HostLayout
    positions: torch.Tensor  # [num_tokens] int64, position of each query token
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat pool slot each new K/V row goes to
    qo_indptr: torch.Tensor  # [num_seqs + 1] int32
    paged_kv_indptr: torch.Tensor  # [num_seqs + 1] int32
    paged_kv_indices: torch.Tensor  # [num_pages_in_step] int32
    paged_kv_last_page_len: torch.Tensor  # [num_seqs] int32
    kv_lens: torch.Tensor  # [num_seqs] int32, KV length of each sequence including this step
    logits_indices: torch.Tensor  # [num_sampled] int64, rows whose logits are sampled
    num_padding: int = 0  # last sequences: padding to a CUDA graph's batch size (or max_num_seqs)
    # A mixed step padded to this many tokens and as many sequences (max_num_seqs at most) for
    # a CUDA graph (StepBuffers.load(pad_tokens=)): rows past qo_indptr[num_seqs - num_padding]
    # are padding.
    token_bucket: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.host.num_tokens

    @property
    def num_seqs(self) -> int:
        return self.host.num_seqs

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence has exactly one query row."""
        return self.host.is_pure_decode


class AttentionBackend(ABC):
    """Paged attention over a KVPool. Subclasses implement `plan` and `_attend`.

    A backend that sets `supports_cuda_graph` can serve pure-decode steps captured in CUDA
    graphs: the model runner pads the batch to a captured size, calls `plan_graph(meta, size)`
    outside the graph before every replay, and `run()` inside the graph must then read only
    device buffers that keep their addresses (no host sync, no allocation that depends on the
    step). `graph_key(meta)` names any extra shape a capture depends on.

    A backend that also sets `supports_mixed_graph` can serve any step (prefill chunks mixed
    with decodes) padded to a token bucket and as many sequences (max_num_seqs at most), some
    with no query rows and no KV (AttentionMetadata.token_bucket): `plan(meta)` then runs
    outside the graph and `mixed_graph_key(meta)` names the kernel variant the capture baked in.

    A backend that sets `supports_one_launch_decode` implements `attend_one_launch`: a
    pure-decode step's attention in one kernel a layer, for the fused decode path.
    """

    name = "abstract"
    supports_cuda_graph = False
    supports_mixed_graph = False
    supports_one_launch_decode = False

    def __init__(self, kv_pool: KVPool, num_q_heads: int, scale: float | None = None):
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = kv_pool.head_dim
        self.scale = scale if scale is not None else self.head_dim**-0.5
        self.meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare for one step; called once before the layers run."""
        self.meta = meta

    def plan_graph(self, meta: AttentionMetadata, batch_size: int) -> None:
        """Plan a pure-decode step padded to `batch_size` for replay in a CUDA graph."""
        self.plan(meta)

    def graph_key(self, meta: AttentionMetadata) -> tuple:
        """Extra shape (beyond the padded batch size) that a captured graph is specific to."""
        return ()

    def decode_warm_contexts(self, num_seqs: int) -> tuple[int, ...]:
        """Longest KV lengths of the warm-up's pure-decode steps of num_seqs rows (padded) that
        reach every graph of that size which the KV lengths pick: (0,) where none depends on them."""
        return (0,)

    def mixed_graph_key(self, meta: AttentionMetadata) -> tuple:
        """The kernel variant a mixed step padded for a graph runs (part of the graph's key)."""
        raise NotImplementedError(f"the {self.name} backend serves mixed steps eagerly")

    def warm_contexts(self, num_tokens: int, max_q_len: int) -> tuple[int, ...]:
        """Longest KV lengths of the warm-up's steps of num_tokens rows (padded) and a longest
        chunk of max_q_len that, together, reach every kernel variant (and mixed graph) of that
        shape which the KV lengths pick: (0,) where none depends on them."""
        return (0,)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens -> attention output [T, Hq, D]."""
        self.kv_pool.write(layer, k, v, self.meta.slot_mapping)
        return self._attend(layer, q)

    def run_rope(self, layer: int, q, k, v, positions, cos_sin_cache, qk_norm=None) -> torch.Tensor:
        """`run` for q/k not rotated yet: the pool applies RoPE (after Qwen3's per-head norms,
        `qk_norm`) and writes K/V (`KVPool.write_rope`, one fused kernel on CUDA), then attention."""
        slots = self.meta.slot_mapping
        q = self.kv_pool.write_rope(layer, q, k, v, positions, cos_sin_cache, slots, qk_norm)
        return self._attend(layer, q)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention only: this step's K/V are already in the pool (the fused decode path's QKV
        GEMV writes them in its epilogue), q already rotated."""
        return self._attend(layer, q)

    def decode_variant(self, num_seqs: int) -> tuple | None:
        """The kernel variant a pure-decode step of num_seqs sequences compiles, where that
        depends on the step (the warm-up compiles one step per variant); None: it does not."""
        return None

    def prefill_variant(self, max_q_len: int) -> tuple | None:
        """`decode_variant` for steps whose longest chunk is max_q_len tokens."""
        return None

    def attend_one_launch(self, layer: int, q: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """`attend` for a pure-decode step in one kernel launch (PDL with pdl)."""
        raise NotImplementedError(f"the {self.name} backend has no one-launch decode attention")

    @abstractmethod
    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q over the pool, K/V of this step already written."""
