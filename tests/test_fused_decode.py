"""The fused decode path's wiring (flashlet/runner/fused_decode.py) on the CPU, and its refusals.

The CuTe kernels need a GPU (tests/gpu/test_gpu_fused_decode.py, tests/kernels/test_cute_gemv.py);
here each GEMV is replaced by its fp32 PyTorch reference (`gemv_reference`, which the GPU tests
hold the kernels to), so what is checked is the layer sequence around them: the norm folded
into QKV / gate+up / LM head, the in-place residual stream, the split, RoPE and attention
through the backend, the argmax path and the engine's choice of it, against the per-op model;
and the default (auto): the conditions under which it turns the path on, each broken alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.kernels.cute_gemv import gemv_reference, plan_gemv, rope_kv_reference
from flashlet.kvcache.kv_pool import KVPool
from flashlet.models.weights import PRESETS_DIR
from flashlet.runner import fused_decode
from flashlet.runner.fused_decode import FusedParts
from flashlet.runner.model_runner import ModelRunner
from flashlet.core import engine as engine_module
from tests.conftest import run_to_completion


class ReferenceGemv:
    """CuteGemv's interface for M rows (`rows=M`: x [M, K], out [M, N], the argmax's [M], a
    residual [M, N], a bias [N], RopeKV's positions and slots [M]; fp8: e4m3 codes and their
    row scales), each row computed by gemv_reference / rope_kv_reference (the kernels' fp32
    references; with a scale, quantization.dequant_linear's numerics)."""

    def __init__(self, n_rows, k, epilogue="none", *, device="cuda", pdl=False, norm=False, eps=1e-6,
                 rope=None, rows=1, fp8=False, mma=None):
        self.plan = plan_gemv(n_rows, k, epilogue, norm=norm, eps=eps, rope=rope, fp8=fp8, mma=mma)
        self.rows = rows
        self.calls = 0
        self.compile_seconds = None  # as CuteGemv: set once compiled (at its first call)

    def __call__(self, x, weight, extra=None, *, out, norm_weight=None, rope_kv=None, scale=None):
        p, m = self.plan, self.rows
        assert (norm_weight is not None) == p.norm and weight.shape == (p.n_rows, p.k)
        assert (scale is not None) == p.fp8 == (weight.dtype == torch.float8_e4m3fn), (p.fp8, weight.dtype)
        assert (rope_kv is not None) == (p.rope is not None)
        assert x.shape == (m, p.k) and out.shape[0] == m, (x.shape, out.shape, m)
        for r in range(m):
            out[r] = self._row(r, x, weight, extra, norm_weight, rope_kv, out.dtype, scale).reshape(out[r].shape)
        self.calls += 1
        self.compile_seconds = 0.5
        return out

    def _row(self, r, x, weight, extra, norm_weight, rope_kv, dtype, scale):
        p = self.plan
        if p.rope is not None:  # the model's dtype (fp32 here), not the kernel's bf16
            assert rope_kv.positions.shape == rope_kv.slot_mapping.shape == (self.rows,)
            row_kv = dataclasses.replace(rope_kv, positions=rope_kv.positions[r : r + 1],
                                         slot_mapping=rope_kv.slot_mapping[r : r + 1])
            return rope_kv_reference(x[r : r + 1], weight, extra, p.rope, row_kv, norm_weight, p.eps, dtype=dtype,
                                     scale=scale)
        if p.epilogue == "residual":
            assert extra.shape == (self.rows, p.n_rows)
            extra = extra[r]
        return gemv_reference(x[r : r + 1], weight, p.epilogue, extra, norm_weight, p.eps, scale=scale)


@pytest.fixture
def all_kernel_rows(monkeypatch):
    """The fused path serving every row count its kernel takes (SERVED_ROWS, the measured
    choice, raised to MAX_ROWS): the wiring of steps of 5-16 rows."""
    monkeypatch.setattr(fused_decode, "SERVED_ROWS", fused_decode.MAX_ROWS)


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setattr(fused_decode, "CuteGemv", ReferenceGemv)
    monkeypatch.setattr(fused_decode, "cute_available", lambda: (True, ""))
    monkeypatch.setattr(fused_decode, "check_fused_decode", lambda model, device, kv_pool=None: None)


def perturb_norms(engine) -> None:
    """Norm weights away from the checkpoint's ones (the same in every engine), so a norm
    applied in the wrong place, or not at all, changes the tokens."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def generate(model_dir, fused, prompts, n=12, rope=False, attn=None, config=None, **params):
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=1,
                                 fused_decode=fused, **(config or {})),
                    FusedParts(rope=rope, attn=attn))
    perturb_norms(engine)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **params))
           for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    engine.check_integrity()
    return [done[i] for i in ids], engine


PROMPTS = [[3, 5, 7, 9, 11] * 4, [2, 4, 6], [8] * 17]


@pytest.mark.parametrize("params", [{}, {"logprobs": 1}], ids=["argmax", "logits"])
def test_fused_wiring_gives_the_model_tokens(tiny_model, reference_kernels, params):
    want, _ = generate(tiny_model, False, PROMPTS, **params)
    got, engine = generate(tiny_model, True, PROMPTS, **params)
    assert got == want
    fused = engine.runner.fused.gemvs[1]
    decode_steps = sum(12 - 1 for _ in PROMPTS)
    layers = len(engine.model.layers)
    assert fused.qkv.calls == fused.down.calls == layers * decode_steps
    # greedy: every decode step's token from the argmax epilogue; logprobs: from the logits
    assert (fused.lm_argmax.calls, fused.lm_head.calls) == (
        (decode_steps, 0) if not params else (0, decode_steps))


@pytest.mark.parametrize("params", [{}, {"logprobs": 1}], ids=["argmax", "logits"])
def test_wide_lm_head_runs_the_norm_and_a_matmul(tiny_model, reference_kernels, monkeypatch, params):
    """An LM head too wide for the norm-folded GEMV (`wide_head`: here MAX_NORM_CHUNKS lowered
    below the tiny model's chunks) runs the final norm, one matmul and an argmax, the rest fused:
    the model's tokens, in greedy and logits steps alike, and no head GEMV is built."""
    monkeypatch.setattr(fused_decode, "MAX_NORM_CHUNKS", 0)
    want, _ = generate(tiny_model, False, PROMPTS, **params)
    matmuls = []
    real = fused_decode.FusedDecode._wide_head
    monkeypatch.setattr(fused_decode.FusedDecode, "_wide_head", lambda *a: matmuls.append(1) or real(*a))
    got, engine = generate(tiny_model, True, PROMPTS, **params)
    assert got == want
    gemvs = engine.runner.fused.gemvs[1]
    assert gemvs.lm_head is None and gemvs.lm_argmax is None
    assert len(matmuls) == sum(12 - 1 for _ in PROMPTS) and gemvs.qkv.calls > 0


def test_a_bf16_shape_on_one_row_tensor_cores_is_wired_and_taken_by_auto(tiny_model, bf16_model, reference_kernels,
                                                                        monkeypatch):
    """A bf16 shape in BF16_ONE_ROW_MMA_SHAPES: its one-row GEMVs are planned on the tensor cores
    (its M-row ones are already), the tokens stay the model's, the path serves up to
    SERVED_ROWS_BF16_LARGE rows there, and auto no longer declines it for its norm-folded chunks
    (MAX_NORM_CHUNKS lowered here below the tiny model's)."""
    want, _ = generate(tiny_model, False, PROMPTS)
    model = Engine(EngineConfig(model=str(tiny_model), device="cpu", max_num_seqs=1)).model
    shape = (model.config.hidden_size, model.layers[0].down_proj.weight.shape[1])
    monkeypatch.setattr(fused_decode, "BF16_ONE_ROW_MMA_SHAPES", {shape})
    got, engine = generate(tiny_model, True, PROMPTS)
    assert got == want
    gemvs = engine.runner.fused.gemvs[1]
    assert all(g.plan.mma for g in (gemvs.qkv, gemvs.o, gemvs.gate_up, gemvs.down))
    assert not gemvs.lm_argmax.plan.mma  # the head keeps its own plan
    # Its steps of more rows than SERVED_ROWS_BF16_LARGE run per-op (cuBLAS beat the 16-row GEMVs)
    many = Engine(EngineConfig(model=str(tiny_model), device="cpu", max_num_seqs=16, fused_decode=True))
    assert many.runner.fused.row_counts == [1, 2, 4] == [r for r in [1, 2, 4, 8, 16]
                                                         if r <= fused_decode.SERVED_ROWS_BF16_LARGE]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_decode, "MAX_NORM_CHUNKS", 0)
    bf16_shape = (bf16_model.config.hidden_size, bf16_model.layers[0].down_proj.weight.shape[1])
    monkeypatch.setattr(fused_decode, "BF16_ONE_ROW_MMA_SHAPES", set())
    assert "chunks" in fused_decode.auto_declines(bf16_model, torch.device("cuda"), use_graphs=True)
    # Declined by auto, the wide shape still runs its one row on the tensor cores when forced on
    # (the CUDA-core form collapses past MAX_NORM_CHUNKS)
    assert fused_decode.bf16_one_row_tensor_cores(bf16_model)
    monkeypatch.setattr(fused_decode, "MAX_NORM_CHUNKS", 10**6)
    assert not fused_decode.bf16_one_row_tensor_cores(bf16_model)
    monkeypatch.setattr(fused_decode, "MAX_NORM_CHUNKS", 0)
    monkeypatch.setattr(fused_decode, "BF16_ONE_ROW_MMA_SHAPES", {bf16_shape})
    assert fused_decode.auto_declines(bf16_model, torch.device("cuda"), use_graphs=True) is None


@pytest.mark.parametrize("params", [{}, {"logprobs": 1}], ids=["argmax", "logits"])
def test_rope_epilogue_wiring_gives_the_model_tokens(tiny_model, reference_kernels, monkeypatch, params):
    """FusedParts.rope: RoPE and the K/V write happen in the QKV GEMV's epilogue (here its
    reference), the backend only attends; the pool's RoPE kernel never runs on a fused step."""
    want, _ = generate(tiny_model, False, PROMPTS, **params)
    write_rope_calls = []
    real = fused_decode.FusedDecode._qkv_attend
    monkeypatch.setattr(fused_decode.FusedDecode, "_qkv_attend",
                        lambda *a: write_rope_calls.append(1) or real(*a))
    got, engine = generate(tiny_model, True, PROMPTS, rope=True, **params)
    assert got == want
    fused = engine.runner.fused
    assert fused.rope is not None and fused.gemvs[1].qkv.plan.epilogue.endswith("rope_kv")
    assert fused.gemvs[1].qkv.calls == len(engine.model.layers) * sum(12 - 1 for _ in PROMPTS)
    assert not write_rope_calls


# Tokens a prompt in the interpreted one-launch test: 6 take the 20- and 17-token prompts past
# the 16-token splits from the first decode step (so the merge runs), at ~55% of 10's cost.
ONE_LAUNCH_TOKENS = 6


def small_one_launch_splits(monkeypatch) -> dict:
    """The triton backend's decode splits made 16 tokens (PROMPTS then take several, so the
    one-launch attention's last program merges) -> the engine config that asks for that backend."""
    from flashlet.attention import triton_backend
    from flashlet.kernels import tuning

    monkeypatch.setattr(tuning, "default_decode", lambda *a: tuning.DecodeConfig(block_n=16, min_split_tokens=16))
    monkeypatch.setattr(triton_backend, "ONE_LAUNCH_MIN_SPLIT_TOKENS", 16)
    return {"backend": "triton"}


def count_rope_forms(monkeypatch) -> dict:
    """Counts, from now on: the one-launch attention's launches with rope_in ("rope_in") and
    without ("plain"), and the pool's RoPE + K/V writes inside a fused step ("fused_pool_rope")."""
    from flashlet.attention import triton_backend

    calls = {"rope_in": 0, "plain": 0, "fused_pool_rope": 0}
    inside = [False]
    real_one, real_write, real_hidden = (triton_backend.decode_attention_one_launch, KVPool.write_rope,
                                         fused_decode.FusedDecode.hidden)

    def one(*a, **k):
        calls["rope_in" if k.get("rope_in") is not None else "plain"] += 1
        return real_one(*a, **k)

    def write_rope(pool, *a, **k):
        calls["fused_pool_rope"] += inside[0]
        return real_write(pool, *a, **k)

    def hidden(self, *a, **k):
        inside[0] = True
        try:
            return real_hidden(self, *a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(triton_backend, "decode_attention_one_launch", one)
    monkeypatch.setattr(KVPool, "write_rope", write_rope)
    monkeypatch.setattr(fused_decode.FusedDecode, "hidden", hidden)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("model,rope", [("tiny_qwen2", True), ("tiny_llama", False)],
                         ids=["qwen2-rope-epilogue", "llama-rope-kernel"])
def test_one_launch_attention_wiring_gives_the_model_tokens(model, rope, reference_kernels, monkeypatch, request):
    """FusedParts.attn: on the triton backend (interpreted, ~20 s), every fused step's
    attention is one `attend_one_launch` a layer and never the two-launch kernels; splits made
    small (16 tokens) so the last-program merge runs; tokens are the per-op engine's (same backend)."""
    tiny_model = request.getfixturevalue(model)
    from flashlet.attention import triton_backend

    triton = small_one_launch_splits(monkeypatch)
    want, _ = generate(tiny_model, False, PROMPTS, n=ONE_LAUNCH_TOKENS, config=triton)
    calls = {"one": 0, "merged": 0, "two": 0}
    real_one, real_two = triton_backend.decode_attention_one_launch, triton_backend.decode_attention

    def one(*a, **k):
        calls["one"] += 1
        calls["merged"] += k["num_splits"] > 1 and int(a[5].max()) > 16  # several splits used
        return real_one(*a, **k)

    monkeypatch.setattr(triton_backend, "decode_attention_one_launch", one)
    monkeypatch.setattr(triton_backend, "decode_attention",
                        lambda *a, **k: calls.__setitem__("two", calls["two"] + 1) or real_two(*a, **k))
    got, engine = generate(tiny_model, True, PROMPTS, n=ONE_LAUNCH_TOKENS, rope=rope, attn=True,
                           config=triton)
    assert got == want
    assert engine.runner.fused.one_launch_attention
    assert calls["one"] == len(engine.model.layers) * sum(ONE_LAUNCH_TOKENS - 1 for _ in PROMPTS)
    assert calls["merged"] > 0 and calls["two"] == 0  # prefill runs prefill_attention
    assert not engine.runner.backend._merge_counts.any()


@pytest.mark.slow
def test_one_launch_attention_is_the_fused_paths_own_whatever_the_backend(tiny_qwen2, reference_kernels,
                                                                          monkeypatch):
    """With a step backend that has no one-launch attention (torch here, FlashInfer on a GPU)
    the fused path attends through a triton backend of its own over the same pool (interpreted,
    ~20 s): fused steps plan and run it, every other step the step backend; tokens are the
    per-op engine's on the step backend."""
    from flashlet.attention import triton_backend

    torch_backend = {"backend": "torch"}
    want, _ = generate(tiny_qwen2, False, PROMPTS[:2], n=6, config=torch_backend)
    calls = []
    real = triton_backend.decode_attention_one_launch
    monkeypatch.setattr(triton_backend, "decode_attention_one_launch",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    got, engine = generate(tiny_qwen2, True, PROMPTS[:2], n=6, attn=True, config=torch_backend)
    assert got == want
    runner = engine.runner
    assert runner.backend.name == "torch" and runner.fused_attention.name == "triton"
    assert runner.fused.one_launch_attention
    assert len(calls) == len(engine.model.layers) * 2 * (6 - 1)
    assert not runner.fused_attention._merge_counts.any()


@pytest.mark.slow
def test_fused_graphs_attend_through_the_fused_attention_behind_another_backend(tiny_qwen2,
                                                                                reference_kernels):
    """The graph path (graphs stood in for by eager replays) behind the torch step backend, its
    one-launch attention the fused path's own triton backend (interpreted, ~20 s): one- and
    two-row steps plan and key their graphs by it (never by the step backend, whose graph key
    is a page table width); tokens are the per-op engine's."""
    from tests.test_step_layout import graphs_on_the_cpu

    prompts = [[3, 5, 7, 9, 11] * 3, [2, 4, 6]]
    outs = []
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=2, backend="torch",
                                     max_num_batched_tokens=32, fused_decode=fused),
                        FusedParts(attn=True if fused else None))
        perturb_norms(engine)
        graphs_on_the_cpu(engine)
        params = [SamplingParams(max_new_tokens=4 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
        outs.append([o.token_ids for o in run_to_completion(engine, prompts, params)])
    assert outs[0] == outs[1]
    runner = engine.runner
    assert runner.fused_attention.name == "triton" and runner.backend.name == "torch"
    keys = set(runner.graphs)
    assert {(1, "tokens"), (2, "tokens")} <= keys  # the fused attention's key adds nothing
    assert all(len(key) == 2 for key in keys)
    assert not runner.fused_attention._merge_counts.any()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"], ids=["rope-epilogue", "rope-in-attention"])
def test_a_long_context_entry_takes_long_steps_into_graphs_of_their_own(tiny_qwen2, reference_kernels,
                                                                          monkeypatch, tmp_path, family):
    """tuning.ONE_LAUNCH_LONG_TABLE (here for one row, from 24 tokens; interpreted, ~15 s): the
    warm-up captures each one-row fused graph twice (short and long), a step whose longest row
    is past the threshold replays the long one, whose attention runs the long entry's variant
    (Qwen3: with the rows made in the kernel, `rope_in`, and the merge in two levels), and the
    tokens are the per-op engine's;
    two-row steps (no entry) keep one graph."""
    from flashlet.attention import triton_backend
    from flashlet.core import warmup
    from flashlet.kernels import tuning
    from tests.test_model_families import save_family
    from tests.test_step_layout import graphs_on_the_cpu

    model = tiny_qwen2 if family == "qwen2" else save_family("qwen3", tmp_path / "q3")
    triton = small_one_launch_splits(monkeypatch)
    monkeypatch.setattr(fused_decode, "ROPE_IN_ATTENTION", "1")
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_CONTEXT", 24)  # short steps still split in 2
    long_entry = tuning.OneLaunchConfig(block_n=16, num_warps=2, num_stages=2, min_split_tokens=16, num_splits=4,
                                        prefetch_pages=True, merge_group=2 if family == "qwen3" else 0)
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    key = (head_dim, cfg["num_attention_heads"] // cfg["num_key_value_heads"], 1)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {key: long_entry})
    prompts = [[3, 5, 7, 9, 11] * 4, [2, 4, 6]]  # 20 tokens: its decode crosses 24, then 24 + 16
    params = [SamplingParams(max_new_tokens=22 - 16 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = []
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(model), device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
                                     max_num_pages=32, fused_decode=fused, **triton),
                        FusedParts(attn=True if fused else None))
        perturb_norms(engine)
        graphs_on_the_cpu(engine)
        if fused:
            engine.runner.use_mixed_graphs = False
            warmup.warm_up(engine)
            assert {(1, "tokens"), (1, "tokens", "long"), (1, "logits", "long"), (2, "tokens")} <= set(engine.runner.graphs)
            assert not any(key[:1] == (2,) and "long" in key for key in engine.runner.graphs)
            seen = []
            real = triton_backend.decode_attention_one_launch
            monkeypatch.setattr(triton_backend, "decode_attention_one_launch",
                                lambda *a, **k: seen.append((a[0].shape[0], int(a[5].max()), k["prefetch_pages"]))
                                or real(*a, **k))
        outs.append([o.token_ids for o in run_to_completion(engine, prompts, params)])
    assert outs[0] == outs[1]
    # Short steps and two-row steps run the short config; a steady step past the threshold keeps
    # the graph it replays until its next load (at the latest a page start, 16 tokens on).
    assert not any(p for rows, n, p in seen if n < 24 or rows > 1)
    assert all(p for rows, n, p in seen if rows == 1 and n >= 24 + 16) and any(n >= 24 + 16 for _, n, _ in seen)
    assert not engine.runner.fused_attention._merge_counts.any()


def test_fused_logits_match_the_model(tiny_qwen2, reference_kernels):
    """Every step's logits (an observer makes the fused path write them) against the per-op
    model's, in fp32: the same sums in another order."""
    rows = {False: [], True: []}
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1,
                                     fused_decode=fused))
        perturb_norms(engine)
        engine.observe_steps(lambda meta, logits, fused=fused: rows[fused].append(logits.clone()))
        engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert engine.runner.fused.gemvs[1].lm_head.calls == 5 and len(rows[True]) == 6
    for want, got in zip(rows[False], rows[True]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fused_decode_refuses_what_it_cannot_run(tiny_qwen2):
    with pytest.raises(ValueError, match="CUDA only.*bf16 only"):
        Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", fused_decode=True))


def test_fused_parts_need_the_fused_path(tiny_qwen2):
    off = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1, fused_decode=False)
    for part in ("pdl", "rope", "attn"):
        with pytest.raises(ValueError, match=rf"fused parts \['{part}'\] apply to the fused decode path"):
            Engine(off, FusedParts(**{part: True}))
        assert Engine(off, FusedParts(**{part: False})).runner.fused is None  # off and off: fine


def test_fused_decode_rope_refuses_what_its_epilogue_cannot_do(tiny_qwen2):
    """Qwen3's per-head q / k norm sits between the projection and RoPE; a bf16 table would
    change the numerics: both are refused by name (with the device and dtype reasons)."""
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1))
    model, pool = engine.model, engine.runner.kv_pool
    model.layers[0].q_norm = torch.ones(model.layers[0].head_dim)
    model.cos_sin_cache = model.cos_sin_cache.to(torch.bfloat16)
    with pytest.raises(ValueError, match="normalised.*cos [|] sin table must be fp32"):
        fused_decode.check_fused_decode(model, torch.device("cpu"), pool)
    with pytest.raises(ValueError) as plain:  # without the pool: no rope reasons
        fused_decode.check_fused_decode(model, torch.device("cpu"))
    assert "RoPE in the QKV epilogue" not in str(plain.value)


