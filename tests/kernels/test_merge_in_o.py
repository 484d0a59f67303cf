"""One row's attention merged in the O GEMV's prologue (fused_decode.MERGE_IN_O): the one-launch
attention leaves its split partials (`decode_attention_one_launch(partials_out=True)`) and the
CuTe GEMV planned with `merge_in` merges them into x before its dot products.

On any machine: the attention's partials (Triton's interpreter without CUDA), merged by the slow
obvious reference under the split rule the GEMV repeats, give the attention's own output; the
plan and the call refuse what the merge form cannot do. With CUDA and the CuTe DSL: the merge
GEMV against the reference merge followed by the fp32 GEMV, the slots past the row's splits
poisoned.
"""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels import cute_gemv
from flashlet.kernels.cute_gemv import (CuteGemv, SplitPartials, gemv_reference, merge_in, merge_partials_reference,
                                        plan_gemv, split_count)
from flashlet.kernels.decode_attention import decode_attention_one_launch, decode_attention_reference

NAN = float("nan")
HAVE_CUTE, NO_CUTE_REASON = cute_gemv.cute_available()
GPU_SKIP = ("needs CUDA" if not torch.cuda.is_available()
            else None if HAVE_CUTE else f"needs the CuTe DSL: {NO_CUTE_REASON[:160]}")
needs_gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")


