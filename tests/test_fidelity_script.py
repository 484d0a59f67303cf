"""scripts/fidelity.py end to end on the CPU: a tiny Qwen3 config, the torch backend, fp32
against fp32 (exact agreement expected), results written as JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fidelity.py"
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 512, "tie_word_embeddings": True}


def load_script():
    spec = importlib.util.spec_from_file_location("fidelity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_on_tiny(tmp_path, *flags) -> tuple[int, list]:
    """The script on the tiny config (CPU, fp32, torch backend) with `flags` -> (exit code, the
    records it wrote)."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "fidelity.json"
    rc = load_script().main(["--config", str(config), "--device", "cpu", "--backend", "torch",
                             *flags, "--json", str(out)])
    return rc, json.loads(out.read_text())


PRESET_RUN = ("--dtype", "float32", "--num-seqs", "2", "--seq-len", "128", "--chunk", "48")


@pytest.mark.slow
def test_fidelity_runs_end_to_end_on_a_tiny_config(tmp_path):
    rc, (result,) = run_on_tiny(tmp_path, *PRESET_RUN)
    assert rc == 0
    assert result["positions"] == 256
    assert result["distinct_fp32_argmax"] > 50  # not a degenerate model
    torch_run = result["backends"]["torch"]
    assert torch_run["agreement"] == 1.0 and torch_run["disagreements"] == []
    assert torch_run["max_abs_logit_diff"] < 1e-4


def test_fewer_than_256_positions_is_refused():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--num-seqs", "1", "--seq-len", "100"])


def test_paired_difference_counts_only_the_positions_where_the_two_differ():
    import torch

    fidelity = load_script()
    ours = torch.tensor([True] * 90 + [False] * 10)
    theirs = torch.tensor([True] * 88 + [False] * 2 + [True] * 2 + [False] * 8)
    diff, se = fidelity.paired_difference(ours, theirs)
    assert diff == pytest.approx(0.0)
    d = torch.tensor([0.0] * 88 + [1.0] * 2 + [-1.0] * 2 + [0.0] * 8)
    assert se == pytest.approx(d.std().item() / 10)
    assert fidelity.paired_difference(ours, ours) == (0.0, 0.0)


def test_markdown_table_marks_failures_with_the_reason():
    fidelity = load_script()
    hf = {"agreement": 0.95, "agreement_se": 0.005, "disagreements": []}
    ok = {"agreement": 0.945, "agreement_se": 0.005, "diff_vs_hf_low": -0.005, "diff_se": 0.003,
          "disagreements": [{"position": 1, "fp32_gap": 0.01}]}
    short = {"agreement": 0.93, "agreement_se": 0.006, "diff_vs_hf_low": -0.02, "diff_se": 0.004,
             "disagreements": [{"position": 2, "fp32_gap": 0.5}]}
    table = fidelity.markdown_table([{"config": "p", "positions": 2048, "dtype": "bfloat16",
                                      "hf_low": hf, "near_tie_threshold": 0.1,
                                      "backends": {"torch": ok, "flashinfer": short}}])
    header, rule, row = table.splitlines()
    assert header == "| preset | positions | HF bfloat16 | threshold | torch | flashinfer |"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["p", "2048", "95.00 +- 0.98", "0.1"]
    assert cells[4] == "94.50 +- 0.98 (diff -0.50 +- 0.59)"
    assert cells[5].startswith("**93.00") and "1.00 pt short" in cells[5] and "gaps 0.5" in cells[5]


def test_diagnose_schedule_covers_each_prompt_once_then_decodes():
    fidelity = load_script()
    import random

    prompts, totals, steps = fidelity.diag_schedule(random.Random(0), 4, 64, pure_decode_steps=3)
    assert all(100 <= p <= 300 for p in prompts)
    seen = {i: [] for i in range(4)}
    for step in steps:
        for i, start, n in step:
            assert start == len(seen[i])  # each sequence's rows in order, none skipped
            seen[i] += range(start, start + n)
    assert [len(s) for s in seen.values()] == totals
    mixed = [s for s in steps if any(n > 1 for *_, n in s) and any(st >= prompts[i] for i, st, _ in s)]
    assert mixed, "no step mixes decode rows with prefill chunks"
    assert all(n == 1 for step in steps[-3:] for *_, n in step)


