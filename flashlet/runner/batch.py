"""The step batch: the model runner's persistent rows, a step's layout built from them, and the
buffers that put it on the device. Every step goes through these: the engine's, the warm-up's
synthetic ones and the tests'.

- `InputBatch` is the persistent batch (the role of vLLM v1's InputBatch): a row per running
  request, holding its page table and where its next input token comes from. The scheduler
  emits what changed (scheduler.BatchUpdate: rows removed and added, page-table changes, the
  step's positions and tokens); `InputBatch.apply` takes it and builds the step's `StepLayout`
  in a few numpy calls over the step's rows: input ids, positions, slot mapping, FlashInfer's
  indptr / indices / last-page lengths, KV lengths, sampled rows, fed rows. It is the one
  builder: `build_layout(rows, page_size)`, the tests' and the warm-up's pure function of
  StepRows, puts its rows in a batch of their own. Tensor-parallel workers apply the same
  updates to their own InputBatch (parallel.py's step channel). A layout holds numpy arrays;
  each field's tensor is made when first read (loading a step reads the arrays).
- `StepBuffers.load(layout)` copies a layout into persistent buffers: every field in one arena
  of bytes, pinned on the host and uploaded to the device in ONE copy that does not block, so
  no tensor is allocated per step, and placed so that a decode step padded to a CUDA graph's
  batch size finds every field at the addresses that graph reads. Asked to (`pad_to`), it
  pads a pure-decode step to a captured batch size with rows that write to and read from the
  pool's scratch page, or (`pad_tokens`) pads any step to a token bucket and to as many
  sequences (max_seqs at most) for a mixed-step CUDA graph, and it feeds the previous step's
  sampled tokens (still on the device) into the rows that take them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from itertools import chain
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch

from flashlet.attention.base import AttentionMetadata
from flashlet.core.request import PLACEHOLDER
from flashlet.core.sampling import SamplingColumns, SamplingParams


class StepRow(NamedTuple):
    """One sequence's part of a step."""

    token_ids: Sequence[int]  # its new tokens (PLACEHOLDER: the previous step's sampled token)
    num_computed: int  # tokens before them whose K/V are in the pool: the first one's position
    page_ids: Sequence[int]  # its page table, covering num_computed + len(token_ids) tokens
    sample: bool = True  # its last row's logits are sampled
    feed_src: int = 0  # for a PLACEHOLDER token: its row in the previous step's sampled tokens


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


@dataclass
class StepLayout:
    """One step's batch layout as CPU tensors. T tokens (query rows) over B sequences; request
    b's rows are qo_indptr[b]:qo_indptr[b+1] and its pages
    paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]] (see attention/base.py).

    The builder (InputBatch.layout) makes a layout from its numpy arrays (`from_arrays`); each
    field's tensor, a view of its array, is made when the field is first read. Loading a step
    reads the arrays only, and a tensor from numpy costs ~3k instructions to make and ~2k to free (its deleter
    takes the GIL): eleven a step were a sixth of a one-row step's host time."""

    input_ids: torch.Tensor  # [T] int64 (0 in a fed row until the device writes the token)
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: the flat pool slot each new K/V row goes to
    qo_indptr: torch.Tensor  # [B + 1] int32
    paged_kv_indptr: torch.Tensor  # [B + 1] int32
    paged_kv_indices: torch.Tensor  # [pages] int32
    paged_kv_last_page_len: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32: KV length of each sequence including this step
    logits_indices: torch.Tensor  # [S] int64: the rows whose logits are sampled
    feed_rows: torch.Tensor = field(default_factory=_empty)  # [F] int64: rows whose input is
    feed_src: torch.Tensor = field(default_factory=_empty)  # previous step's sampled[feed_src]
    # (Not a field: no annotation.) A verify step laid out as one decode row per query token
    # (InputBatch._as_decode_rows, fused_decode.verify_as_decode_rows).
    verify_as_decode_rows = False
    # (Not a field either.) A steady decode step whose every column is the last step's plus one
    # and every row is fed the token it sampled last step, in order (no row starts a page):
    # what the fused greedy graph's own input advance makes on the device (ModelRunner.load).
    advances_last = False

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], verify_as_decode_rows: bool = False) -> "StepLayout":
        """The layout whose fields are these arrays (by name, in LAYOUT_DTYPES' dtypes); a copy
        of another layout passes on its `verify_as_decode_rows`."""
        layout = cls.__new__(cls)  # no tensors yet: __getattr__ makes each when first read
        layout.arrays = arrays
        layout.verify_as_decode_rows = verify_as_decode_rows
        return layout

    @classmethod
    def deferred(cls, build) -> "StepLayout":
        """A layout whose arrays `build()` makes when they are first read (a steady step's,
        which a runner that skips its load never reads)."""
        layout = cls.__new__(cls)
        layout.build_arrays = build
        return layout

    def __getattr__(self, name: str) -> torch.Tensor:
        # Reached only for attributes not set: a field of a layout made from arrays.
        arrays = self.__dict__.get("arrays")
        if arrays is None and "build_arrays" in self.__dict__ and name in LAYOUT_DTYPES:
            arrays = self.arrays
        if arrays is None or name not in LAYOUT_DTYPES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        make = self.__dict__.get("make_tensor")
        tensor = torch.from_numpy(arrays[name]) if make is None else make(name)
        setattr(self, name, tensor)
        return tensor

    @property
    def num_tokens(self) -> int:
        return len(self.arrays["positions"])

    @property
    def num_seqs(self) -> int:
        return len(self.arrays["kv_lens"])

    @property
    def num_sampled(self) -> int:
        return len(self.arrays["logits_indices"])

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """The fields by name as numpy arrays sharing the tensors' memory (the builders and
        StepBuffers.load give theirs: Tensor.numpy() costs about a microsecond a field), or
        a deferred layout's, built now."""
        build = self.__dict__.get("build_arrays")
        if build is not None:
            return build()
        return {name: getattr(self, name).numpy() for name in LAYOUT_DTYPES}

    @cached_property
    def query_lens(self) -> np.ndarray:
        """[B] query rows of each sequence."""
        return np.diff(self.arrays["qo_indptr"])

    @cached_property
    def is_pure_decode(self) -> bool:
        """Every sequence has exactly one query row."""
        return bool((self.query_lens == 1).all())

    @cached_property
    def max_query_len(self) -> int:
        return int(self.query_lens.max(initial=0))

    @cached_property
    def max_kv_len(self) -> int:
        return int(self.arrays["kv_lens"].max(initial=0))

    def without_feed(self) -> "StepLayout":
        """This layout with no fed rows: for a rank that gets its input ids whole (a worker)."""
        none = np.zeros(0, np.int64)
        return StepLayout.from_arrays({**self.arrays, "feed_rows": none, "feed_src": none},
                                      self.verify_as_decode_rows)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields by name (StepLayout(**tensors) rebuilds it)."""
        return {name: getattr(self, name) for name in LAYOUT_DTYPES}


_INT32 = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "kv_lens")
LAYOUT_DTYPES = {f.name: torch.int32 if f.name in _INT32 else torch.int64
                 for f in fields(StepLayout)}


class _DecodeColumns(NamedTuple):
    """A decode step's per-row columns, kept for the next step if it is the same rows."""

    version: int  # the batch's then: the same version, the same occupants
    rows: np.ndarray
    positions: np.ndarray  # int64
    slots: np.ndarray  # int64
    kv_ptr: np.ndarray  # int32, paged_kv_indptr
    indices: np.ndarray  # int32, paged_kv_indices
    kv_lens: np.ndarray  # int32
    indices_changed: bool = False  # a row's indexed pages were replaced since
    # Steady steps taken since these columns were made, each every row one token on and none
    # starting a page: a step's positions, slots and KV lengths are these + ahead (_advance).
    ahead: int = 0
    # How many such steps these columns allow before some row starts a page (None: not asked
    # yet; a fed steady step asks it once)
    room: int | None = None

    def moved_on(self) -> "_DecodeColumns":
        """The same columns with `ahead` added in (ahead 0)."""
        k = self.ahead
        if not k:
            return self
        return self._replace(positions=self.positions + k, slots=self.slots + k,
                             kv_lens=self.kv_lens + k, ahead=0, room=self.room - k)