def test_a_long_down_projection_runs_on_cublas_inside_the_fused_step(tiny_model, reference_kernels,
                                                                      monkeypatch):
    """Past MAX_DOWN_K (Qwen2.5-7B / 14B's 18,944) the down projection is one GEMM into the
    residual stream (cuBLAS on a GPU), the rest of the layer stays fused; tokens are the per-op
    engine's. The shape no longer refuses the path."""
    monkeypatch.setattr(fused_decode, "MAX_DOWN_K", 64)  # the tiny models' 128 is "long"
    want, _ = generate(tiny_model, False, PROMPTS)
    addmm_calls = []
    real = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda *a, **k: addmm_calls.append(1) or real(*a, **k))
    got, engine = generate(tiny_model, True, PROMPTS)
    assert got == want
    fused = engine.runner.fused.gemvs[1]
    assert fused.down is None and fused.qkv.calls == fused.gate_up.calls == len(addmm_calls) > 0
    assert not any("intermediate_size" in why for why in fused_decode.refusals(engine.model, torch.device("cuda")))


def test_fused_decode_needs_one_gpu():
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(fused_decode=True, tensor_parallel_size=2)


def test_fused_decode_flags_parse_on_off_and_absent():
    """--fused-decode / --no-fused-decode force it on / off; absent leaves it to auto (None),
    and the help says what auto does. Its parts are no user setting: no flag names them."""
    # One line per flag: argparse wraps help at hyphens, which would split the flag names.
    parser = argparse.ArgumentParser(
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=10_000))
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args(["--fused-decode"]).fused_decode is True
    assert parser.parse_args(["--no-fused-decode"]).fused_decode is False
    assert parser.parse_args([]).fused_decode is None
    for part in ("pdl", "rope", "attn"):
        assert f"--fused-decode-{part}" not in parser.format_help()
    assert EngineConfig.from_cli(parser.parse_args([])).fused_decode is None
    assert EngineConfig.from_cli(parser.parse_args(["--no-fused-decode"])).fused_decode is False
    text = " ".join(parser.format_help().split())
    for condition in ("default auto", "CUDA sm_90+", "bf16", "whatever --backend", "one GPU",
                      "nvidia-cutlass-dsl==4.8.1", "--no-fused-decode turns it off"):
        assert condition in text, condition


