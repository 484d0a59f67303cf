"""The one-launch decode making its own row (`decode_attention_one_launch(rope_in=)`): q and the
newest k normalised (Qwen3's per-head norms) and rotated inside the attention kernel, the newest
K/V row written into the pool by the program that owns it, against the two kernels it replaces'
reference: `rope_kv_write_reference` (the model's norms, `TorchOps.rope`, the pool write), then
`decode_attention_reference` over that pool. On the CPU the kernel runs in the interpreter."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlet.kernels.decode_attention import (RopeIn, decode_attention_one_launch, decode_attention_reference,
                                               one_launch_counters)
from flashlet.kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference
from flashlet.kvcache.kv_pool import quantize_fp8
from flashlet.models.ops import QKNorm
from tests.triton_interpreter import interpreted_accesses

NAN = float("nan")


def _case(kh, *, group, num_kv_heads, page_size, kv_len, head_dim, dtype, seed=0):
    """One row: its pool (random past rows, the newest row's slot poisoned), raw q / k / v as
    views of one QKV output, its position (kv_len - 1), the RoPE table and per-head norms."""
    paged = kh.make_paged([kv_len], page_size, num_kv_heads, head_dim, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    hq = group * num_kv_heads
    qkv = (torch.randn(1, hq + 2 * num_kv_heads, head_dim, generator=g) * 3 + 0.5).to(dtype).to(kh.device)
    q, k, v = qkv.split([hq, num_kv_heads, num_kv_heads], dim=1)
    norm = QKNorm((torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(kh.device),
                  (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(kh.device), 1e-6)
    last = kv_len - 1
    page = paged["pages"][0][last // page_size]
    slot = torch.tensor([page * page_size + last % page_size], device=kh.device)
    paged["k_cache"][page, last % page_size] = NAN  # the kernel must write it before any read
    paged["v_cache"][page, last % page_size] = NAN
    positions = torch.tensor([last], device=kh.device)
    return paged, q, k, v, positions, kh.cos_sin_cache(kv_len + 8, head_dim), norm, slot


def _run(kh, paged, q, k, v, positions, cos_sin, norm, *, num_splits, min_split_tokens, block_n,
         k_cache=None, v_cache=None, k_scale=1.0, v_scale=1.0, outs=(None, None)):
    k_cache = paged["k_cache"] if k_cache is None else k_cache
    v_cache = paged["v_cache"] if v_cache is None else v_cache
    hq, head_dim = q.shape[1], q.shape[2]
    out = torch.full((1, hq, head_dim), NAN, dtype=q.dtype, device=kh.device)
    counts = torch.zeros(k_cache.shape[2], dtype=torch.int32, device=kh.device)
    got = decode_attention_one_launch(
        q, k_cache, v_cache, paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], head_dim**-0.5,
        out=out, mid_o=torch.full((num_splits, hq, head_dim), NAN, device=kh.device),
        mid_lse=torch.full((num_splits, hq), NAN, device=kh.device), merge_counts=counts,
        num_splits=num_splits, min_split_tokens=min_split_tokens, block_n=block_n,
        k_scale=k_scale, v_scale=v_scale, rope_in=RopeIn(k, v, positions, cos_sin, norm, *outs))
    assert got is out and not torch.isnan(out).any() and not counts.any()
    return out


@pytest.mark.parametrize("group,num_kv_heads,page_size,kv_len,head_dim,num_splits,min_split_tokens,block_n,qk_norm,dtype", [
    (2, 8, 16, 37, 128, 4, 16, 16, True, torch.float32),    # Qwen3's heads: 3 splits, newest in the last one's 1st block
    (2, 4, 16, 90, 64, 2, 16, 16, True, torch.float32),     # the newest row in a later block of its split (the loop)
    (7, 2, 8, 1, 64, 4, 16, 16, False, torch.float32),      # a one-token context: the newest row is the only one
    (7, 2, 8, 100, 64, 8, 16, 32, False, torch.float32),    # Qwen2.5's group, no norms, 4 splits merged
    (2, 8, 16, 45, 128, 4, 16, 16, True, torch.bfloat16),   # bf16: roundings as the RoPE kernel's
])
def test_rope_in_matches_the_rope_kernel_then_attention(kh, group, num_kv_heads, page_size, kv_len, head_dim,
                                                        num_splits, min_split_tokens, block_n, qk_norm, dtype):
    if dtype == torch.bfloat16 and kh.device != "cuda":
        pytest.skip("the interpreter's bf16 dots are wrong for the one-launch kernel with or without rope_in")
    paged, q, k, v, pos, cs, norm, slot = _case(kh, group=group, num_kv_heads=num_kv_heads, page_size=page_size,
                                                 kv_len=kv_len, head_dim=head_dim, dtype=dtype)
    norm = norm if qk_norm else None
    kc_ref, vc_ref = paged["k_cache"].clone(), paged["v_cache"].clone()
    want_q, _ = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slot, qk_norm=norm)
    want = decode_attention_reference(want_q, kc_ref, vc_ref, paged["kv_indptr"], paged["kv_indices"],
                                      paged["kv_lens"], head_dim**-0.5)
    common = dict(num_splits=num_splits, min_split_tokens=min_split_tokens, block_n=block_n)
    # Written into copies first: nothing of the pool read may be a row this launch writes (its
    # slot stays poisoned), as on the GPU, where the programs run at once.
    outs = (paged["k_cache"].clone(), paged["v_cache"].clone())
    redirected = _run(kh, paged, q, k, v, pos, cs, norm, **common, outs=outs)
    got = _run(kh, paged, q, k, v, pos, cs, norm, **common)
    assert torch.equal(redirected, got) and torch.equal(outs[0], paged["k_cache"]) and torch.equal(outs[1], paged["v_cache"])
    # bf16 (GPU): the norm's and rotation's roundings may land an ulp apart (rstd summed in
    # another order, test_kern_rope_qk_norm.py).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert kh.rel_err(got, want) < tol
    assert kh.rel_err(paged["k_cache"], kc_ref) < tol and torch.equal(paged["v_cache"], vc_ref)
    # A second launch over the same pool (a graph replay) reads what the first one wrote.
    again = _run(kh, paged, q, k, v, pos, cs, norm, **common)
    assert torch.equal(again, got)


def test_rope_in_over_an_fp8_pool_writes_the_scaled_row_and_reads_it_back(kh):
    """An e4m3 pool: the newest K / V row stored as the RoPE kernel stores it (x / scale,
    saturated: the same bytes) and attended in that form, as the loaded row would be. (The
    kernels, not the PyTorch reference, are the bytes' reference: the interpreter's e4m3 casts
    truncate where PyTorch's round.)"""
    paged, q, k, v, pos, cs, norm, slot = _case(kh, group=2, num_kv_heads=4, page_size=16, kv_len=40,
                                                 head_dim=64, dtype=torch.float32, seed=3)
    k_scale, v_scale = 0.05, 0.03
    kc8 = quantize_fp8(paged["k_cache"].nan_to_num(0.0), k_scale, torch.float8_e4m3fn)
    vc8 = quantize_fp8(paged["v_cache"].nan_to_num(0.0), v_scale, torch.float8_e4m3fn)
    kc_ref, vc_ref = kc8.clone(), vc8.clone()
    want_q, _ = rope_kv_write(q, k, v, pos, cs, kc_ref, vc_ref, slot, kv_scales=(k_scale, v_scale), qk_norm=norm)
    want = decode_attention_reference(want_q, kc_ref.float() * k_scale, vc_ref.float() * v_scale,
                                      paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 64**-0.5)
    got = _run(kh, paged, q, k, v, pos, cs, norm, num_splits=4, min_split_tokens=16, block_n=16,
               k_cache=kc8, v_cache=vc8, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(kc8.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc8.view(torch.uint8), vc_ref.view(torch.uint8))
    assert kh.rel_err(got, want) < 1e-5


def test_rope_in_refuses_what_it_cannot_serve(kh):
    paged, q, k, v, pos, cs, norm, _ = _case(kh, group=2, num_kv_heads=2, page_size=8, kv_len=9, head_dim=32,
                                             dtype=torch.float32)
    common = dict(out=torch.empty_like(q), mid_o=None, mid_lse=None,
                  merge_counts=torch.zeros(2, dtype=torch.int32, device=kh.device), num_splits=1)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"], 0.2)
    with pytest.raises(ValueError, match=r"qk_norm weights must be \[32\]"):
        decode_attention_one_launch(*args, **common, rope_in=RopeIn(k, v, pos, cs, norm._replace(q_weight=norm.q_weight[:8])))
    with pytest.raises(ValueError, match="RoPE table"):
        decode_attention_one_launch(*args, **common, rope_in=RopeIn(k, v, pos, cs[:, :16], norm))
    with pytest.raises(ValueError, match="k / v must be"):
        decode_attention_one_launch(*args, **common, rope_in=RopeIn(k[:, :1], v, pos, cs, norm))
    many = q.expand(18, -1, -1).contiguous()
    with pytest.raises(ValueError, match="at most 17 rows"):
        decode_attention_one_launch(many, *args[1:], **{**common, "out": torch.empty_like(many)},
                                    rope_in=RopeIn(k.expand(18, -1, -1), v.expand(18, -1, -1), pos.expand(18), cs, norm))


# ---- several rows: distinct sequences, a verify step's rows of one sequence, shared prefixes -----


def _batch_case(kh, rows, *, group, num_kv_heads, head_dim, page_size, shared_first_page=(), seed=0):
    """rows: (sequence, kv_len) per row, in order; the rows of one sequence share its page table
    (a verify step's rows: kv_lens one apart). shared_first_page: sequences whose first page is
    sequence 0's (a cached prefix). Returns the pool (random past rows, every row's newest slot
    poisoned), the page table, raw q / k / v, positions (kv_len - 1), slots, the table, norms."""
    g = torch.Generator().manual_seed(seed)
    longest = {}
    for seq, kv_len in rows:
        longest[seq] = max(longest.get(seq, 0), kv_len)
    need = {seq: -(-n // page_size) for seq, n in longest.items()}
    order = torch.randperm(sum(need.values()) + 2, generator=g).tolist()
    pages = {seq: [order.pop() for _ in range(n)] for seq, n in need.items()}
    for seq in shared_first_page:
        pages[seq][0] = pages[0][0]
    total = len(order) + sum(need.values())
    k_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=g).to(kh.device)
    v_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=g).to(kh.device)
    indptr, indices, slots = [0], [], []
    for seq, kv_len in rows:
        own = pages[seq][: -(-kv_len // page_size)]
        indices += own
        indptr.append(len(indices))
        slots.append(own[(kv_len - 1) // page_size] * page_size + (kv_len - 1) % page_size)
    for slot in slots:
        k_cache.view(-1, num_kv_heads, head_dim)[slot] = NAN
        v_cache.view(-1, num_kv_heads, head_dim)[slot] = NAN
    table = dict(kv_indptr=torch.tensor(indptr, dtype=torch.int32, device=kh.device),
                 kv_indices=torch.tensor(indices, dtype=torch.int32, device=kh.device),
                 kv_lens=torch.tensor([n for _, n in rows], dtype=torch.int32, device=kh.device))
    hq = group * num_kv_heads
    qkv = (torch.randn(len(rows), hq + 2 * num_kv_heads, head_dim, generator=g) * 3 + 0.5).to(kh.device)
    q, k, v = qkv.split([hq, num_kv_heads, num_kv_heads], dim=1)
    norm = QKNorm((torch.rand(head_dim, generator=g) + 0.5).to(kh.device),
                  (torch.rand(head_dim, generator=g) + 0.5).to(kh.device), 1e-6)
    positions = table["kv_lens"].long() - 1
    return (k_cache, v_cache, table, q, k, v, positions, torch.tensor(slots, device=kh.device),
            kh.cos_sin_cache(max(longest.values()) + 8, head_dim), norm)


@pytest.mark.parametrize("rows,shared,kv_pack", [
    ([(0, 40), (1, 70), (2, 1), (3, 33)], (), 1),                       # four sequences, one of one token
    ([(0, 40), (1, 70), (2, 9), (3, 33)], (), 2),                       # the same, two KV heads a program
    ([(0, 30), (1, 61), (1, 62), (1, 63), (1, 64), (1, 65), (2, 20)], (), 1),  # a k = 4 verify step between two
    ([(1, 90), (1, 91), (1, 92)], (), 2),                               # verify rows in a split's second block
    ([(0, 40), (1, 41), (2, 42)], (1, 2), 1),                           # a shared first page, lengths one apart
])
def test_rope_in_over_several_rows_matches_the_rope_kernel_then_attention(kh, rows, shared, kv_pack,
                                                                         verify_rows=None):
    """Each row's newest K/V written by its own program; a verify step's rows (one sequence, KV
    lengths one apart) each make the rows before them from the rows that write them, wherever
    they fall in a split (the first block or later ones); rows of sequences that only share a
    cached prefix's page never take each other's rows (the look-back is exact). The rows are
    written into copies of the pool (RopeIn.k_out / v_out), whose poisoned slots stay in the
    pool read: on a GPU the programs run at once, so no program may read a row this launch
    writes, which the interpreter (one program after another) would otherwise let pass. Steps
    whose rows are all different sequences' launch as a plain decode step (no look-back), as
    the engine launches them (`TritonBackend.looks_back`)."""
    if verify_rows is None:
        verify_rows = _has_verify_rows(rows)
    num_kv_heads, head_dim, page_size = 4, 32, 8
    kc, vc, table, q, k, v, pos, slots, cs, norm = _batch_case(
        kh, rows, group=2, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        shared_first_page=shared)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want_q, _ = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slots, qk_norm=norm)
    want = decode_attention_reference(want_q, kc_ref, vc_ref, table["kv_indptr"], table["kv_indices"],
                                      table["kv_lens"], head_dim**-0.5)
    num_splits, batch, hq = 4, len(rows), q.shape[1]
    k_out, v_out = kc.clone(), vc.clone()
    for launch in range(2):  # the same twice (a graph replay)
        out = torch.full((batch, hq, head_dim), NAN, device=kh.device)
        counts = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=kh.device)
        decode_attention_one_launch(
            q, kc, vc, table["kv_indptr"], table["kv_indices"], table["kv_lens"], head_dim**-0.5, out=out,
            mid_o=torch.full((batch * num_splits, hq, head_dim), NAN, device=kh.device),
            mid_lse=torch.full((batch * num_splits, hq), NAN, device=kh.device), merge_counts=counts,
            num_splits=num_splits, min_split_tokens=32, block_n=16, kv_heads_per_program=kv_pack,
            rope_in=RopeIn(k, v, pos, cs, norm, k_out, v_out), verify_rows=verify_rows)
        assert not torch.isnan(out).any() and not counts.any()
        assert kh.rel_err(out, want) < 1e-5, launch
    assert kh.rel_err(k_out, kc_ref) < 1e-5 and torch.equal(v_out, vc_ref)


def _has_verify_rows(rows) -> bool:
    """Do 2+ of these (sequence, kv_len) rows belong to one sequence (a verify step's)?"""
    return len({seq for seq, _ in rows}) < len(rows)


def test_rope_in_verify_rows_launched_as_plain_rows_read_what_no_one_wrote(kh):
    """verify_rows=False compiles the look-back out: a k = 4 verify step so launched (the engine
    never does) reads the rows before each row from the pool, where no one wrote them (poisoned
    slots, NaN). The look-back, shown by its absence."""
    with pytest.raises(AssertionError):
        test_rope_in_over_several_rows_matches_the_rope_kernel_then_attention(
            kh, [(0, 30), (1, 61), (1, 62), (1, 63), (1, 64), (1, 65), (2, 20)], (), 1, verify_rows=False)


def test_rope_in_over_an_fp8_pool_with_verify_rows(kh):
    """A k = 2 verify step beside another sequence over an e4m3 pool: the rows a verify row makes
    for the rows before it are rounded to the pool's e4m3 as those rows' own programs store them
    (the RoPE kernel's bytes: the interpreter's e4m3 casts truncate, PyTorch's round)."""
    rows = [(0, 25), (1, 50), (1, 51), (1, 52)]
    kc, vc, table, q, k, v, pos, slots, cs, norm = _batch_case(kh, rows, group=2, num_kv_heads=2, head_dim=32,
                                                               page_size=8, seed=4)
    k_scale, v_scale = 0.05, 0.03
    kc8 = quantize_fp8(kc.nan_to_num(0.0), k_scale, torch.float8_e4m3fn)
    vc8 = quantize_fp8(vc.nan_to_num(0.0), v_scale, torch.float8_e4m3fn)
    kc_ref, vc_ref = kc8.clone(), vc8.clone()
    want_q, _ = rope_kv_write(q, k, v, pos, cs, kc_ref, vc_ref, slots, kv_scales=(k_scale, v_scale), qk_norm=norm)
    want = decode_attention_reference(want_q, kc_ref.float() * k_scale, vc_ref.float() * v_scale,
                                      table["kv_indptr"], table["kv_indices"], table["kv_lens"], 32**-0.5)
    batch, hq = len(rows), q.shape[1]
    k_out, v_out = kc8.clone(), vc8.clone()
    out = torch.full((batch, hq, 32), NAN, device=kh.device)
    decode_attention_one_launch(
        q, kc8, vc8, table["kv_indptr"], table["kv_indices"], table["kv_lens"], 32**-0.5, out=out,
        mid_o=torch.full((batch * 4, hq, 32), NAN, device=kh.device),
        mid_lse=torch.full((batch * 4, hq), NAN, device=kh.device),
        merge_counts=torch.zeros(batch * 2, dtype=torch.int32, device=kh.device),
        num_splits=4, min_split_tokens=16, block_n=16, k_scale=k_scale, v_scale=v_scale,
        rope_in=RopeIn(k, v, pos, cs, norm, k_out, v_out))
    assert torch.equal(k_out.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(v_out.view(torch.uint8), vc_ref.view(torch.uint8))
    assert kh.rel_err(out, want) < 1e-5


@st.composite
def rope_in_layouts(draw):
    """(rows, shared, page_size): 1-3 sequences in a random order, each 1-4 rows of one verify
    run (KV lengths one apart), some sharing sequence 0's first page (then no row of either
    writes into it: a cached prefix's page is full). (Up to 3 sequences and 12 examples: the
    interpreter's time grows with the rows' tokens; the 12 still draw up to 10 rows, all 4 splits
    used, the block loop with and without page ids carried ahead, shared pages, both packings.)"""
    page_size = draw(st.sampled_from([4, 8]))
    count = draw(st.integers(1, 3))
    runs = [(draw(st.integers(1, 60)), draw(st.integers(1, 4))) for _ in range(count)]
    order = draw(st.permutations(range(count)))
    rows = [(seq, runs[seq][0] + i) for seq in order for i in range(runs[seq][1])]
    past_first_page = [runs[seq][0] > page_size for seq in range(count)]
    shared = tuple(seq for seq in range(1, count)
                   if past_first_page[0] and past_first_page[seq] and draw(st.booleans()))
    return rows, shared, page_size


@settings(max_examples=12, deadline=None, derandomize=True)
@given(layout=rope_in_layouts(), kv_pack=st.sampled_from([1, 2]), num_splits=st.sampled_from([1, 2, 4]),
       qk_norm=st.booleans(), prefetch_pages=st.booleans(), lean=st.sampled_from(["0", "1"]),
       seed=st.integers(0, 1000))
def test_rope_in_random_layouts(kh, layout, kv_pack, num_splits, qk_norm, prefetch_pages, lean, seed):
    """Random steps of verify runs and plain rows (launched as the engine does: with the
    look-back only where a sequence has 2+ rows), shared prefix pages, splits, packing, the
    block loop with page ids carried ahead or not and the lean merge ($FLASHLET_LEAN_MERGE) or
    not: the rope_in launch against the RoPE kernel's reference then attention, and in the
    interpreter its access log: no program loads or stores a pool element that another program
    of the launch stores."""
    import flashlet.kernels.decode_attention as da

    lean_before = da.LEAN_MERGE
    da.LEAN_MERGE = frozenset({"peel", "rows"}) if lean == "1" else frozenset()
    try:
        _random_layout(kh, layout, kv_pack, num_splits, qk_norm, prefetch_pages, seed)
    finally:
        da.LEAN_MERGE = lean_before


def _random_layout(kh, layout, kv_pack, num_splits, qk_norm, prefetch_pages, seed):
    rows, shared, page_size = layout
    num_kv_heads, head_dim = 4, 32
    kc, vc, table, q, k, v, pos, slots, cs, norm = _batch_case(
        kh, rows, group=2, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        shared_first_page=shared, seed=seed)
    norm = norm if qk_norm else None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want_q, _ = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slots, qk_norm=norm)
    want = decode_attention_reference(want_q, kc_ref, vc_ref, table["kv_indptr"], table["kv_indices"],
                                      table["kv_lens"], head_dim**-0.5)
    batch, hq = len(rows), q.shape[1]
    out = torch.full((batch, hq, head_dim), NAN, device=kh.device)
    counts = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=kh.device)
    scratch = dict(mid_o=None, mid_lse=None)
    if num_splits > 1:
        scratch = dict(mid_o=torch.full((batch * num_splits, hq, head_dim), NAN, device=kh.device),
                       mid_lse=torch.full((batch * num_splits, hq), NAN, device=kh.device))
    launch = functools.partial(
        decode_attention_one_launch,
        q, kc, vc, table["kv_indptr"], table["kv_indices"], table["kv_lens"], head_dim**-0.5, out=out,
        merge_counts=counts, num_splits=num_splits, min_split_tokens=16, block_n=16,
        kv_heads_per_program=kv_pack, rope_in=RopeIn(k, v, pos, cs, norm), prefetch_pages=prefetch_pages,
        verify_rows=_has_verify_rows(rows), **scratch)
    # The rows written into the pool read: no program may load another's; the partials and
    # outputs: only as the merge's counters order them. (A program whose newest row falls past
    # its split's first block loads that row's slot after storing it, and replaces what it loads
    # with the row in registers: own reads are allowed.)
    watched = {name: t for name, t in scratch.items() if t is not None}
    with interpreted_accesses(sync=counts, k_cache=kc, v_cache=vc, out=out, **watched) as log:
        launch()
    assert log is None or log.hazards(own_reads=False) == []
    assert not torch.isnan(out).any() and not counts.any()
    assert kh.rel_err(out, want) < 1e-5
    assert kh.rel_err(kc, kc_ref) < 1e-5 and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("kv_len,prefetch_pages,merge_group", [(1100, True, 0), (1500, True, 4), (1100, False, 0)])
def test_rope_in_at_the_long_entry_that_failed_on_the_h200(kh, kv_len, prefetch_pages, merge_group):
    """The one-row long one-launch entry of test_gpu_fused_decode.py's rope-in-attention cases
    (Qwen3's rows made in the kernel, head_dim 64 and group 2 as its tiny model: 64-key blocks on 2
    warps, 3 stages, 32 splits, rows of 1,024+ tokens split at 64, page ids carried ahead, grouped
    or not): the reference's output, and in the interpreter no race in the pool or the merge. On
    the H200 the engine's test at that entry failed (2026-12-05): not the kernel, but a steady step
    at the threshold that replayed the short graph (fixed in TritonBackend.long_context; the
    engine's test passed on an H100 since). On a GPU (fp32 here) this runs the entry's exact tile,
    its programs at once."""
    rows = [(0, kv_len)]
    kc, vc, table, q, k, v, pos, slots, cs, norm = _batch_case(kh, rows, group=2, num_kv_heads=2, head_dim=64,
                                                               page_size=16, seed=kv_len)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want_q, _ = rope_kv_write_reference(q, k, v, pos, cs, kc_ref, vc_ref, slots, qk_norm=norm)
    want = decode_attention_reference(want_q, kc_ref, vc_ref, table["kv_indptr"], table["kv_indices"],
                                      table["kv_lens"], 64**-0.5)
    splits, hq = 32, q.shape[1]
    out = torch.full((1, hq, 64), NAN, device=kh.device)
    counts = torch.zeros(one_launch_counters(1, 2, splits, merge_group), dtype=torch.int32, device=kh.device)
    scratch = dict(mid_o=torch.full((splits, hq, 64), NAN, device=kh.device),
                   mid_lse=torch.full((splits, hq), NAN, device=kh.device))
    with interpreted_accesses(sync=counts, k_cache=kc, v_cache=vc, out=out, **scratch) as log:
        decode_attention_one_launch(
            q, kc, vc, table["kv_indptr"], table["kv_indices"], table["kv_lens"], 64**-0.5, out=out,
            merge_counts=counts, num_splits=splits, min_split_tokens=256, block_n=64, num_warps=2, num_stages=3,
            long_from_tokens=1024, long_split_tokens=64, rope_in=RopeIn(k, v, pos, cs, norm),
            prefetch_pages=prefetch_pages, merge_group=merge_group, **scratch)
    assert log is None or log.hazards(own_reads=False) == []
    assert not counts.any()
    assert kh.rel_err(out, want) < 1e-5
    assert kh.rel_err(kc, kc_ref) < 1e-5 and torch.equal(vc, vc_ref)
