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
    """AttentionMetadata for one step over `pool` (built by `flashlet.runner.batch`, as the engine's
    steps are): seqs is [(kv_len, q_len)], the q_len newest tokens of each sequence being this
    step's rows. Pages come from the pool's allocator; shared_prefix_pages {seq: (other_seq, n)}
    makes seq reuse other_seq's first n pages (which must hold no token of this step). Returns
    (meta, pages per sequence)."""
    from flashlet.runner.batch import StepRow, build_layout, load_layout

    ps = pool.page_size
    shared_prefix_pages = shared_prefix_pages or {}
    pages, rows = [], []
    for b, (kv_len, q_len) in enumerate(seqs):
        assert 1 <= q_len <= kv_len or (q_len == 0 and kv_len >= 0)
        own = []
        if b in shared_prefix_pages:
            other, n = shared_prefix_pages[b]
            own = list(pages[other][:n])
            assert n * ps <= kv_len - q_len and n * ps <= seqs[other][0] - seqs[other][1]
        own += pool.allocator.allocate(-(-kv_len // ps) - len(own))
        pages.append(own)
        rows.append(StepRow([0] * q_len, kv_len - q_len, own))
    _, meta = load_layout(build_layout(rows, ps), device)
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
