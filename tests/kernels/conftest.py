"""Shared set-up for the kernel tests.

Without CUDA the Triton kernels run through the interpreter: TRITON_INTERPRET=1 must be set
before `flashlet.kernels` is first imported (the choice is made when each `@triton.jit`
decorator runs), so it is set here, at import time.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (NaN anywhere in actual gives NaN)."""
    a, e = actual.double(), expected.double()
    diff = (a - e).abs().max()
    return float(diff / e.abs().max().clamp_min(1e-30))


def make_paged(
    kv_lens,
    page_size,
    num_kv_heads,
    head_dim,
    *,
    dtype=torch.float32,
    device=DEVICE,
    seed=0,
    shared_prefix_pages=None,
    spare_pages=3,
):
    """Random K/V pages and a page table for sequences of kv_lens tokens.

    Pages are handed out in a shuffled order (so neighbouring pages of a sequence are not
    neighbours in the pool). shared_prefix_pages: {seq: (other_seq, n)} makes seq's first n pages
    the same pool pages as other_seq's first n. Returns a dict of k_cache, v_cache [P, page,
    Hkv, D], kv_indptr, kv_indices, kv_lens (int32, on device) and the host page lists."""
    gen = torch.Generator().manual_seed(seed)
    shared_prefix_pages = shared_prefix_pages or {}
    need = [-(-n // page_size) for n in kv_lens]
    total = sum(need) + spare_pages
    order = torch.randperm(total, generator=gen).tolist()
    pages: list[list[int]] = []
    for b, n in enumerate(need):
        own = []
        if b in shared_prefix_pages:
            other, m = shared_prefix_pages[b]
            own = pages[other][:m]
        while len(own) < n:
            own.append(order.pop())
        pages.append(own)
    k_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + len(p))
    flat = [x for p in pages for x in p] or [0]
    return dict(
        k_cache=k_cache,
        v_cache=v_cache,
        kv_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        kv_indices=torch.tensor(flat, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(list(kv_lens), dtype=torch.int32, device=device),
        pages=pages,
        indptr_host=indptr,
    )


def cos_sin_cache(max_pos: int, head_dim: int, base: float = 10000.0, device=DEVICE) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def make_step(pool, seqs, *, shared_prefix_pages=None, device=DEVICE):
    """AttentionMetadata for one step over `pool`: seqs is [(kv_len, q_len)], the q_len newest
    tokens of each sequence being this step's rows. Pages come from the pool's allocator;
    shared_prefix_pages {seq: (other_seq, n)} makes seq reuse other_seq's first n pages (which
    must hold no token of this step). Returns (meta, pages per sequence)."""
    from flashlet.attention.base import AttentionMetadata

    ps = pool.page_size
    shared_prefix_pages = shared_prefix_pages or {}
    pages, positions, slots = [], [], []
    for b, (kv_len, q_len) in enumerate(seqs):
        assert 1 <= q_len <= kv_len or (q_len == 0 and kv_len >= 0)
        own = []
        if b in shared_prefix_pages:
            other, n = shared_prefix_pages[b]
            own = list(pages[other][:n])
            assert n * ps <= kv_len - q_len and n * ps <= seqs[other][0] - seqs[other][1]
        own += pool.allocator.allocate(-(-kv_len // ps) - len(own))
        pages.append(own)
        for pos in range(kv_len - q_len, kv_len):
            positions.append(pos)
            slots.append(own[pos // ps] * ps + pos % ps)
    qo, kv_indptr = [0], [0]
    for (kv_len, q_len), own in zip(seqs, pages):
        qo.append(qo[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + len(own))
    last = [kv_len - (len(own) - 1) * ps if own else 0 for (kv_len, _), own in zip(seqs, pages)]
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        num_tokens=qo[-1],
        num_seqs=len(seqs),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        qo_indptr=torch.tensor(qo, **i32),
        paged_kv_indptr=torch.tensor(kv_indptr, **i32),
        paged_kv_indices=torch.tensor([p for own in pages for p in own] or [0], **i32)[: kv_indptr[-1]],
        paged_kv_last_page_len=torch.tensor(last, **i32),
        kv_lens=torch.tensor([n for n, _ in seqs], **i32),
        logits_indices=torch.tensor([x - 1 for x in qo[1:]], dtype=torch.int64, device=device),
        qo_indptr_host=qo,
        paged_kv_indptr_host=kv_indptr,
        kv_lens_host=[n for n, _ in seqs],
        is_pure_decode=all(q == 1 for _, q in seqs),
    )
    return meta, pages


class _Helpers:
    device = DEVICE
    rel_err = staticmethod(rel_err)
    make_paged = staticmethod(make_paged)
    cos_sin_cache = staticmethod(cos_sin_cache)
    make_step = staticmethod(make_step)


@pytest.fixture(scope="session")
def kh():
    """Kernel-test helpers: kh.device, kh.rel_err, kh.make_paged, kh.cos_sin_cache, kh.make_step."""
    return _Helpers