def _split_range(kv_len: int, num_splits: int, split_tokens: int, block_n: int) -> int:
    """decode_attention's `_split_range` written out step by step (its split count)."""
    n = min(-(-kv_len // split_tokens), num_splits)
    n = max(n, 1)
    split_len = -(-(-(-kv_len // n)) // block_n) * block_n
    split_len = max(split_len, block_n)
    return max(-(-kv_len // split_len), 1)


@pytest.mark.parametrize("kv_len", [1, 15, 16, 17, 255, 256, 257, 1000, 1024, 4095, 9000])
@pytest.mark.parametrize("splits, split_tokens, block_n", [(64, 256, 256), (16, 64, 64), (32, 64, 64), (4, 16, 16)])
def test_split_count_is_the_attention_split_rule(kv_len, splits, split_tokens, block_n):
    assert split_count(kv_len, merge_in(splits, split_tokens, block_n, 64)) == \
        _split_range(kv_len, splits, split_tokens, block_n)


@pytest.mark.parametrize("group, num_kv_heads, kv_pack, kv_len, num_splits, split_tokens, block_n, prefetch", [
    (7, 2, 1, 40, 4, 16, 16, False),   # Qwen2.5-0.5B's group, 3 of 4 splits
    (7, 2, 1, 16, 4, 16, 16, False),   # one split: a partial all the same (no direct store of O)
    (7, 2, 2, 100, 8, 16, 16, False),  # KV heads packed two a program, 7 splits (two merge groups of 4)
    (2, 4, 1, 70, 8, 16, 16, False),   # Qwen3's group
    (3, 1, 1, 200, 4, 16, 32, False),  # splits of several blocks
    (6, 2, 1, 300, 16, 16, 16, True),  # Qwen2.5-1.5B's group and entry's form: 16 splits, page ids ahead
])
def test_partials_out_merged_by_the_rule_give_the_attention_output(kh, group, num_kv_heads, kv_pack, kv_len,
                                                                     num_splits, split_tokens, block_n, prefetch):
    head_dim = 16
    paged = kh.make_paged([kv_len], 8, num_kv_heads, head_dim, seed=kv_len)
    hq = group * num_kv_heads
    q = torch.randn(1, hq, head_dim, generator=torch.Generator().manual_seed(3)).to(kh.device)
    args = (q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"], paged["kv_lens"],
            head_dim**-0.5)
    mid_o = torch.full((num_splits + 2, hq, head_dim), NAN, device=kh.device)  # poisoned past the splits used
    mid_lse = torch.full((num_splits + 2, hq), NAN, device=kh.device)
    counts = torch.zeros(num_kv_heads + 1, dtype=torch.int32, device=kh.device)
    out = torch.full_like(q, NAN)
    got = decode_attention_one_launch(*args, out=out, mid_o=mid_o, mid_lse=mid_lse, merge_counts=counts,
                                      num_splits=num_splits, min_split_tokens=split_tokens, block_n=block_n,
                                      kv_heads_per_program=kv_pack, prefetch_pages=prefetch, partials_out=True)
    assert got is out and torch.isnan(out).all(), "partials_out writes no output"
    assert not counts.any(), "partials_out moves no merge counter"
    rule = merge_in(num_splits, split_tokens, block_n, head_dim)
    n = split_count(kv_len, rule)
    assert not torch.isnan(mid_o[:n]).any() and not torch.isnan(mid_lse[:n]).any(), "a used split left no partial"
    assert torch.isnan(mid_lse[n:]).all(), "a split past the row's count wrote a partial"
    x = merge_partials_reference(SplitPartials(mid_o, mid_lse, paged["kv_lens"], rule))
    want = decode_attention_reference(*args)
    assert kh.rel_err(x.view_as(want), want) < 1e-5


def test_partials_out_refuses_a_two_level_merge(kh):
    paged = kh.make_paged([40], 8, 2, 16)
    q = torch.randn(1, 14, 16, device=kh.device)
    with pytest.raises(ValueError, match="merge_group must be 0"):
        decode_attention_one_launch(q, paged["k_cache"], paged["v_cache"], paged["kv_indptr"], paged["kv_indices"],
                                    paged["kv_lens"], 0.25, out=torch.empty_like(q),
                                    mid_o=torch.empty(8, 14, 16, device=kh.device),
                                    mid_lse=torch.empty(8, 14, device=kh.device),
                                    merge_counts=torch.zeros(64, dtype=torch.int32, device=kh.device),
                                    num_splits=8, min_split_tokens=16, block_n=16, merge_group=2,
                                    partials_out=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(fp8=True), "fp8"), (dict(norm=True), "norm"), (dict(mma=True), "one row on the tensor cores"),
])
def test_merge_plan_refuses_what_it_cannot_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_gemv(896, 896, "residual", merge=merge_in(64, 256, 256, 64), **kwargs)
    with pytest.raises(ValueError, match="whole number of heads"):
        plan_gemv(896, 900, "residual", merge=merge_in(64, 256, 256, 64))
    with pytest.raises(ValueError, match="positive int"):
        merge_in(0, 256, 256, 64)
    with pytest.raises(ValueError, match="partials must be one of"):
        merge_in(64, 256, 256, 64, partials="fp16")


@pytest.mark.parametrize("rows, mma", [(2, None), (4, None), (16, None), (4, False)])
def test_merge_plans_m_rows_as_x_itself_in_either_form(rows, mma):
    """M decode rows merge too, on the tensor cores (bf16's default past one row) or the CUDA cores."""
    rule = merge_in(8, 128, 128, 64)
    plain = plan_gemv(896, 896, "residual", pdl=True, rows=rows, mma=mma)
    merged = plan_gemv(896, 896, "residual", pdl=True, rows=rows, mma=mma, merge=rule)
    assert merged == plain.__class__(**{**plain.__dict__, "merge": rule})


def test_merge_plan_is_os_plan_with_its_rule():
    plain = plan_gemv(896, 896, "residual", pdl=True)
    merged = plan_gemv(896, 896, "residual", pdl=True, merge=merge_in(64, 256, 256, 64))
    assert merged.merge == (64, 256, 256, 64, 4, "fp32") and "merge4" in merged.describe()
    assert merged == plain.__class__(**{**plain.__dict__, "merge": merged.merge})


def _fused_at(shape: tuple[int, int], **fields):
    """A stand-in FusedDecode with a model of `shape` (hidden size, intermediate size), as
    `model_shape` reads one."""
    from types import SimpleNamespace

    down = SimpleNamespace(weight=torch.empty(shape[0], shape[1], device="meta"))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=shape[0]), layers=[SimpleNamespace(down_proj=down)])
    return SimpleNamespace(model=model, **fields)


def test_the_merge_forms_build_their_gemv(monkeypatch):
    """$FLASHLET_MERGE_IN_O's forms as FusedDecode._merge_o plans them: warps, and the group of
    splits a round in the GEMV's merge (the attention's rule otherwise); "auto" the shape's entry."""
    from flashlet.runner import fused_decode

    rule = merge_in(16, 64, 64, 128)
    for setting, shape, warps, group in (("w8g16", (2048, 8192), 8, 16), ("w4", (1024, 3072), 4, 4),
                                         ("auto", (896, 4864), 4, 4), ("auto", (1024, 3072), 8, 16),
                                         ("auto", (1536, 8960), 8, 16)):
        monkeypatch.setattr(fused_decode, "MERGE_IN_O", setting)
        fused = _fused_at(shape, merge_o={}, pdl=True, _widths=lambda: (1024, 2048, 0, 0, 0))
        plan = fused_decode.FusedDecode._merge_o(fused, rule, 1, torch.device("cpu")).plan
        assert (plan.warps, plan.merge) == (warps, (*rule[:4], group, "fp32")), (setting, shape)
    # bf16 partials keep their dtype in the GEMV's rule, its group its own
    bf16 = merge_in(16, 64, 64, 128, partials="bf16")
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "w8g16")
    fused = _fused_at((2048, 8192), merge_o={}, pdl=True, _widths=lambda: (1024, 2048, 0, 0, 0))
    plan = fused_decode.FusedDecode._merge_o(fused, bf16, 1, torch.device("cpu")).plan
    assert plan.merge == (16, 64, 64, 128, 16, "bf16") and "bf16parts" in plan.describe()
    # a looping grid: one CTA an SM walks the tiles, merging once
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "w8g16c1")
    fused = _fused_at((2048, 8192), merge_o={}, pdl=True, _widths=lambda: (2048, 2048, 0, 0, 0))
    plan = fused_decode.FusedDecode._merge_o(fused, bf16, 1, torch.device("cpu")).plan
    assert plan == plan_gemv(2048, 2048, "residual", pdl=True, warps=8, ctas_per_sm=1,
                             merge=(16, 64, 64, 128, 16, "bf16"))
    assert plan.grid < plan.num_tiles
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "1")
    fused = _fused_at((2048, 8192), merge_o={}, pdl=True, _widths=lambda: (1024, 2048, 0, 0, 0))
    assert fused_decode.FusedDecode._merge_o(fused, rule, 1, torch.device("cpu")).plan == \
        plan_gemv(1024, 2048, "residual", pdl=True, merge=rule)
    # past one row: O's M-row plan, its register cap off (the merge's loads need the registers)
    four = fused_decode.FusedDecode._merge_o(fused, rule, 4, torch.device("cpu")).plan
    assert four == plan_gemv(1024, 2048, "residual", pdl=True, rows=4, min_ctas_per_sm=0, merge=rule)
    assert four.rows == 4 and four.min_ctas == 0 and set(fused.merge_o) == {(rule, 1), (rule, 4)}


