"""Every attention backend against the dense reference on random ragged paged batches (CPU)."""

import random

import pytest
import torch

from flashlet.attention.torch_ref import TorchBackend
from flashlet.kvcache.kv_pool import KVPool
from flashlet.runner.batch import StepRow, build_layout, load_layout


def random_step(pool, rng, seqs, device="cpu"):
    """Build a step: seqs = [(kv_len_before, q_len)], pages allocated from the pool, with the
    first two sequences sharing their first page (a cached prefix)."""
    ps = pool.page_size
    rows = []
    shared = pool.allocator.allocate(1)
    for i, (before, q_len) in enumerate(seqs):
        n_pages = -(-(before + q_len) // ps)
        pages = shared if i < 2 and before >= ps else []
        pages = pages + pool.allocator.allocate(n_pages - len(pages))
        rows.append(StepRow([0] * q_len, before, pages))
    _, meta = load_layout(build_layout(rows, ps), device)
    return meta


def compare(make_backend, seqs, hq=6, hkv=2, d=16, ps=4, dtype=torch.float32, device="cpu"):
    rng = random.Random(0)
    torch.manual_seed(0)
    pool = KVPool(1, sum(-(-(b + q) // ps) for b, q in seqs) + 1, ps, hkv, d, dtype, device)
    pool.k_cache.normal_()
    pool.v_cache.normal_()
    meta = random_step(pool, rng, seqs, device)
    q = torch.randn(meta.num_tokens, hq, d, dtype=dtype, device=device)
    k = torch.randn(meta.num_tokens, hkv, d, dtype=dtype, device=device)
    v = torch.randn(meta.num_tokens, hkv, d, dtype=dtype, device=device)
    ref = TorchBackend(pool, hq, batched_decode=False)  # the oracle: the per-sequence loop
    ref.plan(meta)
    expected = ref.run(0, q, k, v)
    other = make_backend(pool, hq)
    other.plan(meta)
    got = other.run(0, q, k, v)
    assert not torch.isnan(got).any(), "an output row was not written"
    return (got.float() - expected.float()).norm() / expected.float().norm()


def test_batched_decode_path_matches_the_per_sequence_loop():
    err = compare(lambda pool, hq: TorchBackend(pool, hq, batched_decode=True),
                  [(0, 1), (5, 1), (8, 1), (13, 1), (30, 1)])
    assert err < 1e-6


def test_batched_decode_path_on_a_long_and_short_mix():
    err = compare(lambda pool, hq: TorchBackend(pool, hq, batched_decode=True),
                  [(0, 1), (16, 1), (100, 1), (300, 1)], ps=16)
    assert err < 1e-6


def test_reference_mask_is_aligned_to_the_end_of_each_sequence():
    # A chunk of 3 new tokens after 5 cached ones: row 0 sees 6 keys, row 2 sees all 8.
    from flashlet.attention.torch_ref import causal_mask_aligned_to_end

    mask = causal_mask_aligned_to_end(3, 8, "cpu")
    assert mask.sum(dim=1).tolist() == [6, 7, 8]


def test_flashinfer_kv_lens_iterate_as_their_maximum():
    """FlashInfer's plan() takes max() over the KV lengths by iterating them; KvLens makes that
    one reduction while staying the same (pinned) host array for every other use."""
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    from flashlet.attention.flashinfer_backend import KvLens

    lens = torch.tensor([5, 300, 17, 42], dtype=torch.int32)
    seen = lens.as_subclass(KvLens).cpu().flatten()  # what plan() does with seq_lens
    assert seen.data_ptr() == lens.data_ptr() and len(seen) == 4
    assert max(seen).item() == 300
    buf = torch.zeros(6, dtype=torch.int32)
    buf[: len(seen)].copy_(seen)
    assert buf.tolist() == [5, 300, 17, 42, 0, 0]