def test_fused_graph_path_on_the_cpu(tiny_qwen2, reference_kernels):
    """The runner's graph path with the fused body (graphs stood in for by eager replays, as in
    test_step_layout): one- and two-row steps replay the fused greedy-token graphs of their
    size, and the tokens are the per-op engine's."""
    from tests.test_step_layout import graphs_on_the_cpu

    prompts = [[3, 5, 7, 9, 11] * 3, [2, 4, 6], [8] * 9]
    outs = []
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=2,
                                     max_num_batched_tokens=32, fused_decode=fused))
        perturb_norms(engine)
        graphs_on_the_cpu(engine)
        params = [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
        outs.append([o.token_ids for o in run_to_completion(engine, prompts, params)])
    assert outs[0] == outs[1]
    keys = {key[:2] for key in engine.runner.graphs}
    assert (1, "tokens") in keys and (2, "tokens") in keys  # the last prompt decodes alone
    assert all(engine.runner.fused.gemvs[m].lm_argmax.calls > 0 for m in (1, 2))


# ---- auto: on by default where it applies (EngineConfig.fused_decode None) -----------------
def test_auto_is_off_on_the_cpu_and_logs_why(tiny_qwen2, caplog):
    """The default asks nothing: on the CPU the engine runs per-op, raises nothing, logs one
    line saying which condition failed, and engine.config says what runs (all off)."""
    with caplog.at_level("INFO", logger="flashlet"):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1))
    assert engine.runner.fused is None
    assert engine.config.fused_decode is False
    lines = [r.getMessage() for r in caplog.records if "fused decode path" in r.getMessage()]
    assert lines == ["fused decode path: off (auto: the device is cpu, not CUDA)"]


