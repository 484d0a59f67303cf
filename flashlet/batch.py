"""A step's batch layout: built once, from rows, by `build_layout`; put on the device by
`StepBuffers`. Every step goes through these two: the engine's, the warm-up's synthetic ones and
the tests'.

- `build_layout(rows, page_size)` is a pure function: each row is one sequence's part of the
  step (its new token ids, how many tokens it has computed, its page table) and the result is a
  `StepLayout`, a small set of named CPU arrays and tensors (input ids, positions, slot mapping,
  FlashInfer's indptr / indices / last-page lengths, KV lengths, sampled rows, fed rows).
  `layout_of(sched, page_size)` reads those rows off a SchedulerOutput; for a step whose every
  row has one token (a decode step) it builds the same layout from the rows' columns, read off
  the requests (`decode_columns`), with little Python per row (`decode_layout` on StepRows; the
  tests hold both to build_layout). A layout holds numpy arrays; each field's tensor is made
  when first read (loading a step reads the arrays).
- `StepBuffers.load(layout)` copies a layout into persistent buffers: every field in one arena
  of bytes, pinned on the host and uploaded to the device in ONE copy that does not block, so
  no tensor is allocated per step, and placed so that a decode step padded to a CUDA graph's
  batch size finds every field at the addresses that graph reads. Asked to (`pad_to`), it
  pads a pure-decode step to a captured batch size with rows that write to and read from the
  pool's scratch page, or (`pad_tokens`) pads any step to a token bucket and to max_seqs
  sequences for a mixed-step CUDA graph, and it feeds the previous step's sampled tokens (still
  on the device) into the rows that take them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from itertools import accumulate, chain
from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from flashlet.attention.base import AttentionMetadata
from flashlet.request import PLACEHOLDER

if TYPE_CHECKING:
    from flashlet.scheduler import SchedulerOutput


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

    The builders make a layout from its numpy arrays (`from_arrays`); each field's tensor, a
    view of its array, is made when the field is first read. Loading a step reads the arrays
    only, and a tensor from numpy costs ~3k instructions to make and ~2k to free (its deleter
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

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "StepLayout":
        """The layout whose fields are these arrays (by name, in LAYOUT_DTYPES' dtypes)."""
        layout = cls.__new__(cls)  # no tensors yet: __getattr__ makes each when first read
        layout.arrays = arrays
        return layout

    def __getattr__(self, name: str) -> torch.Tensor:
        # Reached only for attributes not set: a field of a layout made from arrays.
        arrays = self.__dict__.get("arrays")
        if arrays is None or name not in LAYOUT_DTYPES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        tensor = torch.from_numpy(arrays[name])
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
        StepBuffers.load give theirs: Tensor.numpy() costs about a microsecond a field)."""
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

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields by name (StepLayout(**tensors) rebuilds it)."""
        return {name: getattr(self, name) for name in LAYOUT_DTYPES}


_INT32 = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "kv_lens")
LAYOUT_DTYPES = {f.name: torch.int32 if f.name in _INT32 else torch.int64
                 for f in fields(StepLayout)}


