"""The fused decode path behind another step backend, on the GPU: with backend=flashinfer (and
torch) one-row decode steps are fused, attending through the fused path's own triton one-launch
attention, and their greedy tokens agree with the per-op path on the same backend under the
near-tie rule of tests/gpu/test_gpu_fused_decode.py (teacher-forced)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import save_tiny_model
from tests.gpu.test_gpu_fused_decode import SM90, SMALL, check_teacher_forced, prompts, teacher_forced

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not SM90, reason="auto turns the fused path on at sm_90+ only"),
]


def check_fused_behind(backend: str, folder, new_tokens: int = 32):
    """Auto (no fused flag) on `backend`: fused, its attention triton's, tokens the per-op path's."""
    source = dict(model=str(folder))
    ps = prompts(6, SMALL["vocab_size"])
    ref_tokens = _per_op_tokens(source, ps, new_tokens, backend)
    _, ref_rows, _ = teacher_forced(source, ps, ref_tokens, new_tokens, logits=True, fused=False, backend=backend)
    picks, _, engine = teacher_forced(source, ps, ref_tokens, new_tokens, logits=False, fused=None,
                                      backend=backend)
    runner = engine.runner
    assert runner.fused is not None and runner.fused.one_launch_attention
    assert runner.backend.name == backend and runner.fused_attention.name == "triton"
    assert engine.greedy_steps == len(ps) * (new_tokens - 1)
    _, rows, _ = teacher_forced(source, ps, ref_tokens, new_tokens, logits=True, fused=None, backend=backend)
    _, exact_rows, _ = teacher_forced(source, ps, ref_tokens, new_tokens, logits=True, fused=False,
                                      dtype="float32", backend="torch")
    check_teacher_forced([t for tokens in ref_tokens for t in tokens], ref_rows, rows, picks, exact_rows)
    assert not runner.fused_attention._merge_counts.any()


def _per_op_tokens(source, ps, new_tokens, backend):
    from flashlet import Engine, EngineConfig, SamplingParams
    from tests.test_fused_decode import perturb_norms

    engine = Engine(EngineConfig(**source, backend=backend, dtype="bfloat16", max_num_seqs=1,
                                 max_num_pages=1024, fused_decode=False))
    perturb_norms(engine)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in ps]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_path_on_behind_flashinfer(tmp_path, family):
    if family == "qwen3":
        from tests.test_model_families import save_family

        folder = save_family("qwen3", tmp_path / "q3", **SMALL, head_dim=128)
    else:
        folder = save_tiny_model("qwen2", tmp_path, **SMALL)
    check_fused_behind("flashinfer", folder)


def test_fused_path_on_behind_the_torch_backend(tmp_path):
    check_fused_behind("torch", save_tiny_model("qwen2", tmp_path, **SMALL))


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")
def test_auto_runs_flashinfer_prefill_and_triton_decode_where_the_table_says(tmp_path, monkeypatch):
    """Head_dim 128, group 2 (Qwen3-0.6B's shape) with a table that picks FlashInfer for steps
    with a chunk and Triton for pure-decode steps past the fused rows (the measured table picks
    Triton for both there; this is the routing). Twenty requests decode at 17+
    rows through the Triton decode graphs after FlashInfer's prefill; their greedy tokens match
    a triton-only run's except where a bf16 near-tie parts them (the two prefill kernels round
    differently; a wrong decode read would part every one)."""
    from flashlet import Engine, EngineConfig, SamplingParams
    from tests.test_model_families import save_family

    from flashlet.kernels import tuning

    monkeypatch.setattr(tuning, "BACKEND_PREFERENCE", {(128, 2, "prefill"): "flashinfer",
                                                       (128, 2, "decode"): "triton"})
    folder = save_family("qwen3", tmp_path / "q3", **SMALL, head_dim=128)
    ps = prompts(20, SMALL["vocab_size"])
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for backend in ("auto", "triton"):
        engine = Engine(EngineConfig(model=str(folder), backend=backend, dtype="bfloat16",
                                     max_num_seqs=32, max_num_pages=2048))
        if backend == "auto":
            assert (engine.runner.backend.name, engine.runner.decode_backend.name) == ("flashinfer", "triton")
            assert engine.backend_name == "flashinfer (prefill) + triton (decode)"
            planned = []
            plan = engine.runner.decode_backend.plan_graph
            engine.runner.decode_backend.plan_graph = lambda meta, size: (planned.append(size), plan(meta, size))[1]
        ids = [engine.add_request(p, params) for p in ps]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outputs[backend] = [done[i] for i in ids]
        engine.check_integrity()
        if backend == "auto":
            assert any(size > 16 for size in planned)  # decode graphs past the fused rows ran
    assert all(len(tokens) == 24 for tokens in outputs["auto"])
    same = sum(x == y for x, y in zip(outputs["auto"], outputs["triton"]))
    assert same >= 14, f"{same} of 20 requests' greedy tokens agree"