@pytest.fixture(scope="module")
def bf16_model(tiny_qwen2):
    """A tiny model in bf16 (built on the CPU; auto_declines is given a CUDA device)."""
    return Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", dtype="bfloat16",
                               max_num_seqs=1)).model


# Each condition of auto, broken alone -> a piece of the reason it gives.
AUTO_CONDITIONS = {
    "cpu": "the device is cpu, not CUDA",
    "sm80": "the GPU is sm_80; its PDL launches need sm_90 or newer",
    "fp32": "the dtype is float32; its kernels are bf16 only",
    "tensor-parallel": "tensor parallelism is on",
    "no-graphs": "CUDA graphs are off",
    "shape": "hidden_size = 64 is not a multiple of 128",
    "norm-chunks": "hidden_size = 64 gives its norm-folded one-row GEMVs 1 16-byte chunks a lane",
    "no-dsl": "pip install nvidia-cutlass-dsl",
}


@pytest.mark.parametrize("broken", [None, *AUTO_CONDITIONS])
def test_auto_turns_on_exactly_when_every_condition_holds(bf16_model, tiny_qwen2, monkeypatch, broken):
    """Stand-ins for the GPU (its compute capability) and the CuTe DSL (importable or not):
    with all conditions holding auto says yes; with any one broken it says no, naming it."""
    model = bf16_model
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (8, 0) if broken == "sm80" else (9, 0))
    monkeypatch.setattr(fused_decode, "cute_available",
                        lambda: (False, "the CuTe DSL is not importable: pip install nvidia-cutlass-dsl==4.8.1")
                        if broken == "no-dsl" else (True, ""))
    if broken == "fp32":
        model = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1)).model
    if broken == "tensor-parallel":
        monkeypatch.setattr(model, "tp", object())
    if broken == "shape":
        monkeypatch.setattr(fused_decode, "VEC", 128)
    if broken == "norm-chunks":
        monkeypatch.setattr(fused_decode, "MAX_NORM_CHUNKS", 0)
    device = torch.device("cpu" if broken == "cpu" else "cuda")
    pool = KVPool(1, 1, 16, 1, 16, torch.bfloat16, "cpu")
    why = fused_decode.auto_declines(model, device, use_graphs=broken != "no-graphs", kv_pool=pool)
    if broken is None:
        assert why is None
    else:
        assert why is not None and AUTO_CONDITIONS[broken] in why, why


def test_auto_takes_fp8_weights_as_it_takes_bf16(bf16_model, monkeypatch):
    """fp8 weights are no condition of auto (their fused GEMVs were measured faster than per-op
    and hold to its tokens on the GPU): with everything else holding, auto says yes."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_decode, "cute_available", lambda: (True, ""))
    monkeypatch.setattr(fused_decode, "is_quantized", lambda m: True)
    assert fused_decode.auto_declines(bf16_model, torch.device("cuda"), use_graphs=True) is None


def test_auto_takes_an_fp8_kv_cache_as_it_takes_bf16(bf16_model, monkeypatch):
    """An fp8 KV cache is no condition of auto (the fused path over it was measured faster than
    per-op and holds to its tokens on the GPU): RoPE + the K/V write leave the QKV epilogue."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_decode, "cute_available", lambda: (True, ""))
    pool = KVPool(1, 1, 16, 1, 16, torch.bfloat16, "cpu", cache_dtype=torch.float8_e4m3fn)
    assert pool.is_fp8
    assert fused_decode.auto_declines(bf16_model, torch.device("cuda"), use_graphs=True, kv_pool=pool) is None
    assert any("the pool must be bf16" in why for why in fused_decode.rope_refusals(bf16_model, pool))


def test_auto_on_builds_the_path_with_each_sub_flag_where_it_applies(tiny_qwen2, reference_kernels,
                                                                     monkeypatch, caplog):
    """Where auto says yes the runner builds the path, engine.config reports it, and the tokens
    are the per-op engine's. Parts not named follow where they apply (on the CPU: no PDL;
    the fp32 pool keeps RoPE out of the QKV epilogue; the torch backend has no one-launch
    attention); given by name they hold."""
    monkeypatch.setattr(fused_decode, "auto_declines", lambda *a: None)
    want, _ = generate(tiny_qwen2, False, PROMPTS)
    with caplog.at_level("INFO", logger="flashlet"):
        got, engine = generate(tiny_qwen2, None, PROMPTS, rope=None)
    assert got == want
    assert engine.runner.fused is not None and engine.runner.fused.gemvs[1].lm_argmax.calls > 0
    assert engine.config.fused_decode is True
    assert engine.runner.fused.parts == FusedParts(pdl=False, rope=False, attn=False)
    assert "fused decode path: on (auto), PDL off, RoPE in QKV off, one-launch attention off" in caplog.text
    got, engine = generate(tiny_qwen2, None, PROMPTS, rope=True)  # by name: on (reference epilogue)
    assert got == want and engine.runner.fused.parts.rope and engine.runner.fused.rope is not None
    triton = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", backend="triton", max_num_seqs=1))
    assert triton.runner.fused.one_launch_attention and triton.runner.fused.parts.attn
    plain = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", backend="triton", max_num_seqs=1),
                   FusedParts(attn=False))
    assert not plain.runner.fused.one_launch_attention and not plain.runner.fused.parts.attn


def test_auto_off_where_asked_off_and_explicit_on_still_refuses(tiny_qwen2, monkeypatch):
    """fused_decode=False never builds the path, even where auto would; True raises the old,
    named errors where a condition fails (auto would run per-op there)."""
    monkeypatch.setattr(fused_decode, "auto_declines", lambda *a: None)
    monkeypatch.setattr(fused_decode, "FusedDecode", None)  # building it would fail loudly
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1, fused_decode=False))
    assert engine.runner.fused is None and engine.config.fused_decode is False
    monkeypatch.undo()
    monkeypatch.setattr(fused_decode, "check_fused_decode", lambda model, device, kv_pool=None: None)
    monkeypatch.setattr(fused_decode, "cute_available", lambda: (False, "no DSL here"))
    with pytest.raises(fused_decode.CuteUnavailable, match="fused_decode needs the CuTe DSL: no DSL here"):
        Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1, fused_decode=True))
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1))  # auto
    assert engine.runner.fused is None


