"""Runs the model for one step: load its layout, plan the attention backend, forward, LM head
on the sampled rows.

`load(layout)` puts a step's layout (flashlet/batch.py) into the runner's one set of step
buffers. Pure-decode steps on CUDA are replayed from CUDA graphs, one captured per padded batch
size (1, 2, 4, 8, 16, 32, 64, 128, 256, ... up to max_num_seqs) and per the backend's
`graph_key`: `load` pads such a step with rows that write to and read from the pool's scratch
page and places it in the step buffers where every step of that batch size goes, the captured
graph reads it there (checked before each replay), and planning happens outside the graph
before each replay. Mixed steps (any prefill chunk) run eagerly.

With `fused_decode`, a pure-decode step of one sequence runs `FusedDecode` (CuTe GEMVs with the
norms and epilogues folded in; flashlet/fused_decode.py) instead of the model's per-op forward,
in its graph as well; `greedy_tokens` runs it through the LM head's argmax, for steps whose one
request is plain greedy (the engine decides), so no logits are written at all.
"""

from __future__ import annotations

import logging

import torch

from flashlet.attention import create_backend
from flashlet.attention.base import AttentionMetadata
from flashlet.batch import StepBuffers, StepLayout

log = logging.getLogger("flashlet")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    return sizes + [max_num_seqs]


