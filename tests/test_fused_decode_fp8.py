"""The fused decode path with fp8 weights (`--quantization fp8`) on the CPU: its wiring and its
refusals.

As in tests/test_fused_decode.py each GEMV is replaced by its fp32 reference, here with the
fp8 weight's codes and row scales (gemv_reference's `scale`: quantization.dequant_linear's
numerics, what the fp8 CuteGemv is held to on the GPU in tests/kernels/test_cute_gemv_fp8.py),
so what is checked is that the path hands the decoder's four projections their fp8 codes and
scales, keeps the LM head bf16, and gives the per-op fp8 engine's tokens and logits.
"""

from __future__ import annotations

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.models import quantization
from flashlet.models.weights import load_model
from flashlet.runner import fused_decode
from tests.conftest import save_tiny_model
from tests.test_fused_decode import PROMPTS, generate, perturb_norms, reference_kernels  # noqa: F401

FP8 = {"quantization": "fp8"}


def fp8_projections(gemvs) -> dict[str, bool]:
    return {name: getattr(gemvs, name).plan.fp8 for name in ("qkv", "o", "gate_up", "down", "lm_head", "lm_argmax")}


@pytest.mark.parametrize("rope", [False, True], ids=["rope-kernel", "rope-epilogue"])
@pytest.mark.parametrize("params", [{}, {"logprobs": 1}], ids=["argmax", "logits"])
def test_fp8_fused_wiring_gives_the_per_op_fp8_tokens(tiny_model, reference_kernels, rope, params):
    want, _ = generate(tiny_model, False, PROMPTS, config=FP8, **params)
    got, engine = generate(tiny_model, True, PROMPTS, rope=rope, config=FP8, **params)
    assert got == want
    fused = engine.runner.fused
    assert fused.fp8 and quantization.is_quantized(engine.model)
    # the decoder's projections stream fp8; the LM head (the model's bf16 one) does not
    assert fp8_projections(fused.gemvs[1]) == dict(qkv=True, o=True, gate_up=True, down=True,
                                                   lm_head=False, lm_argmax=False)
    assert fused.gemvs[1].qkv.calls == len(engine.model.layers) * sum(12 - 1 for _ in PROMPTS)