def test_qwen3_per_head_norms_on_the_fused_path(tmp_path, reference_kernels):
    """Qwen3 (per-head q / k RMSNorm between the projection and RoPE), which auto now serves:
    the heads normalised in the pool's RoPE + K/V write step (`QKNorm`, one kernel on CUDA),
    RoPE left out of the QKV epilogue by default; tokens are the per-op engine's."""
    from tests.test_model_families import save_family

    folder = save_family("qwen3", tmp_path / "q3")
    want, _ = generate(folder, False, PROMPTS)
    got, engine = generate(folder, True, PROMPTS, rope=None)
    assert got == want
    assert engine.runner.fused.rope is None and not engine.runner.fused.parts.rope
    assert engine.runner.fused.gemvs[1].lm_argmax.calls > 0


@pytest.mark.slow
def test_qwen3_rope_in_the_one_row_attention_gives_the_model_tokens(tmp_path, reference_kernels, monkeypatch):
    """fused_decode.ROPE_IN_ATTENTION ($FLASHLET_ROPE_IN_ATTENTION=1): Qwen3's one-row fused
    steps attend with `rope_in` (the triton backend, interpreted): its per-head norms, RoPE and
    the newest K/V row's write inside the attention kernel, the pool's RoPE + K/V write never
    called by a decode step; splits made small (16 tokens) so the newest row sits past the first
    split and the merge runs; tokens are the per-op engine's."""
    from tests.test_model_families import save_family

    folder = save_family("qwen3", tmp_path / "q3")
    triton = small_one_launch_splits(monkeypatch)
    want, _ = generate(folder, False, PROMPTS, n=ONE_LAUNCH_TOKENS, config=triton)
    calls = count_rope_forms(monkeypatch)
    monkeypatch.setattr(fused_decode, "ROPE_IN_ATTENTION", "1")
    got, engine = generate(folder, True, PROMPTS, n=ONE_LAUNCH_TOKENS, rope=None, attn=True, config=triton)
    assert got == want
    assert engine.runner.fused.rope_in_attention and engine.runner.fused.rope is None
    decode_steps = sum(ONE_LAUNCH_TOKENS - 1 for _ in PROMPTS)
    assert calls == {"rope_in": len(engine.model.layers) * decode_steps, "plain": 0, "fused_pool_rope": 0}
    assert not engine.runner.fused_attention._merge_counts.any()


# ---- several rows: decode steps of several sequences, verify steps as decode rows -----------
def row_prompts(count: int) -> list[list[int]]:
    """Prompts of 3 to 3 + 2 (count - 1) tokens, each its own."""
    return [[(7 * i + 3 * p + 1) % 200 + 2 for i in range(3 + 2 * p)] for p in range(count)]


def count_per_op_forwards(engine) -> list:
    """Records, for each per-op forward, whether its step was pure decode and whether it
    verified proposals with no prefill chunk beside them (every query token sampled)."""
    seen, model = [], engine.model
    real = model.forward

    def forward(input_ids, positions, attn):
        host = attn.meta.host
        seen.append((host.is_pure_decode, not host.is_pure_decode and host.num_sampled == host.num_tokens))
        return real(input_ids, positions, attn)

    model.forward = forward
    return seen


def run_engine(model_dir, fused, prompts, params, max_num_seqs, spec=None, **config):
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=max_num_seqs,
                                 fused_decode=fused, speculative_config=spec, **config))
    perturb_norms(engine)
    per_op = count_per_op_forwards(engine)
    outs = run_to_completion(engine, prompts, params)
    engine.check_integrity()
    return outs, engine, per_op


@pytest.mark.parametrize("batch", [1, 2, 7, 16])
def test_decode_steps_of_several_rows_run_fused_with_the_model_tokens(tiny_qwen2, reference_kernels,
                                                                     all_kernel_rows, batch):
    """`batch` requests decode together, finishing at different steps, the fused path serving
    up to the kernel's 16 rows (SERVED_ROWS raised to MAX_ROWS, as it will be once 16 fused rows
    are faster): every pure-decode step of n rows runs fused (never the per-op forward), padded
    to the next row count (the decode graph sizes: 1, 2, 4, ..., max_num_seqs), the tokens from
    the argmax epilogue; tokens are the per-op engine's and the padding rows leave the pool as
    it was (integrity)."""
    from flashlet.runner.model_runner import graph_batch_sizes

    prompts = row_prompts(batch)
    params = [SamplingParams(max_new_tokens=3 + i % 4, ignore_eos=True) for i in range(batch)]
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, batch)
    got, engine, per_op = run_engine(tiny_qwen2, True, prompts, params, batch)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    fused = engine.runner.fused
    assert fused.row_counts == graph_batch_sizes(batch) and fused.max_rows == batch
    assert fused.gemvs[batch].lm_argmax.calls > 0  # a step of every row
    assert not any(decode for decode, _ in per_op)
    assert sum(g.lm_head.calls for g in fused.gemvs.values()) == 0
    used = [g for gemvs in fused.gemvs.values() for g in gemvs.all() if g.calls]
    assert fused.compiled() == (len(used), 0.5 * len(used), 0)  # what the warm-up reports


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_several_rows_of_other_families(tmp_path, reference_kernels, all_kernel_rows, family):
    """Qwen3 (per-head q / k norms in the pool's RoPE + K/V write over all rows) and Llama (no
    QKV bias, its own LM head): 5 rows padded to 8, tokens the per-op engine's."""
    from tests.test_model_families import save_family

    folder = save_family(family, tmp_path / family)
    prompts = row_prompts(5)
    params = [SamplingParams(max_new_tokens=3 + i % 3, ignore_eos=True) for i in range(5)]
    want, _, _ = run_engine(folder, False, prompts, params, 8)
    got, engine, per_op = run_engine(folder, True, prompts, params, 8)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.runner.fused.gemvs[8].lm_argmax.calls > 0 and not any(d for d, _ in per_op)


def test_a_step_of_greedy_and_sampled_rows_samples_from_the_fused_logits(tiny_qwen2, reference_kernels):
    """Greedy, seeded top-p, logprobs and min_p rows in one step: the fused path writes logits
    for all (no argmax), the sampler samples the sampled rows from them; tokens and logprobs
    are the per-op engine's."""
    prompts = row_prompts(4)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=1.0, min_p=0.05, seed=9)]
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 4)
    got, engine, per_op = run_engine(tiny_qwen2, True, prompts, params, 4)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for w, g in zip(want[2].logprobs, got[2].logprobs):
        assert w.token_id == g.token_id and w.logprob == pytest.approx(g.logprob, abs=1e-4)
    gemvs = engine.runner.fused.gemvs[4]
    assert gemvs.lm_head.calls > 0 and gemvs.lm_argmax.calls == 0
    assert not any(decode for decode, _ in per_op)


def test_past_the_served_rows_decode_runs_per_op(tiny_qwen2, reference_kernels, monkeypatch):
    """18 sequences (graph sizes 1, 2, 4, 8, 16, 18): the fused path serves the sizes up to
    SERVED_ROWS (set to 4 here, so most sizes lie past it), so steps of 5-18 rows replay the per-op
    graphs (the step backend's), steps of 4 or fewer the fused ones (graphs stood in for by
    eager replays); only the served sizes have GEMVs; tokens are the per-op engine's."""
    from tests.test_step_layout import graphs_on_the_cpu

    monkeypatch.setattr(fused_decode, "SERVED_ROWS", 4)
    prompts = [[(5 * i + p) % 200 + 2 for i in range(3)] for p in range(18)]
    params = [SamplingParams(max_new_tokens=2 + i // 3, ignore_eos=True) for i in range(18)]
    outs = []
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=18, fused_decode=fused))
        perturb_norms(engine)
        graphs_on_the_cpu(engine)
        outs.append([o.token_ids for o in run_to_completion(engine, prompts, params)])
    assert outs[0] == outs[1]
    fused, keys = engine.runner.fused, {key[:2] for key in engine.runner.graphs}
    assert fused_decode.SERVED_ROWS == 4 and fused.row_counts == [1, 2, 4]
    # plain greedy requests: every size replays a graph that ends in the tokens, the per-op
    # sizes' (the argmax of the per-op LM head's logits) and the fused ones'
    assert {(18, "tokens"), (16, "tokens"), (8, "tokens"), (4, "tokens")} <= keys
    assert not any(kind == "logits" for _, kind in keys) and fused.gemvs[4].lm_argmax.calls > 0
    assert sorted(fused.gemvs) == [1, 2, 4]


