"""Paged GQA decode attention over the NHD pool, split-KV with a log-sum-exp merge.

Work. Each of B sequences has one query row (Hq heads of dim D) and attends over all of its
`kv_lens[b]` cached keys/values. The keys live in pages of the pool
`k_cache [pages, page_size, Hkv, D]`; sequence b's pages are
`kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`, its token t is at page `t // page_size`, row
`t % page_size` of its list. Query head h reads KV head `h // G`, with G = Hq / Hkv.

Bytes (the floor, N = sum(kv_lens), e = element size):
    K and V:   2 * N * Hkv * D * e          (each page read ONCE per KV group, not per q head)
    Q and O:   2 * B * Hq * D * e
    page ids:  4 * sum(pages)               (int32)
    split-KV partials add 2 * B * S * Hq * (D + 1) * 4 (written then read; mostly L2).
FLOPs: 4 * N * Hq * D (QK^T and PV, a multiply-add counted as 2).

Design.
- Grid (B, Hkv, S). One program owns one sequence, one KV head and one split: it loads the G
  query heads of that group as a [GP, D] tile and streams its token range of K/V in blocks
  of BLOCK_N tokens, so every K/V row is fetched once for the whole group.
- Several KV heads a program (`kv_heads_per_program`, KV_PACK): grid (B, Hkv / KV_PACK, S), the
  KV_PACK * G query heads rows of one [GP, KV_PACK * D] tile whose columns are the KV_PACK heads
  side by side (a token's row of them is one contiguous run in the NHD pool); row r holds q in
  its own head's D columns and zeros elsewhere, so one QK^T gives every row its own head's
  scores and one online softmax serves all the heads (for G = 7, two heads fill 14 of 16 rows:
  half the softmax work a key); PV yields every head's V for every row, and each row stores its
  own head's columns. The MMAs are those of KV_PACK separate programs.
- The group is padded to GP = max(16, next_pow2(G)) rows so that QK^T and PV are `tl.dot`s
  (tensor-core MMAs need M >= 16). Padded rows load zeros (masked, no memory traffic) and are
  never stored; decode is memory-bound, so the wasted MMA rows cost nothing measurable.
  G = 7 (Qwen2.5-0.5B) and G = 3 (SmolLM2) both pad to 16; G = 1 and 8 also work.
- Tokens map to pages per token (a gather of page ids), so any power-of-two page size works,
  from 1 (one page per token) to larger than BLOCK_N.
- Split-KV. S (a power of two) is the most splits a sequence may use; the launcher picks it
  from the batch size alone (see `choose_num_splits`), so a CUDA graph captured for a batch
  size stays valid whatever the KV lengths are when it is replayed. S and min_split_tokens are
  runtime arguments of the main kernel (one compiled variant per tile shape, split or not);
  only the small merge kernel is compiled per S.
  On the device each sequence uses n_b = min(S, ceil(kv_len / min_split_tokens)) splits of a
  whole number of BLOCK_N blocks; programs with split >= n_b exit at once. Each split writes
  its normalised partial output and its log2-sum-exp to fp32 scratch, and a merge kernel
  (grid (B, Hkv, GP / HPP), HPP >= 2 heads per program, as many as keep its [S, HPP, D] fp32
  tile within 8192 elements) combines the n_b partials: o = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m).
  With S = 1 the main kernel writes the output directly and no merge is launched. With
  `merge_counts` the merge runs in the main kernel instead: each group's last split program to
  finish (an acq_rel counter, as in the one-launch form below) merges the partials.
- Softmax runs in base 2 (scores pre-multiplied by scale * log2 e) in fp32; P is cast to the
  value dtype for the PV product (as FlashAttention does). fp32 inputs use IEEE-precision dots.
- A sequence with kv_len == 0 (a padding row of a CUDA-graph batch) gets a zero output.
- Loading ahead (`prefetch`). A block's K/V addresses need its page ids. Loaded in the same
  iteration ("none"), they keep Triton's pipeliner from staging the K/V copies: it keeps one
  buffer and waits for it, so every block pays a whole memory round trip. "pages" carries the
  next block's page ids in the loop, and the pipeliner then keeps num_stages - 1 blocks in
  flight while one is computed; "blocks" holds the next block in registers by hand. With
  "pages" a split's whole blocks load and score without masks, its partial last block after
  the loop: fewer instructions a key, which is what bounds an fp8 pool (DECODE_NOTES.md).
- An fp8 (e4m3) pool: K/V blocks are loaded as fp8 (half the bytes) and widened for the dots;
  the per-tensor scales multiply in fp32 where they cost nothing per key: k_scale folds into
  the score scale, v_scale into the fp32 accumulator once. With a bf16/fp16 q the dots run in
  fp16 (`fp8_as_fp16`): e4m3 -> fp16 is one cvt per pair of values where e4m3 -> bf16 is three,
  and that widening is per key, the loop's main ALU cost at half the bytes. q is scaled in
  fp32 first (the score scale is then 1), and P in [0, 1] keeps more bits in fp16 than bf16.
  With "pages" its V is read as uint16 pairs (`_v_pairs_as_f16`): V is the PV dot's operand
  to transpose (its keys, the reduction axis, are rows apart), which ldmatrix does for 16-bit
  elements only; as single bytes Triton copied V 8 bytes at a time and read it back one byte
  per load; its low and high bytes are regrouped by one `prmt` per two pairs
  (`_e4m3_pairs_to_f16`, inline PTX; the interpreter runs the shift-and-mask form).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashlet.kernels import pdl, tuning
from flashlet.kernels.pdl import pdl_supported
from flashlet.kernels.rope_kv_write import _to_cache  # a row as the pool stores it

LOG2E = 1.4426950408889634
# The Triton interpreter runs no inline PTX: there fp8 V widens through Triton's own casts.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# "1": the one-launch decode loads page_base beside kv_len, not after its early exit
# (`_one_launch_kernel`'s EARLY_PAGE_BASE), for a GPU A/B in a fresh process: off until measured
# (at head_dim 128, 64-key blocks on 4 warps with page ids ahead, it spills 276 bytes at sm_90a).
EARLY_PAGE_BASE = os.environ.get("FLASHLET_EARLY_PAGE_BASE", "0") == "1"
# The one-launch decode's lean merge: "peel" (the merging program loads its first partials beside
# their log-sum-exps: `_merge_partials`' PEEL, one L2 round trip, not two, where a merge reads at
# most MERGE_SPLITS partials) and "rows" (the merge's tiles hold the real query heads of a program
# padded to a power of two, not to the dot's 16 rows: Qwen3's group 2 reads 8x the partials a
# step). Both on by default since their GPU run (H100, 2026-12-05, through LLM.generate, two
# interleaved pairs: qwen3-0.6b after 1,000 tokens 1,000 -> 1,053 tok/s, after 8,000 529 -> 680,
# qwen2.5-0.5b after 1,000 1,740 -> 1,767; FUSED_NOTES.md, "A lean merge"). $FLASHLET_LEAN_MERGE
# = "0" turns both off for an A/B in a fresh process, "peel" / "rows" one; "1" or unset both.
LEAN_MERGE_ENV = "FLASHLET_LEAN_MERGE"


def lean_merge_parts(text: str) -> frozenset:
    """A $FLASHLET_LEAN_MERGE value as the set of its parts ("peel", "rows"); ValueError for another."""
    text = text.strip().lower()
    forms = {"": ("peel", "rows"), "0": (), "peel": ("peel",), "rows": ("rows",), "1": ("peel", "rows")}
    if text not in forms:
        raise ValueError(f"{LEAN_MERGE_ENV}={text!r}: expected peel, rows, 1 (both) or 0")
    return frozenset(forms[text])


def lean_merge_from_env() -> frozenset:
    """$FLASHLET_LEAN_MERGE's parts (unset: both)."""
    return lean_merge_parts(os.environ.get(LEAN_MERGE_ENV, ""))


LEAN_MERGE = lean_merge_from_env()


@triton.jit
def _split_range(kv_len, num_splits, min_split_tokens, block_n):
    """(number of splits this sequence uses, tokens per split: a multiple of block_n)."""
    n = tl.minimum(tl.cdiv(kv_len, min_split_tokens), num_splits)
    n = tl.maximum(n, 1)
    split_len = tl.cdiv(tl.cdiv(kv_len, n), block_n) * block_n
    split_len = tl.maximum(split_len, block_n)
    n = tl.maximum(tl.cdiv(kv_len, split_len), 1)
    return n, split_len