class ModelRunner:
    def __init__(self, model, kv_pool, config, device, max_pages_per_seq: int):
        self.model = model
        self.kv_pool = kv_pool
        self.device = torch.device(device)
        self.backend = create_backend(config.backend, kv_pool, model.local.num_heads,
                                      max_batch_size=config.max_num_seqs,
                                      max_pages_per_seq=max_pages_per_seq)
        self.use_graphs = (config.cuda_graph and self.device.type == "cuda"
                           and self.backend.supports_cuda_graph)
        self.fused = None
        if config.fused_decode:
            from flashlet.fused_decode import FusedDecode

            if config.fused_decode_attn and not hasattr(self.backend, "attend_one_launch"):
                raise ValueError(f"fused_decode_attn needs the triton backend's one-launch decode; "
                                 f"the backend is {self.backend.name}")
            self.fused = FusedDecode(model, self.device, pdl=config.fused_decode_pdl,
                                     kv_pool=kv_pool if config.fused_decode_rope else None,
                                     one_launch_attention=config.fused_decode_attn)
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs)
        self.max_pages_per_seq = max_pages_per_seq
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        self.buffers = StepBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                                   config.max_num_seqs * max_pages_per_seq, self.device,
                                   scratch_page=kv_pool.scratch_page, page_size=kv_pool.page_size)
        # Recorded once a step's host-to-device copies are queued (inputs, metadata, the
        # backend's plan), before its kernels: when it has fired, pinned staging memory may be
        # rewritten for the next step without waiting for this step's kernels.
        self._staged = torch.cuda.Event() if self.device.type == "cuda" else None

    def wait_inputs_staged(self) -> None:
        """Block until the previous step's inputs have reached the device."""
        if self._staged is not None:
            self._staged.synchronize()

    def load(self, layout: StepLayout, fed_tokens: torch.Tensor | None = None):
        """A step's layout into the step buffers (padded to its graph's batch size when it
        replays one) -> (input_ids, metadata) for `forward`. fed_tokens: the previous step's
        sampled tokens on the device, for the rows that take them (overlap)."""
        self.wait_inputs_staged()  # the pinned staging is free again
        return self.buffers.load(layout, fed_tokens, pad_to=self.graph_batch_size(layout))

    def graph_batch_size(self, layout: StepLayout, num_padding: int = 0) -> int | None:
        """The captured batch size that a step replays at, or None where it runs eagerly:
        graphs serve pure-decode steps in which every row samples. num_padding: rows of
        `layout` that are padding already."""
        n = layout.num_seqs - num_padding
        if not (self.use_graphs and layout.is_pure_decode and n <= self.graph_sizes[-1]
                and layout.logits_indices.shape[0] == n):
            return None
        return next(s for s in self.graph_sizes if s >= n)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> logits [num_sampled, vocab] fp32 for meta.logits_indices."""
        size = self.graph_batch_size(meta.host, meta.num_padding)
        if size is not None:
            return self._replay(input_ids, meta, size)
        self.backend.plan(meta)
        self._mark_staged()
        if self._fused_step(meta):
            return self.fused.logits(input_ids, meta.positions, self.backend)
        hidden = self.model(input_ids, meta.positions, self.backend)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def _fused_step(self, meta: AttentionMetadata) -> bool:
        """Does the fused path serve this step: pure decode of one sequence, which samples."""
        host = meta.host
        return (self.fused is not None and host.is_pure_decode and meta.num_seqs == 1
                and meta.num_padding == 0 and host.logits_indices.shape[0] == 1)

    @torch.inference_mode()
    def greedy_tokens(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The greedy token [1] (int64, on the device) of a step the fused path serves, from
        the LM head's argmax epilogue (no logits); None for any other step (call `forward`)."""
        if not self._fused_step(meta):
            return None
        size = self.graph_batch_size(meta.host, meta.num_padding)
        if size is not None:
            return self._replay(input_ids, meta, size, tokens=True)
        self.backend.plan(meta)
        self._mark_staged()
        return self.fused.token(input_ids, meta.positions, self.backend)

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _replay(self, input_ids: torch.Tensor, meta: AttentionMetadata, size: int,
                tokens: bool = False) -> torch.Tensor:
        if meta.num_seqs != size or not self.buffers.holds(input_ids):
            raise ValueError("a decode step replayed from a CUDA graph must come from "
                             "ModelRunner.load (the graph reads its buffers, padded)")
        self.backend.plan_graph(meta, size)
        key = (size, "tokens" if tokens else "logits") + self.backend.graph_key(meta)
        addresses = graph_input_addresses(input_ids, meta)
        if key not in self.graphs:
            self.graphs[key] = self._capture(input_ids, meta, tokens) + (addresses,)
        graph, out, captured = self.graphs[key]
        if addresses != captured:
            raise RuntimeError(f"a decode step padded to {size} has its inputs at other "
                               f"addresses than the graph captured for it read: the step "
                               f"buffers placed it differently (batch.arena_offsets)")
        self._mark_staged()
        graph.replay()
        return out[: size - meta.num_padding]

    def _mark_staged(self) -> None:
        if self._staged is not None:
            self._staged.record()

    def _decode_body(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     tokens: bool = False) -> torch.Tensor:
        """The forward of a padded decode step (the backend planned for it)."""
        if self.fused is not None and input_ids.shape[0] == 1:
            fused = self.fused.token if tokens else self.fused.logits
            return fused(input_ids, positions, self.backend)
        hidden = self.model(input_ids, positions, self.backend)
        return self.model.compute_logits(hidden)

    def _capture(self, input_ids: torch.Tensor, meta: AttentionMetadata, tokens: bool = False):
        """A graph of this step's forward: it reads the step's inputs at these addresses, the
        ones every later step padded to the same size has (StepBuffers)."""
        size = input_ids.shape[0]
        log.info("capturing a CUDA graph for decode batch %d%s", size,
                 " (fused, greedy tokens)" if tokens else " (fused)" if self.fused and size == 1 else "")
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (lazy kernel compilation, allocator) off the graph
                self._decode_body(input_ids, meta.positions, tokens)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = self._decode_body(input_ids, meta.positions, tokens)
        self.graph_pool = graph.pool()
        return graph, out


def graph_input_addresses(input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[int, ...]:
    """Where a decode step's device inputs are: what a graph captured on it reads."""
    return (input_ids.data_ptr(), meta.positions.data_ptr(), meta.slot_mapping.data_ptr(),
            meta.qo_indptr.data_ptr(), meta.paged_kv_indptr.data_ptr(),
            meta.paged_kv_indices.data_ptr(), meta.paged_kv_last_page_len.data_ptr(),
            meta.kv_lens.data_ptr())
