"""The split-KV form of the ragged prefill kernel (num_splits > 1) against its PyTorch reference:
long-context chunks, mixed steps with decodes, contexts shorter than a split, padded steps, fp8
pools (tiny shapes, small splits, so the interpreter runs each case in seconds)."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.prefill_attention import prefill_attention, prefill_attention_reference, split_scratch

NAN = float("nan")


def _run(kh, *, kv_lens, q_lens, num_splits, min_split_tokens, group=3, num_kv_heads=1, head_dim=16,
         pad_tokens=0, block_m=16, block_n=16, fp8=False, seed=0):
    """One launch over a step of (kv_len, q_len) sequences (q_len 0: padding or no rows) plus
    pad_tokens rows of no sequence. Real rows must match the reference, the others stay NaN.
    Returns the scratch, poisoned with NaN before the launch."""
    paged = kh.make_paged(kv_lens, 16, num_kv_heads, head_dim, seed=seed)
    k_cache, v_cache = paged["k_cache"], paged["v_cache"]
    k_scale, v_scale = 1.0, 1.0
    if fp8:
        k_scale, v_scale = 0.5, 0.25
        k_cache = (k_cache / k_scale).to(torch.float8_e4m3fn)
        v_cache = (v_cache / v_scale).to(torch.float8_e4m3fn)
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    real = qo[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(real + pad_tokens, group * num_kv_heads, head_dim, generator=gen).to(kh.device)
    tables = (k_cache, v_cache, torch.tensor(qo, dtype=torch.int32, device=kh.device), paged["kv_indptr"],
              paged["kv_indices"], paged["kv_lens"], head_dim**-0.5)
    scratch = split_scratch(num_splits, q.shape[0], q.shape[1], head_dim, kh.device)
    for t in scratch:
        t.fill_(NAN)
    out = torch.full_like(q, NAN)
    prefill_attention(q, *tables, out=out, block_m=block_m, block_n=block_n, num_splits=num_splits,
                      min_split_tokens=min_split_tokens, scratch=scratch, k_scale=k_scale, v_scale=v_scale)
    assert not torch.isnan(out[:real]).any(), "a real row was not written"
    assert torch.isnan(out[real:]).all(), "a row of no sequence was written"
    if real:
        want = prefill_attention_reference(q[:real], *tables, k_scale=k_scale, v_scale=v_scale)
        assert kh.rel_err(out[:real], want) < 1e-5
    return scratch


def _wrote_partials(scratch) -> bool:
    return not torch.isnan(scratch[1]).all()


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_long_context_chunk(kh, num_splits):
    """A chunk late in a long sequence: every tile splits its keys (8: more splits than 32-key
    shares of some tiles' keys, so those tiles use fewer)."""
    scratch = _run(kh, kv_lens=[200], q_lens=[12], num_splits=num_splits, min_split_tokens=32)
    assert _wrote_partials(scratch)


def test_split_mixed_chunk_and_decodes(kh):
    """A chunk beside decodes of long and short contexts, two KV heads (GQA packing per head)."""
    scratch = _run(kh, kv_lens=[150, 180, 20, 97], q_lens=[10, 1, 1, 1], num_splits=4, min_split_tokens=32,
                   num_kv_heads=2)
    assert _wrote_partials(scratch)


def test_split_short_contexts_use_one_split(kh):
    """Contexts under two splits' worth: one split each, written straight to out, no partial
    (the extra split programs exit at once)."""
    scratch = _run(kh, kv_lens=[60, 30, 9], q_lens=[20, 1, 9], num_splits=4, min_split_tokens=32)
    assert not _wrote_partials(scratch)


def test_split_first_chunk_of_a_prompt(kh):
    """A whole prompt in one chunk: early tiles see fewer full blocks than late ones (each tile's
    own split count), the first tile none at all."""
    _run(kh, kv_lens=[96], q_lens=[96], num_splits=4, min_split_tokens=16, group=1)


def test_split_padded_step(kh):
    """A graph-padded step: padding sequences (q_len 0) in the middle and at the end, a sequence
    with no rows this step, rows past the last sequence's untouched."""
    _run(kh, kv_lens=[170, 0, 130, 40, 0], q_lens=[6, 0, 1, 0, 0], num_splits=4, min_split_tokens=32,
         pad_tokens=7)


def test_split_fp8_pool(kh):
    _run(kh, kv_lens=[160, 120], q_lens=[8, 1], num_splits=4, min_split_tokens=32, fp8=True, block_n=32)


def test_split_head_dim_64_and_128(kh):
    for head_dim in (64, 128):
        _run(kh, kv_lens=[130, 70], q_lens=[3, 1], num_splits=2, min_split_tokens=32, head_dim=head_dim,
             group=2, seed=head_dim)


def test_split_allocates_its_scratch_when_not_given(kh):
    paged = kh.make_paged([120], 16, 1, 16)
    q = torch.randn(5, 2, 16, device=kh.device)
    tables = (paged["k_cache"], paged["v_cache"], torch.tensor([0, 5], dtype=torch.int32, device=kh.device),
              paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.25)
    out = prefill_attention(q, *tables, block_m=16, block_n=16, num_splits=3, min_split_tokens=16)
    assert kh.rel_err(out, prefill_attention_reference(q, *tables)) < 1e-5


def test_split_rejects_bad_arguments(kh):
    paged = kh.make_paged([40], 16, 1, 16)
    q = torch.randn(4, 2, 16, device=kh.device)
    tables = (paged["k_cache"], paged["v_cache"], torch.tensor([0, 4], dtype=torch.int32, device=kh.device),
              paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.25)
    with pytest.raises(ValueError, match="num_splits"):
        prefill_attention(q, *tables, num_splits=0)
    with pytest.raises(ValueError, match="split scratch"):
        prefill_attention(q, *tables, num_splits=4, scratch=split_scratch(2, 4, 2, 16, kh.device))
    with pytest.raises(ValueError, match="split scratch"):
        prefill_attention(q, *tables, num_splits=2, scratch=split_scratch(2, 3, 2, 16, kh.device))