@triton.jit
def _attend_block(q, k, v, t_mask, m_i, l_i, acc, qk_scale, INPUT_PRECISION: tl.constexpr,
                  MASKED: tl.constexpr = True):
    """One block of keys into the online softmax (base 2): -> (m_i, l_i, acc). k, v: q's dtype
    or fp8 (widened here; their scales are applied by the caller). MASKED=False: every key of
    the block is in range (t_mask unread)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty sequence's block: all weights 0, no NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_block(head, page_base, KvIndices, t, t_mask, d, stride_p, stride_t, PAGE_SIZE: tl.constexpr):
    """K or V rows t (masked) of one KV head -> [BLOCK_N, D]."""
    page = tl.load(KvIndices + page_base + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
    row = t % PAGE_SIZE
    return tl.load(head + page[:, None] * stride_p + row[:, None] * stride_t + d[None, :],
                   mask=t_mask[:, None], other=0.0)


@triton.jit
def _block_keys(t, t_mask, step_from, last, STEP_ROWS_APART: tl.constexpr, NEWEST_FIRST: tl.constexpr):
    """The keys a one-launch block attends. STEP_ROWS_APART: this step's earlier rows (a verify
    row's, from step_from on) are attended in a block of their own, so this block leaves them
    out, and does not load them (being written now, a stale value times a zero weight can still
    be a NaN); the newest row is kept, to be spliced in from registers (`_splice_newest`), unless
    NEWEST_FIRST opened the softmax with it (then it is left out too)."""
    keys = t_mask
    if NEWEST_FIRST:
        keys = t_mask & (t < step_from)
    elif STEP_ROWS_APART:
        keys = t_mask & ((t < step_from) | (t == last))
    return keys


@triton.jit
def _splice_newest(k, v, t, last, k_new, v_new):
    """A block's K and V in k_new's dtype, the newest row's slot (t == last) taken from
    k_new / v_new ([1, COLS], in registers) -> (k, v)."""
    fresh = (t == last)[:, None]
    return tl.where(fresh, k_new, k.to(k_new.dtype)), tl.where(fresh, v_new, v.to(k_new.dtype))


@triton.jit
def _v_pairs_as_f16(head16, page, t, t_mask, d2, stride_p, stride_t, PAGE_SIZE: tl.constexpr,
                    PRMT: tl.constexpr, MASKED: tl.constexpr):
    """An fp8 V block read as uint16 pairs (d = 2j, 2j + 1) -> two [BLOCK_N, D / 2] fp16 tiles,
    (even d, odd d). A 16-bit element in shared memory transposes for the PV dot with ldmatrix,
    where single fp8 bytes would be read one at a time (V's keys, the dot's reduction axis, are
    rows apart). head16: V's head as a uint16 pointer; strides in fp8 elements. PRMT: widen
    with `_e4m3_pairs_to_f16` (CUDA only). MASKED=False: every row in range (t_mask unread)."""
    ptrs = head16 + page[:, None] * (stride_p // 2) + (t % PAGE_SIZE)[:, None] * (stride_t // 2) + d2[None, :]
    if MASKED:
        pairs = tl.load(ptrs, mask=t_mask[:, None], other=0)
    else:
        pairs = tl.load(ptrs)
    if PRMT:
        return _e4m3_pairs_to_f16(pairs)
    lo = (pairs & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = (pairs >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def _e4m3_pairs_to_f16(pairs):
    """uint16 pairs of e4m3 -> (fp16 of the low bytes, fp16 of the high bytes), two pairs at a
    time: one prmt gathers their two low bytes and their two high bytes, and each e4m3x2 ->
    f16x2 cvt widens two values. Written out with the shifts and masks, the compiler splits the
    bytes into registers of their own and packs them back: three to four integer instructions
    a value, the loop's largest cost at fp8's byte rate."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t;
        .reg .b16 l, h;
        prmt.b32 t, $2, 0, 0x3120;
        mov.b32 {l, h}, t;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        }""", "=r,=r,r", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _attend_block_split_v(q, k, v_lo, v_hi, t_mask, m_i, l_i, acc_lo, acc_hi, MASKED: tl.constexpr):
    """`_attend_block` for fp16 dots with V as its even and odd columns (`_v_pairs_as_f16`)."""
    qk = tl.dot(q, tl.trans(k.to(tl.float16)))
    if MASKED:
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p16 = p.to(tl.float16)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p16, v_lo)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p16, v_hi)
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _len_and_page_base(KvLens, KvIndptr, b):
    """(kv_lens[b], kv_indptr[b]) from one two-lane gather: issued as two loads, the second is
    sunk past the early exit that depends on the first, a round trip later."""
    two = tl.arange(0, 2)
    both = tl.load(tl.where(two == 0, KvLens + b, KvIndptr + b))
    return tl.sum(tl.where(two == 0, both, 0), 0), tl.sum(tl.where(two == 1, both, 0), 0)


@triton.jit
def _page_ids(KvIndices, page_base, t, t_mask, PAGE_SIZE: tl.constexpr):
    """The pool page of each token t (masked: 0) -> [BLOCK_N] int64."""
    return tl.load(KvIndices + page_base + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)


@triton.jit
def _kv_rows(head, page, t, t_mask, d, stride_p, stride_t, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr = True):
    """K or V rows of tokens t, whose pages are known (masked rows: 0, no traffic) -> [BLOCK_N, D].
    MASKED=False: every row in range (t_mask unread)."""
    ptrs = head + page[:, None] * stride_p + (t % PAGE_SIZE)[:, None] * stride_t + d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=t_mask[:, None], other=0.0)
    return tl.load(ptrs)


# The split count and the smallest split are runtime values (not specialised on): one compiled
# kernel serves every batch size of a tile shape, split (SPLIT) or not.
@triton.jit(do_not_specialize=["min_split_tokens", "num_splits"])
def _decode_kernel(
    Q, K, V, O, MidO, MidLse, Counts,
    KvIndptr, KvIndices, KvLens,
    qk_scale, v_scale, min_split_tokens, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FP8_AS_FP16: tl.constexpr,
    PREFETCH: tl.constexpr,
    SPLIT_V: tl.constexpr,
    KV_PACK: tl.constexpr,
    HEADS_CONTIGUOUS: tl.constexpr,
    V_PRMT: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) * KV_PACK  # the first of the KV_PACK KV heads this program reads
    split = tl.program_id(2)

    # Rows: the KV_PACK * GROUP query heads (padded to GROUP_PAD); columns: the KV_PACK heads' D
    # each, side by side as one key row holds them. Row r reads only its own head's columns.
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < KV_PACK * GROUP
    heads = kvh * GROUP + g
    c = tl.arange(0, KV_PACK * HEAD_DIM)
    d = c % HEAD_DIM
    own = g_mask[:, None] & ((c // HEAD_DIM)[None, :] == (g // GROUP)[:, None])  # [GP, KV_PACK * D]
    # kv_len, the page list's start and q load side by side, not one round trip after another
    # (the first block's page ids wait on two of them, its K/V on those).
    kv_len, page_base = _len_and_page_base(KvLens, KvIndptr, b)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=own, other=0.0)
    n_splits, split_len = _split_range(kv_len, num_splits, min_split_tokens, BLOCK_N)
    if split >= n_splits:
        return
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    # With page ids carried ahead, whole blocks load and score without masks (fewer instructions
    # a key) and the split's last, partial block runs after the loop.
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    if FP8_AS_FP16:
        # e4m3 widens to fp16 in one cvt per pair (to bf16 it takes three). q carries the
        # score scale (scale * log2 e * k_scale, small) so its fp16 copy cannot overflow.
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, KV_PACK * HEAD_DIM], tl.float32)
    if HEADS_CONTIGUOUS:  # the packed heads are one run of KV_PACK * D values a token
        k_cols = c
        v_cols = c
    else:
        k_cols = (c // HEAD_DIM) * stride_kh + d  # offsets of a key row's packed heads
        v_cols = (c // HEAD_DIM) * stride_vh + d
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    if SPLIT_V:
        # An fp8 pool with pages carried ahead ("pages"), V read as uint16 pairs: see
        # `_v_pairs_as_f16`. The two half-width accumulators interleave back into [GP, D].
        j = tl.arange(0, KV_PACK * HEAD_DIM // 2)
        if HEADS_CONTIGUOUS:
            v_pairs = j
        else:
            v_pairs = (j // (HEAD_DIM // 2)) * (stride_vh // 2) + j % (HEAD_DIM // 2)  # uint16 units (strides even)
        v_head16 = v_head.to(tl.pointer_type(tl.uint16))
        acc_lo = tl.zeros([GROUP_PAD, KV_PACK * HEAD_DIM // 2], tl.float32)
        acc_hi = tl.zeros([GROUP_PAD, KV_PACK * HEAD_DIM // 2], tl.float32)
        t = start + tl.arange(0, BLOCK_N)
        page = _page_ids(KvIndices, page_base, t, t < end, PAGE_SIZE)
        for blk in range(start, full_end, BLOCK_N):
            k = _kv_rows(k_head, page, t, t, k_cols, stride_kp, stride_kt, PAGE_SIZE, False)
            v_lo, v_hi = _v_pairs_as_f16(v_head16, page, t, t, v_pairs, stride_vp, stride_vt, PAGE_SIZE,
                                         V_PRMT, False)
            t = t + BLOCK_N
            page = _page_ids(KvIndices, page_base, t, t < end, PAGE_SIZE)
            m_i, l_i, acc_lo, acc_hi = _attend_block_split_v(q, k, v_lo, v_hi, t, m_i, l_i, acc_lo, acc_hi, False)
        if full_end < end:
            t_mask = t < end
            k = _kv_rows(k_head, page, t, t_mask, k_cols, stride_kp, stride_kt, PAGE_SIZE)
            v_lo, v_hi = _v_pairs_as_f16(v_head16, page, t, t_mask, v_pairs, stride_vp, stride_vt, PAGE_SIZE,
                                         V_PRMT, True)
            m_i, l_i, acc_lo, acc_hi = _attend_block_split_v(q, k, v_lo, v_hi, t_mask, m_i, l_i, acc_lo, acc_hi,
                                                             True)
        acc = tl.reshape(tl.join(acc_lo, acc_hi), [GROUP_PAD, KV_PACK * HEAD_DIM])
    elif PREFETCH == 1:
        # Page ids one block ahead by hand: the K/V addresses of a block then come from the loop's
        # carried values, not from a load in the same iteration, which Triton's pipeliner can
        # stage (num_stages - 1 buffers) instead of ordering each block's copy after the last.
        t = start + tl.arange(0, BLOCK_N)
        page = _page_ids(KvIndices, page_base, t, t < end, PAGE_SIZE)
        for blk in range(start, full_end, BLOCK_N):
            k = _kv_rows(k_head, page, t, t, k_cols, stride_kp, stride_kt, PAGE_SIZE, False)
            v = _kv_rows(v_head, page, t, t, v_cols, stride_vp, stride_vt, PAGE_SIZE, False)
            t = t + BLOCK_N
            page = _page_ids(KvIndices, page_base, t, t < end, PAGE_SIZE)
            m_i, l_i, acc = _attend_block(q, k, v, t, m_i, l_i, acc, qk_scale, INPUT_PRECISION, False)
        if full_end < end:
            t_mask = t < end
            k = _kv_rows(k_head, page, t, t_mask, k_cols, stride_kp, stride_kt, PAGE_SIZE)
            v = _kv_rows(v_head, page, t, t_mask, v_cols, stride_vp, stride_vt, PAGE_SIZE)
            m_i, l_i, acc = _attend_block(q, k, v, t_mask, m_i, l_i, acc, qk_scale, INPUT_PRECISION)
    elif PREFETCH == 2:
        # Software-pipelined by hand: block i+1's K/V and block i+2's page ids are loaded before
        # block i is computed, so neither the page-id -> row dependency nor a DRAM round trip
        # sits between two blocks' math (only loads past `end`, masked, are skipped).
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < end
        page = _page_ids(KvIndices, page_base, t, t_mask, PAGE_SIZE)
        k = _kv_rows(k_head, page, t, t_mask, k_cols, stride_kp, stride_kt, PAGE_SIZE)
        v = _kv_rows(v_head, page, t, t_mask, v_cols, stride_vp, stride_vt, PAGE_SIZE)
        t1 = t + BLOCK_N
        page1 = _page_ids(KvIndices, page_base, t1, t1 < end, PAGE_SIZE)
        for blk in range(start, end, BLOCK_N):
            t2 = t1 + BLOCK_N
            page2 = _page_ids(KvIndices, page_base, t2, t2 < end, PAGE_SIZE)
            k1 = _kv_rows(k_head, page1, t1, t1 < end, k_cols, stride_kp, stride_kt, PAGE_SIZE)
            v1 = _kv_rows(v_head, page1, t1, t1 < end, v_cols, stride_vp, stride_vt, PAGE_SIZE)
            m_i, l_i, acc = _attend_block(q, k, v, t_mask, m_i, l_i, acc, qk_scale, INPUT_PRECISION)
            k, v, t_mask, t1, page1 = k1, v1, t1 < end, t2, page2
    else:
        for blk in range(start, end, BLOCK_N):
            t = blk + tl.arange(0, BLOCK_N)
            t_mask = t < end
            k = _kv_block(k_head, page_base, KvIndices, t, t_mask, k_cols, stride_kp, stride_kt, PAGE_SIZE)
            v = _kv_block(v_head, page_base, KvIndices, t, t_mask, v_cols, stride_vp, stride_vt, PAGE_SIZE)
            m_i, l_i, acc = _attend_block(q, k, v, t_mask, m_i, l_i, acc, qk_scale, INPUT_PRECISION)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if not SPLIT:
        o_ptrs = O + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, (acc * v_scale / l_safe[:, None]).to(O.dtype.element_ty), mask=own)
    else:
        _store_partial(MidO, MidLse, b * num_splits + split, heads, d, own, g_mask, acc * v_scale, l_safe, m_i,
                       empty, NUM_Q_HEADS, HEAD_DIM)
        if MERGE_IN_KERNEL:
            # The last split program of this (sequence, KV heads) to finish merges: see the
            # one-launch kernel below for the ordering (barrier, acq_rel count, L2 loads).
            tl.debug_barrier()
            count = Counts + b * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
                merged = _merge_partials_online(MidO, MidLse, b * num_splits, n_splits, heads, g_mask, d, own,
                                                NUM_Q_HEADS, GROUP_PAD, KV_PACK * HEAD_DIM, HEAD_DIM, MERGE_SPLITS)
                o_ptrs = O + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
                tl.store(o_ptrs, merged.to(O.dtype.element_ty), mask=own)
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _merge_partials_online(MidO, MidLse, slot0, n_splits, heads, g_mask, d, own,
                           NUM_Q_HEADS: tl.constexpr, GROUP_PAD: tl.constexpr, COLS: tl.constexpr,
                           HEAD_DIM: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m) over n_splits partials (a runtime count),
    MERGE_SPLITS at a time with a running max -> [GP, COLS] (row r's own columns: `own`)."""
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, COLS], tl.float32)
    for s0 in range(0, n_splits, MERGE_SPLITS):
        sc = s0 + tl.arange(0, MERGE_SPLITS)
        live = sc < n_splits
        lse = tl.load(MidLse + (slot0 + sc[:, None]) * NUM_Q_HEADS + heads[None, :],
                      mask=live[:, None] & g_mask[None, :], other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty: weights 0
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref[None, :])  # [MS, GP]
        o = tl.load(MidO + ((slot0 + sc[:, None, None]) * NUM_Q_HEADS + heads[None, :, None]) * HEAD_DIM
                    + d[None, None, :], mask=live[:, None, None] & own[None, :, :], other=0.0, cache_modifier=".cg")
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    return acc / tl.where(den == 0.0, 1.0, den)[:, None]


