"""Ragged paged prefill attention against its PyTorch reference (fp32, tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlet.kernels.prefill_attention import prefill_attention, prefill_attention_reference

NAN = float("nan")


def _check(kh, *, group, num_kv_heads, page_size, kv_lens, q_lens, head_dim=16, block_m=16, block_n=16, seed=0):
    assert all(q <= n for q, n in zip(q_lens, kv_lens))
    paged = kh.make_paged(kv_lens, page_size, num_kv_heads, head_dim, seed=seed)
    hq = group * num_kv_heads
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(qo[-1], hq, head_dim, generator=gen).to(kh.device)
    qo_indptr = torch.tensor(qo, dtype=torch.int32, device=kh.device)
    args = (q, paged["k_cache"], paged["v_cache"], qo_indptr, paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"],
            head_dim**-0.5)
    out = torch.full_like(q, NAN)
    got = prefill_attention(*args, out=out, block_m=block_m, block_n=block_n)
    assert got is out
    assert not torch.isnan(out).any(), "an output element was not written"
    want = prefill_attention_reference(*args)
    assert kh.rel_err(out, want) < 1e-5
    return out, want


@pytest.mark.parametrize(
    "group,num_kv_heads,page_size,kv_lens,q_lens,block_m,block_n",
    [
        (7, 1, 8, [20, 9, 33], [12, 1, 1], 32, 16),  # a chunk and two decodes in one launch
        (1, 2, 1, [7, 16], [7, 16], 16, 16),  # whole-sequence prefills, one token per page
        (3, 2, 16, [17, 40, 1], [17, 5, 1], 16, 16),  # a single-token sequence
        (8, 1, 16, [33], [33], 64, 16),  # several tiles, full and diagonal blocks
        (7, 1, 8, [50], [20], 32, 16),  # a chunk in the middle of a sequence
        (3, 1, 32, [70, 3], [35, 2], 16, 16),  # pages larger than the key block
        (7, 2, 4, [16, 24], [8, 8], 16, 32),  # chunk ends on a page boundary, bigger key block
    ],
)
def test_prefill_matches_reference(kh, group, num_kv_heads, page_size, kv_lens, q_lens, block_m, block_n):
    _check(kh, group=group, num_kv_heads=num_kv_heads, page_size=page_size, kv_lens=kv_lens, q_lens=q_lens,
           block_m=block_m, block_n=block_n)


def test_prefill_two_sequences_of_several_tiles(kh):
    _check(kh, group=3, num_kv_heads=1, page_size=8, kv_lens=[9, 40], q_lens=[5, 30])


def test_prefill_decodes_only(kh):
    """A step of decodes only through the prefill kernel (q_len 1 everywhere)."""
    _check(kh, group=7, num_kv_heads=2, page_size=16, kv_lens=[1, 17, 40], q_lens=[1, 1, 1])


def test_prefill_empty_chunk_in_batch(kh):
    """A sequence with no query rows this step (qo_indptr repeats) is skipped cleanly."""
    _check(kh, group=3, num_kv_heads=1, page_size=8, kv_lens=[10, 5, 7], q_lens=[4, 0, 2])


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    group=st.sampled_from([1, 3, 7, 8]),
    num_kv_heads=st.integers(1, 2),
    page_size=st.sampled_from([1, 8, 16]),
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_prefill_random(kh, group, num_kv_heads, page_size, seqs, seed):
    kv_lens = [n for n, _ in seqs]
    q_lens = [max(1, min(n, q)) for n, q in seqs]
    _check(kh, group=group, num_kv_heads=num_kv_heads, page_size=page_size, kv_lens=kv_lens, q_lens=q_lens,
           block_m=32, seed=seed)


def test_prefill_rejects_bad_arguments(kh):
    paged = kh.make_paged([4], 4, 2, 16)
    qo = torch.tensor([0, 4], dtype=torch.int32, device=kh.device)
    args = (paged["k_cache"], paged["v_cache"], qo, paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.25)
    with pytest.raises(ValueError, match="KV groups"):
        prefill_attention(torch.randn(4, 3, 16, device=kh.device), *args)
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(torch.randn(4, 4, 16, device=kh.device), *args, block_m=24)
    with pytest.raises(ValueError, match=r"\[rows, heads, head_dim\]"):
        prefill_attention(torch.randn(4, 64, device=kh.device), *args)
    strided = paged["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        prefill_attention(torch.randn(4, 4, 16, device=kh.device), strided, strided, *args[2:])


def _check_padded(kh, *, group, num_kv_heads, page_size, kv_lens, q_lens, pad_tokens, block_m=16, block_n=16,
                  seed=0):
    """A step padded for a CUDA graph: sequences with q_len 0 (kv_len 0: padding, or > 0: a
    sequence with no rows this step) anywhere, and pad_tokens rows past the last sequence's that
    belong to none, so the grid (from T and B) is bigger than the work. Real rows must match the
    reference; rows of no sequence must stay as they were (poisoned: NaN)."""
    paged = kh.make_paged(kv_lens, page_size, num_kv_heads, head_dim := 16, seed=seed)
    hq = group * num_kv_heads
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    real = qo[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(real + pad_tokens, hq, head_dim, generator=gen).to(kh.device)
    qo_indptr = torch.tensor(qo, dtype=torch.int32, device=kh.device)
    tables = (paged["k_cache"], paged["v_cache"], qo_indptr, paged["kv_indptr"], paged["kv_indices"],
              paged["kv_lens"], head_dim**-0.5)
    out = torch.full_like(q, NAN)
    prefill_attention(q, *tables, out=out, block_m=block_m, block_n=block_n)
    assert not torch.isnan(out[:real]).any(), "a real row was not written"
    assert torch.isnan(out[real:]).all(), "a row of no sequence was written"
    if real:
        want = prefill_attention_reference(q[:real], *tables)
        assert kh.rel_err(out[:real], want) < 1e-5


@pytest.mark.parametrize(
    "group,kv_lens,q_lens,pad_tokens,block_m",
    [
        (3, [10, 0, 7, 0, 0], [4, 0, 2, 0, 0], 9, 16),  # padding sequences in the middle and at the end
        (7, [30, 5, 1, 0], [30, 1, 1, 0], 0, 32),  # a chunk and decodes, one padding sequence
        (1, [50, 12, 0], [20, 0, 0], 40, 16),  # a prefix; a sequence with no rows this step
        (8, [0, 0, 33], [0, 0, 33], 3, 64),  # padding first: the search must skip empty sequences
        (2, [16] * 9 + [0] * 7, [8] * 9 + [0] * 7, 16, 16),  # tiles ending exactly on BLOCK_M
    ],
)
def test_prefill_padded_step_writes_only_real_rows(kh, group, kv_lens, q_lens, pad_tokens, block_m):
    _check_padded(kh, group=group, num_kv_heads=2, page_size=8, kv_lens=kv_lens, q_lens=q_lens,
                  pad_tokens=pad_tokens, block_m=block_m)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    group=st.sampled_from([1, 3, 7]),
    page_size=st.sampled_from([1, 8]),
    seqs=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=6),
    pad_tokens=st.integers(0, 24),
    block_m=st.sampled_from([16, 32]),
    seed=st.integers(0, 1000),
)
def test_prefill_padded_random(kh, group, page_size, seqs, pad_tokens, block_m, seed):
    kv_lens = [n for n, _ in seqs]
    q_lens = [min(n, q) for n, q in seqs]  # q_len 0 where kv_len is 0: padding sequences
    _check_padded(kh, group=group, num_kv_heads=1, page_size=page_size, kv_lens=kv_lens, q_lens=q_lens,
                  pad_tokens=pad_tokens, block_m=block_m, seed=seed)
