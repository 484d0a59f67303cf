"""Runs the model for one step: apply the scheduler's update to the persistent batch, load the
step's layout, plan the attention backend, forward, LM head on the sampled rows.

The runner owns the step batch (`batch`, a batch.InputBatch: a row per running request, its
page table kept between steps); `prepare(update)` applies the scheduler's BatchUpdate to it and
returns the step's layout. `load(layout)` puts a step's layout into the runner's one set of step
buffers. Two attention backends may serve it over the same pool (`attention/selection.py` picks
them): `backend` every step with a prefill chunk, `decode_backend` the pure-decode steps the
fused path does not serve (often the same object). Steps on CUDA are replayed from CUDA
graphs, planned outside the graph before each replay, the graph reading the step buffers where
its capture saw them (checked before each replay):
- pure-decode steps: one graph per padded batch size (1, 2, 4, ... up to max_num_seqs) and per
  the decode backend's `graph_key`; `load` pads such a step with rows that write to and read
  from the pool's scratch page. The graph ends in the logits; a second graph of the same
  size, for steps whose requests are all plain greedy (`greedy_tokens`: the engine decides),
  ends in each row's argmax token, taken over the LM head's bf16 logits: widening them to fp32
  is exact, so the token is the same, and it spares a large step the fp32 copy and half the
  argmax's bytes (at 128 rows x 151,936 ids on the H200, 2026-12-04: the copy took 58 us and the
  argmax 40 of a 2.1 ms step, the bf16 argmax takes 32; decode-sat +3%, offline +3.7%).
- mixed steps (any prefill chunk), on a backend that `supports_mixed_graph` (triton), without
  tensor parallelism (the workers would need the same graphs) and with `mixed_graphs`: one graph
  per token bucket (16, 32, 64, ... up to max_num_batched_tokens, and it) and per the backend's
  `mixed_graph_key` (the prefill kernel's tile variant); `load` pads the step to the bucket and
  to as many sequences, max_num_seqs at most (`StepBuffers.load(pad_tokens=)`). The graph ends
  in the final hidden states [bucket, hidden]; the LM head runs after it, eagerly, on the sampled rows
  (their count varies). A mixed step of more tokens than the largest bucket runs eagerly.
Without graphs (CPU, `cuda_graph` off) every step runs eagerly, unpadded.

With the fused path (`fused_decode`: on by default where it applies, `_fused_decode` decides), a
pure-decode step of up to `fused.max_rows` rows (`fused_decode.SERVED_ROWS`: where a fused step
was measured faster than per-op) in which every row samples runs `FusedDecode` (CuTe GEMVs with
the norms and epilogues folded in; flashlet/runner/fused_decode.py) instead of the model's
per-op forward, padded to one of its row counts (the decode graph sizes up to it) and in that
size's graph where graphs run, attending through `fused_attention` (the decode or step backend
where one has the one-launch attention, else a triton backend of the path's own: only those
steps plan it); `greedy_tokens` runs it through the LM head's argmax, for steps whose requests
are all plain greedy (the engine decides), so no logits are written at all. A speculative
verify step of at most `fused.max_rows` query tokens, all sampled (verify rows and decodes, no
prefill chunk), is loaded as one decode row per query token (`fused_decode.verify_as_decode_rows`)
and runs fused graphs of the same sizes, keyed apart (their attention looks back over the
step's rows of one sequence: `TritonBackend.looks_back`; `verify_graph_sizes` says which the
warm-up captures); its logits rows are the verify step's own. Larger steps run
per-op (in the per-op decode graphs).

Steady replay (STEADY_REPLAY, on by default): the fused greedy graph ends by moving its real
rows' inputs on to the next step's on the device (kernels/step_advance.py: each row's sampled
token becomes its input id; position, slot, KV length and last page length + 1). A next step of
the same rows one token on, each fed its own token and none starting a page
(`StepLayout.advances_last`), then needs no load: `load` hands back the last step's device
views, and the host writes and uploads nothing. Any other step loads as usual, rewriting every
field.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from flashlet.attention import create_backend
from flashlet.attention.base import AttentionMetadata
from flashlet.attention.selection import Platform, choose_paths
from flashlet.runner import fused_decode
from flashlet.runner.batch import InputBatch, StepBuffers, StepLayout
from flashlet.runner.fused_decode import FusedParts

log = logging.getLogger("flashlet")

# The fused greedy graph moves its inputs on for a steady next step, which then loads nothing
# (the module docstring's "Steady replay"). On by default since its GPU run (H200, 2026-12-04:
# tokens on and off identical at 1, 3 and 7 rows; one stream's host part a step 0.171 -> 0.129
# ms; FUSED_NOTES.md, "Steady replay"). $FLASHLET_STEADY_REPLAY=0 / 1 sets it for a fresh
# process and the server's processes (an A/B); tests set it either way to compare.
STEADY_REPLAY_ENV = "FLASHLET_STEADY_REPLAY"
STEADY_REPLAY = os.environ.get(STEADY_REPLAY_ENV, "1") == "1"

# Runs of a step's forward off the graph before its capture: the first compiles what is lazy
# (Triton, the CuTe DSL) and lets the allocator settle; a second only repeats it on the same
# side stream. $FLASHLET_CAPTURE_WARM_RUNS=1 / 2 sets it for an A/B of start time and the graph
# tests: one run read capture -1% on an H100 (FUSED_NOTES.md, "Session 49"), -29% with the CuTe
# compile seconds taken out ("Session 50"), and with the compiles on disk a warm start moved
# 0.24 s, inside the pairs' spread ("Session 52"): the default stays 2.
CAPTURE_WARM_RUNS_ENV = "FLASHLET_CAPTURE_WARM_RUNS"


def capture_warm_runs_from_env() -> int:
    text = os.environ.get(CAPTURE_WARM_RUNS_ENV, "2").strip()
    if text not in ("1", "2"):
        raise ValueError(f"{CAPTURE_WARM_RUNS_ENV}={text!r}: expected 1 or 2 (runs of a step "
                         "off the graph before its capture)")
    return int(text)


CAPTURE_WARM_RUNS = capture_warm_runs_from_env()


class MovedOn(NamedTuple):
    """A replayed step whose graph moved its inputs on: the graph, its device views (a steady
    next step's, as they now hold) and the real rows' tokens (a view of the graph's output)."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    meta: AttentionMetadata
    tokens: torch.Tensor


def _given_or(value: bool | None, default: bool) -> bool:
    """A setting given by name (True / False), else `default` (None: decided here)."""
    return default if value is None else value


def decode_rows_limit(config) -> int:
    """The most rows a pure-decode step may have: max_num_seqs, or with speculation where the
    fused path may run, up to MAX_ROWS query tokens of a verify step: those of up to SERVED_ROWS
    are loaded as decode rows and run fused; the step buffers hold the others' sampled rows too,
    so they replay mixed graphs rather than run eagerly."""
    spec = config.speculative_config
    if spec is None or config.fused_decode is False:
        return config.max_num_seqs
    verify_tokens = config.max_num_seqs * (1 + spec.num_speculative_tokens)
    return max(config.max_num_seqs, min(fused_decode.MAX_ROWS, verify_tokens))


def _padded_decode_size(layout: StepLayout, sizes: list[int], num_padding: int = 0) -> int | None:
    """The smallest of `sizes` (ascending) that holds a pure-decode step in which every row
    samples, or None for any other step or one larger than them all. num_padding: rows of
    `layout` that are padding already."""
    n = layout.num_seqs - num_padding
    if not (layout.is_pure_decode and n <= sizes[-1] and layout.num_sampled == n):
        return None
    return next(s for s in sizes if s >= n)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    return sizes + [max_num_seqs]


MIXED_BUCKET_STEP = 512  # above it, buckets every 512 tokens (powers of two below)


def mixed_graph_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts mixed steps are padded to: powers of two from 16 up to MIXED_BUCKET_STEP,
    then its multiples, and the step budget. A big mixed step is compute-bound, so its padding
    costs GPU time in proportion: with powers of two alone a 6.2k-token step would run as
    8,192; steps of 512 bound the waste at 512 tokens (< 8% past 6k) for a little more capture
    at start (21 graphs at 8192)."""
    sizes, n = [], 16
    while n < min(MIXED_BUCKET_STEP, max_num_batched_tokens):
        sizes.append(n)
        n *= 2
    n = MIXED_BUCKET_STEP
    while n < max_num_batched_tokens:
        sizes.append(n)
        n += MIXED_BUCKET_STEP
    return sizes + [max_num_batched_tokens]


class CurrentStream:
    """`torch.cuda.current_stream(device)` for an event's record at a C call's cost: the Stream
    object is rebuilt only when the current stream changes. (`Event.record()` without a stream
    asks torch for it through several Python layers, a device-index lookup and an environment
    read among them; at one decode row the engine records two events a step.)"""

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.key: tuple | None = None
        self.stream: torch.cuda.Stream | None = None

    def __call__(self) -> torch.cuda.Stream:
        key = torch._C._cuda_getCurrentStream(self.index)  # (stream id, device index, type)
        if key != self.key:
            self.key = key
            self.stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                            device_type=key[2])
        return self.stream


class ModelRunner:
    def __init__(self, model, kv_pool, config, device, max_pages_per_seq: int, fused_parts=None):
        self.model = model
        self.kv_pool = kv_pool
        self.device = torch.device(device)
        dtype = model.embed_tokens.weight.dtype
        paths = choose_paths(config.backend, Platform.of(self.device), kv_pool.head_dim,
                             model.local.num_heads // kv_pool.num_kv_heads, dtype,
                             getattr(model, "tp", None) is not None, config.cuda_graph)
        decode_rows = decode_rows_limit(config)
        # The step backend serves every step with a chunk; the decode backend the pure-decode
        # steps the fused path does not (one object where auto or --backend picks the same).
        self.backend = create_backend(paths.backend, kv_pool, model.local.num_heads,
                                      max_batch_size=decode_rows,
                                      max_pages_per_seq=max_pages_per_seq)
        self.decode_backend = self.backend if paths.decode_backend == paths.backend else \
            create_backend(paths.decode_backend, kv_pool, model.local.num_heads,
                           max_batch_size=decode_rows, max_pages_per_seq=max_pages_per_seq)
        self.use_graphs = (config.cuda_graph and self.device.type == "cuda"
                           and self.decode_backend.supports_cuda_graph)
        # Not under tensor parallelism: the workers run rank 0's steps eagerly, unpadded.
        self.use_mixed_graphs = (self.use_graphs and config.mixed_graphs
                                 and getattr(model, "tp", None) is None
                                 and self.backend.supports_mixed_graph)
        self.token_buckets = mixed_graph_buckets(config.max_num_batched_tokens)
        # Every padded decode size the fused path serves is a row count (it pads as graphs do).
        sizes = graph_batch_sizes(decode_rows)
        self.fused = self._fused_decode(config, model, kv_pool, fused_parts or FusedParts(),
                                        fused_decode.served_row_counts(sizes, model, config.fused_decode_fp8_mma))
        # The fused steps' attention: the step backend where it has the one-launch form, else
        # a triton backend of its own over the same pool (only fused decode steps use it).
        self.fused_attention = self._fused_attention_backend(model, kv_pool, max_pages_per_seq)
        if self.fused is not None:  # its CuTe GEMVs (the merging O's too) compile in workers meanwhile
            self.fused.start_precompile(self.fused_attention)
        fused_rows = self.fused.max_rows if self.fused is not None else 0
        log.info("step paths: %s", paths.log_line(fused_rows, self._fused_off_why))
        if self.fused is None:  # rows past max_num_seqs come from fused verify steps only
            decode_rows = config.max_num_seqs
        self.graph_sizes = graph_batch_sizes(decode_rows)
        self.max_num_seqs = config.max_num_seqs
        self.speculates = config.speculative_config is not None
        self.max_pages_per_seq = max_pages_per_seq
        self.batch = InputBatch(config.max_num_seqs, max_pages_per_seq, kv_pool.page_size)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        self.buffers = StepBuffers(config.max_num_batched_tokens, decode_rows,
                                   decode_rows * max_pages_per_seq, self.device,
                                   scratch_page=kv_pool.scratch_page, page_size=kv_pool.page_size)
        # Recorded once a step's host-to-device copies are queued (inputs, metadata, the
        # backend's plan), before its kernels: when it has fired, pinned staging memory may be
        # rewritten for the next step without waiting for this step's kernels.
        self._staged = torch.cuda.Event() if self.device.type == "cuda" else None
        # The last step, if its graph moved its inputs on (a load takes it: one steady step a
        # replay), and the last such replay (the steady step's own replay repeats it).
        self._moved_on: MovedOn | None = None
        self._last_moved: MovedOn | None = None
        self._moving_graphs: set[tuple] = set()  # the keys of the graphs that do
        # the stream the step is launched on (None off CUDA): this event's and the token buffers'
        self.current_stream = CurrentStream(self.device) if self.device.type == "cuda" else None

    def _fused_decode(self, config, model, kv_pool, parts, row_counts: list[int]):
        """The fused decode path (FusedDecode, GEMVs for each of row_counts) where
        config.fused_decode asks for it, or leaves it to auto and `auto_declines` finds nothing
        against it; else None. A part that `parts` does not name is on where it applies. Logs
        what was chosen (or why auto said no)."""
        self._fused_off_why = "fused_decode=False"
        if config.fused_decode is False:
            if parts.named_on():
                raise ValueError(f"fused parts {parts.named_on()} apply to the fused decode path, "
                                 f"which fused_decode=False turns off")
            return None
        how = "asked for" if config.fused_decode else "auto"
        if config.fused_decode is None:
            why = fused_decode.auto_declines(model, self.device, self.use_graphs, kv_pool)
            if why is not None:
                log.info("fused decode path: off (auto: %s)", why)
                self._fused_off_why = why
                return None
        pdl = _given_or(parts.pdl, fused_decode.has_pdl(self.device))
        rope = _given_or(parts.rope, not fused_decode.rope_refusals(model, kv_pool)
                         and fused_decode.ROPE_IN_ATTENTION != "all")  # "all": an A/B without it
        # On CUDA the one-launch attention is always there (the fused path's own triton
        # backend where the step backend lacks it); on the CPU only an interpreted one.
        attn = _given_or(parts.attn,
                         self.device.type == "cuda" or self.backend.supports_one_launch_decode)
        fused = fused_decode.FusedDecode(model, self.device, pdl=pdl, kv_pool=kv_pool if rope else None,
                                         one_launch_attention=attn, row_counts=row_counts,
                                         fp8_mma=config.fused_decode_fp8_mma)
        log.info("fused decode path: on (%s), PDL %s, RoPE in QKV %s, one-launch attention %s, "
                 "RoPE in the attention %s, fp8 on the tensor cores %s, rows %s (%d CuTe GEMVs)", how,
                 *("on" if x else "off" for x in (pdl, rope, attn, fused.rope_in_attention and not rope,
                                                  fused.fp8_mma)),
                 ", ".join(map(str, fused.row_counts)), sum(len(g.all()) for g in fused.gemvs.values()))
        for rows, why in fused.declined_rows.items():
            log.info("fused decode path: no GEMVs of %d rows for this shape (per-op there): %s", rows, why)
        return fused

    def _fused_attention_backend(self, model, kv_pool, max_pages_per_seq: int):
        """The attention of the steps the fused path serves (up to fused.max_rows decode rows)."""
        if self.fused is None or not self.fused.one_launch_attention:
            return self.decode_backend
        backend = next((b for b in (self.decode_backend, self.backend) if b.supports_one_launch_decode), None)
        if backend is None:
            from flashlet.attention.triton_backend import TritonBackend

            backend = TritonBackend(kv_pool, model.local.num_heads, max_batch_size=self.fused.max_rows,
                                    max_pages_per_seq=max_pages_per_seq)
        backend.fused_rows = self.fused.max_rows  # its steps attend in one launch (a long-context entry's)
        return backend

    def _fused_size(self, size: int) -> bool:
        """Does the fused path serve a pure-decode step padded to `size` rows?"""
        return self.fused is not None and size in self.fused.gemvs

    def decode_attention(self, size: int):
        """The attention backend a pure-decode step padded to `size` rows runs."""
        return self.fused_attention if self._fused_size(size) else self.decode_backend

    def greedy_token_sizes(self) -> list[int]:
        """The sizes a pure-decode step pads to that may end in the greedy tokens (the warm-up
        runs each through `greedy_tokens`, capturing its graph): the fused sizes up to
        max_num_seqs requests or, with speculation, a verify step's tokens as decode rows (its
        greedy requests' argmax decides them); then the per-op decode graphs' other sizes."""
        sizes = []
        if self.fused is not None:
            rows = min(self.graph_sizes[-1], self.fused.max_rows)
            widest = next(s for s in self.fused.row_counts if s >= rows)
            sizes = [s for s in self.fused.row_counts if s <= widest]
        if self.use_graphs and self.model.tp is None:
            sizes += [s for s in self.graph_sizes if s not in sizes and not self._fused_size(s)]
        return sizes

    def verify_graph_sizes(self) -> list[int]:
        """The fused sizes of 2+ rows whose verify steps (decode rows of one sequence) the
        warm-up captures graphs for: their attention compiles a look-back that plain steps' does
        not, so they key graphs of their own (`TritonBackend.looks_back`). Where the engine
        speculates; else none: a step of a short prompt whose every logit is asked for (prompt
        logprobs, an echo: the whole prompt at most `fused.max_rows` tokens) is the only other
        such step, and the first one compiles its attention's look-back variant and captures its
        graph when it comes (once an engine, the kernel from Triton's disk cache after the first:
        a short prompt's logprobs are rare; a speculating engine's verify steps are not)."""
        if not (self.speculates and self.use_graphs):
            return []
        return [s for s in self.greedy_token_sizes() if s > 1 and self._fused_size(s)]

    def wait_inputs_staged(self) -> None:
        """Block until the previous step's inputs have reached the device."""
        if self._staged is not None:
            self._staged.synchronize()

    def prepare(self, update) -> StepLayout:
        """The scheduler's BatchUpdate applied to the batch -> the step's layout (a verify step
        the fused path serves: as decode rows)."""
        return self.batch.apply(update, self.fused.max_rows if self.fused is not None else 0)

    def load(self, layout: StepLayout, fed_tokens: torch.Tensor | None = None,
             token_bucket: int | None = None):
        """A step's layout into the step buffers (padded for the graph it replays, if any) ->
        (input_ids, metadata) for `forward`. fed_tokens: the previous step's sampled tokens on
        the device, for the rows that take them (overlap). token_bucket: a mixed step's bucket
        when it is not the smallest that holds it (the warm-up's captures). A steady step
        whose inputs the last step's graph moved on (STEADY_REPLAY) loads nothing: its device
        views are the last step's."""
        moved, self._moved_on = self._moved_on, None
        if (moved is not None and layout.advances_last and fed_tokens is not None
                and fed_tokens.data_ptr() == moved.tokens.data_ptr()
                and moved.tokens.shape[0] == len(layout.query_lens)):
            return moved.input_ids, moved.meta
        self.wait_inputs_staged()  # the pinned staging is free again
        # A verify step it serves, as decode rows (the batch lays most out so already).
        if self.fused is not None and not layout.verify_as_decode_rows:
            page_size, rows = self.kv_pool.page_size, self.fused.max_rows
            layout = fused_decode.verify_as_decode_rows(layout, page_size, rows) or layout
        pad_to = self.graph_batch_size(layout) or self._fused_batch_size(layout)
        if pad_to is None and token_bucket is None:
            token_bucket = self.token_bucket(layout)
        return self.buffers.load(layout, fed_tokens, pad_to=pad_to, pad_tokens=token_bucket)

    def token_bucket(self, layout: StepLayout) -> int | None:
        """The token bucket of a mixed step that replays a mixed graph, or None (eager)."""
        n = layout.num_tokens
        # A verify step may sample more rows than max_seqs, which would move the fields after
        # logits_indices off the captured addresses (batch.arena_offsets): it runs eagerly.
        if (not self.use_mixed_graphs or layout.is_pure_decode or n > self.token_buckets[-1]
                or max(layout.num_seqs, layout.num_sampled) > self.buffers.max_seqs):
            return None
        bucket = next(t for t in self.token_buckets if t >= n)
        # (a step of more sequences than tokens, one with no row, would not fit its padding)
        return bucket if layout.num_seqs <= self.buffers.mixed_seqs(bucket) else None

    def graph_batch_size(self, layout: StepLayout, num_padding: int = 0) -> int | None:
        """The captured batch size that a step replays at, or None where it runs eagerly:
        graphs serve pure-decode steps in which every row samples. num_padding: rows of
        `layout` that are padding already."""
        return _padded_decode_size(layout, self.graph_sizes, num_padding) if self.use_graphs else None

    def _fused_batch_size(self, layout: StepLayout) -> int | None:
        """The row count an eager step that the fused path serves is padded to, or None."""
        return None if self.fused is None else _padded_decode_size(layout, self.fused.row_counts)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> logits [num_sampled, vocab] fp32 for meta.logits_indices."""
        size = self.graph_batch_size(meta.host, meta.num_padding)
        if size is not None:
            return self._replay(input_ids, meta, size)
        if self._fused_step(meta):
            self.fused_attention.plan(meta)
            self._mark_staged()
            logits = self.fused.logits(input_ids, meta.positions, self.fused_attention)
            return logits[: meta.num_seqs - meta.num_padding]
        backend = self._eager_backend(meta)
        backend.plan(meta)
        if meta.token_bucket is not None and self.use_mixed_graphs:
            hidden = self._replay_mixed(input_ids, meta)
            return self.model.compute_logits(hidden[meta.logits_indices])
        self._mark_staged()
        hidden = self.model(input_ids, meta.positions, backend)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def _eager_backend(self, meta: AttentionMetadata):
        """The backend of a step that replays no decode graph: the decode backend for pure
        decode, the step backend for a step with a chunk."""
        return self.decode_backend if meta.host.is_pure_decode else self.backend

    @torch.inference_mode()
    def forward_hidden(self, input_ids: torch.Tensor,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a step with embedding requests: (the final hidden states [T, hidden],
        the logits). Never a decode graph or the fused path: neither keeps the hidden states.
        A step that would replay a decode graph (a one-token prompt among decodes) runs the
        graph's body eagerly, on the same padded inputs."""
        size = self.graph_batch_size(meta.host, meta.num_padding)
        if size is not None:
            self.decode_backend.plan_graph(meta, size)
            self._mark_staged()
            hidden = self.model(input_ids, meta.positions, self.decode_backend)
            return hidden, self.model.compute_logits(hidden)[: size - meta.num_padding]
        backend = self._eager_backend(meta)
        backend.plan(meta)
        if meta.token_bucket is not None and self.use_mixed_graphs:
            hidden = self._replay_mixed(input_ids, meta)
        else:
            self._mark_staged()
            hidden = self.model(input_ids, meta.positions, backend)
        return hidden, self.model.compute_logits(hidden[meta.logits_indices])

    @staticmethod
    def _decode_sampling_every_row(meta: AttentionMetadata) -> bool:
        """A pure-decode step in which every real row samples (what a decode graph serves)."""
        host = meta.host
        return host.is_pure_decode and host.num_sampled == meta.num_seqs - meta.num_padding

    def _fused_step(self, meta: AttentionMetadata) -> bool:
        """Does the fused path serve this step: pure decode, padded to one of its row counts,
        every real row sampling."""
        return self._fused_size(meta.num_seqs) and self._decode_sampling_every_row(meta)

    @torch.inference_mode()
    def greedy_tokens(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The greedy tokens [rows] (int64, on the device) of a pure-decode step in which
        every row samples: on the fused path from the LM head's argmax epilogue (no logits),
        else from a per-op decode graph that ends in the argmax of the bf16 logits (one
        GPU without tensor parallelism: the workers replay the logits graph); None for any
        other step (call `forward`)."""
        if not self._decode_sampling_every_row(meta):
            return None
        size = self.graph_batch_size(meta.host, meta.num_padding)
        fused = self._fused_size(meta.num_seqs)
        if size is not None and (fused or self.model.tp is None):
            return self._replay(input_ids, meta, size, tokens=True)
        if not fused:  # per-op and eager (no graphs), or tensor parallel: call `forward`
            return None
        self.fused_attention.plan(meta)
        self._mark_staged()
        tokens = self.fused.token(input_ids, meta.positions, self.fused_attention)
        return tokens[: meta.num_seqs - meta.num_padding]

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _replay(self, input_ids: torch.Tensor, meta: AttentionMetadata, size: int,
                tokens: bool = False) -> torch.Tensor:
        again = self._last_moved
        if tokens and again is not None and again.meta is meta:
            # A steady step that loaded nothing: the last step's graph on the same views,
            # which that step checked against the capture (attention planned as then).
            self.decode_attention(size).plan_graph(meta, size)
            self._mark_staged()
            again.graph.replay()
            self._moved_on = again
            return again.tokens
        if meta.num_seqs != size or not self.buffers.holds(input_ids):
            raise ValueError("a decode step replayed from a CUDA graph must come from "
                             "ModelRunner.load (the graph reads its buffers, padded)")
        attn = self.decode_attention(size)
        attn.plan_graph(meta, size)
        key = (size, "tokens" if tokens else "logits") + attn.graph_key(meta)
        moves = key not in self.graphs and tokens and self._moves_inputs_on(size)  # (a capture's)
        if moves:
            self._moving_graphs.add(key)
        out = self._replay_graph(key, input_ids, meta, lambda: self._capture(input_ids, meta, tokens, moves),
                                 f"a decode step padded to {size}")
        real = out[: size - meta.num_padding]
        moved = MovedOn(self.graphs[key][0], input_ids, meta, real) if key in self._moving_graphs else None
        self._moved_on = self._last_moved = moved
        return real

    def _moves_inputs_on(self, size: int) -> bool:
        """Does the greedy graph of a step padded to `size` move its inputs on (steady replay)?"""
        return STEADY_REPLAY and self._fused_size(size) and self.buffers.scratch_page is not None

    def _input_advance(self, input_ids: torch.Tensor, meta: AttentionMetadata):
        """The greedy graph's last kernel where it moves its inputs on: a call on its tokens.
        Compiled here, on copies of the inputs, so that the capture compiles nothing. (Off
        CUDA, where only tests and tools stand in for graphs, the same through numpy.)"""
        from flashlet.kernels import step_advance

        fields = (input_ids, meta.positions, meta.slot_mapping, meta.kv_lens, meta.paged_kv_last_page_len)
        scratch, page_size = self.buffers.scratch_page, self.buffers.page_size
        advance = step_advance.advance_decode_inputs_host
        if input_ids.is_cuda:
            advance = step_advance.advance_decode_inputs
            advance(*(f.clone() for f in fields), torch.zeros_like(input_ids), scratch, page_size)
        return lambda tokens: advance(*fields, tokens, scratch, page_size)

    def _replay_mixed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the mixed graph of a step padded to its token bucket (the backend planned
        it) -> the final hidden states [bucket, hidden], the graph's output."""
        if input_ids.shape[0] != meta.token_bucket or not self.buffers.holds(input_ids):
            raise ValueError("a mixed step replayed from a CUDA graph must come from "
                             "ModelRunner.load (the graph reads its buffers, padded)")
        key = ("mixed", meta.token_bucket) + self.backend.mixed_graph_key(meta)
        return self._replay_graph(key, input_ids, meta, lambda: self._capture_mixed(input_ids, meta),
                                  f"a mixed step padded to {meta.token_bucket} tokens")

    def _replay_graph(self, key: tuple, input_ids: torch.Tensor, meta: AttentionMetadata,
                      capture, step: str) -> torch.Tensor:
        """Replay the graph under `key` (capture() makes it the first time) -> its output,
        once the step's inputs are checked to sit where the capture read them."""
        addresses = graph_input_addresses(input_ids, meta)
        if key not in self.graphs:
            self.graphs[key] = capture() + (addresses,)
        graph, out, captured = self.graphs[key]
        if addresses != captured:
            raise RuntimeError(f"{step} has its inputs at other addresses than the graph "
                               f"captured for it read: the step buffers placed it differently "
                               f"(batch.arena_offsets)")
        self._mark_staged()
        graph.replay()
        return out

    def _mark_staged(self) -> None:
        if self._staged is not None:
            self._staged.record(self.current_stream())

    def _decode_body(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     tokens: bool = False) -> torch.Tensor:
        """The forward of a padded decode step (the backend planned for it)."""
        if self._fused_size(input_ids.shape[0]):
            fused = self.fused.token if tokens else self.fused.logits
            return fused(input_ids, positions, self.fused_attention)
        hidden = self.model(input_ids, positions, self.decode_backend)
        return self.model.greedy_tokens(hidden) if tokens else self.model.compute_logits(hidden)

    def _capture(self, input_ids: torch.Tensor, meta: AttentionMetadata, tokens: bool = False,
                 moves: bool = False):
        """A graph of this decode step's forward: it reads the step's inputs at these
        addresses, the ones every later step padded to the same size has (StepBuffers).
        moves: the graph ends by moving its inputs on (steady replay)."""
        size = input_ids.shape[0]
        kind = ", ".join((["fused"] if self._fused_size(size) else []) + (["greedy tokens"] if tokens else []))
        log.info("capturing a CUDA graph for decode batch %d%s", size, f" ({kind})" if kind else "")
        # The input advance runs in the graph only: the runs before the capture repeat this
        # step on its own inputs, and its replay moves them on once.
        after = self._input_advance(input_ids, meta) if moves else None
        return self._capture_body(lambda: self._decode_body(input_ids, meta.positions, tokens), after)

    def _capture_mixed(self, input_ids: torch.Tensor, meta: AttentionMetadata):
        """A graph of this padded mixed step's forward up to the final hidden states."""
        log.info("capturing a CUDA graph for mixed steps of %d tokens %s", input_ids.shape[0],
                 self.backend.mixed_graph_key(meta))
        return self._capture_body(lambda: self.model(input_ids, meta.positions, self.backend))

    def _capture_body(self, body, after=None):
        """(graph, output) of `body()`, captured after CAPTURE_WARM_RUNS runs off the graph
        (lazy kernel compilation, the allocator), all graphs in one memory pool (they never run
        at once). after: a call on the output, captured after it and never run off the graph."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(CAPTURE_WARM_RUNS):
                body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = body()
            if after is not None:
                after(out)
        self.graph_pool = graph.pool()
        return graph, out


def graph_input_addresses(input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[int, ...]:
    """Where a padded step's device inputs are: what a graph captured on it reads."""
    return (input_ids.data_ptr(), meta.positions.data_ptr(), meta.slot_mapping.data_ptr(),
            meta.qo_indptr.data_ptr(), meta.paged_kv_indptr.data_ptr(),
            meta.paged_kv_indices.data_ptr(), meta.paged_kv_last_page_len.data_ptr(),
            meta.kv_lens.data_ptr())