@triton.jit(do_not_specialize=["min_split_tokens", "block_n"])
def _merge_kernel(
    MidO, MidLse, O, KvLens,
    stride_ob, stride_oh, min_split_tokens, block_n,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Program (b, kvh, j) merges heads kvh*G + j*HPP + [0, HPP) of sequence b over its splits."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    j = tl.program_id(2)
    kv_len = tl.load(KvLens + b)
    n_splits, _ = _split_range(kv_len, NUM_SPLITS, min_split_tokens, block_n)
    s = tl.arange(0, NUM_SPLITS)
    g = j * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    mask2 = (s[:, None] < n_splits) & (g[None, :] < GROUP)  # [S, HPP]
    slot = b * NUM_SPLITS + s
    lse = tl.load(MidLse + slot[:, None] * NUM_Q_HEADS + heads[None, :], mask=mask2, other=float("-inf"))
    m = tl.max(lse, 0)  # [HPP]
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[None, :])  # masked and empty splits: 2^-inf = 0
    o_ptrs = MidO + (slot[:, None, None] * NUM_Q_HEADS + heads[None, :, None]) * HEAD_DIM + d[None, None, :]
    o = tl.load(o_ptrs, mask=mask2[:, :, None], other=0.0)  # [S, HPP, D]
    den = tl.sum(w, 0)
    num = tl.sum(w[:, :, None] * o, 0)  # [HPP, D]
    out = num / tl.where(den == 0.0, 1.0, den)[:, None]
    o_out = O + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_out, out.to(O.dtype.element_ty), mask=(g < GROUP)[:, None])


PREFETCH_MODES = {"none": 0, "pages": 1, "blocks": 2}  # decode_attention(prefetch=) -> PREFETCH


def _loop_constexprs(fp8_kv: bool, q_dtype: torch.dtype, fp8_as_fp16: bool, prefetch: str,
                     v_strides_even: bool = True) -> dict:
    """`_decode_kernel`'s loop choices (FP8_AS_FP16, PREFETCH, SPLIT_V, V_PRMT) from
    decode_attention's arguments; scripts/decode_attn_bench.py lowers the kernel with the same
    ones. V is read as uint16 pairs only where its strides (in fp8 elements) are even."""
    if prefetch not in PREFETCH_MODES:
        raise ValueError(f"prefetch must be one of {tuple(PREFETCH_MODES)}, got {prefetch!r}")
    mode = PREFETCH_MODES[prefetch]
    as_fp16 = fp8_as_fp16 and fp8_kv and q_dtype != torch.float32
    split_v = as_fp16 and mode == PREFETCH_MODES["pages"] and v_strides_even
    return dict(FP8_AS_FP16=as_fp16, PREFETCH=mode, SPLIT_V=split_v, V_PRMT=split_v and not INTERPRETED)


def check_kv_pack(kv_pack: int, num_kv_heads: int) -> None:
    """KV heads per program: a power of two that divides the KV heads; else a ValueError."""
    if kv_pack < 1 or kv_pack & (kv_pack - 1) or num_kv_heads % kv_pack:
        raise ValueError(f"kv_heads_per_program must be a power of two dividing the {num_kv_heads} KV heads, "
                         f"got {kv_pack}")


def check_long_split(min_split_tokens: int, long_from_tokens: int, long_split_tokens: int) -> None:
    """The one-launch decode's split lengths: min_split_tokens >= 1; a long rule
    (long_from_tokens > 0) needs long_split_tokens >= 1; else a ValueError."""
    if min_split_tokens < 1 or long_from_tokens < 0 or (long_from_tokens > 0 and long_split_tokens < 1):
        raise ValueError(f"split lengths must be positive: min_split_tokens {min_split_tokens}, long rule "
                         f"{long_split_tokens} tokens from {long_from_tokens} (0: off)")


def _check_merge_counts(merge_counts: torch.Tensor, count: int) -> None:
    """The last-program merge's counters: at least `count` int32; else a ValueError."""
    if merge_counts.dtype != torch.int32 or merge_counts.numel() < count:
        raise ValueError(f"merge_counts must hold {count} int32 counters")


def one_launch_counters(batch: int, programs_per_row: int, num_splits: int, merge_group: int = 0) -> int:
    """The merge counters a one-launch call reads: one per (sequence, program column), and with
    a two-level merge (0 < merge_group < num_splits) one more per group of splits."""
    groups = num_splits // merge_group if 0 < merge_group < num_splits else 0
    return batch * programs_per_row * (1 + groups)


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def group_pad(group: int) -> int:
    """Rows of the query tile for a KV group of `group` heads (>= 16 for tl.dot)."""
    return max(16, _next_pow2(group))


def choose_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int, waves: int = 2) -> int:
    """Most splits per sequence, from the batch shape only (so it is CUDA-graph stable).

    Aims at about `waves` programs per SM: S = next_pow2(waves * SMs / (B * Hkv)), clamped to
    [1, max_splits]. Large batches get S = 1 (no partials, no merge)."""
    return tuning.num_splits(num_seqs, num_kv_heads, num_sms, waves, max_splits)


def check_cache_dtype(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K/V caches in q's dtype, or both fp8 e4m3 (read with their scales); else a ValueError."""
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"k/v cache dtypes {k_cache.dtype} / {v_cache.dtype} do not match q's "
                         f"{q.dtype} (or float8_e4m3fn for both)")


