"""The fused decode path with fp8 weights (`--quantization fp8`) against the per-op fp8 path, on
the GPU: the decoder's four projections stream e4m3 codes through the fp8 CuteGemv (the CUDA-core
form, or with fused_decode_fp8_mma the tensor-core one), the LM head stays bf16.

The rule is tests/gpu/test_gpu_fused_decode.py's (its module docstring): teacher-forced on the
per-op tokens, the fused logits' RMS error against an fp32 anchor within 1.5x the per-op
path's, and each fused pick the reference's or within the measured noise of it. Here both
engines and the anchor load the same fp8 weights: the anchor is the per-op path in fp32 on the
torch backend, whose fp8 linears are dequant_linear's (fp32 from the codes). The checkpoint's
weights are rounded to bf16 first, so the bf16 engines and the fp32 anchor quantize the same
values to the same codes and scales.
"""

from __future__ import annotations

import pytest
import torch

from flashlet.runner import fused_decode
from tests.conftest import save_tiny_model
from tests.gpu.test_gpu_fused_decode import (HAVE_CUTE, NO_CUTE_REASON, SMALL, build,
                                             check_against_reference_teacher_forced, prompts, run)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and not HAVE_CUTE,
                       reason=f"needs the CuTe DSL: {NO_CUTE_REASON[:160]}"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="fp8 weights (e4m3) need an sm_89+ GPU"),
]