def test_a_gemv_of_one_row_keeps_the_path_at_one_row(tiny_qwen2, reference_kernels, monkeypatch):
    """A CuteGemv that takes no `rows` (a kernel of one row): the path serves one-row steps with
    it, and two-row steps run per-op; tokens are the per-op engine's."""
    class OneRowGemv(ReferenceGemv):
        def __init__(self, n_rows, k, epilogue="none", *, device="cuda", pdl=False, norm=False,
                     eps=1e-6, rope=None):
            super().__init__(n_rows, k, epilogue, norm=norm, eps=eps, rope=rope)

    monkeypatch.setattr(fused_decode, "CuteGemv", OneRowGemv)
    monkeypatch.setattr(fused_decode, "plan_gemv", lambda n_rows, k, epilogue="none", **kw: None)
    assert fused_decode.gemv_row_limit() == 1
    prompts, params = row_prompts(2), SamplingParams(max_new_tokens=5, ignore_eos=True)
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 2)
    got, engine, per_op = run_engine(tiny_qwen2, True, prompts, params, 2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.runner.fused.row_counts == [1] and any(decode for decode, _ in per_op)
    with pytest.raises(ValueError, match=r"row counts must be in 1..1"):
        fused_decode.FusedDecode(engine.model, torch.device("cpu"), row_counts=[1, 2])


def test_row_counts_the_kernel_cannot_plan_run_per_op(tiny_qwen2, reference_kernels, all_kernel_rows, monkeypatch, caplog):
    """A kernel whose plan refuses more than 4 rows for this shape (as the argmax does where K
    gives fewer lanes a row than M): the path keeps 1, 2, 4, logs why 8 is left out, and a
    step of 7 rows runs per-op; tokens are the per-op engine's."""
    class UpToFourRows(ReferenceGemv):
        def __init__(self, *args, rows=1, **kwargs):
            if rows > 4:
                raise ValueError(f"argmax with rows={rows} needs at least as many lanes a row")
            super().__init__(*args, rows=rows, **kwargs)

    monkeypatch.setattr(fused_decode, "CuteGemv", UpToFourRows)
    prompts, params = row_prompts(7), SamplingParams(max_new_tokens=4, ignore_eos=True)
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 8)
    with caplog.at_level("INFO", logger="flashlet"):
        got, engine, per_op = run_engine(tiny_qwen2, True, prompts, params, 8)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    fused = engine.runner.fused
    assert fused.row_counts == [1, 2, 4] and list(fused.declined_rows) == [8]
    assert "no GEMVs of 8 rows for this shape (per-op there): argmax with rows=8" in caplog.text
    assert any(decode for decode, _ in per_op)  # the 7-row steps


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_speculation_widens_the_fused_sizes_to_its_verify_tokens(tiny_qwen2, reference_kernels, caplog, monkeypatch):
    """One sequence with k = 2: verify steps of up to 3 tokens, so the fused row counts (and
    the decode graph sizes, the step buffers, the attention's batch) reach 3, and so do the
    sizes that end in greedy tokens (the warm-up's token graphs: a plain greedy verify step
    takes its argmax there, no graph is captured while serving); the log says what serves what. With
    the fused path off nothing widens. Past SERVED_ROWS (k = 4: 5 tokens) the buffers and graph
    sizes still widen, so a 5-token verify step fits them (a mixed graph, not an eager step),
    while the fused row counts stop at SERVED_ROWS (set to 4 here)."""
    import numpy as np

    from flashlet.runner.batch import InputBatch

    monkeypatch.setattr(fused_decode, "SERVED_ROWS", 4)

    spec = {**NGRAM, "num_speculative_tokens": 2}
    config = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1, fused_decode=True,
                          speculative_config=spec)
    with caplog.at_level("INFO", logger="flashlet"):
        runner = Engine(config).runner
    assert runner.fused.row_counts == runner.graph_sizes == [1, 2, 3]
    assert runner.greedy_token_sizes() == [1, 2, 3] and runner.buffers.max_seqs == 3
    assert "decode (1-3 rows): fused" in caplog.text and "decode (4+ rows)" in caplog.text
    assert "rows 1, 2, 3 (18 CuTe GEMVs)" in caplog.text
    off = Engine(config.replace(fused_decode=False)).runner
    assert off.fused is None and off.graph_sizes == [1] and off.buffers.max_seqs == 1
    wider = Engine(config.replace(speculative_config={**NGRAM, "num_speculative_tokens": 4})).runner
    assert wider.fused.row_counts == [1, 2, 4] == [1, 2, fused_decode.SERVED_ROWS]
    assert wider.graph_sizes == [1, 2, 4, 5] and wider.buffers.max_seqs == 5
    batch = InputBatch(1, 4, 4)
    batch.add(0, [1, 2])
    verify = batch.layout(np.arange(1), [3], [5] * 5, query_lens=[5], spec_lens=[4])
    wider.use_mixed_graphs = True  # as on CUDA
    assert fused_decode.verify_as_decode_rows(verify, 4, wider.fused.max_rows) is None
    assert wider.token_bucket(verify) == 16  # its sampled rows fit the buffers: a mixed graph


def test_a_five_token_verify_step_is_served_as_eight_fused_rows(tiny_qwen2, reference_kernels):
    """The default SERVED_ROWS (16): with two sequences and k = 4 the decode sizes are 1, 2, 4,
    8 and 10, all fused, and one sequence's verify step of 5 tokens loads as decode rows padded
    to 8 (a fused step, not the per-op forward)."""
    import numpy as np

    from flashlet.runner.batch import InputBatch
    from flashlet.runner.model_runner import _padded_decode_size

    config = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=2, fused_decode=True,
                          speculative_config={**NGRAM, "num_speculative_tokens": 4})
    runner = Engine(config).runner
    assert fused_decode.SERVED_ROWS == fused_decode.MAX_ROWS == 16
    assert runner.fused.row_counts == runner.graph_sizes == [1, 2, 4, 8, 10]
    batch = InputBatch(1, 4, 4)
    batch.add(0, [1, 2])
    verify = batch.layout(np.arange(1), [3], [5] * 5, query_lens=[5], spec_lens=[4])
    rows = fused_decode.verify_as_decode_rows(verify, 4, runner.fused.max_rows)
    assert rows is not None and rows.num_seqs == 5
    assert _padded_decode_size(rows, runner.fused.row_counts) == 8


def count_fused_verify_steps(monkeypatch) -> list:
    """Records the number of query tokens of each verify step loaded as decode rows."""
    expanded = []
    real = ModelRunner.load

    def counted(runner, layout, *args, **kwargs):
        input_ids, meta = real(runner, layout, *args, **kwargs)
        if meta.host.verify_as_decode_rows:
            expanded.append(meta.num_seqs - meta.num_padding)
        return input_ids, meta

    monkeypatch.setattr(ModelRunner, "load", counted)
    return expanded


def test_verify_steps_run_fused_and_greedy_output_is_speculation_offs(tiny_qwen2, reference_kernels, all_kernel_rows,
                                                                     monkeypatch):
    """ngram speculation on the fused path: every verify step (at most 2 x 4 tokens) runs as
    decode rows on the fused GEMVs, never the per-op forward, its greedy rows decided by the LM
    head's argmax epilogue (no logits, as without speculation), and the greedy tokens are those
    of the per-op engine without speculation."""
    from tests.test_speculative import repetitive_prompts

    prompts = repetitive_prompts(2, seed=3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 2)
    expanded = count_fused_verify_steps(monkeypatch)
    got, engine, per_op = run_engine(tiny_qwen2, True, prompts, params, 2, spec=NGRAM, page_size=4)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = engine.spec.stats
    assert stats.num_drafts > 0 and len(expanded) > 0 and max(expanded) > 2
    assert not any(decode or verifying for decode, verifying in per_op)  # steps with a chunk only
    fused = engine.runner.fused
    assert fused.row_counts == [1, 2, 4, 8]  # 2 sequences x (1 + 3) tokens
    assert sum(fused.gemvs[m].lm_argmax.calls for m in (4, 8)) > 0  # verify steps of 3+ tokens
    assert sum(g.lm_head.calls for g in fused.gemvs.values()) == 0


