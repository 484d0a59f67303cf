"""The one-launch decode with the O projection and its residual add in the same launch
(`decode_attention_one_launch(o_proj=)`): against the attention reference followed by
residual + out @ W^T (interpreter, fp32), at one row (the products summed in registers) and
several (the tensor-core dot), split or not, KV heads packed, an empty row; the counters back at
zero after every launch, and the bad arguments named."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.decode_attention import (MAX_O_PROGRAMS, OProj, decode_attention_one_launch,
                                               decode_attention_reference)

NAN = float("nan")


def _check(kh, *, group, num_kv_heads, kv_lens, num_splits, hidden, rows_per_program=16, page_size=8,
           head_dim=16, padded_rows=None, launches=2, seed=0, **variant):
    paged = kh.make_paged(kv_lens, page_size, num_kv_heads, head_dim, seed=seed)
    batch, hq = len(kv_lens), group * num_kv_heads
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, hq, head_dim, generator=gen).to(kh.device)
    weight = (torch.randn(hidden, hq * head_dim, generator=gen) / (hq * head_dim) ** 0.5).to(kh.device)
    m = padded_rows or batch  # a fused step's rows: padding rows past the batch keep their residual
    residual0 = torch.randn(m, hidden, generator=gen).to(kh.device)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"])
    attn = decode_attention_reference(*args, head_dim**-0.5)
    want = residual0.clone()
    want[:batch] += attn.reshape(batch, -1) @ weight.t()
    rows = batch * num_splits
    scratch = dict(mid_o=torch.full((rows + 2, hq, head_dim), NAN, device=kh.device),
                   mid_lse=torch.full((rows + 2, hq), NAN, device=kh.device),
                   merge_counts=torch.zeros(batch * num_kv_heads + 1, dtype=torch.int32, device=kh.device))
    counts = torch.zeros(2, dtype=torch.int32, device=kh.device)
    results = []
    for _ in range(launches):  # graph-replayed: the same scratch and counters again
        residual = residual0.clone()
        out = torch.full_like(q, NAN)
        decode_attention_one_launch(*args, head_dim**-0.5, out=out, num_splits=num_splits, min_split_tokens=16,
                                    block_n=16, **scratch, **variant,
                                    o_proj=OProj(weight, residual, counts, rows_per_program))
        assert kh.rel_err(out, attn) < 1e-5, "the attention output (the O programs' input)"
        assert kh.rel_err(residual, want) < 1e-5
        assert torch.equal(residual[batch:], residual0[batch:]), "a padding row's residual changed"
        assert not counts.any() and not scratch["merge_counts"].any(), "a counter was left non-zero"
        results.append(residual)
    assert torch.equal(results[0], results[-1])


@pytest.mark.parametrize("group,num_kv_heads,kv_lens,num_splits,hidden,rows_per_program", [
    (7, 2, [40], 4, 40, 16),  # one row, split and merged; 3 O programs, the last one partial
    (7, 2, [12], 4, 64, 8),  # one row, one split used (written directly); 8 rows a program
    (7, 2, [40], 1, 32, 1),  # S = 1, one weight row a program
    (3, 1, [1, 33, 0, 64], 4, 48, 16),  # four rows (the dot), an empty one, unequal split counts
    (7, 2, [57, 12, 30], 2, 40, 16),  # three rows
])
def test_attention_then_o_in_one_launch_matches_reference(kh, group, num_kv_heads, kv_lens, num_splits, hidden,
                                                          rows_per_program):
    _check(kh, group=group, num_kv_heads=num_kv_heads, kv_lens=kv_lens, num_splits=num_splits, hidden=hidden,
           rows_per_program=rows_per_program)


def test_padding_rows_and_packed_heads_and_the_long_rule(kh):
    _check(kh, group=2, num_kv_heads=4, kv_lens=[70, 5, 33], num_splits=4, hidden=32, padded_rows=4,
           kv_heads_per_program=2, long_from_tokens=48, long_split_tokens=16)


def test_with_page_ids_carried_ahead(kh):
    _check(kh, group=7, num_kv_heads=2, kv_lens=[90], num_splits=2, hidden=32, prefetch_pages=True)


def _call(kh, **o):
    paged = kh.make_paged([4], 4, 2, 16)
    q = torch.randn(1, 4, 16, device=kh.device)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.25)
    parts = dict(weight=torch.randn(32, 64, device=kh.device), residual=torch.randn(1, 32, device=kh.device),
                 counts=torch.zeros(2, dtype=torch.int32, device=kh.device))
    parts.update(o)
    return decode_attention_one_launch(*args, out=torch.empty(1, 4, 16, device=kh.device), mid_o=None, mid_lse=None,
                                       merge_counts=torch.zeros(2, dtype=torch.int32, device=kh.device),
                                       num_splits=1, o_proj=OProj(**parts))


def test_bad_o_proj_arguments_are_named(kh):
    _call(kh)  # the valid call
    with pytest.raises(ValueError, match="weight must be"):
        _call(kh, weight=torch.randn(32, 48, device=kh.device))
    with pytest.raises(ValueError, match="residual must be"):
        _call(kh, residual=torch.randn(1, 16, device=kh.device))
    with pytest.raises(ValueError, match="counts"):
        _call(kh, counts=torch.zeros(2, dtype=torch.int64, device=kh.device))
    with pytest.raises(ValueError, match="power of two"):
        _call(kh, rows_per_program=3)
    with pytest.raises(ValueError, match="O programs"):
        _call(kh, weight=torch.randn(16 * (MAX_O_PROGRAMS + 1), 64, device=kh.device),
              residual=torch.randn(1, 16 * (MAX_O_PROGRAMS + 1), device=kh.device))


# ---- on a GPU: bf16 at the Qwen2.5-0.5B shape, PDL, replayed in a CUDA graph ------------------
def _pdl_ok() -> bool:
    from flashlet.kernels.pdl import pdl_supported

    return torch.cuda.is_available() and pdl_supported(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not _pdl_ok(), reason="needs CUDA sm_90+ (PDL): the O programs' wait and the "
                    "attention programs' release run concurrently only on a GPU")
@pytest.mark.parametrize("kv_lens", [[40], [1000], [3000, 17, 300, 999], [257 * (i + 1) for i in range(16)]],
                         ids=["1x40", "1x1000", "4-rows", "16-rows"])
def test_attention_then_o_bf16_in_a_cuda_graph(kh, kv_lens):
    """14 q heads over 2 KV heads of 64, O 896 x 896 (56 O programs): the replayed graph's
    residual after each of 50 replays (its input copied in before each) is the attention reference
    followed by O in fp32 to bf16 tolerance, the same bits every replay (a race between the
    release adds and the O programs' reads would show as a replay that differs), counters at
    zero."""
    from flashlet.kernels.decode_attention import choose_num_splits

    dev, bf16 = "cuda", torch.bfloat16
    paged = kh.make_paged(kv_lens, 16, 2, 64, dtype=bf16, device=dev)
    batch = len(kv_lens)
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(batch, 14, 64, generator=g, device=dev).to(bf16)
    weight = (torch.randn(896, 896, generator=g, device=dev) / 30).to(bf16)
    residual0 = torch.randn(batch, 896, generator=g, device=dev).to(bf16)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.125)
    attn = decode_attention_reference(*args)
    want = (residual0.float() + attn.float().reshape(batch, -1) @ weight.float().t())
    splits = choose_num_splits(batch, 2, torch.cuda.get_device_properties(0).multi_processor_count, 64)
    scratch = dict(mid_o=torch.zeros(batch * splits, 14, 64, device=dev),
                   mid_lse=torch.zeros(batch * splits, 14, device=dev),
                   merge_counts=torch.zeros(batch * 2, dtype=torch.int32, device=dev))
    counts = torch.zeros(2, dtype=torch.int32, device=dev)
    residual, out = residual0.clone(), torch.empty_like(q)

    def step():  # the launch alone in the graph, as the fused step's kernels are (PDL edges)
        decode_attention_one_launch(*args, out=out, num_splits=splits, min_split_tokens=256, block_n=64, pdl=True,
                                    **scratch, o_proj=OProj(weight, residual, counts))

    side = torch.cuda.Stream()  # compiled outside the capture, on a side stream (torch's pattern)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = []
    for _ in range(50):
        residual.copy_(residual0)
        graph.replay()
        results.append(residual.clone())
    torch.cuda.synchronize()
    assert kh.rel_err(results[0].float(), want) < 2e-2
    assert all(torch.equal(r, results[0]) for r in results[1:]), "a replay differs: the O programs raced"
    assert not counts.any() and not scratch["merge_counts"].any()