def test_fp8_fused_logits_match_the_per_op_fp8_model(tiny_qwen2, reference_kernels):
    """Every step's logits against the per-op fp8 model's (dequant_linear) to fp32 rounding,
    and far from the unquantized model's: the fused path computed with the fp8 weights."""
    rows = {}
    for name, fused, config in (("per-op", False, FP8), ("fused", True, FP8), ("float", False, {})):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1,
                                     fused_decode=fused, **config))
        perturb_norms(engine)
        rows[name] = []
        engine.observe_steps(lambda meta, logits, out=rows[name]: out.append(logits.clone()))
        engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert len(rows["fused"]) == 6
    for want, got, unquantized in zip(rows["per-op"], rows["fused"], rows["float"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert float((unquantized - want).abs().max()) > 100 * float((got - want).abs().max()) + 1e-3


def test_fp8_down_past_max_down_k_runs_the_fp8_linear(tiny_qwen2, reference_kernels, monkeypatch):
    """A down projection too long for the GEMV (MAX_DOWN_K, here below the tiny model's 128)
    runs quantization.linear into the residual stream, the rest fused: the per-op tokens."""
    monkeypatch.setattr(fused_decode, "MAX_DOWN_K", 64)
    calls = []
    real = quantization.linear
    monkeypatch.setattr(quantization, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    want, _ = generate(tiny_qwen2, False, PROMPTS[:2], config=FP8)
    calls.clear()  # the per-op engine's own calls
    got, engine = generate(tiny_qwen2, True, PROMPTS[:2], config=FP8)
    assert got == want
    assert engine.runner.fused.gemvs[1].down is None
    decode_steps = 2 * (12 - 1)
    assert len(calls) >= len(engine.model.layers) * decode_steps  # (+ the prefills' projections)


def test_fused_decode_takes_fp8_weights(tiny_qwen2):
    """fp8 weights are no reason to decline (the CUDA-side checks, run on a CPU model)."""
    model, _, _ = load_model(str(tiny_qwen2), dtype=torch.bfloat16, quantization="fp8")
    assert fused_decode.refusals(model, torch.device("cuda")) == []


def test_fp8_widths_must_be_multiples_of_16(tmp_path):
    """A 16-byte load holds 16 fp8 weights: a K that is a multiple of 8 but not 16 is refused
    for fp8 weights by name, and served in bf16."""
    folder = save_tiny_model("qwen2", tmp_path / "odd", intermediate_size=136)
    fp8, _, _ = load_model(str(folder), dtype=torch.bfloat16, quantization="fp8")
    why = fused_decode.refusals(fp8, torch.device("cuda"))
    assert why == ["intermediate_size = 136 is not a multiple of 16 (16-byte loads of fp8 weights)"]
    bf16, _, _ = load_model(str(folder), dtype=torch.bfloat16)
    assert fused_decode.refusals(bf16, torch.device("cuda")) == []


def test_fp8_weights_are_served_up_to_the_cuda_core_rows(tiny_qwen2, reference_kernels):
    """fp8 GEMVs have no tensor-core form: with 16 sequences the fused path serves 1-4 rows
    (SERVED_ROWS_FP8) for fp8 weights and 1-16 (SERVED_ROWS) for bf16."""
    for config, served in ((FP8, [1, 2, 4]), ({}, [1, 2, 4, 8, 16])):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=16, fused_decode=True,
                                     **config))
        assert engine.runner.fused.row_counts == served


def test_fp8_tensor_cores_as_asked_or_by_hidden_size(tiny_model, reference_kernels):
    """fused_decode_fp8_mma plans the four fp8 projections on the tensor cores at every row count
    and serves up to SERVED_ROWS rows (the LM head stays bf16); off, the CUDA-core form at up
    to SERVED_ROWS_FP8; auto (None), the CUDA-core form outside FP8_MMA_SHAPES, as for this
    tiny model. Either way the tokens are the per-op fp8 engine's."""
    want, _ = generate(tiny_model, False, PROMPTS, config=FP8)
    for opt_in, served in ((None, [1, 2, 4]), (False, [1, 2, 4]), (True, [1, 2, 4, 8, 16])):
        config = dict(FP8, fused_decode_fp8_mma=opt_in)
        got, engine = generate(tiny_model, True, PROMPTS, config=config)
        assert got == want
        assert engine.runner.fused.fp8_mma == bool(opt_in)
        many = Engine(EngineConfig(model=str(tiny_model), device="cpu", max_num_seqs=16, fused_decode=True, **config))
        fused = many.runner.fused
        assert fused.row_counts == served
        for m in served:
            plans = {name: getattr(fused.gemvs[m], name).plan for name in ("qkv", "o", "gate_up", "down", "lm_head")}
            assert {name: (p.fp8, p.mma) for name, p in plans.items()} == dict(
                qkv=(True, bool(opt_in)), o=(True, bool(opt_in)), gate_up=(True, bool(opt_in)),
                down=(True, bool(opt_in)), lm_head=(False, False))


def test_fp8_tensor_cores_at_a_measured_shape_serve_their_own_rows(tiny_model, reference_kernels, monkeypatch):
    """At a shape of FP8_MMA_SHAPES (the 7B's, where 16-row fused steps lost to per-op's cuBLAS)
    fp8 on the tensor cores serves up to SERVED_ROWS_FP8_LARGE rows, asked for or by auto; the
    same tiny model outside the set, asked for, serves SERVED_ROWS."""
    from flashlet.runner import fused_decode

    def served(opt_in):
        config = dict(FP8, fused_decode_fp8_mma=opt_in)
        engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", max_num_seqs=16, fused_decode=True, **config))
        return engine.runner.fused.row_counts

    assert served(True) == [1, 2, 4, 8, 16]
    shape = fused_decode.model_shape(Engine(EngineConfig(model=str(tiny_model), device="cpu", max_num_seqs=1)).model)
    monkeypatch.setattr(fused_decode, "FP8_MMA_SHAPES", {shape})
    want = [r for r in [1, 2, 4, 8, 16] if r <= fused_decode.SERVED_ROWS_FP8_LARGE]
    assert served(None) == served(True) == want == [1, 2, 4, 8]
    assert served(False) == [1, 2, 4]  # the CUDA-core form: SERVED_ROWS_FP8


def test_fp8_tensor_cores_need_the_fused_path():
    """Asking for fp8 on the tensor cores with the fused path turned off is a clear error."""
    with pytest.raises(ValueError, match="fused_decode=False"):
        EngineConfig(fused_decode=False, fused_decode_fp8_mma=True)
    assert EngineConfig().fused_decode_fp8_mma is None  # auto: fused_decode.fp8_tensor_cores


def test_auto_puts_fp8_gemvs_on_the_tensor_cores_at_the_shapes_measured_faster(monkeypatch):
    """Auto's rule: the tensor-core form at the (hidden, intermediate) shapes of FP8_MMA_SHAPES
    (measured faster at Qwen2.5-7B's; slower at 0.5B's and Llama-3.1-8B's), where every K is a
    multiple of its K step; asked for, it holds anywhere its K steps fit."""
    from types import SimpleNamespace

    from flashlet.runner import fused_decode

    monkeypatch.setattr(fused_decode, "is_quantized", lambda m: True)

    def model(hidden, q_size, inter):
        layer = SimpleNamespace(q_size=q_size, down_proj=SimpleNamespace(weight=torch.empty(hidden, inter)))
        return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden), layers=[layer])

    assert fused_decode.fp8_tensor_cores(model(3584, 3584, 18944), None)      # Qwen2.5-7B
    assert not fused_decode.fp8_tensor_cores(model(4096, 4096, 14336), None)  # Llama-3.1-8B
    assert not fused_decode.fp8_tensor_cores(model(896, 896, 4864), None)     # Qwen2.5-0.5B
    assert fused_decode.fp8_tensor_cores(model(896, 896, 4864), True)
    assert not fused_decode.fp8_tensor_cores(model(3584, 3584, 18944), False)