def test_sampled_verify_rows_take_the_fused_logits(tiny_qwen2, reference_kernels, all_kernel_rows, monkeypatch):
    """A verify step with a seeded sampled request beside a greedy one: the fused path writes
    logits for every query token and exact rejection sampling decides; the tokens are those of
    the per-op engine with speculation (the same logits, the same seeded draws)."""
    from tests.test_speculative import repetitive_prompts

    prompts = repetitive_prompts(2, seed=3)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.95, seed=11)]
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 2, spec=NGRAM, page_size=4)
    expanded = count_fused_verify_steps(monkeypatch)
    got, engine, _ = run_engine(tiny_qwen2, True, prompts, params, 2, spec=NGRAM, page_size=4)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    fused = engine.runner.fused
    assert expanded and sum(fused.gemvs[m].lm_head.calls for m in (4, 8)) > 0


def test_fused_verify_logits_are_the_per_op_verify_logits(tiny_qwen2, reference_kernels, all_kernel_rows, monkeypatch):
    """Every step's logits with speculation on (an observer's copy), fused against per-op: the
    same steps, the same rows (each verify row's 1 + k in order), equal to fp32 rounding."""
    from tests.test_speculative import repetitive_prompts

    prompts = repetitive_prompts(3, seed=1)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    rows = {}
    expanded = count_fused_verify_steps(monkeypatch)
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=3, page_size=4,
                                     fused_decode=fused, speculative_config=NGRAM))
        perturb_norms(engine)
        rows[fused] = []
        engine.observe_steps(lambda meta, logits, fused=fused: rows[fused].append(logits.clone()))
        run_to_completion(engine, prompts, params)
    assert len(expanded) > 0 and len(rows[True]) == len(rows[False])
    for want, got in zip(rows[False], rows[True]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class KeepsNothing:
    """The Proposer protocol's hooks for a test proposer that keeps no state and compiles nothing."""

    def on_accepted(self, request, num_accepted):
        pass

    def release(self, request):
        pass

    def warm_up(self):
        pass


class AlwaysGuess(KeepsNothing):
    """A proposer that always proposes k tokens (the request's last k, reversed): verify steps
    of 1 + k tokens a request every step, whatever the model accepts."""

    def propose(self, requests, k):
        return [(list(req.token_slice(0, req.num_tokens))[::-1] * k)[:k] for req in requests]


def test_verify_steps_past_the_row_limit_run_per_op(tiny_qwen2, reference_kernels, monkeypatch):
    """k = 7 with three sequences, the fused path serving up to 8 rows: a verify step of more
    than 8 tokens runs per-op (as does any step with a prefill chunk), one request's (once the
    others finished) fused; the greedy tokens are speculation off's."""
    monkeypatch.setattr(fused_decode, "SERVED_ROWS", 8)
    prompts = row_prompts(3)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 8, 4)]
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 3)
    expanded = count_fused_verify_steps(monkeypatch)
    monkeypatch.setattr(engine_module, "make_proposer", lambda config, engine: AlwaysGuess())
    spec = {**NGRAM, "num_speculative_tokens": 7}
    got, engine, per_op = run_engine(tiny_qwen2, True, prompts, params, 3, spec=spec, page_size=4)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(verifying for _, verifying in per_op)  # a verify-only step on the per-op path
    assert expanded and 2 < max(expanded) <= 8 == engine.runner.fused.max_rows


@pytest.mark.slow
def test_fused_verify_steps_through_the_one_launch_attention(tiny_qwen2, reference_kernels, all_kernel_rows, monkeypatch):
    """The verify rows as decode rows through the triton one-launch attention (interpreted,
    ~30 s) and RoPE + K/V write in the QKV epilogue (its reference): rows of one sequence at
    KV lengths L + 1 .. L + k + 1, each attending after every row's K/V is written; greedy
    tokens are the per-op engine's without speculation, the merge counters left at zero."""
    prompts, params = row_prompts(2), verify_params()
    triton = {"backend": "triton"}
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 2, **triton)
    expanded = count_fused_verify_steps(monkeypatch)
    engine = always_guessing_engine(tiny_qwen2, monkeypatch, FusedParts(rope=True, attn=True), **triton)
    got = run_to_completion(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert expanded and max(expanded) > 2 and engine.runner.fused.one_launch_attention
    assert not engine.runner.backend._merge_counts.any()


def verify_params() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (8, 5)]


