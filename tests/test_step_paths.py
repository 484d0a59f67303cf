"""`--backend auto` and the fused decode path chosen per step kind (flashlet/attention/selection.py):
a pure function of the platform and the model's shape, with its reasons, and the one start line."""

from __future__ import annotations

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.attention import selection
from flashlet.attention.torch_ref import TorchBackend
from flashlet.kernels import tuning
from flashlet.attention.selection import FUSED_DECODE_PATH, Platform, choose_paths

H200 = (9, 0)
BF16 = torch.bfloat16


def platform(capability=H200, installed=("flashinfer",)):
    return Platform("cuda" if capability else "cpu", capability, frozenset(installed))


def paths(requested="auto", plat=None, head_dim=128, group=3, dtype=BF16, tp=False, graphs=True):
    """The paths at a shape the measured table does not hold (head_dim 128, group 3) unless
    asked: auto's default rule there is FlashInfer where it is installed."""
    return choose_paths(requested, plat or platform(), head_dim, group, dtype, tp, graphs)


def test_flashinfer_installed_keeps_one_row_decode_fused():
    """The step backend follows head_dim and what is installed; the fused path does not."""
    with_fi, without_fi = paths(), paths(plat=platform(installed=()))
    assert with_fi.backend == "flashinfer" and without_fi.backend == "triton"
    assert with_fi.fused_decline is None and without_fi.fused_decline is None
    assert paths(head_dim=64, group=7).backend == "triton"  # tuned at head_dim 64
    assert paths("flashinfer").backend_why == "asked for by name"


def test_an_installed_flashinfer_that_fails_to_import_leaves_auto_on_triton(tmp_path, monkeypatch):
    """FlashInfer 0.6.18 beside nvidia-cutlass-dsl 4.3.5 raised AttributeError at import (H200,
    2026-12-03): auto must not pick it and then fail building it, and says why."""
    error = "AttributeError: module 'cutlass' has no attribute 'CUDA_VERSION'"
    failing = Platform("cuda", H200, frozenset(["flashinfer"]), lambda name: error)
    got = paths(plat=failing)
    assert got.backend == "triton" and error in got.backend_why and got.fused_decline is None
    imports = Platform("cuda", H200, frozenset(["flashinfer"]), lambda name: None)
    assert paths(plat=imports).backend == "flashinfer"
    assert paths("flashinfer", plat=failing).backend == "flashinfer"  # by name: create_backend says why
    (tmp_path / "flashlet_broken_backend").mkdir()
    (tmp_path / "flashlet_broken_backend" / "__init__.py").write_text("raise AttributeError('no CUDA_VERSION')")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert selection.import_error("flashlet_broken_backend") == "AttributeError: no CUDA_VERSION"
    assert selection.import_error("json") is None


@pytest.mark.parametrize("broken,why", [
    ({"plat": platform(capability=None)}, "the device is cpu, not CUDA"),
    ({"plat": platform(capability=(8, 0))}, "sm_80; its PDL launches need sm_90"),
    ({"dtype": torch.float16}, "the dtype is float16; its kernels are bf16 only"),
    ({"tp": True}, "tensor parallelism is on"),
    ({"graphs": False}, "CUDA graphs are off"),
])
def test_each_platform_condition_turns_the_fused_path_off_by_name(broken, why):
    got = paths(**broken)
    assert got.fused_decline is not None and why in got.fused_decline
    assert paths(**broken, requested="triton").fused_decline == got.fused_decline  # backend: no condition


def test_cpu_runs_torch_per_op():
    got = paths(plat=platform(capability=None, installed=()))
    assert (got.backend, got.backend_why) == ("torch", "auto on cpu: the torch backend")


def test_the_start_line_names_each_step_kind_and_why():
    fused = paths().log_line(fused_rows=16)
    assert fused == (f"decode (1-16 rows): {FUSED_DECODE_PATH}, and verify steps of <= 16 tokens; "
                     f"decode (17+ rows): flashinfer; prefill/mixed: "
                     f"flashinfer (no measurement for head_dim 128, group 3: FlashInfer's default at "
                     f"head_dim >= 128)")
    one = paths().log_line(fused_rows=1)  # a GEMV of one row only
    assert one.startswith(f"decode (1 row): {FUSED_DECODE_PATH}; decode (2+ rows): flashinfer")
    off = paths(tp=True).log_line(fused_rows=0)
    assert off.startswith("decode (1 row): flashinfer (per-op: tensor parallelism is on")
    shape = paths().log_line(fused_rows=0, fused_why="intermediate_size = 18944 is over 16384")
    assert "(per-op: intermediate_size = 18944 is over 16384)" in shape


def test_auto_picks_each_step_kind_from_the_measured_table(monkeypatch):
    """Qwen3's shape (head_dim 128, group 2) on the H200: FlashInfer's prefill and Triton's
    decode each won their kind in the engine (tuning.BACKEND_PREFERENCE), so auto runs both."""
    monkeypatch.setattr(tuning, "BACKEND_PREFERENCE", {(128, 2, "decode"): "triton",
                                                       (128, 2, "prefill"): "flashinfer"})
    got = paths(group=2)
    assert (got.backend, got.decode_backend) == ("flashinfer", "triton")
    assert "measured faster" in got.backend_why and "measured faster" in got.decode_why
    line = got.log_line(fused_rows=16)
    assert "decode (17+ rows): triton (measured faster at decode steps for head_dim 128, group 2" in line
    assert "prefill/mixed: flashinfer (measured faster at prefill steps" in line
    assert paths(group=2, tp=True).log_line(fused_rows=0).startswith("decode (1 row): triton (per-op:")
    without = paths(group=2, plat=platform(installed=()))  # not installed: triton serves both
    assert (without.backend, without.decode_backend) == ("triton", "triton")
    named = paths("flashinfer", group=2)  # a backend by name serves every kind
    assert (named.backend, named.decode_backend) == ("flashinfer", "flashinfer")


def test_pure_decode_steps_run_the_decode_backend_and_chunk_steps_the_step_backend(tiny_qwen2):
    """The runner routes by step kind: a second backend object set as the decode backend plans
    every pure-decode step and nothing else, and the tokens do not change (both are torch)."""
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def generate(engine):
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        return [done[i] for i in ids]

    want = generate(Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=2)))
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=2))
    runner = engine.runner
    runner.decode_backend = TorchBackend(engine.kv_pool, runner.backend.num_q_heads)
    kinds = {"step": [], "decode": []}
    for name, backend in (("step", runner.backend), ("decode", runner.decode_backend)):
        plan = backend.plan
        backend.plan = lambda meta, plan=plan, name=name: (kinds[name].append(meta.host.is_pure_decode), plan(meta))[1]
    assert generate(engine) == want
    assert kinds["decode"] and all(kinds["decode"])  # pure decode only
    assert kinds["step"] and not any(kinds["step"])  # every step with a chunk


def test_the_engine_logs_one_step_paths_line(tiny_qwen2, caplog):
    with caplog.at_level("INFO", logger="flashlet"):
        Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=1))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step paths:")]
    assert lines == ["step paths: decode (1 row): torch (per-op: the device is cpu, not CUDA); "
                     "decode (2+ rows): torch; prefill/mixed: torch (auto on cpu: the torch backend)"]
