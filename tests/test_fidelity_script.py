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


def fake_scores(n: int = 400):
    """engine_scores' stand-in: argmax tokens per (dtype, variant) that differ from the fp32
    run's on known positions, and a constant NLL per row (so each perplexity is known)."""
    import torch

    ref = torch.arange(n) % 7
    flipped = {"bfloat16": range(0, 12), "fp8 weights": range(6, 40), "fp8 KV": range(0, 16),
               "both": range(0, 50), "checkpoint": range(8, 20)}
    nll = {"float32": 3.0, "bfloat16": 3.01, "fp8 weights": 3.05, "fp8 KV": 3.012, "both": 3.06,
           "checkpoint": 3.02}

    def scores(args, seqs, dtype, variant, model=None):
        assert sum(map(len, seqs)) == n
        if model is not None:  # a --quantized-model row: that folder, as stored
            assert dtype == args.dtype and variant == {}
            key = "checkpoint"
        elif dtype == "float32":
            assert variant == {}
            key = "float32"
        else:
            key = {(): "bfloat16", ("quantization",): "fp8 weights",
                   ("kv_cache_dtype",): "fp8 KV"}.get(tuple(variant), "both")
        top = ref.clone()
        if key != "float32":
            top[list(flipped[key])] += 1
        return top, torch.full((n - len(seqs),), nll[key])

    return scores, flipped


def test_perplexity_agreement_is_against_the_fp32_run_and_differences_are_paired(
        tmp_path, monkeypatch):
    import math

    import torch

    fidelity = load_script()
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    texts[0].write_text("The quick brown fox jumps over the lazy dog. " * 40)
    texts[1].write_text("Pages of a fixed size hold the keys and values. " * 40)
    seqs = fidelity.text_sequences(load_tokenizer(), texts, 200)
    assert [len(s) for s in seqs] == [200, 200]  # each file one sequence, cut to --max-len
    scores, flipped = fake_scores(400)
    monkeypatch.setattr(fidelity, "engine_scores", scores)
    out = tmp_path / "p.json"
    rc = fidelity.main(["--perplexity", "--device", "cpu", "--kv-cache-dtype", "fp8", "--text",
                        *map(str, texts), "--max-len", "200", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["tokens"] == 400 and result["sequences"] == 2
    assert result["agreement"] == pytest.approx(1 - 12 / 400)  # not 1: the fp32 run is the reference
    assert result["perplexity"] == pytest.approx(math.exp(3.01))
    weights, kv, both = (result["variants"][k] for k in ("fp8 weights", "fp8 KV", "fp8 weights + fp8 KV"))
    assert weights["agreement"] == pytest.approx(1 - 34 / 400)
    # paired: positions 0-5 only bf16 gets wrong, 12-39 only fp8 weights do
    assert weights["diff_vs_unquantized"] == pytest.approx((6 - 28) / 400)
    assert kv["diff_vs_unquantized"] == pytest.approx(-4 / 400)
    d = torch.tensor([0.0] * 12 + [-1.0] * 4 + [0.0] * 384)
    assert kv["diff_se"] == pytest.approx(d.std().item() / 20)
    assert weights["allowed_points"] == 0.03 and kv["allowed_points"] == 0.01
    assert both["allowed_points"] is None and both["agreement_verdict"] == "no #31 bound"
    assert weights["ratio"] == pytest.approx(math.exp(0.04))  # 4.1% over: the exit status's rule
    assert rc == 1


def test_a_quantized_checkpoint_is_scored_against_the_original_models_fp32_run(
        tmp_path, monkeypatch):
    fidelity = load_script()
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 100)
    checkpoint = tmp_path / "gptq"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    scores, _ = fake_scores(400)
    models = []

    def recording(args, seqs, dtype, variant, model=None):
        models.append((dtype, model))
        return scores(args, seqs, dtype, variant, model)

    monkeypatch.setattr(fidelity, "engine_scores", recording)
    out = tmp_path / "p.json"
    fidelity.main(["--perplexity", "--device", "cpu", "--text", str(text), "--max-len", "400",
                   "--quantized-model", str(checkpoint), "--json", str(out)])
    # the fp32 reference and the bf16 row are --model's (the default), the row the folder's
    assert models[:2] == [("float32", None), ("bfloat16", None)]
    assert models[-1] == ("bfloat16", str(checkpoint))
    row = json.loads(out.read_text())["variants"]["fp8 checkpoint gptq"]
    assert row["agreement"] == pytest.approx(1 - 12 / 400)
    assert row["diff_vs_unquantized"] == pytest.approx((8 - 8) / 400)  # only bf16 wrong at 0-7, only it at 12-19
    assert row["allowed_points"] == 0.03


def test_quantized_model_is_read_by_perplexity_only_and_must_be_a_model_folder(tmp_path):
    fidelity = load_script()
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--quantized-model", str(tmp_path)])
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--perplexity", "--quantized-model", str(tmp_path)])


def test_agreement_verdict_reads_the_paired_interval():
    fidelity = load_script()
    assert fidelity.agreement_verdict(-0.005, 0.002, 0.01) == "within 1 pt"  # -0.89 at worst
    assert fidelity.agreement_verdict(-0.008, 0.002, 0.01) == "1 pt undecided (inside the interval)"
    assert fidelity.agreement_verdict(-0.045, 0.005, 0.03) == "short of 3 pt"  # -3.52 at best
    assert fidelity.agreement_verdict(-0.045, 0.005, None) == "no #31 bound"
    assert fidelity.agreement_bound({"quantization": "fp8"}) == 0.03
    assert fidelity.agreement_bound({"kv_cache_dtype": "fp8"}) == 0.01
    assert fidelity.agreement_bound({}) is None


def test_text_is_read_by_perplexity_only_and_must_exist(tmp_path):
    fidelity = load_script()
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--text", str(SCRIPT)])
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--perplexity", "--text", str(tmp_path / "missing.txt")])
    assert fidelity.parse_args(["--perplexity"]).text is None


@pytest.mark.slow
def test_perplexity_runs_the_embedded_model_through_the_engine(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(SCRIPT.with_name("fidelity_text.txt").read_text())
    out = tmp_path / "p.json"
    load_script().main(["--perplexity", "--device", "cpu", "--text", str(text), "--max-len", "48",
                        "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["tokens"] == 48
    weights = result["variants"]["fp8 weights"]
    assert 0.5 < result["agreement"] <= 1 and 0.5 < weights["agreement"] <= 1
    assert result["fp32_perplexity"] != result["perplexity"] != weights["perplexity"]


def load_tokenizer():
    from flashlet.models.weights import embedded_model_dir, load_tokenizer as load

    return load(embedded_model_dir())