def build_layout(rows: Iterable[StepRow], page_size: int) -> StepLayout:
    """The layout of a step whose sequences are `rows` (StepRow, or 5-tuples in its order)."""
    ps = page_size
    ids, lens, ends, num_pages, page_ids, sample, feed_src = [], [], [], [], [], [], []
    for tokens, start, pages, samples, src in rows:  # the one loop over the sequences
        n = len(tokens)
        end = start + n
        count = (end + ps - 1) // ps
        ids += tokens
        lens.append(n)
        ends.append(end)
        num_pages.append(count)
        page_ids += pages[:count]
        sample.append(samples)
        feed_src.append(src)
    num_seqs, num_tokens = len(lens), len(ids)
    kv_lens = _array(ends, num_seqs)
    pages_ = _array(num_pages, num_seqs)
    table = np.fromiter(page_ids, np.int32, len(page_ids))
    if len(table) != pages_.sum():
        raise ValueError("a row's page table holds fewer pages than its tokens need")
    # Per token: its sequence, its position, and the pool slot its K/V goes to.
    if num_tokens == num_seqs and 0 not in lens:  # pure decode: one row per sequence
        qo = np.arange(num_seqs + 1)
        seq, positions = qo[:-1], kv_lens - 1
    else:
        lens_ = _array(lens, num_seqs)
        qo = _indptr(lens_)
        seq = np.repeat(np.arange(num_seqs), lens_)
        positions = np.arange(num_tokens) + (kv_lens - qo[1:])[seq]
    kv_ptr = _indptr(pages_)
    page, offset = np.divmod(positions, ps)
    slots = table[kv_ptr[:-1][seq] + page] * ps + offset
    last = kv_lens - np.maximum(pages_ - 1, 0) * ps
    logits = qo[1:] - 1
    if False in sample:
        logits = logits[np.fromiter(sample, bool, num_seqs)]
    input_ids = _array(ids, num_tokens)
    feed_rows = np.flatnonzero(input_ids == PLACEHOLDER)
    if len(feed_rows):
        input_ids[feed_rows] = 0  # the device writes the real token in (StepBuffers.load)
        feed_src_ = _array(feed_src, num_seqs)[seq[feed_rows]]
    else:
        feed_src_ = feed_rows
    i32 = np.int32
    arrays = dict(input_ids=input_ids, positions=positions, slot_mapping=slots,
                  qo_indptr=qo.astype(i32), paged_kv_indptr=kv_ptr.astype(i32),
                  paged_kv_indices=table, paged_kv_last_page_len=last.astype(i32),
                  kv_lens=kv_lens.astype(i32), logits_indices=logits, feed_rows=feed_rows,
                  feed_src=feed_src_)
    return StepLayout.from_arrays(arrays)


def _array(values: list, n: int) -> np.ndarray:
    return np.fromiter(values, np.int64, n)  # faster than np.array from a list