def test_merge_forms_at_each_preset_shape(monkeypatch):
    """"auto" merges in O only at the shapes measured to gain (MERGE_IN_O_SHAPES), each in its form;
    $FLASHLET_MERGE_IN_O_ROWS replaces the form's rows wherever the merge is on."""
    from flashlet.runner import fused_decode
    from flashlet.runner.fused_decode import MergeForm, merge_form

    monkeypatch.setattr(fused_decode, "MERGE_IN_O_ROWS", "auto")
    assert merge_form((896, 4864)) == MergeForm(4, None, 4)
    assert merge_form((1536, 8960)) == merge_form((1024, 3072)) == MergeForm(8, 16, 1)
    assert merge_form((2048, 5632)) == MergeForm(8, 16, 1, ctas_per_sm=1)
    for lost_or_unmeasured in ((2048, 6144), (2048, 8192), (3584, 18944)):
        assert merge_form(lost_or_unmeasured) is None
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "w2g8")
    assert merge_form((2048, 8192)) == MergeForm(2, 8, 1)
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "w8g16c1")
    assert merge_form((2048, 8192)) == MergeForm(8, 16, 1, ctas_per_sm=1)
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "w4c2")
    assert merge_form((2048, 8192)) == MergeForm(4, None, 1, ctas_per_sm=2)
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "w2g8")
    monkeypatch.setattr(fused_decode, "MERGE_IN_O_ROWS", "8")
    assert merge_form((2048, 8192)) == MergeForm(2, 8, 8)
    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "0")
    assert merge_form((896, 4864)) is None


