"""The one-launch decode attention with PDL over a verify step's rows (several rows of one
sequence, each over one more key): nothing this step writes is read before `griddepcontrol.wait`.

The interpreter has no PDL, so the test plays the QKV GEMV that runs beside the attention: at
each program's start (its `launch_dependents`) this step's K/V rows of the pool are NaN, as
they are until the GEMV finishes, and at its `wait` they take their values. A program that read
one of them before the wait returns NaN; one that read them after returns the reference.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flashlet.kernels import decode_attention as da
from flashlet.kernels import pdl
from flashlet.kernels.decode_attention import decode_attention_one_launch, decode_attention_reference
from flashlet.kernels.pdl import pdl_supported

NAN = float("nan")


def verify_step_as_decode_rows(kh, page_size, seqs, shared_prefix_pages=None, head_dim=16):
    """seqs: [(cached tokens, this step's tokens)] -> (pool dict (2 KV heads), kv_indptr,
    kv_indices, kv_lens of one decode row per step token, the (page, row) slots this step
    writes). Each sequence's rows share its page table, their KV lengths cached + 1 .. cached + n."""
    paged = kh.make_paged([c + n for c, n in seqs], page_size, 2, head_dim, seed=3,
                          shared_prefix_pages=shared_prefix_pages)
    indptr, indices, lens, written = [0], [], [], []
    for (cached, n), pages in zip(seqs, paged["pages"]):
        for length in range(cached + 1, cached + n + 1):
            used = pages[: -(-length // page_size)]
            indices += used
            indptr.append(indptr[-1] + len(used))
            lens.append(length)
        written += [(pages[t // page_size], t % page_size) for t in range(cached, cached + n)]
    i32 = dict(dtype=torch.int32, device=kh.device)
    return (paged, torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(lens, **i32),
            written)


def play_the_qkv_gemv(monkeypatch, caches, written):
    """This step's K/V rows are NaN from each program's start to its wait (see the module)."""
    real = [(cache, page, row, cache[page, row].clone()) for cache in caches for page, row in written]

    def poison():
        for cache, page, row, _ in real:
            cache[page, row] = NAN

    def finish():
        for cache, page, row, value in real:
            cache[page, row] = value

    monkeypatch.setattr(pdl, "launch_dependents", poison)
    monkeypatch.setattr(pdl, "wait", finish)
    monkeypatch.setattr(da, "pdl_supported", lambda device: True)


# (cached, step tokens) per sequence: a verify row of 4 tokens whose rows straddle the split
# boundary (16), a decode row, a verify row of 3 within one block, and one of 7 over pages.
STEP = [(14, 4), (8, 1), (5, 3), (30, 7)]
# Decode rows of two sequences sharing a first page (a cached prefix), KV lengths one apart: the
# second looks like the first's next row, so its newest past row is read after the wait too.
SHARED_PREFIX = ([(20, 1), (21, 1), (6, 2)], {1: (0, 2)})


# A plain decode step (every row another sequence's) over the same shared first page: launched
# as the engine launches it (verify_rows=False), with no look-back compiled in.
PLAIN_SHARED_PREFIX = ([(20, 1), (21, 1), (6, 1), (30, 1)], {1: (0, 2)})


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (2, 16), (4, 16), (2, 32)])
@pytest.mark.parametrize("step,shared,verify_rows", [(STEP, None, True), (*SHARED_PREFIX, True),
                                                     (*PLAIN_SHARED_PREFIX, False)],
                         ids=["verify", "shared-prefix", "plain-no-look-back"])
def test_a_verify_step_reads_no_row_of_its_own_before_the_wait(kh, monkeypatch, num_splits, block_n,
                                                              step, shared, verify_rows, scales=None, kv_pack=1):
    if kh.device != "cpu":
        pytest.skip("plays PDL in the interpreter (on a GPU the fused-path tests check it)")
    paged, indptr, indices, lens, written = verify_step_as_decode_rows(kh, 4, step, shared)
    rows, hq, head_dim = len(lens), 4, 16
    q = torch.randn(rows, hq, head_dim, generator=torch.Generator().manual_seed(7))
    caches = (paged["k_cache"], paged["v_cache"])
    scales = scales or {}
    if scales:  # an fp8 pool, read with its scales
        caches = tuple(c.to(torch.float8_e4m3fn) for c in caches)
    want = decode_attention_reference(q, *caches, indptr, indices, lens, head_dim**-0.5, **scales)
    play_the_qkv_gemv(monkeypatch, caches, written)
    out = torch.full_like(q, NAN)
    decode_attention_one_launch(
        q, *caches, indptr, indices, lens, head_dim**-0.5, out=out,
        mid_o=torch.full((rows * num_splits, hq, head_dim), NAN), mid_lse=torch.full((rows * num_splits, hq), NAN),
        merge_counts=torch.zeros(rows * 2, dtype=torch.int32), num_splits=num_splits, min_split_tokens=16,
        block_n=block_n, pdl=True, kv_heads_per_program=kv_pack, verify_rows=verify_rows, **scales)
    assert not torch.isnan(out).any(), "a row written this step was read before the wait"
    assert kh.rel_err(out, want) < 1e-5


def test_a_verify_step_launched_as_plain_rows_reads_its_rows_unwritten(kh, monkeypatch):
    """verify_rows=False compiles the look-back out: over a verify step's rows (which the engine
    never launches so) a row reads the rows before it before the wait, as NaN here. What the
    look-back is for, shown by its absence."""
    if kh.device != "cpu":
        pytest.skip("plays PDL in the interpreter")
    paged, indptr, indices, lens, written = verify_step_as_decode_rows(kh, 4, STEP)
    rows, hq, head_dim = len(lens), 4, 16
    q = torch.randn(rows, hq, head_dim, generator=torch.Generator().manual_seed(7))
    caches = (paged["k_cache"], paged["v_cache"])
    play_the_qkv_gemv(monkeypatch, caches, written)
    out = torch.full_like(q, NAN)
    decode_attention_one_launch(
        q, *caches, indptr, indices, lens, head_dim**-0.5, out=out, mid_o=None, mid_lse=None,
        merge_counts=torch.zeros(rows * 2, dtype=torch.int32), num_splits=1, block_n=16, pdl=True,
        verify_rows=False)
    assert torch.isnan(out).any()


def test_a_verify_step_over_an_fp8_pool(kh, monkeypatch):
    """The same over an fp8 (e4m3) pool: this step's rows widened and scaled as the rest."""
    test_a_verify_step_reads_no_row_of_its_own_before_the_wait(
        kh, monkeypatch, 2, 16, STEP, None, True, scales=dict(k_scale=0.5, v_scale=2.0))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_verify_step_with_both_kv_heads_a_program(kh, monkeypatch, num_splits):
    """The one-launch variant that reads both KV heads in one program: the newest rows and this
    step's earlier rows of both heads are read after the wait too."""
    test_a_verify_step_reads_no_row_of_its_own_before_the_wait(
        kh, monkeypatch, num_splits, 16, STEP, None, True, kv_pack=2)


def test_the_look_back_covers_every_earlier_row_of_a_fused_step():
    """Up to MAX_LOOKBACK + 1 rows (the fused path's 16) a program sees every row before it;
    one row looks at none (the one-stream kernel is the same as without the look-back)."""
    assert da.one_launch_lookback(1) == 0
    for batch in range(2, da.MAX_LOOKBACK + 2):
        lookback = da.one_launch_lookback(batch)
        assert lookback >= batch - 1 and lookback & (lookback - 1) == 0
    assert da.one_launch_lookback(256) == da.MAX_LOOKBACK


# ---- on the GPU: a real race --------------------------------------------------------------------


@triton.jit
def _late_kv_writer(K, V, NewK, NewV, Slots, ROW: tl.constexpr):
    """Plays the QKV GEMV: lets the next kernel launch at once, sleeps 20 us, then writes this
    step's K/V rows (one program a row) at their pool slots."""
    pdl.launch_dependents()
    tl.inline_asm_elementwise("nanosleep.u32 20000; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)
    r = tl.program_id(0)
    slot = tl.load(Slots + r).to(tl.int64)
    e = tl.arange(0, ROW)
    tl.store(K + slot * ROW + e, tl.load(NewK + r * ROW + e))
    tl.store(V + slot * ROW + e, tl.load(NewV + r * ROW + e))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_verify_step_after_a_late_writer_on_the_gpu(kh, num_splits):
    """sm_90+: the K/V writer lets the attention launch (PDL) and then sleeps 20 us before it
    writes this step's rows, which hold NaN until then: the attention must read them after its
    wait. Over 20 launches, every output is the reference's on the written pool."""
    if kh.device != "cuda" or not pdl_supported(torch.device("cuda")):
        pytest.skip("needs Programmatic Dependent Launch (CUDA sm_90+)")
    bf16, page_size, hkv, head_dim = torch.bfloat16, 16, 2, 64
    paged, indptr, indices, lens, written = verify_step_as_decode_rows(kh, page_size, STEP, head_dim=head_dim)
    k_cache, v_cache = (paged[name].to(bf16) for name in ("k_cache", "v_cache"))
    rows, hq = len(lens), 7 * hkv
    slots = torch.tensor([page * page_size + row for page, row in written], dtype=torch.int32, device="cuda")
    new_k, new_v = (c.flatten(0, 1)[slots.long()].clone() for c in (k_cache, v_cache))
    want_out = None
    q = torch.randn(rows, hq, head_dim, device="cuda").to(bf16)
    for _ in range(20):
        for cache in (k_cache, v_cache):
            cache.flatten(0, 1)[slots.long()] = float("nan")
        _late_kv_writer[(len(written),)](k_cache, v_cache, new_k, new_v, slots, ROW=hkv * head_dim)
        out = torch.full_like(q, float("nan"))
        decode_attention_one_launch(
            q, k_cache, v_cache, indptr, indices, lens, head_dim**-0.5, out=out,
            mid_o=torch.empty(rows * num_splits, hq, head_dim, device="cuda"),
            mid_lse=torch.empty(rows * num_splits, hq, device="cuda"),
            merge_counts=torch.zeros(rows * hkv, dtype=torch.int32, device="cuda"),
            num_splits=num_splits, min_split_tokens=16, block_n=16, pdl=True)
        if want_out is None:
            want_out = decode_attention_reference(q, k_cache, v_cache, indptr, indices, lens, head_dim**-0.5)
        assert not torch.isnan(out).any(), "a row written this step was read before the wait"
        assert kh.rel_err(out, want_out) < 1e-2