class InputBatch:
    """The model runner's persistent batch: one row per request the scheduler runs, kept from
    step to step, so a step costs work for what changed, not for every row.

    A row holds what outlives a step: the request's page table (int32, a row of `page_table`),
    the row of the previous launched step's sampled tokens its next input comes from
    (`sample_index`, for overlap), its sampling parameters (`sampling`, numpy columns the
    sampler slices at the step's `sampled_rows`) and prompt length, and when it was added
    (`added_at`: the sampler keeps its penalty state per row, and starts it afresh for a new
    occupant). `apply(update)` takes the scheduler's BatchUpdate: rows removed (finished,
    preempted), rows added with their pages and parameters, page-table changes (a new page
    every page_size tokens, or the prefix cache's deduplication), and the step's columns (each
    scheduled request's id, first position, new tokens, whether it samples); it returns the
    step's StepLayout, built by `layout` in a few numpy calls over the step's rows (the one
    builder: `build_layout` goes through it too).

    Extensions fit the row: a row with several query tokens (a prefill chunk, or speculative
    decoding's newest token and k proposals) is a query length > 1; a verifying row samples its
    last k + 1 tokens (the update's `spec_lens`, widening `logits_indices` from one per sampling
    row to those query rows); a KV cache stored in another
    dtype than the model's changes the pool's pages, not the row, whose page ids and slots are
    dtype-free."""

    def __init__(self, max_seqs: int, max_pages_per_seq: int, page_size: int):
        self.page_size = page_size
        self.page_table = np.zeros((max_seqs, max_pages_per_seq), np.int32)
        self.num_pages = np.zeros(max_seqs, np.int64)  # valid entries of each row's table
        self.sample_index = np.zeros(max_seqs, np.int64)
        self.added_at = np.full(max_seqs, -1, np.int64)  # `version` when the row was taken
        self.row_of: dict[int, int] = {}  # request id -> row
        self.free_rows = list(range(max_seqs - 1, -1, -1))  # popped from the end: 0 first
        self.version = 0  # counts adds and removals: the same version, the same occupants
        self.sampling = SamplingColumns(max_seqs)
        # A decode step's constant columns (qo_indptr, logits_indices, query lengths), sliced.
        self._count_to(max_seqs)
        self._decode: _DecodeColumns | None = None  # the last decode step's (see _advance)
        self.num_prompt_tokens = np.zeros(max_seqs, np.int64)
        self.sampling_rows: list[int] = []  # the last step's sampling requests' rows, in order
        # One entry per sampled position of the last step (a row with several sampled query
        # tokens would repeat): its row, and the output index of the token it samples.
        self.sampled_rows = np.zeros(0, np.int64)
        self._sampled_kv_lens = np.zeros(0, np.int64)
        self._sampled_from: _DecodeColumns | None = None  # else the KV lengths are its, moved on
        self._output_index: np.ndarray | None = None
        self._last_rows: tuple[tuple, np.ndarray] = ((-1, None), np.zeros(0, np.int64))

    @classmethod
    def holding(cls, requests: Sequence) -> "InputBatch":
        """A batch whose rows hold these requests (no pages), each sampling, in this order: for
        tests and tools that call the sampler as the engine does."""
        return cls(max(len(requests), 1), 0, 1).hold(requests)

    def hold(self, requests: Sequence) -> "InputBatch":
        """Rows for exactly these requests (the others leave, new ones join with no pages; each
        row's sampling parameters are the request's), each sampling its next output token, in
        this order: a step's batch as tests and tools see it."""
        keep = {req.request_id for req in requests}
        for i in [i for i in self.row_of if i not in keep]:
            self.remove(i)
        for req in requests:
            if req.request_id not in self.row_of:
                self.add(req.request_id, [])
            row = self.row_of[req.request_id]
            self.sampling.set(row, req.params)
            self.num_prompt_tokens[row] = len(req.prompt_token_ids)
        self.sampling_rows = [self.row_of[req.request_id] for req in requests]
        self.sampled_rows = np.array(self.sampling_rows, np.int64)
        self._output_index = np.array([len(req.output_token_ids) for req in requests], np.int64)
        return self

    def apply(self, update, verify_decode_rows: int = 0) -> "StepLayout":
        """The scheduler's BatchUpdate into the rows -> the step's layout. The sampling rows'
        `sample_index` then point at their places in this step's sampled tokens.
        verify_decode_rows: a verify step of at most that many query tokens, each sampled (no
        prefill chunk), is laid out as one decode row per query token (`_as_decode_rows`)."""
        for request_id in update.removed:
            self.remove(request_id)
        for new_row in update.added:  # scheduler.NewRow: id, pages, parameters, prompt length
            self.add(*new_row)
        if update.pages:
            self._change_pages(update.pages)
        if update.steady:
            return self._advance(update.token_ids)
        rows = self._rows_of(update.request_ids)
        if verify_decode_rows and _samples_every_token(update, verify_decode_rows):
            return self._as_decode_rows(rows, update)
        layout = self.layout(rows, update.starts, update.token_ids, update.query_lens,
                             update.sample, update.spec_lens)
        self._decode = None
        if update.query_lens is None and update.sample is None and update.spec_lens is None:
            self._keep_decode(rows, layout.arrays)
        kv_lens = layout.arrays["kv_lens"]
        if update.sample is not None:
            sampled = np.asarray(update.sample, bool)
            rows, kv_lens = rows[sampled], kv_lens[sampled]
        self._note_sampled(rows, kv_lens)
        return layout

    def _as_decode_rows(self, rows: np.ndarray, update) -> "StepLayout":
        """A verify step whose every query token is sampled, as one decode row per token over
        its sequence's page-table row, at KV lengths position + 1: the layout that
        fused_decode.verify_as_decode_rows makes of the ragged one, built without it (a
        speculating step's host time is not overlapped). The per-token columns are Python
        ints (at most max_rows tokens: cheaper than numpy's calls on arrays that short), each
        made into an array once; a token's pages are a prefix of its row's table, so the page
        indices are those prefixes (views) joined: one numpy call, however long the context."""
        lens, starts, ps = update.query_lens, update.starts, self.page_size
        positions, token_rows, prefixes, slots, last_lens, kv_lens = [], [], [], [], [], []
        kv_ptr = [0]
        for row, start, n in zip(rows.tolist(), starts, lens):
            end = start + n
            if self.num_pages[row] <= (end - 1) // ps:
                raise ValueError("a row's page table holds fewer pages than its tokens need")
            table_row = self.page_table[row]
            # A page at a time (a verify row's k + 1 tokens mostly share one): its tokens'
            # causal prefixes are the table's first page + 1 pages, one view for them all, and
            # their slots and last-page lengths consecutive.
            position = start
            while position < end:
                page, offset = divmod(position, ps)
                run = min(end - position, ps - offset)  # the row's tokens on this page
                slot = int(table_row[page]) * ps + offset
                prefixes += [table_row[: page + 1]] * run
                kv_ptr += range(kv_ptr[-1] + page + 1, kv_ptr[-1] + (page + 1) * (run + 1),
                                page + 1)
                last_lens += range(offset + 1, offset + 1 + run)
                slots += range(slot, slot + run)
                position += run
            positions += range(start, end)
            kv_lens += range(start + 1, end + 1)  # each token's causal prefix, itself included
            token_rows += [row] * n
        num_tokens, token_ids = len(positions), update.token_ids
        if num_tokens >= len(self._counting):  # more decode rows than sequences
            self._count_to(num_tokens)
        # The columns of each dtype in one numpy call (a column is a row of it, contiguous):
        # a call costs about a microsecond, as much as this whole loop a token.
        if PLACEHOLDER in token_ids:  # (not from the engine: a verify step's tokens are read)
            positions_np, slots_np = np.array((positions, slots), np.int64)
            input_ids, feed_rows, feed_src = self._inputs(token_ids, np.array(token_rows, np.int64))
        else:
            input_ids, positions_np, slots_np = np.array((token_ids, positions, slots), np.int64)
            feed_rows = feed_src = self._counting[:0]
        last_page_len, kv_lens_np = np.array((last_lens, kv_lens), np.int32)
        layout = StepLayout.from_arrays(dict(
            input_ids=input_ids, positions=positions_np, slot_mapping=slots_np,
            qo_indptr=self._counting32[: num_tokens + 1],
            paged_kv_indptr=np.array(kv_ptr, np.int32), paged_kv_indices=np.concatenate(prefixes),
            paged_kv_last_page_len=last_page_len, kv_lens=kv_lens_np,
            logits_indices=self._counting[:num_tokens], feed_rows=feed_rows, feed_src=feed_src),
            verify_as_decode_rows=True)
        # the cached properties' values, known already (as _decode_layout's)
        layout.query_lens = self._ones32[:num_tokens]
        layout.is_pure_decode = True
        layout.max_query_len = 1 if num_tokens else 0
        self._decode = None
        self._note_sampled(rows, np.array([s + n for s, n in zip(starts, lens)], np.int64))
        return layout

    def _count_to(self, n: int) -> None:
        """The constant decode columns (_counting, _ones32) for steps of up to n rows."""
        self._counting = np.arange(n + 1, dtype=np.int64)
        self._counting32 = np.arange(n + 1, dtype=np.int32)
        self._ones32 = np.ones(n, np.int32)

    def _note_sampled(self, rows: np.ndarray, kv_lens: np.ndarray) -> None:
        if rows is not self.sampled_rows:  # (else the last step's rows, each sampling again)
            self.sample_index[rows] = self._counting[: len(rows)]
            self.sampling_rows = rows.tolist()
        self.sampled_rows, self._sampled_kv_lens, self._output_index = rows, kv_lens, None
        self._sampled_from = None

    def _keep_decode(self, rows: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Keep a decode step's columns (every row one token, every row sampling): the next
        step may be the same rows one token on (`_advance`)."""
        self._decode = _DecodeColumns(
            self.version, rows, arrays["positions"], arrays["slot_mapping"],
            arrays["paged_kv_indptr"], arrays["paged_kv_indices"], arrays["kv_lens"])

    def _room(self, positions: np.ndarray) -> int:
        """Steps every row can move on from `positions` before one starts a page."""
        return int((self.page_size - 1 - positions % self.page_size).min(initial=self.page_size))

    def _advance(self, token_ids: Sequence[int] | None) -> "StepLayout":
        """A steady decode step's layout: the last step's rows, in its order, each computing
        the token after its last one (token_ids; None: each the token it sampled, fed), moved
        on from the last step's columns. Most rows stay on their page: their slot moves by one
        and their page indices stay; a row whose token starts a page has that page inserted
        after its others. (Few numpy calls: each costs microseconds, more after a forward has
        evicted the host's caches, and a steady step should cost fewer than a rebuild. Where
        every row is fed and none starts a page, none: `_advance_fed`.)"""
        last = self._decode
        if last is None or last.version != self.version:
            raise ValueError("a steady update needs the last step to be a decode step of the "
                             "same rows, each sampling")
        if token_ids is None and not last.indices_changed:
            if last.room is None:  # (ahead is 0 until room is known)
                last = self._decode = last._replace(room=self._room(last.positions))
            if last.ahead < last.room:
                return self._advance_fed(last)
        last = self._decode = last.moved_on()
        rows, positions = last.rows, last.positions + 1
        if last.indices_changed:  # the prefix cache swapped pages in: gather them all again
            layout = self._fresh_decode_layout(rows, positions, token_ids)
            self._keep_decode(rows, layout.arrays)
            self._note_sampled(rows, layout.arrays["kv_lens"])
            return layout
        page, offset = np.divmod(positions, self.page_size)
        kv_ptr, indices, slots = last.kv_ptr, last.indices, last.slots + 1
        starting = np.flatnonzero(offset == 0)  # rows whose token is its page's first
        if len(starting):
            kv_ptr, indices = self._insert_pages(last, starting, page[starting], slots)
        kv_lens = last.kv_lens + 1
        self._decode = _DecodeColumns(self.version, rows, positions, slots, kv_ptr, indices,
                                      kv_lens)
        self._note_sampled(rows, kv_lens)
        return self._decode_layout(rows, positions, slots, kv_ptr, indices, offset, kv_lens,
                                   token_ids)

    def _advance_fed(self, last: "_DecodeColumns") -> "StepLayout":
        """`_advance` where every row is fed its own last token and none starts a page: the
        columns are only counted on (`ahead`), and the layout's arrays are made if it is read
        (a runner whose graph moved its inputs on reads none: StepLayout.advances_last)."""
        cols = self._decode = last._replace(ahead=last.ahead + 1)
        self._note_sampled(cols.rows, None)
        self._sampled_from = cols
        n = len(cols.rows)

        def build() -> dict[str, np.ndarray]:
            at = cols.moved_on()
            return self._decode_arrays(at.rows, at.positions, at.slots, at.kv_ptr, at.indices,
                                       at.positions % self.page_size, at.kv_lens, None)

        layout = StepLayout.deferred(build)
        layout.query_lens = self._ones32[:n]  # (the cached properties, known already)
        layout.is_pure_decode = True
        layout.max_query_len = 1 if n else 0
        layout.advances_last = True
        return layout

    def _insert_pages(self, last: "_DecodeColumns", starting: np.ndarray, page: np.ndarray,
                      slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The last step's page indices with page `page[i]` of row `starting[i]` appended to
        that row's run, and that row's slot (its page's first) set -> (indptr, indices)."""
        rows = last.rows[starting]
        if (self.num_pages[rows] <= page).any():
            raise ValueError("a row's page table holds fewer pages than its tokens need")
        new = self.page_table[rows, page]
        slots[starting] = new
        slots[starting] *= self.page_size
        # Row starting[i]'s run ends at kv_ptr[starting[i] + 1], moved on by the i pages
        # inserted before it (np.insert does the same with more calls).
        at = last.kv_ptr[starting + 1] + self._counting32[: len(starting)]
        indices = np.empty(len(last.indices) + len(starting), np.int32)
        kept = np.ones(len(indices), bool)
        kept[at] = False
        indices[kept] = last.indices
        indices[at] = new
        # Boundary j moves on by the pages inserted before it: those of rows before row j.
        moved = np.searchsorted(starting, self._counting32[: len(last.kv_ptr)])
        return np.add(last.kv_ptr, moved, dtype=np.int32), indices

    @property
    def sampled_output_index(self) -> np.ndarray:
        """The output index of the token each of the last step's sampled positions samples (a
        seeded row's noise is keyed by it); made when first read, as few steps need it."""
        if self._output_index is None:
            kv_lens = self._sampled_kv_lens
            cols = self._sampled_from
            if cols is not None:  # a steady step's columns, counted on
                kv_lens = cols.kv_lens + cols.ahead
            # A row sampling after its last token (KV length n) samples output token n - prompt.
            self._output_index = kv_lens - self.num_prompt_tokens[self.sampled_rows]
        return self._output_index

    def _rows_of(self, request_ids: list[int]) -> np.ndarray:
        """The rows of these requests; the last step's when they are the same requests, in the
        same order, of the same batch version (a steady decode batch: no lookups)."""
        last_key, last_rows = self._last_rows
        if last_key[0] != self.version or last_key[1] != request_ids:
            last_rows = np.fromiter(map(self.row_of.__getitem__, request_ids), np.int64,
                                    len(request_ids))
            self._last_rows = (self.version, request_ids), last_rows
        return last_rows

    def add(self, request_id: int, page_ids: Sequence[int],
            params: SamplingParams | None = None, num_prompt_tokens: int = 0) -> int:
        """A row for a request, holding its page table and sampling parameters (None: greedy)."""
        if request_id in self.row_of:
            raise ValueError(f"request {request_id} has a row already")
        if not self.free_rows:
            raise ValueError(f"the batch holds {len(self.page_table)} rows, all taken")
        row = self.row_of[request_id] = self.free_rows.pop()
        self.version += 1
        self.added_at[row] = self.version
        self.set_pages(row, 0, page_ids)
        self.sampling.set(row, params or _GREEDY)
        self.num_prompt_tokens[row] = num_prompt_tokens
        return row

    def remove(self, request_id: int) -> None:
        """Free a request's row (a no-op for one that never had a row: aborted while waiting)."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.version += 1
            self.num_pages[row] = 0
            self.free_rows.append(row)

    def set_pages(self, row: int, first: int, page_ids: Sequence[int]) -> None:
        """Row `row`'s page table from entry `first` on is page_ids (and ends there)."""
        end = first + len(page_ids)
        if end > self.page_table.shape[1]:
            raise ValueError(f"a page table of {end} pages; rows hold "
                             f"{self.page_table.shape[1]}")
        self.page_table[row, first:end] = page_ids
        self.num_pages[row] = end

    def pages_of(self, request_id: int) -> list[int]:
        """A request's page table as its row holds it."""
        row = self.row_of[request_id]
        return self.page_table[row, : self.num_pages[row]].tolist()

    def _change_pages(self, changes: list[tuple[int, int, list[int]]]) -> None:
        """Page-table changes (request id, first entry, ids from it on) in one numpy write:
        most are one appended page each, and a write a row cost more than the rest of them."""
        if len(changes) == 1:  # one request's (a stream's new page, or a verify step's trim)
            request_id, first, page_ids = changes[0]
            row = self.row_of[request_id]
            if self._decode is not None and self.num_pages[row] > first:
                self._decode = self._decode._replace(indices_changed=True)
            self.set_pages(row, first, page_ids)
            return
        rows, columns, ids, ends, firsts = [], [], [], {}, []
        for request_id, first, page_ids in changes:
            row, end = self.row_of[request_id], first + len(page_ids)
            rows += [row] * len(page_ids)
            columns += range(first, end)
            ids += page_ids
            ends[row] = end
            firsts.append(first)
        if max(ends.values()) > self.page_table.shape[1]:
            raise ValueError(f"a page table of {max(ends.values())} pages; rows hold "
                             f"{self.page_table.shape[1]}")
        changed = list(ends)
        # A change from inside a row's table (not an append) replaces entries a step read.
        if self._decode is not None and (self.num_pages[changed] > firsts).any():
            self._decode = self._decode._replace(indices_changed=True)
        self.page_table[rows, columns] = ids
        self.num_pages[changed] = list(ends.values())

    def layout(self, rows: np.ndarray, starts: Sequence[int], token_ids: Sequence[int],
               query_lens: Sequence[int] | None = None, sample: Sequence[bool] | None = None,
               spec_lens: Sequence[int] | None = None) -> "StepLayout":
        """The layout of a step over `rows` (in this order): row i computes its tokens from
        position starts[i]; token_ids holds every row's new tokens, query_lens[i] of them
        (None: one each, a decode step); sample[i] (None: every row) says whether its last
        token's logits are sampled; spec_lens[i] (None: 0 each), how many of its tokens before
        the last are speculative proposals, whose logits are sampled too (a verify step). A
        PLACEHOLDER token takes the previous step's sampled token of its row (sample_index)."""
        starts = np.array(starts, np.int64)
        if query_lens is None and sample is None and spec_lens is None:
            return self._fresh_decode_layout(rows, starts, token_ids)
        ps, width, i32, i64 = self.page_size, self.page_table.shape[1], np.int32, np.int64
        num_seqs, num_tokens = len(rows), len(token_ids)
        if query_lens is None:  # one token a row: row i is token i
            lens = self._ones32[:num_seqs]
            qo = self._counting[: num_seqs + 1]
            positions, token_rows = starts, rows
        else:
            lens = np.array(query_lens, i64)
            qo = _indptr(lens)
            seq = np.repeat(np.arange(num_seqs), lens)
            positions = np.arange(num_tokens) + (starts - qo[:-1])[seq]
            token_rows = rows[seq]
        kv_lens = starts + lens
        page, offset = np.divmod(positions, ps)
        pages = -(-kv_lens // ps)  # each sequence's pages up to its last token
        last_page_len = kv_lens - np.maximum(pages - 1, 0) * ps  # 0 for no KV at all
        logits = qo[1:] - 1
        if _every_token_sampled(num_tokens, num_seqs, spec_lens, sample):
            logits = np.arange(num_tokens)
        elif spec_lens is not None:
            logits = _verify_rows(logits, np.asarray(spec_lens, i64), sample)
        elif sample is not None:
            logits = logits[np.asarray(sample, bool)]
        kv_ptr, indices = self._gather_pages(rows, pages)
        slots = np.multiply(self.page_table.ravel()[token_rows * width + page], ps,
                            dtype=i64) + offset
        input_ids, feed_rows, feed_src = self._inputs(token_ids, token_rows)
        arrays = dict(input_ids=input_ids, positions=positions, slot_mapping=slots,
                      qo_indptr=qo.astype(i32), paged_kv_indptr=kv_ptr.astype(i32),
                      paged_kv_indices=indices, paged_kv_last_page_len=last_page_len.astype(i32),
                      kv_lens=kv_lens.astype(i32), logits_indices=logits,
                      feed_rows=feed_rows, feed_src=feed_src)
        return StepLayout.from_arrays(arrays)

    def _fresh_decode_layout(self, rows: np.ndarray, starts: np.ndarray,
                             token_ids: Sequence[int]) -> "StepLayout":
        """A decode step (one token a row, every row sampling) built from its rows' tables."""
        page, offset = np.divmod(starts, self.page_size)
        kv_ptr, indices = self._gather_pages(rows, page + 1)
        # a decode token's page is its sequence's last one
        slots = np.multiply(indices[kv_ptr[1:] - 1], self.page_size, dtype=np.int64) + offset
        return self._decode_layout(rows, starts, slots, kv_ptr.astype(np.int32), indices,
                                   offset, (starts + 1).astype(np.int32), token_ids)

    def _decode_layout(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       kv_ptr: np.ndarray, indices: np.ndarray, offset: np.ndarray,
                       kv_lens: np.ndarray, token_ids: Sequence[int] | None) -> "StepLayout":
        """A decode step's layout from its per-row columns (offset: each token's in its page;
        the rest are counts). token_ids None: every row's token is fed from the step before."""
        n = len(rows)
        arrays = self._decode_arrays(rows, positions, slots, kv_ptr, indices, offset, kv_lens, token_ids)
        layout = StepLayout.from_arrays(arrays)
        # the cached properties' values, known already
        layout.query_lens = self._ones32[:n]
        layout.is_pure_decode = True
        layout.max_query_len = 1 if n else 0
        return layout

    def _decode_arrays(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       kv_ptr: np.ndarray, indices: np.ndarray, offset: np.ndarray,
                       kv_lens: np.ndarray, token_ids: Sequence[int] | None) -> dict[str, np.ndarray]:
        """`_decode_layout`'s fields by name."""
        n = len(rows)
        if token_ids is None:
            input_ids, feed_rows = np.zeros(n, np.int64), self._counting[:n]
            feed_src = self.sample_index[rows]
        else:
            input_ids, feed_rows, feed_src = self._inputs(token_ids, rows)
        return dict(input_ids=input_ids, positions=positions, slot_mapping=slots,
                    qo_indptr=self._counting32[: n + 1], paged_kv_indptr=kv_ptr,
                    paged_kv_indices=indices,
                    paged_kv_last_page_len=np.add(offset, 1, dtype=np.int32), kv_lens=kv_lens,
                    logits_indices=self._counting[:n], feed_rows=feed_rows, feed_src=feed_src)

    def _gather_pages(self, rows: np.ndarray, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's first pages[i] page-table entries, concatenated -> (indptr, indices)."""
        if (self.num_pages[rows] < pages).any():
            raise ValueError("a row's page table holds fewer pages than its tokens need")
        kv_ptr = _indptr(pages)
        width = self.page_table.shape[1]
        # one gather over the flat table
        at = np.repeat(rows * width - kv_ptr[:-1], pages) + np.arange(kv_ptr[-1])
        return kv_ptr, self.page_table.ravel()[at]

    def _inputs(self, token_ids: Sequence[int], token_rows: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, fed rows, their sources): a PLACEHOLDER token's row is fed, from its
        request's place in the previous step's sampled tokens, and holds 0 until then."""
        num_tokens, num_fed = len(token_ids), token_ids.count(PLACEHOLDER)
        if num_tokens and num_fed == num_tokens:  # every token fed
            return (np.zeros(num_tokens, np.int64), self._counting[:num_tokens],
                    self.sample_index[token_rows])
        if not num_fed:  # every token known (a verify step's are: its rows' tokens were read)
            return np.array(token_ids, np.int64), self._counting[:0], self._counting[:0]
        input_ids = np.array(token_ids, np.int64)
        feed_rows = (input_ids == PLACEHOLDER).nonzero()[0]
        input_ids[feed_rows] = 0  # the device writes the real token in (StepBuffers.load)
        return input_ids, feed_rows, self.sample_index[token_rows[feed_rows]]


_GREEDY = SamplingParams()


def build_layout(rows: Iterable[StepRow], page_size: int) -> StepLayout:
    """The layout of a step whose sequences are `rows` (StepRow, or 5-tuples in its order):
    the rows put in a batch of their own, whose `layout` builds it (the engine's one path)."""
    rows = [StepRow(*row) for row in rows]
    batch = InputBatch(max(len(rows), 1), max((len(r.page_ids) for r in rows), default=0),
                       page_size)
    for i, row in enumerate(rows):
        batch.add(i, row.page_ids)
        batch.sample_index[i] = row.feed_src
    lens = [len(row.token_ids) for row in rows]
    return batch.layout(np.arange(len(rows)), [row.num_computed for row in rows],
                        list(chain.from_iterable(row.token_ids for row in rows)),
                        None if all(n == 1 for n in lens) else lens, [row.sample for row in rows])


def _samples_every_token(update, most: int) -> bool:
    """Is this (not steady) update a step of decode and verify rows only, every query token
    sampled, at most `most` of them."""
    num_tokens = len(update.token_ids)
    return num_tokens <= most and _every_token_sampled(num_tokens, len(update.request_ids),
                                                       update.spec_lens, update.sample)


def _every_token_sampled(num_tokens: int, num_seqs: int, spec_lens: Sequence[int] | None,
                         sample: Sequence[bool] | None) -> bool:
    """Does a verify step sample every query token: each row samples, and its tokens are its
    last 1 + spec_lens (no prefill chunk before them; a row's query holds at least those)."""
    return (spec_lens is not None and (sample is None or all(sample))
            and num_tokens == num_seqs + sum(spec_lens))


def _verify_rows(last_rows: np.ndarray, spec_lens: np.ndarray,
                 sample: Sequence[bool] | None) -> np.ndarray:
    """The sampled token rows of a verify step: each sampling sequence's last 1 + spec_lens
    rows, in order (last_rows: each sequence's last token row)."""
    counts = spec_lens + 1
    if sample is not None:
        counts = np.where(np.asarray(sample, bool), counts, 0)
    first = np.repeat(last_rows - counts + 1, counts)
    return first + np.arange(counts.sum()) - np.repeat(_indptr(counts)[:-1], counts)


def _indptr(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


# The step arena: every field of a step in one byte buffer, in this order, each at a multiple
# of ARENA_ALIGN bytes. paged_kv_indices, the one field whose length varies at a fixed padded
# batch size, comes last, and the fields that hold at most one entry per sequence reserve one
# per sequence: so every field's offset is a function of the step's token and sequence counts,
# and a decode step padded to a CUDA graph's batch size finds each field where the graph's
# capture did (StepBuffers).
ARENA_ORDER = ("input_ids", "positions", "slot_mapping", "qo_indptr", "paged_kv_indptr",
               "paged_kv_last_page_len", "kv_lens", "logits_indices", "feed_rows", "feed_src",
               "paged_kv_indices")
ARENA_ALIGN = 16  # bytes; Triton specialises a kernel on pointers aligned to 16, as torch's are
_NUMPY_DTYPES = {name: np.int32 if LAYOUT_DTYPES[name] == torch.int32 else np.int64
                 for name in ARENA_ORDER}


class _Placement(NamedTuple):
    """Where the fields before the page indices go for one step shape (their lengths follow
    from it: StepBuffers._lengths)."""

    shape: tuple[int, int, int, int]  # (tokens, sequences, sampled rows, fed rows), padded
    lengths: dict[str, int]
    offsets: dict[str, int]  # bytes
    indices_offset: int  # bytes: where the page indices start
    host: dict[str, np.ndarray]
    dev: dict[str, torch.Tensor]


def _field(typed_arena, offset: int, n: int):
    """n entries at byte `offset` of an arena viewed as one dtype (numpy or torch)."""
    start = offset // typed_arena.itemsize
    return typed_arena[start : start + n]
_AT_MOST_ONE_PER_SEQ = frozenset(("logits_indices", "feed_rows", "feed_src"))


def arena_offsets(lengths: dict[str, int]) -> dict[str, int]:
    """Byte offset of each field in the arena, for a step whose fields have `lengths` entries;
    the value under "end" is where the last field ends."""
    num_seqs = lengths["kv_lens"]
    offsets, offset = {}, 0
    for name in ARENA_ORDER:
        offset = -(-offset // ARENA_ALIGN) * ARENA_ALIGN
        offsets[name] = offset
        n = lengths[name]
        if name in _AT_MOST_ONE_PER_SEQ:
            n = max(n, num_seqs)
        offset += n * LAYOUT_DTYPES[name].itemsize
    offsets["end"] = offset
    return offsets


class StepBuffers:
    """Persistent buffers that a step's layout is loaded into: one arena of bytes holding every
    field (ARENA_ORDER), on CUDA a pinned host arena uploaded to a device arena in one copy
    that does not block the host; on the CPU one arena, which is both.

    A CUDA graph reads its inputs at the addresses its capture saw. Each field's offset is a
    function of the step's token and sequence counts (`arena_offsets`), so every pure-decode
    step padded to batch size b (b tokens, b sequences), and every step padded to a token
    bucket (T_b tokens, `mixed_seqs(T_b)` sequences), puts every field at the same address,
    whatever its page count; ModelRunner still checks the addresses before each replay."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, device,
                 scratch_page: int | None = None, page_size: int = 1):
        """max_pages: page-table entries of one step (one more per sequence is kept for the
        padding rows). scratch_page / page_size: the pool's page that padding rows use."""
        self.device = torch.device(device)
        self.scratch_page, self.page_size = scratch_page, page_size
        self.max_seqs = max_seqs
        max_tokens = max(max_tokens, max_seqs)  # a padded decode step has max_seqs tokens
        self.capacity = dict(input_ids=max_tokens, positions=max_tokens, slot_mapping=max_tokens,
                             qo_indptr=max_seqs + 1, paged_kv_indptr=max_seqs + 1,
                             paged_kv_indices=max_pages + max_seqs,
                             paged_kv_last_page_len=max_seqs, kv_lens=max_seqs,
                             logits_indices=max_tokens, feed_rows=max_seqs, feed_src=max_seqs)
        # Every field at its capacity fits, so every step whose fields fit their capacities does.
        size = -(-arena_offsets(self.capacity)["end"] // 8) * 8  # whole int64 words
        self.staged = self.device.type == "cuda"  # else the host arena is the device's
        self.host_arena = torch.zeros(size, dtype=torch.uint8, pin_memory=self.staged)
        self.dev_arena = (torch.zeros(size, dtype=torch.uint8, device=self.device)
                          if self.staged else self.host_arena)
        self._base = self.dev_arena.data_ptr()
        # The arenas as arrays of each field dtype, made once: a field is then one slice of
        # one of them (its offset is a multiple of ARENA_ALIGN, so of every dtype's size).
        host_np = self.host_arena.numpy()
        self._host = {dtype: host_np.view(dtype) for dtype in (np.int32, np.int64)}
        self._dev = {dtype: self.dev_arena.view(dtype) for dtype in (torch.int32, torch.int64)}
        self._pinned = {dtype: self.host_arena.view(dtype) for dtype in (torch.int32, torch.int64)}
        # The last step's placement, kept while steps repeat its shape (a steady decode batch
        # does): a torch view costs microseconds, and a step reads ten.
        self._placed: _Placement | None = None
        self._indices_views: tuple = (None, None, None)  # ((offset, count), host view, device view)
        # (placement, real rows) of the last step if it was padded to decode rows: its padding
        # rows are in the arena (see load)
        self._padded_as: tuple[_Placement, int] | None = None
        # 0, 1, ..., max_seqs: the padding rows' indptr entries are slices of it (see _pad)
        self._counting = np.arange(max_seqs + 1, dtype=np.int64)

    def holds(self, input_ids: torch.Tensor) -> bool:
        """Are these the input ids of a step loaded here (the arena's first field)?"""
        return input_ids.data_ptr() == self._base

    @classmethod
    def for_layout(cls, layout: StepLayout, device) -> "StepBuffers":
        """Buffers just large enough for `layout` (tests and tools; the engine keeps one set)."""
        arrays = layout.arrays
        return cls(layout.num_tokens, max(layout.num_seqs, len(arrays["feed_rows"])),
                   len(arrays["paged_kv_indices"]), device)

    def load(self, layout: StepLayout, fed_tokens: torch.Tensor | None = None,
             pad_to: int | None = None, pad_tokens: int | None = None
             ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Copy `layout` into the buffers -> (input_ids [T], metadata), views of the device
        arena. fed_tokens: the previous step's sampled tokens on the device, which the fed
        rows take. pad_to: pad a pure-decode step to that many sequences (a CUDA graph's
        batch) with rows on the scratch page. pad_tokens: pad any step to that many tokens (a
        mixed-step graph's bucket) and to as many sequences, max_seqs at most (see `_pad_mixed`).
        The pinned staging must be free (the previous step's copy done:
        ModelRunner.wait_inputs_staged)."""
        arrays = layout.arrays
        num_seqs, num_tokens = len(arrays["kv_lens"]), len(arrays["input_ids"])
        seqs_to, tokens_to = num_seqs, num_tokens
        if pad_tokens is not None:
            self._check_token_padding(layout, pad_tokens)
            seqs_to, tokens_to = self.mixed_seqs(pad_tokens), pad_tokens
        elif pad_to is not None and pad_to > num_seqs:
            self._check_padding(layout, pad_to)
            seqs_to = tokens_to = pad_to
        num_pages = len(arrays["paged_kv_indices"])
        # the fixed fields' lengths follow from these four (see _lengths)
        shape = (tokens_to, seqs_to, len(arrays["logits_indices"]), len(arrays["feed_rows"]))
        placed = self._placed
        if placed is None or placed.shape != shape:
            placed = self._placed = self._place(shape)
        # Rows past num_seqs that the arena holds as this step's padding already: the last
        # step's, of the same shape and rows (a speculating stream's verify steps, each
        # padded to the same row count, write them once).
        padded_as, self._padded_as = self._padded_as, None
        # A padded decode row has a scratch page of its own; a padded mixed sequence has none.
        num_indices = num_pages + (seqs_to - num_seqs if pad_tokens is None else 0)
        self._check_fits({"paged_kv_indices": num_indices})
        at = placed.indices_offset
        views = self._indices_views  # the page indices' views: the last step's, if they fit
        if views[0] != (at, num_indices):  # (a steady decode row adds a page every page_size steps)
            views = self._indices_views = ((at, num_indices),
                                           _field(self._host[np.int32], at, num_indices),
                                           _field(self._dev[torch.int32], at, num_indices))
        host = {**placed.host, "paged_kv_indices": views[1]}
        dev = {**placed.dev, "paged_kv_indices": views[2]}
        for name, values in arrays.items():
            if len(values):
                host[name][: len(values)] = values
        if pad_tokens is not None:
            self._pad_mixed(host, num_seqs, num_tokens, num_pages)
        elif seqs_to > num_seqs:
            held = padded_as is not None and padded_as[0] is placed and padded_as[1] == num_seqs
            self._pad(host, host["paged_kv_indices"], num_seqs, num_pages, seqs_to, rows_held=held)
            self._padded_as = (placed, num_seqs)
        if self.staged:  # the whole step in one copy
            end = at + num_indices * LAYOUT_DTYPES["paged_kv_indices"].itemsize
            self.dev_arena[:end].copy_(self.host_arena[:end], non_blocking=True)
        if len(arrays["feed_rows"]):
            self._feed(dev, placed, arrays["feed_rows"], fed_tokens)
        staged = StepLayout.from_arrays(host, layout.verify_as_decode_rows)
        known = layout.__dict__.get("is_pure_decode")  # (a decode builder's layout: set)
        if known is not None and pad_tokens is None:  # padding rows (pad_to) are decode rows
            staged.is_pure_decode = known
        if self.staged:  # tensors read off the pinned arena, so copies from them do not block
            offsets = {**placed.offsets, "paged_kv_indices": at}
            counts = {**placed.lengths, "paged_kv_indices": num_indices}
            staged.make_tensor = lambda name: _field(self._pinned[LAYOUT_DTYPES[name]],
                                                     offsets[name], counts[name])
        meta = AttentionMetadata(
            host=staged, positions=dev["positions"], slot_mapping=dev["slot_mapping"],
            qo_indptr=dev["qo_indptr"], paged_kv_indptr=dev["paged_kv_indptr"],
            paged_kv_indices=dev["paged_kv_indices"],
            paged_kv_last_page_len=dev["paged_kv_last_page_len"],
            kv_lens=dev["kv_lens"], logits_indices=dev["logits_indices"],
            num_padding=seqs_to - num_seqs, token_bucket=pad_tokens)
        return dev["input_ids"], meta

    @staticmethod
    def _lengths(shape: tuple[int, int, int, int]) -> dict[str, int]:
        """The lengths of the fields before the page indices (those whose offsets the indices'
        length never moves) for a step loaded as `shape`: its tokens and sequences, each
        counting the padding's (a padded decode row is both, plus one scratch page in the page
        indices), its sampled rows and its fed rows."""
        tokens, seqs, sampled, fed = shape
        return dict(input_ids=tokens, positions=tokens, slot_mapping=tokens, qo_indptr=seqs + 1,
                    paged_kv_indptr=seqs + 1, paged_kv_last_page_len=seqs, kv_lens=seqs,
                    logits_indices=sampled, feed_rows=fed, feed_src=fed)

    def _place(self, shape: tuple[int, int, int, int]) -> "_Placement":
        """Where the fields before the page indices go for a step of this shape, and their views."""
        lengths = self._lengths(shape)
        self._check_fits(lengths)
        offsets = arena_offsets({**lengths, "paged_kv_indices": 0})
        host = {name: _field(self._host[_NUMPY_DTYPES[name]], offsets[name], n)
                for name, n in lengths.items()}
        dev = {name: _field(self._dev[LAYOUT_DTYPES[name]], offsets[name], lengths[name])
               for name in _ON_DEVICE if name != "paged_kv_indices"}
        dev["feed_src"] = _field(self._dev[torch.int64], offsets["feed_src"], lengths["feed_src"])
        return _Placement(shape, lengths, offsets, offsets["paged_kv_indices"], host, dev)

    def _check_fits(self, lengths: dict[str, int]) -> None:
        for name, n in lengths.items():
            if n > self.capacity[name]:
                raise ValueError(f"the step's {name} has {n} entries; "
                                 f"the buffers hold {self.capacity[name]}")

    def _feed(self, dev: dict[str, torch.Tensor], placed: "_Placement", rows: np.ndarray,
              fed_tokens: torch.Tensor | None) -> None:
        """The fed rows' input ids <- fed_tokens[feed_src], on the device. Fed rows ascend
        (InputBatch.layout); where they are consecutive (every decode row of an overlapped step,
        in the usual order) that is one gather straight into them, else a gather and a
        scatter."""
        if fed_tokens is None:
            raise ValueError("the step has fed rows but no previous step's tokens were given")
        count, first = len(rows), int(rows[0])
        feed_src = dev["feed_src"]
        if rows[-1] - first == count - 1:  # (every row fed: the input ids' own view, no slice)
            into = dev["input_ids"]
            if count != into.shape[0]:
                into = into[first : first + count]
            torch.index_select(fed_tokens, 0, feed_src, out=into)
        else:
            feed_rows = _field(self._dev[torch.int64], placed.offsets["feed_rows"], count)
            dev["input_ids"].index_copy_(0, feed_rows, fed_tokens.index_select(0, feed_src))

    def _check_padding(self, layout: StepLayout, size: int) -> None:
        if not layout.is_pure_decode:
            raise ValueError("only a pure-decode step is padded to a CUDA-graph batch size")
        if self.scratch_page is None:
            raise ValueError("padding needs the pool's scratch page: StepBuffers(scratch_page=)")
        if size > self.max_seqs:
            raise ValueError(f"cannot pad to {size} sequences: the buffers hold {self.max_seqs}")

    def _check_token_padding(self, layout: StepLayout, size: int) -> None:
        if self.scratch_page is None:
            raise ValueError("padding needs the pool's scratch page: StepBuffers(scratch_page=)")
        if size < layout.num_tokens:
            raise ValueError(f"cannot pad a step of {layout.num_tokens} tokens to {size}")
        if layout.num_seqs > self.mixed_seqs(size):
            raise ValueError(f"the step has {layout.num_seqs} sequences; a step padded to {size} tokens "
                             f"holds {self.mixed_seqs(size)}")

    def mixed_seqs(self, pad_tokens: int) -> int:
        """The sequences a step padded to pad_tokens tokens is padded to: one a token (each of
        a step's sequences has a row), max_seqs at most. Fewer padding sequences, fewer
        programs: the prefill kernel's grid holds one spare tile a sequence (x the KV heads x
        its splits), each finding its sequence by a search before it exits."""
        return min(self.max_seqs, pad_tokens)

    def _pad_mixed(self, a: dict[str, np.ndarray], n: int, num_tokens: int, num_pages: int) -> None:
        """Pad a step to the loaded token count and `mixed_seqs` of it, so that every field's
        offset depends on the token bucket only (a mixed-step graph's inputs). Tokens past
        num_tokens belong to no sequence: id 0 at position 0, their K/V written to the scratch
        page's first slot, their outputs never read (not sampled; attention leaves them zero and
        every other layer is row-wise, so they cannot reach a real row). Sequences n..max_seqs
        have no query rows, no KV and no pages: the indptrs repeat their last value."""
        a["input_ids"][num_tokens:] = 0
        a["positions"][num_tokens:] = 0
        a["slot_mapping"][num_tokens:] = self.scratch_page * self.page_size
        a["qo_indptr"][n + 1 :] = num_tokens
        a["paged_kv_indptr"][n + 1 :] = num_pages
        a["paged_kv_last_page_len"][n:] = 0  # what build_layout gives a KV length of 0
        a["kv_lens"][n:] = 0

    def _pad(self, a: dict[str, np.ndarray], indices: np.ndarray, n: int, num_pages: int,
             size: int, rows_held: bool = False) -> None:
        """Rows n..size: one token at position 0 of a sequence of one token on the scratch
        page (its K/V written there, its output unused). Not sampled. rows_held: the arena
        holds these rows already, but for their pages (which follow the step's own)."""
        np.add(self._counting[1 : size - n + 1], num_pages, out=a["paged_kv_indptr"][n + 1 : size + 1])
        indices[num_pages : num_pages + size - n] = self.scratch_page
        if rows_held:
            return
        a["input_ids"][n:size] = 0
        a["positions"][n:size] = 0
        a["slot_mapping"][n:size] = self.scratch_page * self.page_size
        a["qo_indptr"][n + 1 : size + 1] = self._counting[n + 1 : size + 1]
        a["paged_kv_last_page_len"][n:size] = 1
        a["kv_lens"][n:size] = 1


# The fields the device reads (the fed rows' two are viewed only in a step that has some).
_ON_DEVICE = ("input_ids", "positions", "slot_mapping", "qo_indptr", "paged_kv_indptr",
              "paged_kv_indices", "paged_kv_last_page_len", "kv_lens", "logits_indices")


def load_layout(layout: StepLayout, device) -> tuple[torch.Tensor, AttentionMetadata]:
    """`layout` on `device` through buffers of its own size: for tests and tools."""
    return StepBuffers.for_layout(layout, device).load(layout)