@pytest.mark.slow
def test_diagnose_on_cpu_measures_the_torch_backend_against_fp32(tmp_path):
    rc, (entry,) = run_on_tiny(tmp_path, "--diagnose", "--diag-seqs", "4", "--diag-qk-scale", "1")
    assert rc == 0
    plain, rotated = entry["attention"]
    assert not plain["rope"] and rotated["rope"]
    for kind in ("prefill", "decode-mixed", "decode"):
        floor_rms = plain["errors"]["floor"][kind][0]
        assert 5e-4 < floor_rms < 5e-3  # one bf16 rounding
        # the oracle's math in bf16: at most a few roundings more, never a wrong row
        assert plain["errors"]["torch"][kind][0] < 2 * floor_rms
        assert plain["errors"]["torch"][kind][1] < 0.02
        assert rotated["errors"]["torch"][kind][1] < 0.05
        assert plain["errors"]["hf-way"][kind][1] < 0.02  # its rows mapped back to the steps' rows
        # bf16 partial outputs: more error than one rounding, less than two independent ones
        assert floor_rms < plain["errors"]["emulated split-KV"][kind][0] < 1.5 * floor_rms
    rope = entry["rope"]["positions 0-319"]
    ours = rope["TorchOps.rope (fp32 math and cos/sin, one rounding)"][0]
    assert ours < 1.01 * rope["floor (fp64 result rounded once)"][0]
    assert ours < rope["HF bf16 (cos/sin and each op in bf16)"][0]


@pytest.mark.slow
def test_fidelity_adds_an_fp8_row_judged_against_its_own_backend(tmp_path):
    rc, (result,) = run_on_tiny(tmp_path, *PRESET_RUN, "--quantization", "fp8")
    fp8 = result["backends"]["torch+fp8"]
    assert fp8["diff_vs_unquantized"] == fp8["agreement"] - 1.0
    assert fp8["max_abs_logit_diff"] > 1e-3  # the fp8 weights really ran
    assert fp8["agreement"] > 0.9 and fp8["ok"] and rc == 0


def test_markdown_table_holds_quantized_rows_to_their_own_backend():
    fidelity = load_script()
    hf = {"agreement": 0.99, "agreement_se": 0.002, "disagreements": []}
    row = {"agreement": 0.95, "agreement_se": 0.004, "disagreements": [{"fp32_gap": 5.0}],
           "diff_vs_hf_low": -0.04, "diff_se": 0.004, "diff_vs_unquantized": -0.02}
    assert fidelity.shortfall(row, hf, threshold=0.1) == []  # 2 points under its own: fine
    assert fidelity.shortfall({**row, "diff_vs_unquantized": -0.05}, hf, 0.1) == [
        "2.00 pt short of unquantized - 3"]


def test_kv_cache_dtype_adds_a_row_held_to_one_point_and_reaches_the_engine_config(monkeypatch):
    fidelity = load_script()
    plain = fidelity.parse_args(["--config", "x", "--quantization", "fp8"])
    assert [r[0] for r in fidelity.variant_rows(plain)] == ["+fp8"]
    args = fidelity.parse_args(["--config", "x", "--quantization", "fp8",
                                "--kv-cache-dtype", "fp8"])
    assert fidelity.variant_rows(args) == [("+fp8", {"quantization": "fp8"}, 0.03),
                                           ("+kv-fp8", {"kv_cache_dtype": "fp8"}, 0.01)]
    seen = []

    class Built(Exception):
        pass

    def config(**kwargs):
        seen.append(kwargs)
        raise Built

    monkeypatch.setattr(fidelity, "EngineConfig", config)
    for variant in ({}, {"kv_cache_dtype": "fp8"}):
        with pytest.raises(Built):
            fidelity.engine_for(args, "x", "torch", **variant)
    assert "kv_cache_dtype" not in seen[0]  # not passed unless asked: older configs lack it
    assert seen[1]["kv_cache_dtype"] == "fp8"


def test_perplexity_rows_for_an_fp8_kv_cache():
    fidelity = load_script()
    assert fidelity.perplexity_variants(fidelity.parse_args(["--perplexity"])) == {
        "fp8 weights": {"quantization": "fp8"}}
    with_kv = fidelity.parse_args(["--perplexity", "--kv-cache-dtype", "fp8"])
    rows = fidelity.perplexity_variants(with_kv)
    assert rows == {"fp8 weights": {"quantization": "fp8"}, "fp8 KV": {"kv_cache_dtype": "fp8"},
                    "fp8 weights + fp8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}


def test_an_fp8_kv_row_one_point_short_is_marked():
    fidelity = load_script()
    hf = {"agreement": 0.99, "agreement_se": 0.002, "disagreements": []}
    row = {"agreement": 0.975, "agreement_se": 0.004, "disagreements": [],
           "diff_vs_hf_low": -0.015, "diff_se": 0.004, "diff_vs_unquantized": -0.015,
           "allowed_points": 0.01}
    assert fidelity.shortfall(row, hf, threshold=0.1) == ["0.50 pt short of unquantized - 1"]
