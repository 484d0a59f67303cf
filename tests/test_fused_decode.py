"""The fused decode path's wiring (flashlet/fused_decode.py) on the CPU, and its refusals.

The CuTe kernels need a GPU (tests/gpu/test_gpu_fused_decode.py, tests/kernels/test_cute_gemv.py);
here each GEMV is replaced by its fp32 PyTorch reference (`gemv_reference`, which the GPU tests
hold the kernels to), so what is checked is the layer sequence around them: the norm folded
into QKV / gate+up / LM head, the in-place residual stream, the split, RoPE and attention
through the backend, the argmax path and the engine's choice of it, against the per-op model.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet import fused_decode
from flashlet.kernels.cute_gemv import gemv_reference, plan_gemv, rope_kv_reference


class ReferenceGemv:
    """CuteGemv's interface, computed by gemv_reference (the kernels' fp32 reference)."""

    def __init__(self, n_rows, k, epilogue="none", *, device="cuda", pdl=False, norm=False, eps=1e-6,
                 rope=None):
        self.plan = plan_gemv(n_rows, k, epilogue, norm=norm, eps=eps, rope=rope)
        self.calls = 0

    def __call__(self, x, weight, extra=None, *, out, norm_weight=None, rope_kv=None):
        p = self.plan
        assert (norm_weight is not None) == p.norm and weight.shape == (p.n_rows, p.k)
        assert (rope_kv is not None) == (p.rope is not None)
        if p.rope is not None:  # the model's dtype (fp32 here), not the kernel's bf16
            y = rope_kv_reference(x, weight, extra, p.rope, rope_kv, norm_weight, p.eps, dtype=out.dtype)
        else:
            y = gemv_reference(x, weight, p.epilogue, extra, norm_weight, p.eps)
        out.copy_(y.reshape(out.shape))
        self.calls += 1
        return out


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


def generate(model_dir, fused, prompts, n=12, rope=False, config=None, **params):
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=1,
                                 fused_decode=fused, fused_decode_rope=rope, **(config or {})))
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
    fused = engine.runner.fused
    decode_steps = sum(12 - 1 for _ in PROMPTS)
    layers = len(engine.model.layers)
    assert fused.qkv.calls == fused.down.calls == layers * decode_steps
    # greedy: every decode step's token from the argmax epilogue; logprobs: from the logits
    assert (fused.lm_argmax.calls, fused.lm_head.calls) == (
        (decode_steps, 0) if not params else (0, decode_steps))


@pytest.mark.parametrize("params", [{}, {"logprobs": 1}], ids=["argmax", "logits"])
def test_rope_epilogue_wiring_gives_the_model_tokens(tiny_model, reference_kernels, monkeypatch, params):
    """fused_decode_rope: RoPE and the K/V write happen in the QKV GEMV's epilogue (here its
    reference), the backend only attends; the pool's RoPE kernel never runs on a fused step."""
    want, _ = generate(tiny_model, False, PROMPTS, **params)
    write_rope_calls = []
    real = fused_decode.FusedDecode._qkv_attend
    monkeypatch.setattr(fused_decode.FusedDecode, "_qkv_attend",
                        lambda *a: write_rope_calls.append(1) or real(*a))
    got, engine = generate(tiny_model, True, PROMPTS, rope=True, **params)
    assert got == want
    fused = engine.runner.fused
    assert fused.rope is not None and fused.qkv.plan.epilogue.endswith("rope_kv")
    assert fused.qkv.calls == len(engine.model.layers) * sum(12 - 1 for _ in PROMPTS)
    assert not write_rope_calls


@pytest.mark.slow
@pytest.mark.parametrize("model,rope", [("tiny_qwen2", True), ("tiny_llama", False)],
                         ids=["qwen2-rope-epilogue", "llama-rope-kernel"])
