"""Long contexts in the split-KV decode kernels: past long_context_tokens a row spreads over
every split of the grid (each at least long_split_tokens), below it the short rule stands; both
the two-launch (split + merge kernel) and the one-launch (last program merges) forms, against
the PyTorch reference at tiny shapes (interpreted on the CPU), with poisoned outputs and partials."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.decode_attention import (decode_attention, decode_attention_one_launch,
                                               decode_attention_reference)

NAN = float("nan")


def _case(kh, kv_lens, group, num_kv_heads, page_size, head_dim, num_splits, seed=0):
    paged = kh.make_paged(kv_lens, page_size, num_kv_heads, head_dim, seed=seed)
    hq = group * num_kv_heads
    q = torch.randn(len(kv_lens), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(kh.device)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"],
            head_dim**-0.5)
    rows = len(kv_lens) * num_splits
    scratch = dict(mid_o=torch.full((rows, hq, head_dim), NAN, device=kh.device),
                   mid_lse=torch.full((rows, hq), NAN, device=kh.device))
    return q, args, scratch, decode_attention_reference(*args)


def _splits_written(mid_lse, row, num_splits) -> int:
    """How many of a row's split slots the split kernel wrote (poisoned with NaN before)."""
    return int((~mid_lse[row * num_splits:(row + 1) * num_splits].isnan().any(-1)).sum())


# 40 pages of 16 tokens = 640 tokens, 8 splits: the brief's shape. Short rule: splits of 256
# tokens (3 used); long rule from 256 tokens: all 8 (80 tokens each). The 100-token row stays short.
LONG = dict(long_context_tokens=256, long_split_tokens=32)


def test_two_launch_long_row_uses_every_split(kh):
    q, args, scratch, want = _case(kh, [640, 100, 0], group=7, num_kv_heads=2, page_size=16, head_dim=16,
                                   num_splits=8)
    out = torch.full_like(q, NAN)
    decode_attention(*args, out=out, num_splits=8, min_split_tokens=256, block_n=16, **scratch, **LONG)
    assert kh.rel_err(out, want) < 1e-5
    assert _splits_written(scratch["mid_lse"], 0, 8) == 8
    assert _splits_written(scratch["mid_lse"], 1, 8) == 1
    short = dict(mid_o=torch.full_like(scratch["mid_o"], NAN), mid_lse=torch.full_like(scratch["mid_lse"], NAN))
    decode_attention(*args, out=out, num_splits=8, min_split_tokens=256, block_n=16, **short)  # rule off
    assert kh.rel_err(out, want) < 1e-5 and _splits_written(short["mid_lse"], 0, 8) == 3


@pytest.mark.parametrize("block_n", [16, 64], ids=["block-16", "block-64-partly-masked"])
def test_one_launch_long_row_uses_every_split(kh, block_n):
    """Splits of 80 tokens: with 64-token blocks the second block of each is partly masked."""
    q, args, scratch, want = _case(kh, [640, 100, 0], group=7, num_kv_heads=2, page_size=16, head_dim=16,
                                   num_splits=8)
    counts = torch.zeros(3 * 2, dtype=torch.int32, device=kh.device)
    for _ in range(2):  # replayed: the counters are back at zero, the output the same
        out = torch.full_like(q, NAN)
        decode_attention_one_launch(*args, out=out, num_splits=8, min_split_tokens=256, block_n=block_n,
                                    merge_counts=counts, **scratch, **LONG)
        assert kh.rel_err(out, want) < 1e-5 and not counts.any()
    assert _splits_written(scratch["mid_lse"], 0, 8) == 8


@pytest.mark.parametrize("form", ["two-launch", "one-launch"])
def test_many_splits_merge_in_several_chunks(kh, form):
    """128 splits of 16 tokens over 2,048 tokens at group 7, head_dim 64: the merge kernel takes
    the partials 64 at a time, the one-launch merge [8, 7 * 64] tiles at a time."""
    q, args, scratch, want = _case(kh, [2048, 40], group=7, num_kv_heads=1, page_size=16, head_dim=64,
                                   num_splits=128, seed=3)
    out = torch.full_like(q, NAN)
    long = dict(long_context_tokens=1024, long_split_tokens=16)
    if form == "two-launch":
        decode_attention(*args, out=out, num_splits=128, min_split_tokens=256, block_n=16, **scratch, **long)
    else:
        counts = torch.zeros(2, dtype=torch.int32, device=kh.device)
        decode_attention_one_launch(*args, out=out, num_splits=128, min_split_tokens=256, block_n=16,
                                    merge_counts=counts, **scratch, **long)
        assert not counts.any()
    assert kh.rel_err(out, want) < 1e-5
    assert _splits_written(scratch["mid_lse"], 0, 128) == 128


def test_long_rule_rejects_bad_settings(kh):
    q, args, scratch, _ = _case(kh, [64], group=1, num_kv_heads=1, page_size=16, head_dim=16, num_splits=2)
    with pytest.raises(ValueError, match="long_split_tokens >= 16"):
        decode_attention(*args, num_splits=2, long_context_tokens=32, long_split_tokens=8, **scratch)


def test_one_row_grid_fills_the_h200_and_the_rule_reaches_the_kernels(kh, monkeypatch):
    """At one row the one-launch grid aims at `waves` programs per SM (132 SMs), at most 4 in all:
    128 splits at Qwen2.5-0.5B's two KV heads, 64 at Qwen3-0.6B's eight; the two-launch form keeps
    its cap of 64; the backend passes the long rule to both forms."""
    from flashlet.attention import triton_backend
    from flashlet.attention.triton_backend import TritonBackend
    from flashlet.kv_pool import KVPool

    pool = KVPool(1, 2048, 16, 2, 64, torch.float32, kh.device)
    tri = TritonBackend(pool, 14, num_sms=132)
    cfg, splits = tri.one_launch_config(1)
    assert splits == 128 and tri.decode_variant(1)[1] == 64
    assert tri._mid_o.shape[0] >= 128
    qwen3 = TritonBackend(KVPool(1, 2048, 16, 8, 128, torch.float32, kh.device), 16, num_sms=132)
    assert qwen3.one_launch_config(1)[1] == 64
    assert (cfg.long_context_tokens, cfg.long_split_tokens) == (4096, 128)
    seen = []
    for name in ("decode_attention", "decode_attention_one_launch"):
        monkeypatch.setattr(triton_backend, name, lambda *a, **k: seen.append(
            (k["long_context_tokens"], k["long_split_tokens"])))
    meta, _ = kh.make_step(pool, [(5000, 1)])
    tri.plan(meta)
    q = torch.zeros(1, 14, 64, device=kh.device)
    tri.attend(0, q)
    tri.attend_one_launch(0, q)
    assert seen == [(4096, 128)] * 2