def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """q [rows, Hq, D] over one layer's pool k/v_cache [P, page, Hkv, D], as the Triton attention
    kernels (decode and prefill) read them -> (Hq, D, page size, Hkv), or a ValueError naming
    what is off."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [rows, heads, head_dim] and the k/v cache [pages, page_size, "
                         f"kv_heads, head_dim], got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    num_q_heads, head_dim = q.shape[1:]
    _, page_size, num_kv_heads, head_dim_k = k_cache.shape
    if head_dim_k != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v cache {tuple(k_cache.shape)}")
    check_cache_dtype(q, k_cache, v_cache)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV groups")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k/v cache rows must be contiguous in head_dim")
    return num_q_heads, head_dim, page_size, num_kv_heads


def _check_shapes(q, k_cache, v_cache, num_splits: int, block_n: int) -> tuple:
    """-> (batch, Hq, D, page size, Hkv) of a decode call, or a ValueError naming what is off."""
    num_q_heads, head_dim, page_size, num_kv_heads = check_paged_attention(q, k_cache, v_cache)
    batch = q.shape[0]
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    return batch, num_q_heads, head_dim, page_size, num_kv_heads


def _strides(q, out, k_cache, v_cache) -> tuple[int, ...]:
    """The strides both decode kernels take, in their order: q, out (sequence, head); the K
    and V pools (page, token, head)."""
    return (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
    min_split_tokens: int = 128,
    block_n: int = 64,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_as_fp16: bool = True,
    prefetch: str = "none",
    kv_heads_per_program: int = 1,
    merge_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one row per sequence) over one layer's pool k/v_cache [P, page, Hkv, D].

    kv_indptr [B + 1] int32, kv_indices int32 page ids, kv_lens [B] int32 (tokens, the newest
    included). num_splits: the most splits per sequence (a power of two; 1 = no split-KV).
    mid_o [>= B * num_splits, Hq, D] fp32 and mid_lse [>= B * num_splits, Hq] fp32 are the
    split scratch (allocated here when None). k_scale / v_scale: what the stored K / V are
    multiplied by (an fp8 pool's). fp8_as_fp16: an fp8 pool read by a bf16/fp16 q computes its
    dots in fp16 (False: in q's dtype). prefetch (PREFETCH_MODES): what the loop loads ahead by
    hand; "none" leaves it all to Triton's pipeliner (num_stages), "pages" carries the next
    block's page ids so the pipeliner can keep num_stages - 1 blocks of K/V in flight, "blocks"
    also holds the next block's K/V in registers. kv_heads_per_program: KV heads one program
    reads side by side (their query heads share one softmax tile: see the module docstring).
    merge_counts: int32 [>= B * Hkv / kv_heads_per_program] counters, zero before the first call
    and left at zero by each: with them (and num_splits > 1) each group's last split program
    merges the partials, no merge kernel is launched (one per stream, never shared by two
    launches in flight). Returns out [B, Hq, D] in q's dtype. No host sync.
    """
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _check_shapes(
        q, k_cache, v_cache, num_splits, block_n)
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_q_heads // num_kv_heads
    check_kv_pack(kv_heads_per_program, num_kv_heads)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits > 1:
        rows = batch * num_splits
        if mid_o is None:
            mid_o = torch.empty((rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        if mid_lse is None:
            mid_lse = torch.empty((rows, num_q_heads), dtype=torch.float32, device=q.device)
        if mid_o.shape[0] < rows or mid_lse.shape[0] < rows or not (mid_o.is_contiguous() and mid_lse.is_contiguous()):
            raise ValueError(f"split scratch holds {mid_o.shape[0]} rows, needs {rows} contiguous")
    else:
        mid_o, mid_lse = out, out  # unused (an unsplit launch writes O directly)
    groups = num_kv_heads // kv_heads_per_program
    merge_in_kernel = merge_counts is not None and num_splits > 1
    if merge_in_kernel:
        _check_merge_counts(merge_counts, batch * groups)
    precision = "ieee" if q.dtype == torch.float32 else None  # None: the default (bf16/fp16 MMAs)
    loop = _loop_constexprs(k_cache.dtype == torch.float8_e4m3fn, q.dtype, fp8_as_fp16, prefetch,
                            all(s % 2 == 0 for s in v_cache.stride()[:3]))
    gp = group_pad(group * kv_heads_per_program)
    _decode_kernel[(batch, groups, num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, merge_counts if merge_in_kernel else kv_lens,
        kv_indptr, kv_indices, kv_lens,
        scale * LOG2E * k_scale, v_scale, min_split_tokens, num_splits,
        *_strides(q, out, k_cache, v_cache),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        GROUP_PAD=gp,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        INPUT_PRECISION=precision,
        **loop,
        KV_PACK=kv_heads_per_program,
        HEADS_CONTIGUOUS=k_cache.stride(2) == head_dim and v_cache.stride(2) == head_dim,
        MERGE_IN_KERNEL=merge_in_kernel,
        # Partials merged at a time: a [MS, GP, KV_PACK * D] fp32 tile of at most 4096 elements.
        MERGE_SPLITS=max(1, min(num_splits, 4096 // (gp * kv_heads_per_program * head_dim))),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1 and not merge_in_kernel:
        merge_gp = group_pad(group)  # the merge kernel's rows: one KV head's group
        # Heads per merge program: keep the [S, heads, D] fp32 tile near 8192 elements (>= 2 heads).
        hpp = max(2, min(merge_gp, 8192 // (num_splits * head_dim)))
        _merge_kernel[(batch, num_kv_heads, merge_gp // hpp)](
            mid_o, mid_lse, out, kv_lens,
            out.stride(0), out.stride(1), min_split_tokens, block_n,
            NUM_Q_HEADS=num_q_heads,
            GROUP=group,
            HEADS_PER_PROG=hpp,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            num_warps=4 if num_splits * hpp * head_dim <= 8192 else 8,
        )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain PyTorch: gather each sequence's pages, softmax(q K^T * scale) V in fp32 (stored
    K / V times k_scale / v_scale)."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    indptr, lens = kv_indptr.tolist(), kv_lens.tolist()
    out = torch.zeros_like(q)
    for b in range(batch):
        n = lens[b]
        if n == 0:
            continue
        pages = kv_indices[indptr[b] : indptr[b] + (n + page_size - 1) // page_size].long()
        # k, v: [n, Hq, D]
        k = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1) * k_scale
        v = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1) * v_scale
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


# ---- one launch: split-KV whose last program merges (decode steps of 1-16 rows) -----------------
#
# The fused decode path (flashlet/runner/fused_decode.py) runs 1-16 rows a step, where the two
# launches above (split kernel, then merge kernel) cost two dependent kernel boundaries a
# layer for a few microseconds of work. `decode_attention_one_launch` does the same work in
# one launch (the Triton backend's per-op decode steps of as many rows too): grid (B, Hkv, S) as
# before, and a sequence whose kv_len needs one split writes
# O directly; otherwise each split writes its partial, then bumps a per-(sequence, KV head)
# counter, and the program that brings it to n_splits (the last to finish) merges the
# partials and sets the counter back to 0, so the next launch (the next layer, the next graph
# replay) finds it at 0 again. The merge is ordered after every split's partial by the CTA
# barrier before the counter's acq_rel atomic (release of this CTA's stores at GPU scope)
# and by the atomic's acquire in the merging CTA, whose loads bypass L1 (".cg": another SM
# wrote those lines).
#
# With USE_PDL (Programmatic Dependent Launch, sm_90+) the kernel lets its dependent (the O
# projection) launch at once, and reads before `griddepcontrol.wait` only what no kernel of this
# step writes: kv_lens and the page table (copied in before the step) and the first block's past
# K/V rows (written by earlier steps, which finished before this step's graph started or, run
# eagerly, before some kernel launched without PDL between them: the LM head's GEMM). q, this
# step's K/V rows (the fused path's QKV GEMV writes them, the per-op path's RoPE + K/V write
# kernel), the partials and the counter (the previous layer's attention may still run before the
# wait) come after it.
#
# This step's rows of a sequence are usually its newest one. A speculative verify step run as
# decode rows (fused_decode.verify_as_decode_rows) has k + 1 rows of one sequence, row i over KV
# length p + i + 1: rows p .. p + i - 1 of its KV are written by this step too. Such rows are
# consecutive in the batch, over the same page table, their KV lengths one apart; so a program
# looks back over up to LOOKBACK earlier rows of the batch (their kv_lens and first page ids,
# before the wait) and counts the run of rows that match: every one of them is a row this step
# writes, and only rows before them are read before the wait. A false match (two sequences
# sharing a first page, lengths one apart) only moves a past row after the wait: slower, never
# stale. LOOKBACK covers every earlier row of a batch of up to MAX_LOOKBACK + 1 rows (the fused
# path's steps) and, past that, sequences of up to MAX_LOOKBACK + 1 rows a step.
#
# ROPE_IN (`rope_in=`, off by default): q, k and v come as the QKV projection wrote them, and the
# kernel makes this step's rows itself after its wait (Qwen3's per-head norms, RoPE, the pool's
# rounding), the program whose split holds a row's newest position storing that K/V row. No
# program then loads a slot another program of this launch writes: the newest row comes from
# registers, and a verify row makes the step's earlier rows it reads from the rows that write them,
# found exactly (the same pool page for that position: `_rows_before_writing_this_rows_kv`), with
# or without PDL. NEWEST_FIRST (rope_in steps of 2+ rows: `rope_in_newest_first`): the newest row
# opens the online softmax as a one-key block of its own, and no block loads or attends its slot.
# Otherwise (one row) the owner's block loop past its first block loads the newest row's slot too,
# and replaces what it loads with the row in registers: a mask of its own for that load cost
# registers and spills at the 64 x 128 tile with page ids ahead and groups. The interpreter's
# access log, tests/triton_interpreter.py, holds the kernel to this.
#
# Variants (tuning.OneLaunchConfig picks them per rows bucket; off where no entry sets them, and
# then the kernel compiles to the PTX it had before they existed): KV_PACK KV heads a program, as in
# `_decode_kernel`; LONG_RULE, a row of at least long_from_tokens splitting at long_split_tokens
# (runtime values: one graph per row count serves every length); MERGE_SPLITS, the merge width;
# PREFETCH_PAGES, page ids carried a block ahead by the block loop; MERGE_GROUP, the merge in two
# levels (each MERGE_GROUP splits' last program folds theirs, the last group's merges the groups':
# one program no longer merges up to 64 partials alone while the GPU idles). MERGE_PEEL and
# MERGE_ROWS, the lean merge (LEAN_MERGE: on by default; $FLASHLET_LEAN_MERGE=0 is an A/B switch,
# not a config field): the merge's first partials load beside its log-sum-exps; its tiles hold
# only the real query heads.


@triton.jit
def _store_partial(MidO, MidLse, slot, heads, d, own, g_mask, acc, l_safe, m_i, empty,
                   NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A split's partial (its normalised output, in MidO's dtype: fp32, or bf16 left to a consumer's
    merge) and base-2 log-sum-exp (fp32, -inf where it saw no key) into split slot `slot` of MidO /
    MidLse."""
    tl.store(MidO + (slot * NUM_Q_HEADS + heads[:, None]) * HEAD_DIM + d[None, :],
             (acc / l_safe[:, None]).to(MidO.dtype.element_ty), mask=own)
    tl.store(MidLse + slot * NUM_Q_HEADS + heads, tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)), mask=g_mask)


@triton.jit
def _group_counter(Counts, b, grp, NUM_GROUPS: tl.constexpr):
    """Split group grp's counter for sequence b and this program's column: the group counters
    follow the grid's (sequence, program column) top counters (`one_launch_counters`)."""
    top_counters = tl.num_programs(0) * tl.num_programs(1)
    return Counts + top_counters + (b * tl.num_programs(1) + tl.program_id(1)) * NUM_GROUPS + grp


@triton.jit(do_not_specialize=["min_split_tokens", "long_from_tokens", "long_split_tokens"])
def _one_launch_kernel(
    Q, K, V, O, MidO, MidLse, Counts,
    KvIndptr, KvIndices, KvLens,
    qk_scale, v_scale, min_split_tokens, long_from_tokens, long_split_tokens,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOOKBACK: tl.constexpr,
    STEP_ROWS: tl.constexpr,
    KV_PACK: tl.constexpr,
    LONG_RULE: tl.constexpr,
    KNew=None, VNew=None, Pos=None, CosSin=None, QW=None, KW=None, KOut=None, VOut=None,
    stride_knb=0, stride_knh=0, stride_vnb=0, stride_vnh=0, stride_cs=0,
    norm_eps=0.0, k_inv_scale=1.0, v_inv_scale=1.0,
    ROPE_IN: tl.constexpr = False,
    NEWEST_FIRST: tl.constexpr = False,
    QK_NORM: tl.constexpr = False,
    CACHE_FP8: tl.constexpr = False,
    PREFETCH_PAGES: tl.constexpr = False,
    EARLY_PAGE_BASE: tl.constexpr = False,
    MERGE_GROUP: tl.constexpr = 0,
    MERGE_PEEL: tl.constexpr = False,
    MERGE_ROWS: tl.constexpr = 0,
    PARTIALS_OUT: tl.constexpr = False,
):
    if USE_PDL:
        pdl.launch_dependents()  # the O GEMV may launch and load its weights now
    b = tl.program_id(0)
    kvh = tl.program_id(1) * KV_PACK  # the first of the KV_PACK KV heads this program reads
    split = tl.program_id(2)
    kv_len = tl.load(KvLens + b)
    page_base = tl.load(KvIndptr + b)  # issued beside kv_len, not after the branch on it
    # With LONG_RULE a row at least long_from_tokens long splits at long_split_tokens: runtime
    # values, so one compiled kernel (and one CUDA graph) serves every length.
    split_tokens = min_split_tokens
    if LONG_RULE:
        split_tokens = tl.where(kv_len >= long_from_tokens, long_split_tokens, min_split_tokens)
    n_splits, split_len = _split_range(kv_len, NUM_SPLITS, split_tokens, BLOCK_N)
    # EARLY_PAGE_BASE: page_base (never negative) in the branch, so its load stays beside
    # kv_len's; the compiler sinks it past the branch otherwise (sm_90a SASS, Triton 3.7.1), one
    # dependent round trip more before the first block's page ids.
    past_the_splits = split >= n_splits
    if EARLY_PAGE_BASE:
        past_the_splits = past_the_splits | (page_base < 0)
    if past_the_splits:
        return
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    # Rows: the KV_PACK * GROUP query heads (padded to GROUP_PAD); columns: the KV_PACK heads' D
    # each, side by side as a key row holds them (`_decode_kernel`'s packing). Row r reads and
    # writes only its own head's columns (`own`).
    c = tl.arange(0, KV_PACK * HEAD_DIM)
    d = c % HEAD_DIM
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < KV_PACK * GROUP
    if KV_PACK == 1:
        own = g_mask[:, None]
        k_cols = d
        v_cols = d
    else:
        own = g_mask[:, None] & ((c // HEAD_DIM)[None, :] == (g // GROUP)[:, None])
        k_cols = (c // HEAD_DIM) * stride_kh + d
        v_cols = (c // HEAD_DIM) * stride_vh + d
    heads = kvh * GROUP + g
    q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :]

    # Before the wait, everything no kernel of this step writes: the first block's page ids
    # and past K/V rows, and the newest row's address (the page table is copied in before the
    # graph starts). After it only q and the newest K/V row, three independent loads from
    # known addresses: one L2 round trip (and, for a verify row, this step's earlier rows).
    last = kv_len - 1
    step_from = last  # the first position this step writes in this row's KV
    if LOOKBACK > 0:
        if ROPE_IN:  # exact: these rows are made here, not read, so a false match would be wrong
            step_from = last - _rows_before_writing_this_rows_kv(b, kv_len, page_base, KvIndptr, KvIndices,
                                                                 KvLens, PAGE_SIZE, LOOKBACK)
        else:
            step_from = last - _rows_before_of_same_sequence(b, kv_len, page_base, KvIndptr, KvIndices,
                                                             KvLens, LOOKBACK)
    t = start + tl.arange(0, BLOCK_N)
    t_mask = t < end
    past = t_mask & (t < step_from)
    k = _kv_block(k_head, page_base, KvIndices, t, past, k_cols, stride_kp, stride_kt, PAGE_SIZE)
    v = _kv_block(v_head, page_base, KvIndices, t, past, v_cols, stride_vp, stride_vt, PAGE_SIZE)
    in_block = (kv_len > 0) & (last >= start) & (last < start + BLOCK_N) & (last < end)
    # ROPE_IN: the program whose range holds the newest row makes that row and writes it.
    owns_last = (kv_len > 0) & (last >= start) & (last < end)
    last_mask = owns_last if ROPE_IN else in_block
    last_page = tl.load(KvIndices + page_base + last // PAGE_SIZE, mask=last_mask, other=0).to(tl.int64)
    k_last_at = kvh * stride_kh + last_page * stride_kp + (last % PAGE_SIZE) * stride_kt + k_cols
    v_last_at = kvh * stride_vh + last_page * stride_vp + (last % PAGE_SIZE) * stride_vt + v_cols
    k_last = K + k_last_at
    v_last = V + v_last_at
    if ROPE_IN:  # this row's RoPE table row (its position is copied in before the step)
        cs_row = CosSin + tl.load(Pos + b).to(tl.int64) * stride_cs
    if PREFETCH_PAGES:  # the second block's page ids, before the wait too (the loop carries them)
        t_next = start + BLOCK_N + tl.arange(0, BLOCK_N)
        page_next = _page_ids(KvIndices, page_base, t_next, t_next < end, PAGE_SIZE)
    if USE_PDL:
        pdl.wait()  # the QKV GEMV has finished: q and the newest K/V row (ROPE_IN: q, k, v) are written
    if ROPE_IN:
        # q and the newest k as the QKV GEMV left them: normalised (QK_NORM) and rotated here,
        # rounded as rope_kv_write rounds them; the newest K/V row stored by its owner only
        # (the rows of this step that read it make it themselves), as the pool holds it (an
        # fp8 pool's scale applied), and read back in that form, as the loaded form would be.
        # The table row and the norms' weights load beside q and k (one round trip): held across
        # the wait they cost registers the first block's K/V need. Columns c of a packed tile:
        # head c // D's column d; its rotation pair is that head's column `partner`.
        half = d % (HEAD_DIM // 2)
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)[None, :]
        cos = tl.load(cs_row + half).to(tl.float32)[None, :]
        sin = tl.load(cs_row + HEAD_DIM // 2 + half).to(tl.float32)[None, :]
        qw = cos
        qw_partner = cos
        kw = cos
        kw_partner = cos
        if QK_NORM:
            qw = tl.load(QW + d).to(tl.float32)[None, :]
            qw_partner = tl.load(QW + partner).to(tl.float32)[None, :]
            kw = tl.load(KW + d).to(tl.float32)[None, :]
            kw_partner = tl.load(KW + partner).to(tl.float32)[None, :]
        q = _norm_rope(tl.load(q_ptrs, mask=own, other=0.0),
                       tl.load(q_ptrs + (partner - d)[None, :], mask=own, other=0.0),
                       cos, sin, sign, qw, qw_partner, norm_eps, HEAD_DIM, 1, QK_NORM)
        kn_cols = ((c // HEAD_DIM) * stride_knh + d)[None, :]  # a row's KV_PACK heads, side by side
        kn_partner = kn_cols + (partner - d)[None, :]
        vn_cols = ((c // HEAD_DIM) * stride_vnh + d)[None, :]
        kn_row = KNew + b * stride_knb + kvh * stride_knh
        vn_row = VNew + b * stride_vnb + kvh * stride_vnh
        mine = (c >= 0)[None, :] & owns_last  # [1, COLS]
        k_fresh = _to_cache(_norm_rope(tl.load(kn_row + kn_cols, mask=mine, other=0.0),
                                        tl.load(kn_row + kn_partner, mask=mine, other=0.0),
                                        cos, sin, sign, kw, kw_partner, norm_eps, HEAD_DIM, KV_PACK, QK_NORM),
                             k_inv_scale, K, CACHE_FP8)
        v_fresh = _to_cache(tl.load(vn_row + vn_cols, mask=mine, other=0.0), v_inv_scale, V, CACHE_FP8)
        # k_last / v_last's rows, in KOut / VOut (the pool unless a test redirects them)
        tl.store((KOut + k_last_at)[None, :], k_fresh, mask=mine)
        tl.store((VOut + v_last_at)[None, :], v_fresh, mask=mine)
        k_new = k_fresh.to(q.dtype)  # [1, COLS]
        v_new = v_fresh.to(q.dtype)
    else:
        q = tl.load(q_ptrs, mask=own, other=0.0)
        # In q's dtype before the select (an fp8 pool's rows are widened here, not in the dots).
        k_new = tl.load(k_last, mask=in_block, other=0.0).to(q.dtype)[None, :]
        v_new = tl.load(v_last, mask=in_block, other=0.0).to(q.dtype)[None, :]
    if NEWEST_FIRST:
        # (ROPE_IN steps of 2+ rows.) The newest row made here opens the online softmax as its
        # one key (CUDA-core dot products, exact weight 1), so k_new / v_new die here: carried
        # through the block loop to be spliced into the block that holds their slot, they cost
        # the loop ~90 registers a thread (Qwen3's 4-row tile: 217 -> 128, two blocks an SM; sm_90a,
        # Triton 3.7.1). The blocks then never attend that slot (and never load it: a stale value
        # times a zero weight can still be a NaN). Rows a program does not own the newest key of
        # start empty. At one row the splice stays: the cross-warp sums put a dependent step
        # between the wait and the first block, and one stream lost 3-5% (H100, FUSED_NOTES
        # "Session 56").
        # Row r of a packed tile holds q in its own head's columns and zeros elsewhere, so the
        # sum over all columns is its own head's score; acc takes every head's V, as PV does.
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale
        m_i = tl.where(owns_last, s_new, float("-inf"))
        l_i = tl.where(owns_last, 1.0, 0.0) + tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.where(owns_last, v_new.to(tl.float32), 0.0) + tl.zeros([GROUP_PAD, KV_PACK * HEAD_DIM], tl.float32)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    else:
        k, v = _splice_newest(k, v, t, last, k_new, v_new)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, KV_PACK * HEAD_DIM], tl.float32)
    # This step's earlier rows of the sequence (a verify row's) are keys of a block of their own,
    # loaded now; the first block holds the rows before them (and the newest row, unless it
    # opened the softmax above).
    first_keys = _block_keys(t, t_mask, step_from, last, LOOKBACK > 0, NEWEST_FIRST)
    m_i, l_i, acc = _attend_block(q, k, v, first_keys, m_i, l_i, acc, qk_scale, INPUT_PRECISION)
    if LOOKBACK > 0:
        if step_from < last:
            s = step_from + tl.arange(0, STEP_ROWS)
            if ROPE_IN:
                # Every one of them in this split's range, made from the rows that write them (row
                # b - (last - s) of the step, at its own position), as those rows' programs make them.
                s_mask = (s >= start) & (s < end) & (s < last)
                src = b - (last - s)
                s_cs = CosSin + tl.load(Pos + src, mask=s_mask, other=0).to(tl.int64)[:, None] * stride_cs
                s_cos = tl.load(s_cs + half[None, :], mask=s_mask[:, None], other=0.0).to(tl.float32)
                s_sin = tl.load(s_cs + HEAD_DIM // 2 + half[None, :], mask=s_mask[:, None], other=0.0).to(tl.float32)
                s_k = KNew + src[:, None] * stride_knb + kvh * stride_knh
                k_step = _to_cache(_norm_rope(tl.load(s_k + kn_cols, mask=s_mask[:, None], other=0.0),
                                               tl.load(s_k + kn_partner, mask=s_mask[:, None], other=0.0),
                                               s_cos, s_sin, sign, kw, kw_partner, norm_eps, HEAD_DIM, KV_PACK,
                                               QK_NORM),
                                    k_inv_scale, K, CACHE_FP8)
                v_step = _to_cache(tl.load(VNew + src[:, None] * stride_vnb + kvh * stride_vnh + vn_cols,
                                            mask=s_mask[:, None], other=0.0), v_inv_scale, V, CACHE_FP8)
            else:  # those in the first block (later blocks read theirs after the wait)
                s_mask = (s >= start) & (s < start + BLOCK_N) & (s < end) & (s < last)
                k_step = _kv_block(k_head, page_base, KvIndices, s, s_mask, k_cols, stride_kp, stride_kt, PAGE_SIZE)
                v_step = _kv_block(v_head, page_base, KvIndices, s, s_mask, v_cols, stride_vp, stride_vt, PAGE_SIZE)
            m_i, l_i, acc = _attend_block(q, k_step, v_step, s_mask, m_i, l_i, acc, qk_scale, INPUT_PRECISION)
    # New names in the loop: the first block's k and v are already q's dtype, an fp8 pool's
    # blocks here are still fp8 (`_attend_block` widens them), and a loop-carried name keeps one type.
    if PREFETCH_PAGES:
        # Page ids a block ahead, carried by the loop (the two-launch form's "pages"): a block's
        # K/V addresses come from the iteration before, not from a load in the same one, so the
        # pipeliner can stage the block's copy num_stages - 1 iterations early.
        for blk in range(start + BLOCK_N, end, BLOCK_N):
            t = t_next
            page = page_next
            t_mask = t < end
            blk_keys = _block_keys(t, t_mask, step_from, last, ROPE_IN, NEWEST_FIRST)
            k_blk = _kv_rows(k_head, page, t, blk_keys, k_cols, stride_kp, stride_kt, PAGE_SIZE)
            v_blk = _kv_rows(v_head, page, t, blk_keys, v_cols, stride_vp, stride_vt, PAGE_SIZE)
            t_next = t + BLOCK_N
            page_next = _page_ids(KvIndices, page_base, t_next, t_next < end, PAGE_SIZE)
            if ROPE_IN and not NEWEST_FIRST:
                k_blk, v_blk = _splice_newest(k_blk, v_blk, t, last, k_new, v_new)
            m_i, l_i, acc = _attend_block(q, k_blk, v_blk, blk_keys, m_i, l_i, acc, qk_scale, INPUT_PRECISION)
    else:
        for blk in range(start + BLOCK_N, end, BLOCK_N):
            t = blk + tl.arange(0, BLOCK_N)
            t_mask = t < end
            blk_keys = _block_keys(t, t_mask, step_from, last, ROPE_IN, NEWEST_FIRST)
            k_blk = _kv_block(k_head, page_base, KvIndices, t, blk_keys, k_cols, stride_kp, stride_kt, PAGE_SIZE)
            v_blk = _kv_block(v_head, page_base, KvIndices, t, blk_keys, v_cols, stride_vp, stride_vt, PAGE_SIZE)
            if ROPE_IN and not NEWEST_FIRST:  # the newest row from registers
                k_blk, v_blk = _splice_newest(k_blk, v_blk, t, last, k_new, v_new)
            m_i, l_i, acc = _attend_block(q, k_blk, v_blk, blk_keys, m_i, l_i, acc, qk_scale, INPUT_PRECISION)

    acc = acc * v_scale
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_ptrs = O + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if PARTIALS_OUT:
        # The merge is the consumer's (the O GEMV's prologue, `cute_gemv.merge_in`): every split,
        # one included, leaves its partial and log-sum-exp, and no counter moves.
        _store_partial(MidO, MidLse, b * NUM_SPLITS + split, heads, d, own, g_mask, acc, l_safe, m_i, empty,
                       NUM_Q_HEADS, HEAD_DIM)
    elif n_splits == 1:
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=own)
    else:
        slot0 = b * NUM_SPLITS
        _store_partial(MidO, MidLse, slot0 + split, heads, d, own, g_mask, acc, l_safe, m_i, empty,
                       NUM_Q_HEADS, HEAD_DIM)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        count = Counts + b * (NUM_KV_HEADS // KV_PACK) + tl.program_id(1)
        # The merge's rows: the dot's GROUP_PAD (16 or more; MERGE_ROWS 0), or with MERGE_ROWS
        # below it the KV_PACK * GROUP real query heads padded to MERGE_ROWS only (Qwen3's group 2:
        # 2 rows, not 16), so a merge step reads GROUP_PAD / MERGE_ROWS times as many partials.
        merge_rows: tl.constexpr = GROUP_PAD if MERGE_ROWS == 0 else MERGE_ROWS
        if merge_rows == GROUP_PAD:
            m_heads = heads
            m_mask = g_mask
            m_own = own
            m_out = o_ptrs
        else:
            gm = tl.arange(0, merge_rows)
            m_mask = gm < KV_PACK * GROUP
            m_heads = kvh * GROUP + gm
            if KV_PACK == 1:
                m_own = m_mask[:, None]
            else:
                m_own = m_mask[:, None] & ((c // HEAD_DIM)[None, :] == (gm // GROUP)[:, None])
            m_out = O + b * stride_ob + m_heads[:, None] * stride_oh + d[None, :]
        if MERGE_GROUP == 0:
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
                out, _ = _merge_partials(MidO, MidLse, slot0, n_splits, m_heads, m_mask, d, m_own,
                                         NUM_Q_HEADS, merge_rows, KV_PACK * HEAD_DIM, HEAD_DIM, NUM_SPLITS,
                                         MERGE_SPLITS, 1, MERGE_PEEL)
                tl.store(m_out, out.to(O.dtype.element_ty), mask=m_own)
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        else:
            # In two levels: the last program of each MERGE_GROUP consecutive splits folds their
            # partials into the group's first slot, and the last group to finish merges the
            # groups' into O. A row of at most MERGE_GROUP splits is one group, merged into O.
            num_groups: tl.constexpr = NUM_SPLITS // MERGE_GROUP
            n_groups = tl.cdiv(n_splits, MERGE_GROUP)
            grp = split // MERGE_GROUP
            g0 = grp * MERGE_GROUP
            in_group = tl.minimum(n_splits - g0, MERGE_GROUP)
            group_count = _group_counter(Counts, b, grp, num_groups)
            if tl.atomic_add(group_count, 1, sem="acq_rel", scope="gpu") == in_group - 1:
                out, lse_g = _merge_partials(MidO, MidLse, slot0 + g0, in_group, m_heads, m_mask, d, m_own,
                                             NUM_Q_HEADS, merge_rows, KV_PACK * HEAD_DIM, HEAD_DIM, MERGE_GROUP,
                                             MERGE_SPLITS, 1, MERGE_PEEL)
                tl.atomic_xchg(group_count, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                if n_groups == 1:
                    tl.store(m_out, out.to(O.dtype.element_ty), mask=m_own)
                else:
                    tl.debug_barrier()  # every thread has read the group's partials before its first is overwritten
                    group_mid = MidO + ((slot0 + g0) * NUM_Q_HEADS + m_heads[:, None]) * HEAD_DIM + d[None, :]
                    tl.store(group_mid, out, mask=m_own)
                    tl.store(MidLse + (slot0 + g0) * NUM_Q_HEADS + m_heads, lse_g, mask=m_mask)
                    tl.debug_barrier()  # the group's partial is stored before the counter moves
                    if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n_groups - 1:
                        out, _ = _merge_partials(MidO, MidLse, slot0, n_groups, m_heads, m_mask, d, m_own,
                                                 NUM_Q_HEADS, merge_rows, KV_PACK * HEAD_DIM, HEAD_DIM, num_groups,
                                                 MERGE_SPLITS, MERGE_GROUP, MERGE_PEEL)
                        tl.store(m_out, out.to(O.dtype.element_ty), mask=m_own)
                        tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _norm_rope(x, partner, cos, sin, sign, w, w_partner, eps, HEAD_DIM: tl.constexpr, SEGMENTS: tl.constexpr,
               QK_NORM: tl.constexpr):
    """Rows x [R, SEGMENTS * D] of SEGMENTS head vectors each (1: one head a row, its other
    columns zero), `partner` the same rows with each head's halves swapped (each column's
    rotation pair), cos / sin / sign / the weights per column ([1, cols] or [R, cols]) -> each head
    RMSNorm'd over D (QK_NORM) then rotate-half RoPE, in x's dtype, rounded as `rope_kv_write`
    rounds (normalised to x's dtype, times the weight, rounded; the rotation in fp32 from that,
    rounded once)."""
    xf = x.to(tl.float32)
    pf = partner.to(tl.float32)
    if QK_NORM:
        if SEGMENTS == 1:
            rstd = tl.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)[:, None]
        else:
            rows: tl.constexpr = x.shape[0]
            ss = tl.sum(tl.reshape(xf * xf, (rows, SEGMENTS, HEAD_DIM)), 2)
            per_head = tl.rsqrt(ss / HEAD_DIM + eps)[:, :, None]
            rstd = tl.reshape(tl.broadcast_to(per_head, (rows, SEGMENTS, HEAD_DIM)), (rows, SEGMENTS * HEAD_DIM))
        xf = (w * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        pf = (w_partner * (pf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    return (xf * cos + sign * pf * sin).to(x.dtype)


@triton.jit
def _rows_before_writing_this_rows_kv(b, kv_len, page_base, KvIndptr, KvIndices, KvLens,
                                      PAGE_SIZE: tl.constexpr, LOOKBACK: tl.constexpr):
    """How many rows just before row b write, in this step, K/V rows that row b reads (rope_in,
    where a row makes its newest K/V row itself): the run of rows b - j, j = 1 .. LOOKBACK, whose
    newest position, kv_len - 1 - j, lies on the same pool page in their page table as in row b's
    (so at the same slot). Exact: rows that only share a prefix's pages never match. Reads only
    what is copied in before the step."""
    j = 1 + tl.arange(0, LOOKBACK)
    prev = b - j
    pos = kv_len - 1 - j
    prev_len = tl.load(KvLens + prev, mask=prev >= 0, other=0)
    prev_base = tl.load(KvIndptr + prev, mask=prev >= 0, other=0)  # beside prev_len, not after it
    cand = (prev >= 0) & (pos >= 0) & (prev_len == pos + 1)
    mine = tl.load(KvIndices + page_base + pos // PAGE_SIZE, mask=cand, other=-1)
    theirs = tl.load(KvIndices + prev_base + pos // PAGE_SIZE, mask=cand, other=-2)
    same = cand & (mine == theirs)
    return tl.min(tl.where(same, LOOKBACK + 1, j), 0) - 1  # the first j that does not match, less one


@triton.jit
def _rows_before_of_same_sequence(b, kv_len, page_base, KvIndptr, KvIndices, KvLens,
                                  LOOKBACK: tl.constexpr):
    """How many rows just before row b belong to its sequence in this step (a verify step's
    rows as decode rows): the run of rows b - j, j = 1 .. LOOKBACK, whose KV length is
    kv_len - j over the same first page. Reads only what is copied in before the step."""
    j = 1 + tl.arange(0, LOOKBACK)
    prev = b - j
    prev_len = tl.load(KvLens + prev, mask=prev >= 0, other=0)
    prev_base = tl.load(KvIndptr + prev, mask=prev >= 0, other=0)  # beside prev_len, not after it
    has_pages = (prev >= 0) & (prev_len > 0)
    prev_first = tl.load(KvIndices + prev_base, mask=has_pages, other=-1)
    first = tl.load(KvIndices + page_base, mask=kv_len > 0, other=-2)
    same = has_pages & (prev_len == kv_len - j) & (prev_first == first)
    return tl.min(tl.where(same, LOOKBACK + 1, j), 0) - 1  # the first j that does not match, less one


@triton.jit
def _merge_partials(MidO, MidLse, slot0, n_splits, heads, g_mask, d, own,
                    NUM_Q_HEADS: tl.constexpr, GROUP_PAD: tl.constexpr, COLS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, MERGE_SPLITS: tl.constexpr,
                    SLOT_STRIDE: tl.constexpr = 1, PEEL: tl.constexpr = False):
    """o = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m) over the n_splits partials in slots
    slot0 + s * SLOT_STRIDE -> (o [GP, COLS], their log-sum-exp [GP]: m + log2 of the sum, -inf
    where every partial is empty) (row r's own columns: `own`, [GP, 1] or [GP, COLS]). All
    log-sum-exps at once ([S, GP]), then the partials MERGE_SPLITS at a time.
    PEEL: the first MERGE_SPLITS partials load beside the log-sum-exps; where they are all of
    them (a runtime branch) m and the sum come from that chunk alone: one L2 round trip and no
    cross-warp reduction over the [S, GP] tile, where there were two round trips."""
    if PEEL:
        first_lse, first_o = _partials_chunk(MidO, MidLse, slot0, tl.arange(0, MERGE_SPLITS), n_splits, heads,
                                             g_mask, d, own, NUM_Q_HEADS, COLS, HEAD_DIM, SLOT_STRIDE)
        if n_splits <= MERGE_SPLITS:
            m = tl.max(first_lse, 0)
            m = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp2(first_lse - m[None, :])
            den = tl.sum(w, 0)
            acc = tl.sum(w[:, :, None] * first_o, 0)
        else:
            m, den = _merge_weights(MidLse, slot0, n_splits, heads, g_mask, NUM_Q_HEADS, NUM_SPLITS, SLOT_STRIDE)
            acc = tl.sum(tl.exp2(first_lse - m[None, :])[:, :, None] * first_o, 0)
            acc = _merge_chunks(acc, m, MidO, MidLse, slot0, MERGE_SPLITS, n_splits, heads, g_mask, d, own,
                                NUM_Q_HEADS, COLS, HEAD_DIM, MERGE_SPLITS, SLOT_STRIDE)
    else:
        m, den = _merge_weights(MidLse, slot0, n_splits, heads, g_mask, NUM_Q_HEADS, NUM_SPLITS, SLOT_STRIDE)
        acc = _merge_chunks(tl.zeros([GROUP_PAD, COLS], tl.float32), m, MidO, MidLse, slot0, 0, n_splits, heads,
                            g_mask, d, own, NUM_Q_HEADS, COLS, HEAD_DIM, MERGE_SPLITS, SLOT_STRIDE)
    empty = den == 0.0
    den_safe = tl.where(empty, 1.0, den)
    return acc / den_safe[:, None], tl.where(empty, float("-inf"), m + tl.log2(den_safe))


@triton.jit
def _merge_weights(MidLse, slot0, n_splits, heads, g_mask, NUM_Q_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   SLOT_STRIDE: tl.constexpr):
    """(m, sum_s 2^(lse_s - m)) [GP] over every partial's log-sum-exp at once ([S, GP])."""
    s = tl.arange(0, NUM_SPLITS)
    lse = tl.load(MidLse + (slot0 + s[:, None] * SLOT_STRIDE) * NUM_Q_HEADS + heads[None, :],
                  mask=(s[:, None] < n_splits) & g_mask[None, :], other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 2^-inf = 0
    return m, tl.sum(tl.exp2(lse - m[None, :]), 0)


@triton.jit
def _merge_chunks(acc, m, MidO, MidLse, slot0, first, n_splits, heads, g_mask, d, own, NUM_Q_HEADS: tl.constexpr,
                  COLS: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_SPLITS: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """acc + sum_s 2^(lse_s - m) o_s over partials first .. n_splits - 1, MERGE_SPLITS at a time."""
    for s0 in range(first, n_splits, MERGE_SPLITS):
        w, o = _partials_chunk(MidO, MidLse, slot0, s0 + tl.arange(0, MERGE_SPLITS), n_splits, heads, g_mask, d, own,
                               NUM_Q_HEADS, COLS, HEAD_DIM, SLOT_STRIDE, m)
        acc += tl.sum(w[:, :, None] * o, 0)
    return acc


@triton.jit
def _partials_chunk(MidO, MidLse, slot0, sc, n_splits, heads, g_mask, d, own,
                    NUM_Q_HEADS: tl.constexpr, COLS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    SLOT_STRIDE: tl.constexpr, m=None):
    """Partials sc's log-sum-exps [MS, GP] (given m: their weights 2^(lse - m), made between the
    two loads) and outputs [MS, GP, COLS], past L1, masked past n_splits."""
    mask = (sc[:, None] < n_splits) & g_mask[None, :]  # [MS, GP]
    lse = tl.load(MidLse + (slot0 + sc[:, None] * SLOT_STRIDE) * NUM_Q_HEADS + heads[None, :], mask=mask,
                  other=float("-inf"), cache_modifier=".cg")
    if m is not None:
        lse = tl.exp2(lse - m[None, :])
    if COLS == HEAD_DIM:  # one KV head: a row's columns are all its own
        o_mask = mask[:, :, None]
    else:
        o_mask = mask[:, :, None] & own[None, :, :]
    o = tl.load(MidO + ((slot0 + sc[:, None, None] * SLOT_STRIDE) * NUM_Q_HEADS + heads[None, :, None]) * HEAD_DIM
                + d[None, None, :], mask=o_mask, other=0.0, cache_modifier=".cg")
    return lse, o


def _scratch_ok(t: torch.Tensor | None, rows: int, dtypes: tuple = (torch.float32,)) -> bool:
    return t is not None and t.shape[0] >= rows and t.is_contiguous() and t.dtype in dtypes


def decode_attention_one_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor,
    mid_o: torch.Tensor | None,
    mid_lse: torch.Tensor | None,
    merge_counts: torch.Tensor,
    num_splits: int,
    min_split_tokens: int = 256,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    pdl: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_heads_per_program: int = 1,
    long_from_tokens: int = 0,
    long_split_tokens: int = 0,
    merge_splits: int | None = None,
    rope_in: RopeIn | None = None,
    prefetch_pages: bool = False,
    merge_group: int = 0,
    verify_rows: bool = True,
    partials_out: bool = False,
) -> torch.Tensor:
    """`decode_attention` in one launch, the split-KV merge done by each group's last program.

    Same arguments as `decode_attention`; the scratch is required (mid_o / mid_lse are
    unused, may be None, when num_splits is 1): mid_o [>= B * num_splits,
    Hq, D] fp32, mid_lse [>= B * num_splits, Hq] fp32, merge_counts [>= B * Hkv] int32, all
    zero before the first launch (each launch leaves them at zero: keep one per stream, never
    shared by two launches in flight). pdl: launch with Programmatic Dependent Launch (sm_90+
    only; `pdl_supported`). No host sync: CUDA-graph safe for any kv_lens.

    Variants (the defaults give the kernel as it was before them, not a measured choice):
    kv_heads_per_program, KV heads one program reads side by side (`decode_attention`'s packing;
    a power of two dividing Hkv; merge_counts needs only B * Hkv / kv_heads_per_program). A row
    of at least long_from_tokens tokens (0: none) splits at long_split_tokens instead of
    min_split_tokens, both runtime values: a long row takes more of the grid's splits without a
    larger grid.
    merge_splits: partials the merging program reads at a time (a power of two; None: as many
    as fit a 4096-element fp32 tile). prefetch_pages: each block's page ids loaded a block
    ahead (the second block's before the PDL wait), as the two-launch form's "pages" prefetch.
    merge_group: the merge in two levels (0: one), a power of two: the last program of each
    merge_group consecutive splits folds their partials, and the last group's program merges
    the groups' (a row of at most merge_group splits: its one group's into O). merge_counts
    then needs `one_launch_counters(...)` counters.

    rope_in (`RopeIn`): q and this step's newest K / V rows come as the QKV projection left
    them, and the kernel normalises (Qwen3's per-head norms) and rotates q and k itself and
    writes each row's newest K / V row into the pool (at the slot its page table gives it), so
    no RoPE + K/V write kernel runs before it. A verify step's rows of one sequence (each reads
    the rows before it, which this launch writes) make those rows too, from the rows that write
    them, found by `_rows_before_writing_this_rows_kv` (the look-back runs with or without PDL):
    at most MAX_LOOKBACK + 1 rows.

    verify_rows: whether rows of one sequence may be in this batch (a verify step as decode
    rows, `fused_decode.verify_as_decode_rows`: each row reads K/V rows that the rows before it
    write). With PDL or rope_in those take the look-back (`one_launch_lookback`); False, a
    plain decode step's rows (every one another sequence's), compiles it out: fewer registers
    at 2+ rows (FUSED_NOTES "Session 57"). False over rows of one sequence reads what another
    row has not yet written: wrong output.

    partials_out: no merge here: every split of each row (one split too) leaves its partial
    in mid_o and its log-sum-exp in mid_lse, slot b * num_splits + s, for the consumer to merge
    (the O GEMV's prologue, `cute_gemv.merge_in`, which takes the split count from kv_lens by
    the same rule); out is not written, merge_counts not touched. mid_o may then be bf16 (half
    the bytes the consumer loads; `merge_in(partials="bf16")`)."""
    batch, num_q_heads, head_dim, page_size, num_kv_heads = _check_shapes(
        q, k_cache, v_cache, num_splits, block_n)
    rope_args = _rope_in_args(rope_in, q, k_cache, v_cache, k_scale, v_scale)
    check_kv_pack(kv_heads_per_program, num_kv_heads)
    check_long_split(min_split_tokens, long_from_tokens, long_split_tokens)
    if merge_splits is not None and (merge_splits < 1 or merge_splits & (merge_splits - 1)):
        raise ValueError(f"merge_splits must be a power of two, got {merge_splits}")
    if merge_group < 0 or merge_group == 1 or merge_group & (merge_group - 1):
        raise ValueError(f"merge_group must be 0 (one merge level) or a power of two >= 2, got {merge_group}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or out.shape != q.shape:
        raise ValueError("q and out must match in shape and have contiguous head rows")
    rows = batch * num_splits
    if partials_out and merge_group:
        raise ValueError("partials_out leaves the merge to the consumer: merge_group must be 0")
    if num_splits == 1 and not partials_out:
        mid_o, mid_lse = out, out  # unused: one split writes O directly
    elif (not _scratch_ok(mid_o, rows, (torch.float32, torch.bfloat16) if partials_out else (torch.float32,))
          or not _scratch_ok(mid_lse, rows)):
        raise ValueError(f"split scratch must be {rows} contiguous fp32 rows (mid_o, mid_lse; mid_o may be bf16 "
                         "with partials_out)")
    groups = num_kv_heads // kv_heads_per_program
    merge = one_launch_merge_constexprs(num_q_heads // num_kv_heads, kv_heads_per_program, head_dim, num_splits,
                                        merge_splits, merge_group)
    _check_merge_counts(merge_counts, one_launch_counters(batch, groups, num_splits, merge["MERGE_GROUP"]))
    if pdl and not pdl_supported(q.device):
        raise ValueError(f"Programmatic Dependent Launch needs a CUDA device of sm_90 or newer ({q.device})")
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    gp = group_pad(group * kv_heads_per_program)
    launch = {"launch_pdl": True} if pdl else {}
    _one_launch_kernel[(batch, groups, num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, merge_counts,
        kv_indptr, kv_indices, kv_lens,
        scale * LOG2E * k_scale, v_scale, min_split_tokens, long_from_tokens, long_split_tokens,
        *_strides(q, out, k_cache, v_cache),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=gp,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        USE_PDL=pdl,
        LOOKBACK=launch_lookback(batch, verify_rows, pdl, rope_in is not None),
        STEP_ROWS=MAX_LOOKBACK,
        KV_PACK=kv_heads_per_program,
        LONG_RULE=long_from_tokens > 0,
        PREFETCH_PAGES=prefetch_pages,
        EARLY_PAGE_BASE=EARLY_PAGE_BASE,
        **merge,
        PARTIALS_OUT=partials_out,
        num_warps=num_warps,
        num_stages=num_stages,
        **rope_args,
        **launch,
    )
    return out


class RopeIn(NamedTuple):
    """What `decode_attention_one_launch(rope_in=)` needs to make this step's rows itself: the
    newest k and v rows [B, Hkv, D] as the QKV projection wrote them (views of its output),
    the rows' positions [B], the RoPE table [max_pos, D] (cos | sin) and Qwen3's per-head norms
    (`QKNorm`: q_weight, k_weight [D], eps; None without them)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    qk_norm: object | None = None
    # Where the rows are written: the pool (None), or tensors of its shape. A test passes copies,
    # so that no read can see a row this launch writes (on the GPU its programs run at once; the
    # interpreter runs them one after another).
    k_out: torch.Tensor | None = None
    v_out: torch.Tensor | None = None


def rope_in_newest_first(rows: int) -> bool:
    """Whether a rope_in step of `rows` rows opens the softmax with the newest row
    (`_one_launch_kernel`'s NEWEST_FIRST): at 2+ rows, where it frees the block loop's registers;
    one row keeps the splice (FUSED_NOTES "Session 56")."""
    return rows > 1


def _rope_in_args(rope_in: RopeIn | None, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scale: float, v_scale: float) -> dict:
    """The kernel's ROPE_IN arguments ({} without rope_in), or a ValueError naming what is off."""
    if rope_in is None:
        return {}
    batch, _, head_dim = q.shape
    kv_shape = (batch, k_cache.shape[2], head_dim)
    if batch > MAX_LOOKBACK + 1:
        raise ValueError(f"rope_in serves steps of at most {MAX_LOOKBACK + 1} rows (its look-back finds "
                         f"the rows of a sequence that write what another reads), got {batch}")
    k, v, cos_sin = rope_in.k, rope_in.v, rope_in.cos_sin_cache
    if tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"rope_in's k / v must be {kv_shape} with contiguous head rows, got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"rope_in's k / v must be q's dtype {q.dtype}, got {k.dtype} / {v.dtype}")
    if cos_sin.shape[-1] != head_dim or cos_sin.stride(-1) != 1 or rope_in.positions.shape != (batch,):
        raise ValueError(f"rope_in needs a [max_pos, {head_dim}] RoPE table with contiguous rows and "
                         f"{batch} positions, got {tuple(cos_sin.shape)} and {tuple(rope_in.positions.shape)}")
    k_out = k_cache if rope_in.k_out is None else rope_in.k_out
    v_out = v_cache if rope_in.v_out is None else rope_in.v_out
    if (k_out.shape, k_out.stride(), k_out.dtype) != (k_cache.shape, k_cache.stride(), k_cache.dtype) or \
            (v_out.shape, v_out.stride(), v_out.dtype) != (v_cache.shape, v_cache.stride(), v_cache.dtype):
        raise ValueError("rope_in's k_out / v_out must be laid out as the pool's k / v caches")
    norm = rope_in.qk_norm
    if norm is not None and (tuple(norm.q_weight.shape), tuple(norm.k_weight.shape)) != ((head_dim,),) * 2:
        raise ValueError(f"qk_norm weights must be [{head_dim}], got {tuple(norm.q_weight.shape)} "
                         f"and {tuple(norm.k_weight.shape)}")
    return dict(
        KNew=k, VNew=v, Pos=rope_in.positions, CosSin=cos_sin, KOut=k_out, VOut=v_out,
        QW=norm.q_weight if norm is not None else None, KW=norm.k_weight if norm is not None else None,
        stride_knb=k.stride(0), stride_knh=k.stride(1), stride_vnb=v.stride(0), stride_vnh=v.stride(1),
        stride_cs=cos_sin.stride(0), norm_eps=float(norm.eps) if norm is not None else 0.0,
        k_inv_scale=1.0 / k_scale, v_inv_scale=1.0 / v_scale,
        ROPE_IN=True, NEWEST_FIRST=rope_in_newest_first(batch), QK_NORM=norm is not None,
        CACHE_FP8=k_cache.dtype == torch.float8_e4m3fn)


# The most earlier rows a program of the one-launch decode looks back over for rows of its own
# sequence (see above): the fused path's steps have at most 16 rows.
MAX_LOOKBACK = 16


def one_launch_merge_constexprs(group: int, kv_heads_per_program: int, head_dim: int, num_splits: int,
                                merge_splits: int | None = None, merge_group: int = 0,
                                lean: frozenset | None = None) -> dict:
    """`_one_launch_kernel`'s merge constexprs as `decode_attention_one_launch` launches it, with
    the lean merge's parts `lean` (None: LEAN_MERGE, as this process has it): MERGE_SPLITS, partials
    merged at a time (None: as many as a [MS, rows, cols] fp32 tile of at most 4096 elements
    holds), MERGE_GROUP (0 where one group would hold every split: one level), MERGE_PEEL, and
    MERGE_ROWS, the merge's rows (0: the dot's GROUP_PAD; the lean merge's real heads below it)."""
    lean = LEAN_MERGE if lean is None else lean
    gp = group_pad(group * kv_heads_per_program)
    merge_rows = min(gp, max(2, _next_pow2(group * kv_heads_per_program))) if "rows" in lean else gp
    if merge_splits is None:
        merge_splits = max(1, min(num_splits, 4096 // (merge_rows * kv_heads_per_program * head_dim)))
    return dict(MERGE_SPLITS=min(merge_splits, num_splits), MERGE_GROUP=merge_group if merge_group < num_splits else 0,
                MERGE_PEEL="peel" in lean, MERGE_ROWS=0 if merge_rows == gp else merge_rows)


def one_launch_lookback(batch: int) -> int:
    """Earlier rows a program looks back over in a batch of `batch` rows: all of them (a power
    of two, at least 2) up to MAX_LOOKBACK; 0 for one row (nothing before it)."""
    return 0 if batch == 1 else min(MAX_LOOKBACK, max(2, _next_pow2(batch - 1)))


def launch_lookback(batch: int, verify_rows: bool, pdl: bool, rope_in: bool) -> int:
    """The LOOKBACK `decode_attention_one_launch` compiles: `one_launch_lookback` where rows of
    one sequence may be in the batch (verify_rows) and a row could otherwise read one of them
    unwritten: before the PDL wait, or as a row made in the kernel (rope_in); else 0."""
    return one_launch_lookback(batch) if verify_rows and (pdl or rope_in) else 0
