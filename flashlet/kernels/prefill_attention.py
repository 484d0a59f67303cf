"""Ragged paged causal attention: prefill chunks and decodes of one step in one launch.

Work. Sequence b owns query rows `qo_indptr[b]:qo_indptr[b + 1]` (q_len rows: a prefill chunk,
or 1 for a decode) and `kv_lens[b]` cached tokens in its pages
`kv_indices[kv_indptr[b]:kv_indptr[b + 1]]` of the NHD pool `[pages, page_size, Hkv, D]`,
the chunk's own K/V already written. The causal mask is aligned to the END of the sequence:
query row i of the chunk (prefix = kv_len - q_len) sees keys 0 .. prefix + i.

Bytes (the floor, e = element size, T = total query rows, N = sum(kv_lens)):
    Q and O:   2 * T * Hq * D * e
    K and V:   2 * N * Hkv * D * e          (once per KV group; a tile of BLOCK_M rows re-reads
                                             the keys it needs, from L2 when tiles share them)
FLOPs: 4 * Hq * D * sum_b sum_i (prefix_b + i + 1)   (the visible (query, key) pairs)

Design.
- Packed GQA: the G query heads of a KV group are packed into the M dimension of the tile.
  Tile row r of sequence b stands for query token r // G and head kvh * G + r % G, so one
  program serves a whole group and a decode (q_len = 1) still fills G rows of its tile.
- Grid (ceil(T * G / BLOCK_M) + B, Hkv[, S]): a function of the tensors' shapes only, so one
  launch serves eager steps and CUDA-graph replays of a step padded to T tokens and B
  sequences (padding sequences have q_len 0; padding rows past qo_indptr[B] belong to none).
  Program pid takes one (sequence, M-tile) of the flattened work: sequence i owns programs
  start_i .. start_{i+1} - 1, start_i = (qo_indptr[i] * G) // BLOCK_M + i, which is strictly
  increasing and covers ceil(q_len_i * G / BLOCK_M) tiles plus at most one spare (and one,
  spare, for q_len 0), so start_B <= the grid. A program finds its sequence by a binary
  search over qo_indptr (log2 B scalar loads) and exits when its tile is past the sequence's
  rows (spare tiles, empty sequences, programs past the last sequence's). Within a sequence
  tiles are numbered from its END (its first program takes its last, most expensive tile), so
  heavy tiles start first; across sequences programs go in sequence order (the launch order
  of the earlier (tiles, B, Hkv) grid too). No host value sizes the grid: no sync.
- Keys are streamed in BLOCK_N blocks gathered through the page table token by token (any
  power-of-two page size). Blocks every row of the tile fully sees (keys < prefix + first
  token + 1, rounded down to BLOCK_N) run without a mask; the rest, up to the last row's
  diagonal, run with the causal mask.
- Split-KV (num_splits S > 1; S = 1 compiles none of it: no scratch, no second launch). A
  tile alone walks all its keys serially; a chunk of a few hundred tokens is ~100 programs, too
  few for the SMs once the context is long. Grid (tiles + B, Hkv, S): split s of a tile takes
  full blocks [s * F // n, (s + 1) * F // n) of its F full blocks, and the last split the
  diagonal blocks too, so each split's every row sees every key of its full blocks (no row is
  left with no key, a max at -inf). n = min(S, F // ceil(min_split_tokens / BLOCK_N)), at least
  1: a runtime value from kv_lens (CUDA-graph stable). A tile of one split writes `out` as
  above; the others write their unnormalized accumulator, running max and sum (fp32) to a
  scratch [S, T, Hq, (D)] at their rows' (token, head) and exit, and `_merge_kernel` (grid
  (tiles + B, Hkv), one program per tile recomputing n) rescales them to a common max and
  writes `out`. Splits s >= n exit at once and write nothing. The split axis is the grid's
  slowest: within each split the heavy tiles still start first. A split launch caps registers
  so that two programs fit an SM (SPLIT_PROGRAMS_PER_SM): the point is more programs in flight.
- Online softmax in base 2, fp32 accumulators; P is cast to q's dtype for PV.
- An fp8 (e4m3) pool: blocks load as fp8 and are widened to q's dtype for the dots; k_scale
  folds into the fp32 score scale and v_scale multiplies the fp32 accumulator once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlet.kernels.decode_attention import check_paged_attention

LOG2E = 1.4426950408889634
# Two split programs resident per SM: 8 warps at head_dim 128 compile to 140 registers a thread
# unbounded (one program an SM), to 128 with no spill and no added instruction at this cap
# (scripts/prefill_split_bench.py --lower). Unsplit launches keep the compiler's choice.
SPLIT_PROGRAMS_PER_SM = 2


@triton.jit
def _attend_blocks(
    acc, m_i, l_i, q, q_pos,
    k_head, v_head, KvIndices, page_base,
    lo, hi, qk_scale,
    stride_kp, stride_kt, stride_vp, stride_vt,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    d = tl.arange(0, HEAD_DIM)
    for blk in range(lo, hi, BLOCK_N):
        t = blk + tl.arange(0, BLOCK_N)
        if MASKED:
            t_mask = t < hi
            page = tl.load(KvIndices + page_base + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        else:
            page = tl.load(KvIndices + page_base + t // PAGE_SIZE).to(tl.int64)
        row = t % PAGE_SIZE
        k_ptrs = k_head + page[:, None] * stride_kp + row[:, None] * stride_kt + d[None, :]
        v_ptrs = v_head + page[:, None] * stride_vp + row[:, None] * stride_vt + d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=t_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BM, BN]
        if MASKED:
            visible = (t[None, :] <= q_pos[:, None]) & t_mask[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=t_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_sequence(QoIndptr, pid, num_seqs, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """(i, start_i): the last sequence i whose first program start_i is <= pid. start_i =
    (qo_indptr[i] * G) // BLOCK_M + i strictly increases with i and start_0 = 0, so a binary
    search over [0, num_seqs) keeps lo's start <= pid < hi's start."""
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start_mid = (tl.load(QoIndptr + mid) * GROUP) // BLOCK_M + mid
        right = start_mid <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo, (tl.load(QoIndptr + lo) * GROUP) // BLOCK_M + lo


@triton.jit
def _find_tile(QoIndptr, pid, num_seqs, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """(b, tile, q_start, n_rows) of program pid; tile < 0 for a program with no tile (spare
    tiles, empty sequences, programs past the last sequence's). A sequence's first program
    takes its last (heaviest) tile."""
    b, first_pid = _find_sequence(QoIndptr, pid, num_seqs, GROUP, BLOCK_M)
    q_start = tl.load(QoIndptr + b)
    n_rows = (tl.load(QoIndptr + b + 1) - q_start) * GROUP
    tile = tl.cdiv(n_rows, BLOCK_M) - 1 - (pid - first_pid)
    return b, tile, q_start, n_rows


@triton.jit
def _tile_keys(KvLens, b, tile, q_start, n_rows, QoIndptr,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(prefix, full_end, causal_end) of a tile: keys [0, full_end) every row sees (whole
    BLOCK_N blocks), [full_end, causal_end) the diagonal blocks up to the last row's key."""
    q_len = tl.load(QoIndptr + b + 1) - q_start
    prefix = tl.load(KvLens + b) - q_len
    first_tok = (tile * BLOCK_M) // GROUP
    last_tok = (tl.minimum(tile * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
    full_end = ((prefix + first_tok + 1) // BLOCK_N) * BLOCK_N
    return prefix, full_end, prefix + last_tok + 1


@triton.jit
def _num_tile_splits(full_end, min_split_blocks, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Splits a tile uses: each takes at least min_split_blocks of its full blocks, at most
    NUM_SPLITS of them, at least one."""
    return tl.minimum(tl.maximum((full_end // BLOCK_N) // min_split_blocks, 1), NUM_SPLITS)


@triton.jit(do_not_specialize=["num_seqs", "min_split_blocks"])
def _prefill_kernel(
    Q, K, V, O,
    QoIndptr, KvIndptr, KvIndices, KvLens,
    MidAcc, MidM, MidL,
    num_seqs, min_split_blocks,
    qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_as, stride_at, stride_ah, stride_ms, stride_mt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b, tile, q_start, n_rows = _find_tile(QoIndptr, pid, num_seqs, GROUP, BLOCK_M)
    if tile < 0:
        return
    prefix, full_end, causal_end = _tile_keys(KvLens, b, tile, q_start, n_rows, QoIndptr, GROUP, BLOCK_M, BLOCK_N)
    if NUM_SPLITS == 1:
        lo = 0
        hi = full_end
        tail_end = causal_end
    else:
        # Split s of n takes full blocks [s * F // n, (s + 1) * F // n) (at least one each:
        # n <= F), the last split the diagonal blocks too: every row sees every key of a split's
        # full blocks, so no split leaves a row with no key (its max at -inf).
        split = tl.program_id(2)
        n_split = _num_tile_splits(full_end, min_split_blocks, NUM_SPLITS, BLOCK_N)
        if split >= n_split:
            return
        full_blocks = full_end // BLOCK_N
        lo = (split * full_blocks // n_split) * BLOCK_N
        hi = ((split + 1) * full_blocks // n_split) * BLOCK_N
        tail_end = tl.where(split == n_split - 1, causal_end, full_end)
    page_base = tl.load(KvIndptr + b)

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = r < n_rows
    tok = r // GROUP
    heads = kvh * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (q_start + tok)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=r_mask[:, None],
        other=0.0,
    )
    q_pos = prefix + tok  # the last key each row sees

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, q_pos, k_head, v_head, KvIndices, page_base, lo, hi, qk_scale,
        stride_kp, stride_kt, stride_vp, stride_vt,
        HEAD_DIM, PAGE_SIZE, BLOCK_N, False, INPUT_PRECISION,
    )
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, q_pos, k_head, v_head, KvIndices, page_base, full_end, tail_end, qk_scale,
        stride_kp, stride_kt, stride_vp, stride_vt,
        HEAD_DIM, PAGE_SIZE, BLOCK_N, True, INPUT_PRECISION,
    )
    t64 = (q_start + tok).to(tl.int64)
    if NUM_SPLITS == 1:
        _store_out(O, acc, l_i, v_scale, t64, heads, r_mask, stride_ot, stride_oh, HEAD_DIM)
    else:
        if n_split == 1:
            _store_out(O, acc, l_i, v_scale, t64, heads, r_mask, stride_ot, stride_oh, HEAD_DIM)
        else:  # a partial for `_merge_kernel`: unnormalized, without v_scale
            a_ptrs = MidAcc + split * stride_as + t64[:, None] * stride_at + heads[:, None] * stride_ah + d[None, :]
            tl.store(a_ptrs, acc, mask=r_mask[:, None])
            ml = split * stride_ms + t64 * stride_mt + heads
            tl.store(MidM + ml, m_i, mask=r_mask)
            tl.store(MidL + ml, l_i, mask=r_mask)


@triton.jit
def _store_out(O, acc, l_i, v_scale, t64, heads, r_mask, stride_ot, stride_oh, HEAD_DIM: tl.constexpr):
    """out rows = acc * v_scale / l (a row with no key, l = 0, gets zeros)."""
    d = tl.arange(0, HEAD_DIM)
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = O + t64[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=r_mask[:, None])


@triton.jit(do_not_specialize=["num_seqs", "min_split_blocks"])
def _merge_kernel(
    O, QoIndptr, KvLens, MidAcc, MidM, MidL,
    num_seqs, min_split_blocks, v_scale,
    stride_ot, stride_oh, stride_as, stride_at, stride_ah, stride_ms, stride_mt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One program per (tile, KV head) of `_prefill_kernel`'s grid: the tile's split count
    recomputed as the split programs computed it; one split: they wrote `out`, nothing to do."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b, tile, q_start, n_rows = _find_tile(QoIndptr, pid, num_seqs, GROUP, BLOCK_M)
    if tile < 0:
        return
    _, full_end, _ = _tile_keys(KvLens, b, tile, q_start, n_rows, QoIndptr, GROUP, BLOCK_M, BLOCK_N)
    n_split = _num_tile_splits(full_end, min_split_blocks, NUM_SPLITS, BLOCK_N)
    if n_split == 1:
        return
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = r < n_rows
    t64 = (q_start + r // GROUP).to(tl.int64)
    heads = kvh * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    a_off = t64[:, None] * stride_at + heads[:, None] * stride_ah + d[None, :]
    ml = t64 * stride_mt + heads
    # Every split saw keys of every row (m finite): rescale each to the running max.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(0, n_split):
        m_s = tl.load(MidM + s * stride_ms + ml, mask=r_mask, other=0.0)
        l_s = tl.load(MidL + s * stride_ms + ml, mask=r_mask, other=0.0)
        a_s = tl.load(MidAcc + s * stride_as + a_off, mask=r_mask[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        l = l * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    _store_out(O, acc, l, v_scale, t64, heads, r_mask, stride_ot, stride_oh, HEAD_DIM)


def split_scratch(num_splits: int, num_tokens: int, num_q_heads: int, head_dim: int, device) -> tuple:
    """(acc [S, T, Hq, D], max [S, T, Hq], sum [S, T, Hq]) fp32: the split partials of steps of
    up to num_tokens query rows."""
    acc = torch.empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device)
    m = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=device)
    return acc, m, torch.empty_like(m)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int = 1,
    min_split_tokens: int = 1024,
    scratch: tuple | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] ragged by qo_indptr [B + 1] over one layer's pool k/v_cache [P, page, Hkv, D].

    kv_indptr [B + 1] int32, kv_indices int32, kv_lens [B] int32 (>= each q_len). Sequences
    may have q_len 0 and rows past qo_indptr[B] belong to none (a step padded for a CUDA
    graph): their output rows are not written. No host sync; the grid depends on T and B only.
    k_scale / v_scale: what the stored K / V are multiplied by (an fp8 pool's).
    num_splits > 1: split-KV, each tile's keys over up to num_splits programs of at least
    min_split_tokens keys (rounded up to block_n), merged by a second launch; scratch: the
    partials' buffers (`split_scratch`, at least num_splits x T; None: allocated here).
    Returns out [T, Hq, D] in q's dtype."""
    num_q_heads, head_dim, page_size, num_kv_heads = check_paged_attention(q, k_cache, v_cache)
    num_tokens = q.shape[0]
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    if num_splits < 1 or min_split_tokens < 1:
        raise ValueError(f"num_splits and min_split_tokens must be >= 1, got {num_splits}, {min_split_tokens}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_q_heads // num_kv_heads
    batch = qo_indptr.shape[0] - 1
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or num_tokens == 0:
        return out
    if num_splits > 1:
        if scratch is None:
            scratch = split_scratch(num_splits, num_tokens, num_q_heads, head_dim, q.device)
        _check_scratch(scratch, num_splits, num_tokens, num_q_heads, head_dim)
        mid_acc, mid_m, mid_l = scratch
    else:
        mid_acc = mid_m = mid_l = out  # never read or written: NUM_SPLITS = 1 compiles that away
    min_split_blocks = -(-min_split_tokens // block_n)
    limits = split_launch_limits(num_warps) if num_splits > 1 else {}
    precision = "ieee" if q.dtype == torch.float32 else None  # None: the default (bf16/fp16 MMAs)
    tiles = triton.cdiv(num_tokens * group, block_m) + batch
    mid_strides = (mid_acc.stride(0), mid_acc.stride(1), mid_acc.stride(2), mid_m.stride(0), mid_m.stride(1))
    _prefill_kernel[(tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out,
        qo_indptr, kv_indptr, kv_indices, kv_lens,
        mid_acc, mid_m, mid_l,
        batch, min_split_blocks,
        scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *mid_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        INPUT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
        **limits,
    )
    if num_splits > 1:
        _merge_kernel[(tiles, num_kv_heads)](
            out, qo_indptr, kv_lens, mid_acc, mid_m, mid_l,
            batch, min_split_blocks, v_scale,
            out.stride(0), out.stride(1), *mid_strides,
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            num_warps=merge_warps(head_dim),
        )
    return out


def split_launch_limits(num_warps: int) -> dict:
    """The split kernel's register cap (`maxnreg`): SPLIT_PROGRAMS_PER_SM programs of num_warps
    in the SM's 64K registers, where that is under the hardware's 255 a thread."""
    regs = (65536 // (SPLIT_PROGRAMS_PER_SM * 32 * num_warps)) // 8 * 8
    return {"maxnreg": regs} if regs < 255 else {}


def merge_warps(head_dim: int) -> int:
    """The merge's warps: its [BLOCK_M, D] fp32 sums over 4 warps at D <= 64, 8 above."""
    return 4 if head_dim <= 64 else 8


def _check_scratch(scratch: tuple, num_splits: int, num_tokens: int, num_q_heads: int, head_dim: int) -> None:
    acc, m, l = scratch
    if (acc.dtype != torch.float32 or acc.dim() != 4 or acc.shape[0] < num_splits or acc.shape[1] < num_tokens
            or acc.shape[2:] != (num_q_heads, head_dim) or not acc.is_contiguous()
            or m.shape != acc.shape[:3] or l.shape != m.shape or m.dtype != torch.float32
            or not m.is_contiguous() or not l.is_contiguous()):
        raise ValueError(f"split scratch {tuple(acc.shape)} / {tuple(m.shape)} does not hold {num_splits} "
                         f"splits of {num_tokens} tokens x {num_q_heads} heads x {head_dim} (fp32, contiguous)")


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain PyTorch: per sequence, gather pages and run masked softmax attention in fp32
    (stored K / V times k_scale / v_scale)."""
    num_q_heads = q.shape[1]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    qo, indptr, lens = qo_indptr.tolist(), kv_indptr.tolist(), kv_lens.tolist()
    out = torch.zeros_like(q)
    for b in range(len(qo) - 1):
        q_len, n = qo[b + 1] - qo[b], lens[b]
        if q_len == 0:
            continue
        pages = kv_indices[indptr[b] : indptr[b] + (n + page_size - 1) // page_size].long()
        k = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1) * k_scale
        v = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1) * v_scale
        s = torch.einsum("qhd,nhd->hqn", q[qo[b] : qo[b + 1]].float(), k) * scale
        rows = torch.arange(q_len, device=q.device)[:, None] + (n - q_len)
        visible = torch.arange(n, device=q.device)[None, :] <= rows
        s = s.masked_fill(~visible, float("-inf"))
        out[qo[b] : qo[b + 1]] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v).to(q.dtype)
    return out
