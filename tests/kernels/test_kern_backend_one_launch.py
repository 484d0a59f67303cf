"""The per-op decode step in one launch (asked for: $FLASHLET_ONE_LAUNCH_DECODE=1, set here for
every test, or `one_launch_decode`; off by default, measured slower at the 7B shape):
TritonBackend's `run` / `run_rope` of a pure-decode step of up to ONE_LAUNCH_DECODE_MAX_ROWS rows
call `decode_attention_one_launch` (the merge in the kernel) and never the two-launch kernels,
and match the torch oracle and the two-launch form; through the engine the greedy tokens are the
two-launch form's. Interpreted on the CPU, splits made small so that the merges run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.attention import triton_backend
from flashlet.attention.torch_ref import TorchBackend
from flashlet.attention.triton_backend import ONE_LAUNCH_DECODE_ENV, ONE_LAUNCH_DECODE_MAX_ROWS, TritonBackend
from flashlet.kernels.pdl import pdl_supported
from flashlet.kvcache.kv_pool import KVPool
from tests.conftest import run_to_completion

SPLIT = 16  # the smallest KV split and block of both forms here: a few dozen tokens split
SMALL = dict(num_sms=4, min_split_tokens=SPLIT, decode_block_n=SPLIT)
# Context lengths that end before, on and after split and page (16) boundaries.
LENGTHS = (1, 15, 16, 17, 33, 48, 64, 71, 100, 31, 2, 47, 80, 16, 63, 129)


@pytest.fixture(autouse=True)
def small_splits(monkeypatch):
    monkeypatch.setattr(triton_backend, "ONE_LAUNCH_MIN_SPLIT_TOKENS", SPLIT)
    monkeypatch.setenv(ONE_LAUNCH_DECODE_ENV, "1")


def _spy(monkeypatch) -> dict:
    """The keyword arguments of each call of either decode form the backend makes."""
    calls = {"one": [], "two": []}
    real_one, real_two = triton_backend.decode_attention_one_launch, triton_backend.decode_attention

    def one(*args, **kwargs):
        calls["one"].append(kwargs)
        return real_one(*args, **kwargs)

    def two(*args, **kwargs):
        calls["two"].append(kwargs)
        return real_two(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention_one_launch", one)
    monkeypatch.setattr(triton_backend, "decode_attention", two)
    return calls


def _pool(kh, lengths, num_kv_heads, head_dim, page_size=16, dtype=torch.float32, cache_dtype=None, spare=2):
    pool = KVPool(1, sum(-(-n // page_size) for n in lengths) + spare, page_size, num_kv_heads, head_dim, dtype,
                  kh.device, cache_dtype=cache_dtype)
    g = torch.Generator().manual_seed(len(lengths))
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g).to(pool.k_cache.dtype))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g).to(pool.v_cache.dtype))
    return pool


# (head_dim, Hq, Hkv) -> batch sizes: Qwen2.5-7B's group 7 (no table entry: the derived config),
# Qwen3's group 2 (its table entry at 4 rows) and Qwen2.5-1.5B's group 6.
SHAPES = {(128, 28, 4): (1, 5, 16), (128, 4, 2): (4,), (128, 12, 2): (3,)}


@pytest.mark.parametrize("shape,batch", [(s, b) for s, bs in SHAPES.items() for b in bs],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_a_per_op_decode_step_attends_in_one_launch(kh, monkeypatch, shape, batch):
    """`run` (K/V write, then attention) of a pure-decode step: one one-launch call a layer,
    no two-launch kernel; the oracle's output, the two-launch form's to fp32 rounding, and the
    merge counters back at zero."""
    head_dim, hq, hkv = shape
    lengths = LENGTHS[:batch]
    pool = _pool(kh, lengths, hkv, head_dim)
    meta, _ = kh.make_step(pool, [(n, 1) for n in lengths])
    # 32 SMs: several splits a row at every batch size here (up to 32 at one row, 2 at 16), in
    # a fraction of the interpreter time of an H200's 132.
    tri, two = (TritonBackend(pool, hq, **{**SMALL, "num_sms": 32}, one_launch_decode=on) for on in (True, False))
    ref = TorchBackend(pool, hq, batched_decode=False)
    for b in (tri, two, ref):
        b.plan(meta)
    g = torch.Generator().manual_seed(batch)
    q, k, v = (torch.randn(batch, h, head_dim, generator=g).to(kh.device) for h in (hq, hkv, hkv))
    calls = _spy(monkeypatch)
    got = tri.run(0, q, k, v)
    assert len(calls["one"]) == 1 and not calls["two"]
    # PDL where the device has it (a Hopper GPU), never in the interpreter
    assert calls["one"][0]["num_splits"] > 1 and calls["one"][0]["pdl"] == pdl_supported(pool.k_cache.device)
    want = ref.run(0, q, k, v)
    assert kh.rel_err(got, want) < 1e-5
    assert not tri._merge_counts.any()
    old = two._attend(0, q)  # the two-launch form over the same pool
    assert len(calls["two"]) == 1 and len(calls["one"]) == 1
    assert kh.rel_err(got, old) < 1e-5


def test_more_rows_than_the_one_launch_limit_keep_the_two_launch_form(kh, monkeypatch):
    """17 rows (past ONE_LAUNCH_DECODE_MAX_ROWS) and rows past max_batch_size (the counters'
    rows) take the two-launch form; a step with a chunk the prefill kernel."""
    assert ONE_LAUNCH_DECODE_MAX_ROWS == 16
    lengths = [5 + 3 * i for i in range(17)]
    pool = _pool(kh, lengths, 2, 16, spare=8)
    calls = _spy(monkeypatch)
    q = torch.randn(17, 6, 16).to(kh.device)
    capped = TritonBackend(pool, 6, **SMALL, max_batch_size=2)
    for backend, rows in ((TritonBackend(pool, 6, **SMALL), 17), (capped, 3)):
        meta, _ = kh.make_step(pool, [(n, 1) for n in lengths[:rows]])
        backend.plan(meta)
        ref = TorchBackend(pool, 6, batched_decode=False)
        ref.plan(meta)
        assert kh.rel_err(backend._attend(0, q[:rows]), ref._attend(0, q[:rows])) < 1e-5
        assert not calls["one"] and len(calls["two"]) == 1
        calls["two"].clear()
    assert capped.one_launch_decode_rows == 2
    meta, _ = kh.make_step(pool, [(20, 4), (9, 1)])  # a chunk and a decode
    backend = TritonBackend(pool, 6, **SMALL)
    backend.plan(meta)
    backend._attend(0, torch.randn(5, 6, 16).to(kh.device))
    assert not calls["one"] and not calls["two"]


def test_run_rope_of_a_decode_step_attends_in_one_launch(kh, monkeypatch):
    """The model's entry (the pool rotates and writes K/V, then attention) against RoPE in
    PyTorch followed by the oracle."""
    from flashlet.models.ops import TorchOps

    lengths = (40, 7, 33)
    pool = _pool(kh, lengths, 2, 32)
    meta, _ = kh.make_step(pool, [(n, 1) for n in lengths])
    cs = kh.cos_sin_cache(256, 32)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, h, 32, generator=g).to(kh.device) for h in (14, 2, 2))
    tri, ref = TritonBackend(pool, 14, **SMALL), TorchBackend(pool, 14, batched_decode=False)
    tri.plan(meta)
    ref.plan(meta)
    calls = _spy(monkeypatch)
    got = tri.run_rope(0, q, k, v, meta.positions, cs)
    qr, kr = TorchOps.rope(q, k, meta.positions, cs)
    assert kh.rel_err(got, ref.run(0, qr, kr, v)) < 1e-5
    assert len(calls["one"]) == 1 and not calls["two"]


def test_an_fp8_pool_is_read_in_one_launch_with_its_scales(kh, monkeypatch):
    """A bf16 model over a scaled fp8 pool (Qwen2.5's group 7): the one-launch form widens fp8 to
    bf16 and applies k_scale / v_scale; within bf16 / fp8 rounding of the oracle and the
    two-launch form (fp16 dots, V as uint16 pairs)."""
    lengths = (47, 16, 70, 1)
    pool = _pool(kh, lengths, 2, 16, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(0)
    pool.k_scales[0], pool.v_scales[0] = 0.05, 0.02
    pool.k_cache.copy_((torch.randn(pool.k_cache.shape, generator=g) * 20).to(torch.float8_e4m3fn))
    pool.v_cache.copy_((torch.randn(pool.v_cache.shape, generator=g) * 50).to(torch.float8_e4m3fn))
    meta, _ = kh.make_step(pool, [(n, 1) for n in lengths])
    q = torch.randn(4, 14, 16, generator=g).half().to(kh.device)
    tri, two = (TritonBackend(pool, 14, **SMALL, one_launch_decode=on) for on in (True, False))
    ref = TorchBackend(pool, 14, batched_decode=False)
    for b in (tri, two, ref):
        b.plan(meta)
    calls = _spy(monkeypatch)
    got = tri._attend(0, q)
    assert len(calls["one"]) == 1 and not calls["two"]
    assert calls["one"][0]["k_scale"] == 0.05 and calls["one"][0]["v_scale"] == 0.02
    assert kh.rel_err(got.float(), ref._attend(0, q).float()) < 2e-2
    assert kh.rel_err(got.float(), two._attend(0, q).float()) < 2e-2


def test_pdl_where_the_device_has_it(kh, monkeypatch):
    """On a device with PDL the per-op launch takes it; "nopdl" and one_launch_pdl=False launch
    without. A plain decode step's rows are different sequences': the launch says so
    (verify_rows=False: no look-back compiled in). The kernel is stood in for: the CPU has no PDL."""
    monkeypatch.setattr(triton_backend, "pdl_supported", lambda device: True)
    seen = []
    monkeypatch.setattr(triton_backend, "decode_attention_one_launch",
                        lambda *a, **k: seen.append(k) or k["out"])
    lengths = (30, 9, 17)
    pool = _pool(kh, lengths, 2, 16)
    meta, _ = kh.make_step(pool, [(n, 1) for n in lengths])
    q = torch.randn(3, 6, 16).to(kh.device)
    backend = TritonBackend(pool, 6, **SMALL)
    assert backend.one_launch_pdl
    backend.plan(meta)
    backend._attend(0, q)
    assert seen[-1]["pdl"] is True and seen[-1]["verify_rows"] is False
    monkeypatch.setenv(ONE_LAUNCH_DECODE_ENV, "nopdl")
    for off in (TritonBackend(pool, 6, **SMALL), TritonBackend(pool, 6, **SMALL, one_launch_pdl=False)):
        assert off.one_launch_decode_rows == 16 and not off.one_launch_pdl
        off.plan(meta)
        off._attend(0, q)
        assert seen[-1]["pdl"] is False


def test_a_verify_steps_decode_rows_look_back_in_a_graph_of_their_own(kh, monkeypatch):
    """A verify step laid out as decode rows (rows of one sequence, `verify_as_decode_rows`)
    launches with verify_rows=True (the look-back compiled in) and keys a graph apart from a plain
    step's of the same rows ("verify"); one row looks back at nothing, so it keeps the plain key;
    a long-context step's key holds both. The kernel is stood in for."""
    from flashlet.runner.batch import load_layout
    from flashlet.runner.fused_decode import verify_as_decode_rows

    monkeypatch.setattr(triton_backend, "pdl_supported", lambda device: True)
    seen = []
    monkeypatch.setattr(triton_backend, "decode_attention_one_launch",
                        lambda *a, **k: seen.append(k) or k["out"])
    pool = _pool(kh, (30, 20, 12, 30, 20, 30), 2, 16)
    backend = TritonBackend(pool, 6, **SMALL)
    plain, _ = kh.make_step(pool, [(30, 1), (20, 1), (12, 1)])
    ragged, _ = kh.make_step(pool, [(30, 3), (20, 1)])  # a k = 2 verify row beside a decode row
    ragged.host.arrays["logits_indices"] = np.arange(4)  # every query token sampled
    verify_layout = verify_as_decode_rows(ragged.host, pool.page_size, 16)
    assert verify_layout is not None and verify_layout.num_seqs == 4
    _, verify = load_layout(verify_layout, kh.device)
    one_row, _ = kh.make_step(pool, [(30, 1)])
    one_row.host.verify_as_decode_rows = True
    keys = []
    for meta in (plain, verify, one_row):
        backend.plan(meta)
        backend._attend(0, torch.randn(meta.num_seqs, 6, 16).to(kh.device))
        keys.append(backend.graph_key(meta))
    assert keys == [(), ("verify",), ()]
    assert [k["verify_rows"] for k in seen] == [False, True, False]
    monkeypatch.setattr(backend, "long_context", lambda meta: True)
    assert backend.graph_key(verify) == ("long", "verify") and backend.graph_key(plain) == ("long",)


def test_the_env_var_restores_the_two_launch_form(kh, monkeypatch):
    """$FLASHLET_ONE_LAUNCH_DECODE, read by the constructor: "0" (or unset: the default) gives
    every decode step the two-launch form, "1" one launch; the constructor's argument wins; other
    values are refused by name."""
    lengths = (40, 3)
    pool = _pool(kh, lengths, 2, 16)
    meta, _ = kh.make_step(pool, [(n, 1) for n in lengths])
    q = torch.randn(2, 6, 16).to(kh.device)
    calls = _spy(monkeypatch)
    for value, asked, form in (("", None, "two"), ("0", None, "two"), ("1", None, "one"), ("0", True, "one"),
                               ("1", False, "two")):
        monkeypatch.setenv(ONE_LAUNCH_DECODE_ENV, value)
        backend = TritonBackend(pool, 6, **SMALL, one_launch_decode=asked)
        monkeypatch.delenv(ONE_LAUNCH_DECODE_ENV)  # read once: later changes reach no backend built
        backend.plan(meta)
        backend._attend(0, q)
        assert [k for k, v in calls.items() if v] == [form], (value, asked)
        assert backend.one_launch_decode_rows == (16 if form == "one" else 0)
        calls["one"].clear()
        calls["two"].clear()
    for bad in ("2", "off", "yes"):
        monkeypatch.setenv(ONE_LAUNCH_DECODE_ENV, bad)
        with pytest.raises(ValueError, match=ONE_LAUNCH_DECODE_ENV):
            TritonBackend(pool, 6, **SMALL)


@pytest.mark.slow
def test_the_engines_per_op_decode_gives_the_two_launch_forms_tokens(kh, tiny_qwen2, monkeypatch):
    """Through the engine (triton backend, per-op path; interpreted on the CPU: ~15 s): three requests
    decoding together, their prompts past the 16-token splits, give the same greedy tokens in one
    launch as with $FLASHLET_ONE_LAUNCH_DECODE=0; each form's decode steps call only its kernels."""
    prompts = [[3, 5, 7, 9, 11] * 4, [2, 4, 6], [8] * 33]
    params = [SamplingParams(max_new_tokens=5 + i, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for value in ("1", "0"):
        monkeypatch.setenv(ONE_LAUNCH_DECODE_ENV, value)
        # Spied before the engine is built: on a GPU its warm-up captures the decode steps' CUDA
        # graphs, and a replay makes no Python call, so only the capture shows the graphs' kernels.
        calls = _spy(monkeypatch)
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device=kh.device, backend="triton", max_num_seqs=3,
                                     fused_decode=False))
        outs[value] = [o.token_ids for o in run_to_completion(engine, prompts, params)]
        one, two = len(calls["one"]), len(calls["two"])
        assert (one > 0, two > 0) == ((True, False) if value == "1" else (False, True)), (value, one, two)
        assert any(c["num_splits"] > 1 for c in calls["one"] + calls["two"])
        assert not engine.runner.backend._merge_counts.any()
    assert outs["1"] == outs["0"]


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("length", [1, 40, 129])
def test_one_row_partials_out_merge_to_the_attention_output(kh, monkeypatch, cache_dtype, length):
    """`attend_one_launch(partials_out=True)` at one row (the fused path's merge in the O GEMV):
    the split partials it returns, merged by the reference under the rule it names, are its
    output without them, over a bf16 or a scaled fp8 pool; no merge counter moves. More rows, or
    a long step, return the output as always."""
    from flashlet.kernels.cute_gemv import SplitPartials, merge_partials_reference, split_count

    pool = _pool(kh, [length], 2, 16, dtype=torch.float16, cache_dtype=cache_dtype)
    if cache_dtype is not None:
        pool.k_scales[0], pool.v_scales[0] = 0.05, 0.02
    meta, _ = kh.make_step(pool, [(length, 1)])
    q = torch.randn(1, 14, 16, generator=torch.Generator().manual_seed(length)).half().to(kh.device)
    tri = TritonBackend(pool, 14, **SMALL, one_launch_decode=True)
    tri.plan(meta)
    want = tri.attend_one_launch(0, q)
    parts = tri.attend_one_launch(0, q, partials_out=True)
    assert isinstance(parts, SplitPartials) and not tri._merge_counts.any()
    cfg, splits = tri.one_launch_config(1)
    assert parts.rule[:4] == (splits, cfg.min_split_tokens, cfg.block_n, 16)
    assert (split_count(length, parts.rule) > 1) == (length > SPLIT)  # the longer rows merge several
    assert kh.rel_err(merge_partials_reference(parts).view_as(want).float(), want.float()) < 1e-3
    monkeypatch.setattr(tri, "long_context", lambda meta: True)
    assert isinstance(tri.attend_one_launch(0, q, partials_out=True), torch.Tensor)


def _planned_step(kh, lengths: list[int], seed: int):
    """A one-launch triton backend planned for a decode step of one row per length (group 7, two
    KV heads of 16, an fp16 pool), and the step's q."""
    pool = _pool(kh, lengths, 2, 16, dtype=torch.float16)
    meta, _ = kh.make_step(pool, [(n, 1) for n in lengths])
    q = torch.randn(len(lengths), 14, 16, generator=torch.Generator().manual_seed(seed)).half().to(kh.device)
    tri = TritonBackend(pool, 14, **SMALL, one_launch_decode=True)
    tri.plan(meta)
    return tri, q


def test_rows_partials_out_merge_to_the_attention_output(kh):
    """Three rows of a step (1, 40 and 129 tokens: one, several and the most splits), each row's
    partials in its own slots: merged by the reference, the step's output without them."""
    from flashlet.kernels.cute_gemv import SplitPartials, merge_partials_reference

    tri, q = _planned_step(kh, [1, 40, 129], seed=3)
    want = tri.attend_one_launch(0, q)
    parts = tri.attend_one_launch(0, q, partials_out=True)
    assert isinstance(parts, SplitPartials) and not tri._merge_counts.any()
    assert kh.rel_err(merge_partials_reference(parts, 3).view_as(want).float(), want.float()) < 1e-3
    # rows past the step's (a padded q) keep the output form
    assert isinstance(tri.attend_one_launch(0, torch.cat([q, q[:1]]), partials_out=True), torch.Tensor)


def test_bf16_partials_are_the_fp32_partials_rounded(kh):
    """`attend_one_launch(partials="bf16")` (FLASHLET_MERGE_PARTIALS=bf16): the same split partials
    as fp32's, each rounded once to bf16 (not left fp32) in the same scratch's bf16 view, the
    log-sum-exps fp32 and unchanged, the rule naming the dtype; merged, the output within bf16's
    rounding."""
    from flashlet.kernels.cute_gemv import merge_partials_reference, same_split_rule, split_count

    lengths = [1, 40, 129]
    tri, q = _planned_step(kh, lengths, seed=5)
    want = tri.attend_one_launch(0, q)
    fp32 = tri.attend_one_launch(0, q, partials_out=True)
    o32, lse32 = fp32.mid_o.clone(), fp32.mid_lse.clone()
    bf16 = tri.attend_one_launch(0, q, partials_out=True, partials="bf16")
    assert bf16.mid_o.dtype == torch.bfloat16 and bf16.mid_o.data_ptr() == fp32.mid_o.data_ptr()
    assert bf16.rule[5] == "bf16" and fp32.rule[5] == "fp32" and not same_split_rule(bf16.rule, fp32.rule)
    splits = fp32.rule[0]
    for b, n in enumerate(lengths):
        used = slice(b * splits, b * splits + split_count(n, fp32.rule))
        # within one bf16 step of the fp32 value (the GPU rounds to nearest; Triton's CPU
        # interpreter truncates)
        err = (bf16.mid_o[used].float() - o32[used]).abs()
        assert (err <= o32[used].abs() * 2.0**-7).all() and bf16.mid_o[used].float().ne(o32[used]).any(), \
            f"row {b}'s partials"
        assert torch.equal(bf16.mid_lse[used], lse32[used]), f"row {b}'s log-sum-exps"
    assert kh.rel_err(merge_partials_reference(bf16, 3).view_as(want).float(), want.float()) < 1e-2
    with pytest.raises(ValueError, match="partials must be"):
        tri.attend_one_launch(0, q, partials_out=True, partials="fp16")


def test_long_two_launch_steps_return_their_output(kh, monkeypatch):
    """A long step attended in two launches (`long_in_two_launches`) returns its output with
    partials_out too: the two-launch form merges its own partials (their merge in O, measured
    slower, was removed in session 71)."""
    tri, q = _planned_step(kh, [90, 200], seed=9)
    want = tri.attend_one_launch(0, q)
    monkeypatch.setattr(tri, "long_context", lambda meta: True)
    monkeypatch.setattr(tri, "long_in_two_launches", lambda n: True)
    got = tri.attend_one_launch(0, q, partials_out=True, partials="bf16")
    assert isinstance(got, torch.Tensor) and kh.rel_err(got.float(), want.float()) < 1e-3