def _indptr(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def decode_layout(rows: Iterable[StepRow], page_size: int) -> StepLayout:
    """build_layout for a step whose every row has exactly one token (a decode step, the common
    one): the same StepLayout, built from the rows' columns (`_decode_layout`; the engine's
    steps give it their columns straight from the requests, `decode_columns`)."""
    rows = list(rows)
    tokens, starts, tables, samples, feed_src = zip(*rows) if rows else ((),) * 5
    lens = set(map(len, tokens))
    if lens - {1}:
        raise ValueError(f"decode_layout takes one token a row, got {max(lens - {1})}")
    tables = [np.asarray(t, np.int32).tobytes() for t in tables]
    sample_rows = [row for row, sample in enumerate(samples) if sample]
    return _decode_layout(list(chain.from_iterable(tokens)), starts, tables, sample_rows,
                          feed_src, page_size)


_PAGE_BYTES = np.dtype(np.int32).itemsize  # of a page id in a page table (Request.page_table)


def _decode_layout(token_ids: Sequence[int], starts: Sequence[int], tables: Sequence[bytes],
                   sample_rows: Sequence[int], feed_src: Sequence[int], page_size: int
                   ) -> StepLayout:
    """The layout of a decode step from its rows' columns (a StepRow's fields: the one token of
    each row in token_ids, each page table as int32 bytes, the rows that sample). Python per
    row only counts pages (a comprehension); each field is then one numpy call, or a few, over
    the whole step. As few as that: at these sizes numpy costs per call, not per row, and more
    so when the forward has just evicted its code and data (3-10 us a call on the CPU here)."""
    num_seqs, ps, i32, i64 = len(starts), page_size, np.int32, np.int64
    num_pages = [start // ps + 1 for start in starts]  # each row's new K/V goes to its last
    if list(map(len, tables)) != [n * _PAGE_BYTES for n in num_pages]:
        tables = _cut_tables(tables, num_pages)
    table = np.frombuffer(bytearray().join(tables), i32)  # a bytearray: the array is writable
    kv_ptr = np.array(list(accumulate(num_pages, initial=0)), i32)
    input_ids = np.array(token_ids, i64)
    feed_rows = (input_ids == PLACEHOLDER).nonzero()[0]
    input_ids[feed_rows] = 0  # the device writes the real token in (StepBuffers.load)
    positions = np.array(starts, i64)
    offsets = positions % ps
    arrays = dict(input_ids=input_ids, positions=positions,
                  slot_mapping=table[kv_ptr[1:] - 1] * ps + offsets,
                  qo_indptr=np.arange(num_seqs + 1, dtype=i32),
                  paged_kv_indptr=kv_ptr, paged_kv_indices=table,
                  paged_kv_last_page_len=(offsets + 1).astype(i32),
                  kv_lens=(positions + 1).astype(i32),
                  logits_indices=np.asarray(sample_rows, i64),
                  feed_rows=feed_rows, feed_src=np.array(feed_src, i64)[feed_rows])
    layout = StepLayout.from_arrays(arrays)
    # The cached properties' values, known already (each is numpy work on every load).
    layout.query_lens = np.ones(num_seqs, i32)
    layout.is_pure_decode = True
    layout.max_query_len = 1 if num_seqs else 0
    return layout


def _cut_tables(tables: Sequence[bytes], num_pages: list[int]) -> list[bytes]:
    """Each row's page table cut to the pages its tokens use (a request may hold pages reserved
    ahead); ValueError if one holds fewer."""
    if any(len(t) < n * _PAGE_BYTES for t, n in zip(tables, num_pages)):
        raise ValueError("a row's page table holds fewer pages than its tokens need")
    return [t[: n * _PAGE_BYTES] for t, n in zip(tables, num_pages)]


def step_rows(sched: "SchedulerOutput"):
    """The scheduled requests as StepRows (generated: the builder's loop is the only one)."""
    for req, n in sched.scheduled:
        start = req.num_computed_tokens
        end = start + n
        tokens = (req.token_at(start),) if n == 1 else req.token_slice(start, end)
        yield tokens, start, req.page_ids, end == req.num_tokens, req.sample_row


def decode_columns(sched: "SchedulerOutput") -> tuple[list, list, list, Sequence[int], list]:
    """`_decode_layout`'s columns of a step whose every request computes one token: token ids,
    starts, page tables (each request's, as bytes), the rows that sample (ascending), feed
    sources. One list at a time over the requests, no tuple per row (this runs over every
    running request every step)."""
    reqs = [req for req, _ in sched.scheduled]
    starts = [req.num_computed_tokens for req in reqs]
    if len(sched.sampling) == len(reqs):  # every row samples: its token is the newest one
        token_ids = [(req.output_token_ids or req.prompt_token_ids)[-1] for req in reqs]
        sample_rows = np.arange(len(reqs))
    else:
        token_ids = [req.token_at(start) for req, start in zip(reqs, starts)]
        sample_rows = [row for row, (req, start) in enumerate(zip(reqs, starts))
                       if start + 1 == req.num_tokens]
    tables = [req.page_table for req in reqs]
    feed_src = [req.sample_row for req in reqs]
    return token_ids, starts, tables, sample_rows, feed_src


def layout_of(sched: "SchedulerOutput", page_size: int) -> StepLayout:
    """The layout of a scheduled step (its sampling rows are `sched.sampling`, in order)."""
    if sched.is_pure_decode:
        return _decode_layout(*decode_columns(sched), page_size)
    return build_layout(step_rows(sched), page_size)


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
_FIXED = ARENA_ORDER[:-1]  # the fields whose offsets the indices' length never moves
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


class _Fields(NamedTuple):
    """The views of the fields before the page indices, for one set of lengths."""

    np: dict[str, np.ndarray]  # host, to write into
    host: dict[str, torch.Tensor]
    dev: dict[str, torch.Tensor]
    indices_offset: int  # bytes: where the page indices start


class _Pages(NamedTuple):
    """The views of the page indices at an offset and length, and of the span to upload."""

    np: np.ndarray
    host: torch.Tensor
    dev: torch.Tensor
    host_span: torch.Tensor  # bytes [0, end of the indices): the one host-to-device copy
    dev_span: torch.Tensor


class StepBuffers:
    """Persistent buffers that a step's layout is loaded into: one arena of bytes holding every
    field (ARENA_ORDER), on CUDA a pinned host arena uploaded to a device arena in one copy
    that does not block the host; on the CPU one arena, which is both.

    A CUDA graph reads its inputs at the addresses its capture saw. Each field's offset is a
    function of the step's token and sequence counts (`arena_offsets`), so every pure-decode
    step padded to batch size b (b tokens, b sequences), and every step padded to a token
    bucket (T_b tokens, max_seqs sequences), puts every field at the same address, whatever its
    page count; ModelRunner still checks the addresses before each replay."""

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
                             logits_indices=max_seqs, feed_rows=max_seqs, feed_src=max_seqs)
        # Every field at its capacity fits, so every step whose fields fit their capacities does.
        size = arena_offsets(self.capacity)["end"]
        self.staged = self.device.type == "cuda"  # else the host arena is the device's
        self.host_arena = torch.zeros(size, dtype=torch.uint8, pin_memory=self.staged)
        self.dev_arena = (torch.zeros(size, dtype=torch.uint8, device=self.device)
                          if self.staged else self.host_arena)
        self._base = self.dev_arena.data_ptr()
        self._fields: dict[tuple[int, ...], _Fields] = {}  # views, kept: slicing costs more
        self._pages: dict[tuple[int, int], _Pages] = {}
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

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
        mixed-step graph's bucket) and to max_seqs sequences (see `_pad_mixed`). The pinned
        staging must be free (the previous step's copy done: ModelRunner.wait_inputs_staged)."""
        arrays = layout.arrays
        num_seqs, num_tokens = len(arrays["kv_lens"]), len(arrays["input_ids"])
        seqs_to, tokens_to = num_seqs, num_tokens
        if pad_tokens is not None:
            self._check_token_padding(layout, pad_tokens)
            seqs_to, tokens_to = self.max_seqs, pad_tokens
        elif pad_to is not None and pad_to > num_seqs:
            self._check_padding(layout, pad_to)
            seqs_to = tokens_to = pad_to
        placed = self._fields_for(arrays, seqs_to - num_seqs, tokens_to - num_tokens)
        num_pages = len(arrays["paged_kv_indices"])
        # A padded decode row has a scratch page of its own; a padded mixed sequence has none.
        extra_pages = seqs_to - num_seqs if pad_tokens is None else 0
        pages = self._pages_at(placed.indices_offset, num_pages + extra_pages)
        for name, array in placed.np.items():
            values = arrays[name]
            array[: len(values)] = values
        pages.np[:num_pages] = arrays["paged_kv_indices"]
        if pad_tokens is not None:
            self._pad_mixed(placed.np, num_seqs, num_tokens, num_pages)
        elif seqs_to > num_seqs:
            self._pad(placed.np, pages.np, num_seqs, num_pages, seqs_to)
        if self.staged:  # the whole step in one copy
            pages.dev_span.copy_(pages.host_span, non_blocking=True)
        dev = placed.dev
        if len(arrays["feed_rows"]):
            self._feed(dev, arrays["feed_rows"], fed_tokens)
        staged = StepLayout(**placed.host, paged_kv_indices=pages.host)
        staged.arrays = {**placed.np, "paged_kv_indices": pages.np}
        meta = AttentionMetadata(
            host=staged, positions=dev["positions"], slot_mapping=dev["slot_mapping"],
            qo_indptr=dev["qo_indptr"], paged_kv_indptr=dev["paged_kv_indptr"],
            paged_kv_indices=pages.dev, paged_kv_last_page_len=dev["paged_kv_last_page_len"],
            kv_lens=dev["kv_lens"], logits_indices=dev["logits_indices"],
            num_padding=seqs_to - num_seqs, token_bucket=pad_tokens)
        return dev["input_ids"], meta

    def _fields_for(self, arrays: dict[str, np.ndarray], pad_seqs: int, pad_tokens: int) -> _Fields:
        """The views of the fields before the page indices for a step of these arrays padded
        by pad_seqs sequences and pad_tokens tokens (kept per set of lengths)."""
        key = tuple([len(arrays[name]) for name in _FIXED]) + (pad_seqs, pad_tokens)
        fields = self._fields.get(key)
        if fields is None:
            lengths = dict(zip(_FIXED, key))
            for name in _PER_TOKEN:
                lengths[name] += pad_tokens
            for name in _PER_SEQ:
                lengths[name] += pad_seqs
            lengths["paged_kv_indices"] = 0
            self._check_fits(lengths)
            offsets = arena_offsets(lengths)
            views = {name: self._views(name, offsets[name], lengths[name]) for name in _FIXED}
            fields = _Fields(np={name: v[0] for name, v in views.items()},
                             host={name: v[1] for name, v in views.items()},
                             dev={name: v[2] for name, v in views.items()},
                             indices_offset=offsets["paged_kv_indices"])
            if len(self._fields) >= 4096:  # bounded: lengths take many values over a run
                self._fields.clear()
            self._fields[key] = fields
        return fields

    def _pages_at(self, offset: int, count: int) -> _Pages:
        """The views of `count` page indices at byte `offset`, and of the span up to their end."""
        pages = self._pages.get((offset, count))
        if pages is None:
            self._check_fits({"paged_kv_indices": count})
            end = offset + count * LAYOUT_DTYPES["paged_kv_indices"].itemsize
            pages = _Pages(*self._views("paged_kv_indices", offset, count),
                           host_span=self.host_arena[:end], dev_span=self.dev_arena[:end])
            if len(self._pages) >= 8192:  # bounded: page counts take many values
                self._pages.clear()
            self._pages[offset, count] = pages
        return pages

    def _views(self, name: str, offset: int, n: int) -> tuple[np.ndarray, torch.Tensor,
                                                               torch.Tensor]:
        """(numpy, host, device) views of field `name`: n entries at byte `offset`."""
        dtype = LAYOUT_DTYPES[name]
        end = offset + n * dtype.itemsize
        host = self.host_arena[offset:end].view(dtype)
        return host.numpy(), host, self.dev_arena[offset:end].view(dtype)

    def _check_fits(self, lengths: dict[str, int]) -> None:
        for name, n in lengths.items():
            if n > self.capacity[name]:
                raise ValueError(f"the step's {name} has {n} entries; "
                                 f"the buffers hold {self.capacity[name]}")

    def _feed(self, dev: dict[str, torch.Tensor], rows: np.ndarray,
              fed_tokens: torch.Tensor | None) -> None:
        """The fed rows' input ids <- fed_tokens[feed_src], on the device. Fed rows ascend
        (build_layout); where they are consecutive (every decode row of an overlapped step, in
        the usual order) that is one gather straight into them, else a gather and a scatter."""
        if fed_tokens is None:
            raise ValueError("the step has fed rows but no previous step's tokens were given")
        first, count = int(rows[0]), len(rows)
        if rows[-1] - first == count - 1:
            torch.index_select(fed_tokens, 0, dev["feed_src"], out=self._input_rows(first, count))
        else:
            fed = fed_tokens.index_select(0, dev["feed_src"])
            dev["input_ids"].index_copy_(0, dev["feed_rows"], fed)

    def _input_rows(self, first: int, count: int) -> torch.Tensor:
        """The device view of input ids first..first+count (kept: slicing costs more than the
        gather it feeds)."""
        rows = self._rows.get((first, count))
        if rows is None:
            if len(self._rows) >= 8192:
                self._rows.clear()
            rows = self._rows[first, count] = self._views("input_ids", 0, first + count)[2][first:]
        return rows

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
        if layout.num_seqs > self.max_seqs:
            raise ValueError(f"the step has {layout.num_seqs} sequences; "
                             f"the buffers hold {self.max_seqs}")

    def _pad_mixed(self, a: dict[str, np.ndarray], n: int, num_tokens: int, num_pages: int) -> None:
        """Pad a step to the loaded token count and max_seqs sequences, so that every field's
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
             size: int) -> None:
        """Rows n..size: one token at position 0 of a sequence of one token on the scratch
        page (its K/V written there, its output unused). Not sampled."""
        a["input_ids"][n:size] = 0
        a["positions"][n:size] = 0
        a["slot_mapping"][n:size] = self.scratch_page * self.page_size
        a["qo_indptr"][n + 1 : size + 1] = np.arange(n + 1, size + 1)
        a["paged_kv_indptr"][n + 1 : size + 1] = np.arange(num_pages + 1, num_pages + size - n + 1)
        indices[num_pages : num_pages + size - n] = self.scratch_page
        a["paged_kv_last_page_len"][n:size] = 1
        a["kv_lens"][n:size] = 1


# The fields a padding token, and a padding sequence, add an entry to (a padded decode row is
# both, plus one scratch page in the page indices).
_PER_TOKEN = ("input_ids", "positions", "slot_mapping")
_PER_SEQ = ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len", "kv_lens")


def load_layout(layout: StepLayout, device) -> tuple[torch.Tensor, AttentionMetadata]:
    """`layout` on `device` through buffers of its own size: for tests and tools."""
    return StepBuffers.for_layout(layout, device).load(layout)