def test_merge_settings_refuse_what_they_do_not_know():
    """A mistyped $FLASHLET_MERGE_IN_O or $FLASHLET_MERGE_IN_O_ROWS stops the import with a message
    that names the variable and what it takes."""
    import subprocess
    import sys

    for env, value in (("FLASHLET_MERGE_IN_O", "w3"), ("FLASHLET_MERGE_IN_O", "w8c3"), ("FLASHLET_MERGE_IN_O_ROWS", "16"),
                       ("FLASHLET_MERGE_IN_O_ROWS", "4x"), ("FLASHLET_MERGE_PARTIALS", "fp16")):
        run = subprocess.run([sys.executable, "-c", "import flashlet.runner.fused_decode"], capture_output=True,
                             text=True, env={**__import__("os").environ, env: value})
        assert run.returncode != 0 and f"{env}={value!r}: expected" in run.stderr, (env, value, run.stderr[-300:])


def test_merge_call_refuses_partials_of_another_rule():
    gemv = CuteGemv(896, 896, "residual", device="cpu", merge=merge_in(64, 256, 256, 64))
    parts = SplitPartials(torch.zeros(64 * 896), torch.zeros(64 * 14), torch.ones(1, dtype=torch.int32),
                          merge_in(32, 256, 256, 64))
    w, r = torch.zeros(896, 896, dtype=torch.bfloat16), torch.zeros(1, 896, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="count or read the splits wrong"):
        gemv(parts, w, r, out=r)
    with pytest.raises(ValueError, match="SplitPartials"):
        gemv(torch.zeros(1, 896, dtype=torch.bfloat16), w, r, out=r)
    short = SplitPartials(torch.zeros(8 * 896), torch.zeros(64 * 14), torch.ones(1, dtype=torch.int32),
                          merge_in(64, 256, 256, 64))
    with pytest.raises(ValueError, match="mid_o"):
        gemv(short, w, r, out=r)
    # bf16 partials: the rule says so, and mid_o must be bf16 (the plan compiles its loads in)
    halves = CuteGemv(896, 896, "residual", device="cpu", merge=merge_in(64, 256, 256, 64, partials="bf16"))
    with pytest.raises(ValueError, match="count or read the splits wrong"):
        halves(parts, w, r, out=r)
    as_fp32 = SplitPartials(torch.zeros(64 * 896), torch.zeros(64 * 14), torch.ones(1, dtype=torch.int32),
                            merge_in(64, 256, 256, 64, partials="bf16"))
    with pytest.raises(ValueError, match="mid_o must be a contiguous, 16-byte aligned torch.bfloat16"):
        halves(as_fp32, w, r, out=r)


@pytest.mark.parametrize("setting, shape, rows, fp8, mma, merges", [
    ("auto", (896, 4864), 1, False, False, True),    # Qwen2.5-0.5B: measured, on
    ("auto", (896, 4864), 4, False, False, True),    # ... steps of up to four rows too
    ("auto", (896, 4864), 5, False, False, False),
    ("auto", (1536, 8960), 1, False, False, True),   # Qwen2.5-1.5B
    ("auto", (1536, 8960), 2, False, False, False),  # one row there
    ("auto", (1024, 3072), 1, False, False, True),   # Qwen3-0.6B, in its own form
    ("auto", (2048, 8192), 1, False, False, False),  # Llama-3.2-1B: measured to lose, off
    ("auto", (896, 4864), 1, False, True, False),    # not a one-row O on the tensor cores (a 7B-class shape's)
    ("auto", (896, 4864), 2, False, True, True),     # ... whose M-row steps still merge
    ("auto", (896, 4864), 1, True, False, False),    # bf16 weights only
    ("1", (2048, 5632), 1, False, False, True),      # forced at any shape
    ("1", (2048, 5632), 2, False, False, False),     # ... one row unless rows are asked for
    ("w4", (2048, 8192), 1, False, True, False),     # not where O runs on the tensor cores
    ("w8g16", (2048, 6144), 1, False, False, True),  # a form with its own group of splits a round
    ("0", (896, 4864), 1, False, False, False),
])
def test_which_steps_merge_in_the_o_gemv(monkeypatch, setting, shape, rows, fp8, mma, merges):
    from flashlet.runner import fused_decode

    monkeypatch.setattr(fused_decode, "MERGE_IN_O", setting)
    monkeypatch.setattr(fused_decode, "MERGE_IN_O_ROWS", "auto")
    fused = _fused_at(shape, fp8=fp8, bf16_one_row_mma=mma)
    assert fused_decode.FusedDecode.merges_in_o(fused, rows) is merges
    monkeypatch.setattr(fused_decode, "MERGE_IN_O_ROWS", "4")  # several rows asked for: up to 4 merge
    assert fused_decode.FusedDecode.merges_in_o(fused, rows) is (setting != "0" and not fp8 and rows <= 4 and (
        rows > 1 or not mma) and (setting != "auto" or shape in fused_decode.MERGE_IN_O_SHAPES))