def always_guessing_engine(model_dir, monkeypatch, parts: FusedParts, **config) -> Engine:
    """Two sequences, the fused path forced with `parts`, n-gram speculation whose proposer
    always guesses (AlwaysGuess): verify steps of several rows every step."""
    monkeypatch.setattr(engine_module, "make_proposer", lambda config, engine: AlwaysGuess())
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=2, page_size=4,
                                 fused_decode=True, speculative_config=NGRAM, **config), parts)
    perturb_norms(engine)
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_rope_in_the_attention_over_verify_steps_and_several_rows(tmp_path, tiny_qwen2, reference_kernels,
                                                                 all_kernel_rows, monkeypatch, family):
    """ROPE_IN_ATTENTION with n-gram verify steps as decode rows and two sequences decoding
    together (triton, interpreted): every fused step's attention makes its rows (a verify row
    the rows before it, from the rows that write them), none runs the pool's RoPE + K/V write;
    greedy tokens are the per-op engine's without speculation. Qwen2 with its RoPE epilogue
    off (FusedParts(rope=False)): the form a 4- or 16-row A/B would run."""
    from tests.test_model_families import save_family

    folder = save_family("qwen3", tmp_path / "q3") if family == "qwen3" else tiny_qwen2
    prompts, params = row_prompts(2), verify_params()
    triton = small_one_launch_splits(monkeypatch)
    want, _, _ = run_engine(folder, False, prompts, params, 2, **triton)
    calls = count_rope_forms(monkeypatch)
    monkeypatch.setattr(fused_decode, "ROPE_IN_ATTENTION", "1")
    expanded = count_fused_verify_steps(monkeypatch)
    engine = always_guessing_engine(folder, monkeypatch, FusedParts(rope=False, attn=True), **triton)
    got = run_to_completion(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert expanded and max(expanded) > 2 and engine.runner.fused.rope_in_attention
    assert calls["rope_in"] > 0 and calls["plain"] == 0 and calls["fused_pool_rope"] == 0
    assert not engine.runner.fused_attention._merge_counts.any()


def test_verify_rows_as_decode_rows_give_the_ragged_steps_logits(tiny_qwen2):
    """A step of two verify rows (one from position 0, one after 5 cached tokens) and a decode,
    over a pool of random K/V: the same step as one decode row per query token gives the same
    logits through the per-op model (the torch backend's decode and ragged kernels)."""
    import numpy as np

    from flashlet.runner.batch import InputBatch, load_layout

    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=3, page_size=4))
    pool, model, backend = engine.kv_pool, engine.model, engine.runner.backend
    g = torch.Generator().manual_seed(0)
    for cache in (pool.k_cache, pool.v_cache):
        cache.copy_(torch.randn(cache.shape, generator=g))
    batch = InputBatch(3, 4, 4)
    for i, pages in enumerate(([1, 2], [3, 4, 5], [6, 7])):
        batch.add(i, pages)
    layout = batch.layout(np.arange(3), [0, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11],
                          query_lens=[6, 3, 1], spec_lens=[5, 2, 0])
    decode = fused_decode.verify_as_decode_rows(layout, 4, 16)
    assert decode is not None and decode.is_pure_decode and decode.num_seqs == 10
    assert decode.arrays["kv_lens"].tolist() == [1, 2, 3, 4, 5, 6, 6, 7, 8, 7]
    logits = []
    for step in (layout, decode):
        input_ids, meta = load_layout(step, "cpu")
        backend.plan(meta)
        logits.append(model.compute_logits(model(input_ids, meta.positions, backend)[meta.logits_indices]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_verify_as_decode_rows_declines_what_it_does_not_serve():
    """A prefill chunk (its first rows not sampled), more tokens than the fused rows, a pure
    decode step (nothing to do) and a verify row whose proposals are cut short of its chunk."""
    import numpy as np

    from flashlet.runner.batch import InputBatch

    batch = InputBatch(2, 4, 4)
    batch.add(0, [1, 2])
    batch.add(1, [3, 4])
    rows = np.arange(2)

    def step(starts, lens, spec_lens=None):
        return batch.layout(rows, starts, [5] * sum(lens), query_lens=lens, spec_lens=spec_lens)

    assert fused_decode.verify_as_decode_rows(step([0, 2], [3, 1]), 4, 16) is None  # chunk
    assert fused_decode.verify_as_decode_rows(step([0, 2], [3, 1], [1, 0]), 4, 16) is None  # cut short
    assert fused_decode.verify_as_decode_rows(step([0, 2], [3, 2], [2, 1]), 4, 4) is None  # 5 > 4 rows
    assert fused_decode.verify_as_decode_rows(batch.layout(rows, [2, 3], [5, 6]), 4, 16) is None
    assert fused_decode.verify_as_decode_rows(step([0, 2], [3, 2], [2, 1]), 4, 5) is not None


def test_the_one_launch_attention_looks_back_over_every_row_of_a_fused_step():
    """A fused step's attention (PDL) tells a verify row's own earlier rows from the past by
    looking back over the rows before it (kernels/decode_attention.py): at every row count the
    kernel can serve, the look-back reaches the step's first row."""
    from flashlet.kernels.decode_attention import one_launch_lookback

    for rows in range(2, fused_decode.MAX_ROWS + 1):
        assert one_launch_lookback(rows) >= rows - 1
    assert fused_decode.SERVED_ROWS <= fused_decode.MAX_ROWS


def test_fused_verify_steps_replay_the_decode_graphs(tiny_qwen2, reference_kernels, monkeypatch):
    """With graphs (stood in for by eager replays on the CPU) and k = 4: a verify step of 5
    tokens (past SERVED_ROWS) runs per-op; one of up to 4 (near max_new_tokens) is loaded as
    decode rows and replays the greedy-token graph of its padded size, never an eager fused
    step; the greedy tokens are speculation off's."""
    from tests.test_step_layout import graphs_on_the_cpu

    monkeypatch.setattr(fused_decode, "SERVED_ROWS", 4)  # (so a 5-token verify step lies past it)
    prompts, params = row_prompts(1), SamplingParams(max_new_tokens=12, ignore_eos=True)
    want, _, _ = run_engine(tiny_qwen2, False, prompts, params, 1)
    expanded = count_fused_verify_steps(monkeypatch)
    monkeypatch.setattr(engine_module, "make_proposer", lambda config, engine: AlwaysGuess())
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1, page_size=4,
                                 fused_decode=True, speculative_config={**NGRAM, "num_speculative_tokens": 4}))
    perturb_norms(engine)
    per_op = count_per_op_forwards(engine)
    graphs_on_the_cpu(engine)
    runner, replayed, eager = engine.runner, [], []
    real_replay, real_token = runner._replay, runner.fused.token

    def replay(input_ids, meta, size, tokens=False):
        replayed.append((size, tokens, meta.num_seqs - meta.num_padding))
        return real_replay(input_ids, meta, size, tokens)

    def token(input_ids, *args):  # inside a replay the last one recorded is this step's
        if not replayed or replayed[-1][0] != input_ids.shape[0]:
            eager.append(input_ids.shape[0])
        return real_token(input_ids, *args)

    runner._replay = replay
    monkeypatch.setattr(runner.fused, "token", token)
    got = run_to_completion(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert not eager
    verify_replays = [(size, rows) for size, tokens, rows in replayed if tokens and rows > 1]
    padded = [next(s for s in runner.fused.row_counts if s >= n) for n in expanded]
    assert expanded and verify_replays == list(zip(padded, expanded)) and max(expanded) <= 4
    assert any(verifying for _, verifying in per_op)  # the 5-token steps


def test_auto_declines_the_presets_whose_norm_folded_gemvs_hold_too_many_chunks_a_lane():
    """MAX_NORM_CHUNKS by preset: the shapes measured fast on the fused path (or as small) stay
    on; Qwen2.5-7B (14 chunks: ~10x slower than per-op on the H200) and the larger ones decline."""
    on = {}
    for path in sorted(PRESETS_DIR.glob("*.json")):
        hidden = json.loads(path.read_text())["hidden_size"]
        on[path.stem] = fused_decode.norm_chunks_per_lane(hidden) <= fused_decode.MAX_NORM_CHUNKS
    assert on == {"llama-3.1-8b": False, "llama-3.2-1b": True, "mistral-7b": False,
                  "qwen2.5-0.5b": True, "qwen2.5-0.5b-smolvocab": True, "qwen2.5-1.5b": True,
                  "qwen2.5-14b": False, "qwen2.5-7b": False, "qwen3-0.6b": True, "qwen3-1.7b": True,
                  "tinyllama-1.1b": True}
    assert fused_decode.norm_chunks_per_lane(3584) == 14
    assert fused_decode.norm_chunks_per_lane(3584, fp8=True) == 7  # 16 fp8 weights a chunk


@pytest.mark.parametrize("name, env, values, expected", [
    ("ROPE_IN_ATTENTION", "FLASHLET_ROPE_IN_ATTENTION", ("0", "1", "all"), "expected 0, 1 or all"),
    ("ATTENTION_PDL", "FLASHLET_ATTENTION_PDL", ("0", "1", "one-row"), "expected 0, 1 or one-row"),
])
def test_env_switches_read_their_values(name, env, values, expected):
    """$FLASHLET_ROPE_IN_ATTENTION: 0 / 1 / all; $FLASHLET_ATTENTION_PDL: 0 / 1 / one-row. Each
    unset is 1 (the default: rope_in measured faster for Qwen3; the attention launched with PDL
    like the GEMVs around it), anything else a clear error at import."""
    import os
    import subprocess
    import sys

    # One child (torch imported once, not once a value): the module imported with the switch
    # unset, then re-imported (importlib.reload runs its top level again) at each value.
    probe = """if True:
        import importlib, json, os, sys
        env, name, values = sys.argv[1], sys.argv[2], sys.argv[3:]
        from flashlet.runner import fused_decode as f
        got = [getattr(f, name)]
        for value in values:
            os.environ[env] = value
            try:
                got.append(getattr(importlib.reload(f), name))
            except ValueError as e:
                got.append("ValueError: " + str(e))
        print(json.dumps(got))"""
    unset = {k: v for k, v in os.environ.items() if k != env}
    out = subprocess.run([sys.executable, "-c", probe, env, name, *values, "yes"], capture_output=True, text=True,
                         env=unset)
    assert out.returncode == 0, out.stderr[-500:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got[0] == "1" and got[1:-1] == list(values), got
    assert got[-1].startswith("ValueError: ") and expected in got[-1], got[-1]


@pytest.mark.parametrize("value, launches", [("1", (True, True, True)), ("0", (False, False, False)),
                                             ("one-row", (True, False, False))])
def test_the_attention_pdl_rule_by_rows(monkeypatch, value, launches):
    """FusedDecode.attention_pdl(rows): with PDL on the path, the attention launches with it on
    steps of 1 / 4 / 16 rows as ATTENTION_PDL says; with PDL off (the CPU, pre-sm_90) never."""
    from types import SimpleNamespace

    monkeypatch.setattr(fused_decode, "ATTENTION_PDL", value)
    rule = fused_decode.FusedDecode.attention_pdl
    assert tuple(rule(SimpleNamespace(pdl=True), rows) for rows in (1, 4, 16)) == launches
    assert not any(rule(SimpleNamespace(pdl=False), rows) for rows in (1, 4, 16))


def test_every_fused_row_count_is_within_the_rope_in_look_back():
    """rope_in finds a verify row's earlier rows by looking back MAX_LOOKBACK rows: every row
    count the fused path serves (cute_gemv.MAX_ROWS) must be within it."""
    from flashlet.kernels.cute_gemv import MAX_ROWS
    from flashlet.kernels.decode_attention import MAX_LOOKBACK

    assert MAX_ROWS <= MAX_LOOKBACK + 1
