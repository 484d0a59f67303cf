"""Runs the model for one step: plan the attention backend, forward, LM head on sampled rows.

Pure-decode steps on CUDA are replayed from CUDA graphs, one captured per padded batch size
(1, 2, 4, 8, 16, 32, 64, 128, 256, ... up to max_num_seqs) and per the backend's `graph_key`.
The batch is padded with rows that write to and read from the pool's scratch page; planning
happens outside the graph before each replay. Mixed steps (any prefill chunk) run eagerly.
"""

from __future__ import annotations

import logging

import torch

from flashlet.attention import create_backend
from flashlet.attention.base import AttentionMetadata

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
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs)
        self.max_pages_per_seq = max_pages_per_seq
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        if self.use_graphs:
            self._static = _StaticDecodeBuffers(self.graph_sizes[-1], max_pages_per_seq,
                                                kv_pool, self.device)
        # Recorded once a step's host-to-device copies are queued (inputs, metadata, the
        # backend's plan), before its kernels: when it has fired, pinned staging memory may be
        # rewritten for the next step without waiting for this step's kernels.
        self._staged = torch.cuda.Event() if self.device.type == "cuda" else None

    def wait_inputs_staged(self) -> None:
        """Block until the previous step's inputs have reached the device."""
        if self._staged is not None:
            self._staged.synchronize()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> logits [num_sampled, vocab] fp32 for meta.logits_indices."""
        if self.use_graphs and meta.is_pure_decode and meta.num_seqs <= self.graph_sizes[-1]:
            return self._replay(input_ids, meta)
        self.backend.plan(meta)
        self._mark_staged()
        hidden = self.model(input_ids, meta.positions, self.backend)
        return self.model.compute_logits(hidden[meta.logits_indices])

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _replay(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        size = next(s for s in self.graph_sizes if s >= meta.num_seqs)
        padded = self._static.fill(input_ids, meta, size)
        self.backend.plan_graph(padded, size)
        key = (size,) + self.backend.graph_key(padded)
        if key not in self.graphs:
            self.graphs[key] = self._capture(size)
        graph, logits = self.graphs[key]
        self._mark_staged()
        graph.replay()
        return logits[: meta.num_seqs]

    def _mark_staged(self) -> None:
        if self._staged is not None:
            self._staged.record()

    def _decode_body(self, size: int) -> torch.Tensor:
        hidden = self.model(self._static.input_ids[:size], self._static.positions[:size],
                            self.backend)
        return self.model.compute_logits(hidden)

    def _capture(self, size: int):
        log.info("capturing a CUDA graph for decode batch %d", size)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (lazy kernel compilation, allocator) off the graph
                self._decode_body(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = self._decode_body(size)
        self.graph_pool = graph.pool()
        return graph, logits


class _StaticDecodeBuffers:
    """Fixed-address inputs and metadata of captured decode graphs, refilled (and padded with
    rows on the scratch page) before each replay. Metadata is staged in pinned host memory so
    its copies to the device are asynchronous."""

    META = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
            "kv_lens")

    def __init__(self, max_size: int, max_pages_per_seq: int, kv_pool, device):
        self.scratch_slot = kv_pool.scratch_page * kv_pool.page_size
        self.scratch_page = kv_pool.scratch_page
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_size, **i64)
        self.positions = torch.zeros(max_size, **i64)
        self.slot_mapping = torch.zeros(max_size, **i64)
        self.logits_indices = torch.arange(max_size, **i64)
        sizes = {"qo_indptr": max_size + 1, "paged_kv_indptr": max_size + 1,
                 "paged_kv_indices": max_size * max_pages_per_seq + max_size,
                 "paged_kv_last_page_len": max_size, "kv_lens": max_size}
        self.host = {k: torch.zeros(n, dtype=torch.int32, pin_memory=True) for k, n in sizes.items()}
        self.np = {k: v.numpy() for k, v in self.host.items()}
        self.dev = {k: torch.zeros(n, dtype=torch.int32, device=device) for k, n in sizes.items()}
        self.np["qo_indptr"][:] = range(max_size + 1)

    def fill(self, input_ids, meta: AttentionMetadata, size: int) -> AttentionMetadata:
        n, pad = meta.num_seqs, size - meta.num_seqs
        src = meta.host_tensors
        num_pages = meta.paged_kv_indptr_host[-1]
        kv_indptr_host = meta.paged_kv_indptr_host + list(range(num_pages + 1, num_pages + pad + 1))
        np_ = self.np
        np_["paged_kv_indptr"][: size + 1] = kv_indptr_host
        np_["paged_kv_indices"][:num_pages] = src["paged_kv_indices"].numpy()
        np_["paged_kv_indices"][num_pages : num_pages + pad] = self.scratch_page
        np_["paged_kv_last_page_len"][:n] = src["paged_kv_last_page_len"].numpy()
        np_["paged_kv_last_page_len"][n:size] = 1
        np_["kv_lens"][:n] = src["kv_lens"].numpy()
        np_["kv_lens"][n:size] = 1
        lengths = {"qo_indptr": size + 1, "paged_kv_indptr": size + 1,
                   "paged_kv_indices": num_pages + pad, "paged_kv_last_page_len": size,
                   "kv_lens": size}
        host, dev = {}, {}
        for name, length in lengths.items():
            host[name] = self.host[name][:length]
            dev[name] = self.dev[name][:length]
            dev[name].copy_(host[name], non_blocking=True)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        if pad:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.scratch_slot)
        return AttentionMetadata(
            num_tokens=size, num_seqs=size, positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], qo_indptr=dev["qo_indptr"],
            paged_kv_indptr=dev["paged_kv_indptr"], paged_kv_indices=dev["paged_kv_indices"],
            paged_kv_last_page_len=dev["paged_kv_last_page_len"], kv_lens=dev["kv_lens"],
            logits_indices=self.logits_indices[:size], qo_indptr_host=list(range(size + 1)),
            paged_kv_indptr_host=kv_indptr_host, kv_lens_host=meta.kv_lens_host + [1] * pad,
            is_pure_decode=True, host_tensors=host)
