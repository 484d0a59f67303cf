"""A Triton kernel for paged grouped-query attention at decode time.

The PyTorch version (v08) gathers every slot's pages into one contiguous tensor of max_seq_len
positions, scores all of them and masks the tail. This kernel reads the pages in place instead,
one page at a time through the page table, and stops after the slot's last page: its work follows
the real sequence length. Scores, softmax and the weighted sum of values are fused with an online
softmax (a running maximum and sum), so nothing of size seq_len is ever written to memory. One
program serves one (slot, key/value head) pair and all the query heads that share that K/V head,
so each cached key and value is loaded once per group, not once per query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import check_triton_can_run


@triton.jit
def paged_gqa_decode_kernel(
    q_ptr,  # [num_slots, num_heads, head_dim]
    k_cache_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads, head_dim]
    v_cache_ptr,  # same layout as k_cache
    page_table_ptr,  # [num_slots, max_pages_per_slot] int32
    seq_lens_ptr,  # [num_slots] cached tokens of each slot, the new one included
    out_ptr,  # [num_slots, num_heads, head_dim]
    scale,
    group_size,
    head_dim,
    max_pages_per_slot,
    PAGE_SIZE: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    groups = tl.arange(0, BLOCK_GROUP)  # the query heads of this K/V head, padded to a power of 2
    dims = tl.arange(0, BLOCK_DIM)
    rows = tl.arange(0, PAGE_SIZE)  # token rows inside one page
    group_mask, dim_mask = groups < group_size, dims < head_dim

    # the group's queries: [BLOCK_GROUP, BLOCK_DIM]
    heads = kv_head * group_size + groups
    q_offsets = (slot * num_kv_heads * group_size + heads)[:, None] * head_dim + dims[None, :]
    q_mask = group_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + slot)
    running_max = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)  # per query head
    running_sum = tl.zeros([BLOCK_GROUP], tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], tl.float32)  # unnormalised weighted sum of values
    row_stride = num_kv_heads * head_dim
    for page_index in range(0, tl.cdiv(seq_len, PAGE_SIZE)):
        page = tl.load(page_table_ptr + slot * max_pages_per_slot + page_index).to(tl.int64)
        valid = page_index * PAGE_SIZE + rows < seq_len  # [PAGE_SIZE] the last page may be partial
        kv_offsets = (
            (page * PAGE_SIZE + rows)[:, None] * row_stride + kv_head * head_dim + dims[None, :]
        )  # [PAGE_SIZE, BLOCK_DIM]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_GROUP, PAGE_SIZE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # online softmax: rescale what was accumulated so far to the new running maximum
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])  # [BLOCK_GROUP, PAGE_SIZE]
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_gqa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each slot's one new query attends to its cached keys, read page by page."""
    # q: [num_slots, num_heads, head_dim]; k_cache, v_cache: [num_pages, page_size, kv_heads, dim]
    # page_table: [num_slots, max_pages_per_slot] int32; seq_lens: [num_slots]
    check_triton_can_run(q)
    num_slots, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if page_size & (page_size - 1):
        raise ValueError(f"the Triton paged kernel needs a power-of-two page_size, got {page_size}")
    q = q.contiguous()
    out = torch.empty_like(q)
    group_size = num_heads // num_kv_heads
    paged_gqa_decode_kernel[(num_slots, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        out,
        scale,
        group_size,
        head_dim,
        page_table.shape[1],
        PAGE_SIZE=page_size,
        BLOCK_GROUP=triton.next_power_of_2(group_size),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
    )
    return out