def _partials(n_used: int, splits: int, k: int, head_dim: int, seed: int, partials: str = "fp32") -> SplitPartials:
    """Random partials and log-sum-exps in the first n_used slots, NaN past them, and a KV length
    the rule (256-token splits, 64-key blocks) gives exactly n_used splits."""
    gen = torch.Generator().manual_seed(seed)
    heads = k // head_dim
    mid_o = torch.full((splits, heads, head_dim), NAN)
    mid_lse = torch.full((splits, heads), NAN)
    mid_o[:n_used] = torch.randn(n_used, heads, head_dim, generator=gen)
    mid_lse[:n_used] = 4 * torch.randn(n_used, heads, generator=gen)  # weights far apart and near
    rule = merge_in(splits, 256, 64, head_dim, partials=partials)
    kv_len = 256 * n_used - 100
    assert split_count(kv_len, rule) == n_used
    return SplitPartials(mid_o.to(cute_gemv.partial_dtype(rule)).cuda(), mid_lse.cuda(),
                         torch.tensor([kv_len], dtype=torch.int32, device="cuda"), rule)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, k, head_dim", [(896, 896, 64), (1024, 2048, 128), (1536, 1536, 128)])
@pytest.mark.parametrize("n_used", [1, 3, 4, 7, 9])
@pytest.mark.parametrize("knobs", [{}, dict(warps=4), dict(staged=True, stages=2, warps=2),
                                   dict(warps=2, staged=False), dict(ctas_per_sm=1)],  # (the last loops)
                         ids=["plan", "w4", "staged", "w2", "looping"])
@pytest.mark.parametrize("group", [4, 16])
def test_merge_gemv_matches_the_reference_merge_then_gemv(kh, n, k, head_dim, n_used, knobs, group, partials="fp32"):
    """x merged in the prologue (poisoned slots past the row's splits never read), then W x + r,
    against the reference merge rounded to bf16 (as the attention stores x) and the fp32 GEMV;
    four or sixteen splits loaded a round (the GEMV's own group: the partials' rule keeps 4)."""
    parts = _partials(n_used, 16, k, head_dim, seed=n_used, partials=partials)
    gemv = CuteGemv(n, k, "residual", pdl=True, merge=(*parts.rule[:4], group, partials), **knobs)
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).cuda()
    r = torch.randn(1, n, generator=gen).to(torch.bfloat16).cuda()
    want = gemv_reference(merge_partials_reference(parts).to(torch.bfloat16), w, "residual", r)
    for _ in range(2):  # a second launch: nothing left over from the first
        out = r.clone()
        gemv(parts, w, out, out=out)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        assert kh.rel_err(out, want) < 1e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, k, head_dim", [(896, 896, 64), (1024, 2048, 128)])
@pytest.mark.parametrize("n_used", [1, 4, 9])
@pytest.mark.parametrize("knobs", [dict(warps=4), dict(warps=8), dict(warps=8, ctas_per_sm=1)],
                         ids=["w4", "w8", "w8-looping"])
@pytest.mark.parametrize("group", [4, 16])
def test_merge_gemv_of_bf16_partials(kh, n, k, head_dim, n_used, knobs, group):
    """The same with bf16 partial outputs (`merge_in(partials="bf16")`: half the bytes a CTA loads),
    against the reference merge of the same bf16 values (eight warps at K = 896 in the register
    form: staged they need 57 KB of shared memory, which the plan refuses)."""
    if knobs["warps"] == 8 and k == 896:
        knobs = {**knobs, "staged": False}
    test_merge_gemv_matches_the_reference_merge_then_gemv(kh, n, k, head_dim, n_used, knobs, group, "bf16")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("knobs", [dict(min_ctas_per_sm=0), dict(mma=False, warps=8)])