def test_one_launch_attention_wiring_gives_the_model_tokens(model, rope, reference_kernels, monkeypatch, request):
    """fused_decode_attn: on the triton backend (interpreted, ~30 s), every fused step's
    attention is one `attend_one_launch` a layer and never the two-launch kernels; splits made
    small (16 tokens) so the last-program merge runs; tokens are the per-op engine's (same backend)."""
    tiny_model = request.getfixturevalue(model)
    from flashlet.attention import triton_backend
    from flashlet.kernels import tuning

    monkeypatch.setattr(tuning, "default_decode", lambda *a: tuning.DecodeConfig(block_n=16, min_split_tokens=16))
    monkeypatch.setattr(triton_backend, "ONE_LAUNCH_MIN_SPLIT_TOKENS", 16)
    triton = {"backend": "triton"}
    want, _ = generate(tiny_model, False, PROMPTS, n=10, config=triton)
    calls = {"one": 0, "merged": 0, "two": 0}
    real_one, real_two = triton_backend.decode_attention_one_launch, triton_backend.decode_attention

    def one(*a, **k):
        calls["one"] += 1
        calls["merged"] += k["num_splits"] > 1 and int(a[5].max()) > 16  # several splits used
        return real_one(*a, **k)

    monkeypatch.setattr(triton_backend, "decode_attention_one_launch", one)
    monkeypatch.setattr(triton_backend, "decode_attention",
                        lambda *a, **k: calls.__setitem__("two", calls["two"] + 1) or real_two(*a, **k))
    got, engine = generate(tiny_model, True, PROMPTS, n=10, rope=rope, config={**triton, "fused_decode_attn": True})
    assert got == want
    assert engine.runner.fused.one_launch_attention
    assert calls["one"] == len(engine.model.layers) * sum(10 - 1 for _ in PROMPTS)
    assert calls["merged"] > 0 and calls["two"] == 0  # prefill runs prefill_attention
    assert not engine.runner.backend._merge_counts.any()


def test_fused_decode_attn_needs_the_triton_backend(tiny_qwen2):
    with pytest.raises(ValueError, match="fused_decode_attn applies"):
        EngineConfig(fused_decode_attn=True)
    with pytest.raises(ValueError, match="one-launch decode; backend is 'torch'"):
        EngineConfig(fused_decode=True, fused_decode_attn=True, backend="torch")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args(["--fused-decode-attn"]).fused_decode_attn is True
    assert parser.parse_args([]).fused_decode_attn is False


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
    assert engine.runner.fused.lm_head.calls == 5 and len(rows[True]) == 6
    for want, got in zip(rows[False], rows[True]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fused_decode_refuses_what_it_cannot_run(tiny_qwen2):
    with pytest.raises(ValueError, match="CUDA only.*bf16 only"):
        Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", fused_decode=True))


def test_fused_decode_rope_needs_fused_decode():
    with pytest.raises(ValueError, match="fused_decode_rope applies"):
        EngineConfig(fused_decode_rope=True)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args(["--fused-decode-rope"]).fused_decode_rope is True
    assert parser.parse_args([]).fused_decode_rope is False


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
    assert "fused_decode_rope" not in str(plain.value)


def test_fused_decode_refuses_a_down_projection_it_cannot_stream(tmp_path):
    """Qwen2.5-7B's 18,944-wide down projection ran at 17.5 tok/s fused against 214 per-op (no
    split-K): refused by name, with the measured reason."""
    from tests.conftest import save_tiny_model

    big = save_tiny_model("qwen2", tmp_path, intermediate_size=fused_decode.MAX_DOWN_K + 64)
    engine = Engine(EngineConfig(model=str(big), device="cpu", max_num_seqs=1))
    with pytest.raises(ValueError, match="intermediate_size = 16448 is over 16384"):
        fused_decode.check_fused_decode(engine.model, torch.device("cpu"))


def test_fused_decode_needs_one_gpu():
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(fused_decode=True, tensor_parallel_size=2)


def test_fused_decode_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args(["--fused-decode"]).fused_decode is True
    assert parser.parse_args([]).fused_decode is False


def test_fused_graph_path_on_the_cpu(tiny_qwen2, reference_kernels):
    """The runner's graph path with the fused body (graphs stood in for by eager replays, as in
    test_step_layout): batch-1 steps replay the fused greedy-token graph, two-row steps the
    per-op graphs, and the tokens are the per-op engine's."""
    from tests.test_step_layout import _graphs_on_the_cpu

    prompts = [[3, 5, 7, 9, 11] * 3, [2, 4, 6], [8] * 9]
    outs = []
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=2,
                                     max_num_batched_tokens=32, fused_decode=fused))
        perturb_norms(engine)
        _graphs_on_the_cpu(engine)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True))
               for i, p in enumerate(prompts)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.check_integrity()
        outs.append([done[i] for i in ids])
    assert outs[0] == outs[1]
    keys = {key[:2] for key in engine.runner.graphs}
    assert (1, "tokens") in keys and (2, "logits") in keys  # the last prompt decodes alone
    assert engine.runner.fused.lm_argmax.calls > 0