def round_to_bf16(folder) -> None:
    """The checkpoint's weights rounded to bf16 values (saved back in place): the bf16 engines
    and the fp32 anchor then quantize the same values to the same codes and scales."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model.save_pretrained(folder)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def fp8_model(request, tmp_path_factory):
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(f"fused-fp8-{request.param}"), **SMALL)
    round_to_bf16(folder)
    return dict(model=str(folder), quantization="fp8"), SMALL["vocab_size"]


def assert_fp8_gemvs(engine) -> None:
    fused = engine.runner.fused
    assert fused is not None and fused.fp8
    for gemvs in fused.gemvs.values():
        assert all(g.plan.fp8 for g in (gemvs.qkv, gemvs.o, gemvs.gate_up, gemvs.down) if g is not None)
        heads = [g for g in (gemvs.lm_head, gemvs.lm_argmax) if g is not None]  # none: `wide_head`
        assert not any(g.plan.fp8 for g in heads)


def test_fp8_fused_greedy_tokens_match_the_per_op_fp8_path(fp8_model):
    """16 prompts x 32 tokens, one at a time, each part of the path off (the GEMVs alone)."""
    source, vocab = fp8_model
    engine = check_against_reference_teacher_forced(source, prompts(16, vocab), 32)
    assert_fp8_gemvs(engine)


def test_fp8_fused_with_every_part_matches_the_per_op_fp8_path(fp8_model):
    """PDL, RoPE + the K/V write in the fp8 QKV GEMV's epilogue, one-launch attention: the
    path as the engine runs it by default."""
    source, vocab = fp8_model
    engine = check_against_reference_teacher_forced(source, prompts(16, vocab), 32, fused_decode_pdl=True,
                                                    fused_decode_rope=True, fused_decode_attn=True)
    assert_fp8_gemvs(engine)
    assert engine.runner.fused.parts.named_on() == ["pdl", "rope", "attn"]


@pytest.mark.parametrize("batch", [2, 3, 4])
def test_fp8_fused_batches_match_the_per_op_fp8_path(fp8_model, batch):
    """`batch` prompts decoding together through the 2- and 4-row fp8 GEMVs (3 padded to 4)."""
    source, vocab = fp8_model
    engine = check_against_reference_teacher_forced(source, prompts(batch, vocab), 24, max_num_seqs=4,
                                                    fused_decode_pdl=True, fused_decode_rope=True,
                                                    fused_decode_attn=True)
    assert_fp8_gemvs(engine)
    assert engine.runner.fused.row_counts == [1, 2, 4]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="auto turns the fused path on at sm_90+ only (PDL)")
def test_forced_fp8_fused_path_replays_its_eager_tokens(fp8_model):
    """fp8 weights on the fused path (forced: auto leaves them per-op until this file passes on
    a GPU): the graphs replay what the same path gives eagerly."""
    source, vocab = fp8_model
    engine = build(True, **source, backend="triton", dtype="bfloat16", max_num_pages=1024)
    assert_fp8_gemvs(engine)
    graphed, _ = run(source, prompts(4, vocab), 16, fused=True)
    eager, _ = run(source, prompts(4, vocab), 16, fused=True, cuda_graph=False)
    assert eager == graphed


def test_fp8_down_past_max_down_k_runs_the_fp8_gemm_inside_the_fused_step(fp8_model, monkeypatch):
    """A down projection longer than the GEMV serves (MAX_DOWN_K; lowered here below SMALL's
    768, as Qwen2.5-7B's 18,944 is above it) runs the per-op fp8 GEMM (Triton) into the
    residual stream inside the fused step, captured in its graph."""
    monkeypatch.setattr(fused_decode, "MAX_DOWN_K", 512)
    source, vocab = fp8_model
    engine = check_against_reference_teacher_forced(source, prompts(4, vocab), 24, fused_decode_pdl=True,
                                                    fused_decode_rope=True, fused_decode_attn=True)
    assert_fp8_gemvs(engine)
    assert all(g.down is None for g in engine.runner.fused.gemvs.values())


@pytest.mark.parametrize("batch", [1, 2])
def test_fp8_step_in_the_7b_form_matches_the_per_op_fp8_path(fp8_model, monkeypatch, batch):
    """The fused step as Qwen2.5-7B runs it: the down projection past MAX_DOWN_K (the fp8 GEMM
    adding into the residual) and an LM head too wide for its GEMV (`wide_head`: the final norm,
    cuBLAS and an argmax into the int64 tokens; MAX_NORM_CHUNKS lowered here below SMALL's),
    captured in the step's graph, against per-op fp8."""
    monkeypatch.setattr(fused_decode, "MAX_DOWN_K", 512)
    monkeypatch.setattr(fused_decode, "MAX_NORM_CHUNKS", 0)
    source, vocab = fp8_model
    engine = check_against_reference_teacher_forced(source, prompts(4 if batch == 1 else batch, vocab), 24, max_num_seqs=batch,
                                                    fused_decode_pdl=True, fused_decode_rope=True,
                                                    fused_decode_attn=True)
    assert_fp8_gemvs(engine)
    for gemvs in engine.runner.fused.gemvs.values():
        assert gemvs.down is None and gemvs.lm_head is None and gemvs.lm_argmax is None


@pytest.mark.parametrize("batch", [1, 2, 7, 16])
def test_fp8_tensor_core_gemvs_match_the_per_op_fp8_path(fp8_model, batch):
    """fused_decode_fp8_mma: the four fp8 projections on the tensor cores (`fp8=True, mma=True`,
    every row count; 7 rows padded to 8), with every part of the path, against per-op fp8."""
    source, vocab = fp8_model
    engine = check_against_reference_teacher_forced(source, prompts(batch, vocab), 24, max_num_seqs=batch,
                                                    fused_decode_pdl=True, fused_decode_rope=True,
                                                    fused_decode_attn=True, fused_decode_fp8_mma=True)
    assert_fp8_gemvs(engine)
    fused = engine.runner.fused
    assert fused.fp8_mma and fused.max_rows >= batch
    for gemvs in fused.gemvs.values():
        assert all(g.plan.mma for g in (gemvs.qkv, gemvs.o, gemvs.gate_up, gemvs.down) if g is not None)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="auto turns the fused path on at sm_90+ only (PDL)")
def test_qwen3_fp8_at_the_defaults_matches_the_per_op_fp8_path(tmp_path):
    """Qwen3 with fp8 weights, no fused flag given (auto takes it since fp8 weights are no
    condition): its per-head q / k norm keeps RoPE out of the QKV epilogue, the four fp8
    projections stream through the fp8 GEMVs, and the tokens hold to per-op fp8's."""
    from tests.test_model_families import save_family

    folder = save_family("qwen3", tmp_path / "q3", **SMALL, head_dim=64)
    round_to_bf16(folder)
    source = dict(model=str(folder), quantization="fp8")
    engine = check_against_reference_teacher_forced(source, prompts(8, SMALL["vocab_size"]), 32, fused=None)
    assert_fp8_gemvs(engine)
    assert engine.config.fused_decode and not engine.runner.fused.parts.rope