@pytest.mark.parametrize("k", [3, 5])
def test_fp8_fused_verify_steps_give_the_per_op_fp8_tokens(tiny_qwen2, reference_kernels, k):
    """fp8 weights with n-gram speculation: auto now takes fp8 onto the fused path, so verify
    steps meet the fp8 GEMVs (up to SERVED_ROWS_FP8 rows on the CUDA cores; a step of more, as
    k = 5's full drafts, runs per-op). Greedy tokens equal the per-op fp8 engine's, and the
    fused GEMVs ran verify rows (the prompt lookup drafts fewer than k at times)."""
    from tests.test_speculative import NGRAM, generate as spec_generate, repetitive_prompts

    spec = {**NGRAM, "num_speculative_tokens": k}
    prompts = repetitive_prompts(3, seed=11)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    outs = {}
    for fused in (False, True):
        done, engine = spec_generate(tiny_qwen2, prompts, params, spec=spec, device="cpu",
                                     max_num_seqs=1, fused_decode=fused, **FP8)
        outs[fused] = [o.token_ids for o in done]
        assert engine.spec.stats.num_drafts > 0
    assert outs[True] == outs[False]
    rows = {m for m, g in engine.runner.fused.gemvs.items() if g.qkv.calls}
    assert max(rows) > 1 and max(rows) <= fused_decode.SERVED_ROWS_FP8, rows


def test_qwen3_fp8_weights_on_the_fused_path_give_the_per_op_fp8_tokens(tmp_path, reference_kernels):
    """Qwen3 (its per-head q / k norms in the pool's RoPE + K/V write kernel) with fp8 weights,
    which auto now takes onto the fused path: the fp8 GEMVs' tokens are the per-op fp8
    engine's."""
    from tests.test_model_families import save_family

    folder = save_family("qwen3", tmp_path / "q3")
    want, _ = generate(folder, False, PROMPTS, config=FP8)
    got, engine = generate(folder, True, PROMPTS, rope=None, config=FP8)
    assert got == want
    fused = engine.runner.fused
    assert fused.fp8 and not fused.parts.rope
    assert fp8_projections(fused.gemvs[1]) == dict(qkv=True, o=True, gate_up=True, down=True,
                                                   lm_head=False, lm_argmax=False)