def test_m_row_merge_gemv_matches_the_reference_merge_then_gemv(kh, rows, knobs):
    """M decode rows, each with its own split count (1 to 9 of 16, slots row * 16 + s), merged
    into shared memory and read as x by the tensor-core fragments or the CUDA-core rows: against
    the reference merge rounded to bf16 and the fp32 GEMV, every unused slot poisoned."""
    n, k, head_dim, splits = 896, 896, 64, 16
    heads = k // head_dim
    gen = torch.Generator().manual_seed(rows)
    used = [1 + (3 * m + 2) % 9 for m in range(rows)]
    mid_o = torch.full((rows * splits, heads, head_dim), NAN)
    mid_lse = torch.full((rows * splits, heads), NAN)
    for m, u in enumerate(used):
        mid_o[m * splits: m * splits + u] = torch.randn(u, heads, head_dim, generator=gen)
        mid_lse[m * splits: m * splits + u] = 4 * torch.randn(u, heads, generator=gen)
    rule = merge_in(splits, 256, 64, head_dim)
    kv_lens = torch.tensor([256 * u - 100 for u in used], dtype=torch.int32)
    assert [split_count(int(v), rule) for v in kv_lens] == used
    parts = SplitPartials(mid_o.cuda(), mid_lse.cuda(), kv_lens.cuda(), rule)
    gemv = CuteGemv(n, k, "residual", pdl=True, rows=rows, merge=rule, **knobs)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).cuda()
    r = torch.randn(rows, n, generator=gen).to(torch.bfloat16).cuda()
    want = gemv_reference(merge_partials_reference(parts, rows).to(torch.bfloat16), w, "residual", r)
    out = r.clone()
    gemv(parts, w, out, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert kh.rel_err(out, want) < 1e-2


def test_start_precompile_hands_the_merging_o_gemvs_to_the_workers(monkeypatch):
    """FusedDecode.start_precompile, given the fused steps' attention backend: beside every row
    count's GEMVs, the O GEMVs that merge (one per row count that merges in O, under the rule the
    backend names for it: Qwen3's with RoPE in the attention), so that no merging O compiles in
    the warm-up on a first start; none without a backend or where the backend names no rule."""
    from types import MethodType, SimpleNamespace

    from flashlet.runner import fused_decode

    monkeypatch.setattr(fused_decode, "MERGE_IN_O", "auto")
    monkeypatch.setattr(fused_decode, "MERGE_IN_O_ROWS", "auto")
    monkeypatch.setattr(fused_decode, "MERGE_PARTIALS", "bf16")
    handed = []
    monkeypatch.setattr(fused_decode.cute_precompile, "start", lambda gemvs: handed.append(list(gemvs)) or "job")
    asked = []

    class Attn:
        def partials_rule(self, rows, rope_in, partials):
            asked.append((rows, rope_in, partials))
            return None if rows == 3 else merge_in(8 * rows, 128, 128, 64, partials=partials)

    plain = [SimpleNamespace(name=f"gemv{m}") for m in (1, 2, 3, 4, 8)]
    fused = _fused_at((896, 4864), merge_o={}, pdl=True, _widths=lambda: (896, 896, 0, 0, 0), fp8=False,
                      bf16_one_row_mma=False, one_launch_attention=True, rope=None, rope_in_attention=True,
                      row_counts=[1, 2, 3, 4, 8], device=torch.device("cpu"),
                      gemvs={m: SimpleNamespace(all=lambda g=g: [g]) for m, g in zip((1, 2, 3, 4, 8), plain)})
    fused.merges_in_o = MethodType(fused_decode.FusedDecode.merges_in_o, fused)
    fused._merge_o = MethodType(fused_decode.FusedDecode._merge_o, fused)
    fused_decode.FusedDecode.start_precompile(fused, Attn())
    assert fused.precompile == "job" and asked == [(m, True, "bf16") for m in (1, 2, 3, 4)]  # the 0.5B: up to 4 rows
    merging = handed[0][len(plain):]
    assert handed[0][:len(plain)] == plain and merging == [fused.merge_o[k] for k in fused.merge_o]
    assert sorted(rows for _, rows in fused.merge_o) == [1, 2, 4]  # 3 rows: the backend names no rule
    assert all(rule == merge_in(8 * rows, 128, 128, 64, partials="bf16") for rule, rows in fused.merge_o)
    fused_decode.FusedDecode.start_precompile(fused, None)  # no backend: the row counts' GEMVs only
    assert handed[1] == plain
