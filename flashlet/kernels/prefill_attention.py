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
- Grid (ceil(T * G / BLOCK_M) + B, Hkv): a function of the tensors' shapes only, so one
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
- Online softmax in base 2, fp32 accumulators; P is cast to q's dtype for PV.
- An fp8 (e4m3) pool: blocks load as fp8 and are widened to q's dtype for the dots; k_scale
  folds into the fp32 score scale and v_scale multiplies the fp32 accumulator once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlet.kernels.decode_attention import check_cache_dtype

LOG2E = 1.4426950408889634


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


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    Q, K, V, O,
    QoIndptr, KvIndptr, KvIndices, KvLens,
    num_seqs,
    qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b, first_pid = _find_sequence(QoIndptr, pid, num_seqs, GROUP, BLOCK_M)

    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    n_rows = q_len * GROUP
    # The sequence's first program takes its last (heaviest) tile; spare programs go below 0.
    tile = tl.cdiv(n_rows, BLOCK_M) - 1 - (pid - first_pid)
    if tile < 0:
        return
    kv_len = tl.load(KvLens + b)
    prefix = kv_len - q_len
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

    first_tok = (tile * BLOCK_M) // GROUP
    last_tok = (tl.minimum(tile * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
    full_end = ((prefix + first_tok + 1) // BLOCK_N) * BLOCK_N  # keys every row sees
    causal_end = prefix + last_tok + 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, q_pos, k_head, v_head, KvIndices, page_base, 0, full_end, qk_scale,
        stride_kp, stride_kt, stride_vp, stride_vt,
        HEAD_DIM, PAGE_SIZE, BLOCK_N, False, INPUT_PRECISION,
    )
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, q_pos, k_head, v_head, KvIndices, page_base, full_end, causal_end, qk_scale,
        stride_kp, stride_kt, stride_vp, stride_vt,
        HEAD_DIM, PAGE_SIZE, BLOCK_N, True, INPUT_PRECISION,
    )
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = O + (q_start + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=r_mask[:, None])


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
) -> torch.Tensor:
    """q [T, Hq, D] ragged by qo_indptr [B + 1] over one layer's pool k/v_cache [P, page, Hkv, D].

    kv_indptr [B + 1] int32, kv_indices int32, kv_lens [B] int32 (>= each q_len). Sequences
    may have q_len 0 and rows past qo_indptr[B] belong to none (a step padded for a CUDA
    graph): their output rows are not written. No host sync; the grid depends on T and B only.
    k_scale / v_scale: what the stored K / V are multiplied by (an fp8 pool's).
    Returns out [T, Hq, D] in q's dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, head_dim_k = k_cache.shape
    if head_dim_k != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v cache {tuple(k_cache.shape)}")
    check_cache_dtype(q, k_cache, v_cache)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV groups")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k/v cache rows must be contiguous in head_dim")
    group = num_q_heads // num_kv_heads
    batch = qo_indptr.shape[0] - 1
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or num_tokens == 0:
        return out
    precision = "ieee" if q.dtype == torch.float32 else None  # None: the default (bf16/fp16 MMAs)
    grid = (triton.cdiv(num_tokens * group, block_m) + batch, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out,
        qo_indptr, kv_indptr, kv_indices, kv_lens,
        batch,
        scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        INPUT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


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
