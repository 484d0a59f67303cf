"""A decode step's inputs moved on to the next step's, on the device.

The fused decode path's greedy graph ends with this kernel (ModelRunner, "steady replay"): the
step's rows each sampled their next token, and if the next step is the same rows one token on
(no row starting a new page, every row fed its own token), its inputs are these plus one, so
the host need not write and upload them. Per real row i:
    input_ids[i] = tokens[i]; positions[i] += 1; slot_mapping[i] += 1;
    kv_lens[i] += 1; last_page_len[i] += 1.
Padding rows (a CUDA graph's rows past the real ones, on the pool's scratch page: their slot
// page_size is scratch_page) are left as they are, so that they never leave that page. A row
whose next token starts a page gets a wrong slot here; the host never replays such a step on
these values: it loads the step (StepBuffers.load), which rewrites every field.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of the kernel's block at the least: the fused path's most rows (cute_gemv.MAX_ROWS), so one
# compiled kernel serves every row count it pads to (n is a runtime value).
MIN_BLOCK = 16


@triton.jit(do_not_specialize=["n", "scratch_page"])
def _advance_kernel(InputIds, Positions, Slots, KvLens, LastPageLen, Tokens, n, scratch_page,
                    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    row = i < n
    slot = tl.load(Slots + i, mask=row, other=0)
    real = row & (slot // PAGE_SIZE != scratch_page)
    token = tl.load(Tokens + i, mask=real, other=0)
    tl.store(InputIds + i, token.to(InputIds.dtype.element_ty), mask=real)
    tl.store(Slots + i, slot + 1, mask=real)
    tl.store(Positions + i, tl.load(Positions + i, mask=real, other=0) + 1, mask=real)
    tl.store(KvLens + i, tl.load(KvLens + i, mask=real, other=0) + 1, mask=real)
    tl.store(LastPageLen + i, tl.load(LastPageLen + i, mask=real, other=0) + 1, mask=real)


def advance_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_lens: torch.Tensor, last_page_len: torch.Tensor, tokens: torch.Tensor,
                          scratch_page: int, page_size: int) -> None:
    """In place, one launch: each real row's inputs moved on by its sampled token (above).
    All [n] on one device; tokens holds n or more (the first n are the rows')."""
    n = input_ids.shape[0]
    fields = (positions, slot_mapping, kv_lens, last_page_len)
    if any(t.shape != (n,) for t in fields) or tokens.shape[0] < n:
        raise ValueError(f"advance_decode_inputs: rows differ ({n} input ids, "
                         f"{[tuple(t.shape) for t in fields]}, {tuple(tokens.shape)} tokens)")
    if n == 0:
        return
    # One compiled kernel for every fused row count (up to MIN_BLOCK rows): n is not specialised.
    _advance_kernel[(1,)](input_ids, positions, slot_mapping, kv_lens, last_page_len, tokens, n,
                          scratch_page, PAGE_SIZE=page_size, BLOCK=max(MIN_BLOCK, triton.next_power_of_2(n)))


def advance_decode_inputs_host(input_ids, positions, slot_mapping, kv_lens, last_page_len, tokens,
                               scratch_page: int, page_size: int) -> None:
    """The same on CPU tensors, through numpy views (a few microseconds at 16 rows, where torch's
    masked indexing costs tens): what a CUDA graph's stand-in on the CPU runs (tests, tools)."""
    n = input_ids.shape[0]
    real = slot_mapping.numpy() // page_size != scratch_page
    input_ids.numpy()[real] = tokens.numpy()[:n][real]
    for field in (positions, slot_mapping, kv_lens, last_page_len):
        field.numpy()[real] += 1
