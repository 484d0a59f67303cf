"""scripts/prefill_split_bench.py on the CPU: every config is checked against the reference before
it would be timed, and a wrong kernel is reported (exit 1), never timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashlet.kernels import prefill_attention as pa
from tests.conftest import load_script

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs the interpreter on the CPU; "
                              "on a GPU the script itself is the check (it verifies every config)")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prefill_split_bench.py"
FEW = ["--smoke", "--contexts", "40", "--splits", "2", "--min-split-tokens", "16"]


@CPU_ONLY
def test_smoke_checks_every_config(tmp_path):
    out = tmp_path / "rows.json"
    assert load_script("prefill_split_bench").main([*FEW, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["splits"]) for r in rows] == [("tiny-g3", 1), ("tiny-g3", 2), ("tiny-g2", 1), ("tiny-g2", 2)]
    assert all(r["max_rel_err"] < 1e-5 and "ms_24_layers" not in r and not r.get("wrong") for r in rows)


@CPU_ONLY
def test_smoke_checks_the_other_tiles_asked_for(tmp_path):
    """--block-n / --num-stages: the engine's tile first, then each other key block and stage
    count, every config checked."""
    out = tmp_path / "rows.json"
    assert load_script("prefill_split_bench").main([*FEW, "--block-n", "16,32", "--num-stages", "3",
                                                   "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["block_n"], r["num_stages"], r["splits"]) for r in rows if r["model"] == "tiny-g3"] == [
        (16, 2, 1), (16, 2, 2), (16, 3, 1), (16, 3, 2), (32, 3, 1), (32, 3, 2)]
    assert all(r["max_rel_err"] < 1e-5 and not r.get("wrong") for r in rows)


@CPU_ONLY
def test_a_wrong_kernel_is_reported_not_timed(monkeypatch, tmp_path):
    real = pa.prefill_attention

    def halved(*args, **kwargs):
        return real(*args, **kwargs).mul_(0.5)

    monkeypatch.setattr(pa, "prefill_attention", halved)
    out = tmp_path / "rows.json"
    assert load_script("prefill_split_bench").main([*FEW, "--json", str(out)]) == 1
    assert all(r["wrong"] for r in json.loads(out.read_text()))


def test_arguments_are_checked():
    bench = load_script("prefill_split_bench")
    for bad in (["--models", "llama"], ["--contexts", "100", "--chunk", "448"], ["--splits", "0"],
                ["--block-n", "24"], ["--num-stages", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    args = bench.parse_args(["--splits", "4,8"])
    assert args.splits == (1, 4, 8) and args.contexts == bench.CONTEXTS and args.chunk == 448


@pytest.mark.slow
def test_split_kernel_lowers_for_sm90_without_spills():
    """--lower (a child without the interpreter): at Qwen3-0.6B's tiles (8 warps) the split kernel
    holds 128 registers (two programs an SM) with no spill, the merge spills nothing either, and
    the unsplit kernel gets no register cap."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--lower", "1", "8", "--models", "qwen3-0.6b"],
                          capture_output=True, text=True, timeout=600, cwd=SCRIPT.parents[1],
                          env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(SCRIPT.parents[1])})
    if proc.returncode != 0 and "No such file" in proc.stderr and "ptxas" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    unsplit, split = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert "maxnreg" not in unsplit and split["maxnreg"] == 128
    assert "Used 128 registers" in split["prefill_kernel_ptxas"]
    for text in (unsplit["prefill_kernel_ptxas"], split["prefill_kernel_ptxas"], split["merge_kernel_ptxas"]):
        assert "0 bytes spill stores" in text and "0 bytes spill loads" in text


def test_the_best_config_becomes_a_prefill_table_entry_the_engine_loads(tmp_path, monkeypatch):
    """--table-json: per model the config of least total time over every context timed (one
    missing a context is left out), in the short bucket's key, with its splits' rows cut to fit
    the one scratch; tuning.load_tables puts it in PREFILL_TABLE, where prefill_config finds it."""
    from flashlet.kernels import tuning

    bench = load_script("prefill_split_bench")

    def row(bn, st, s, m, context, ms):
        return dict(model="qwen3-0.6b", context=context, block_n=bn, num_stages=st, splits=s, min_split_tokens=m,
                    ms_24_layers=ms)

    rows = [row(32, 2, 16, 512, 8000, 2.0), row(32, 2, 16, 512, 30000, 4.0),
            row(64, 3, 32, 256, 8000, 1.5), row(64, 3, 32, 256, 30000, 3.0),
            row(64, 4, 32, 256, 8000, 0.5),  # not timed at 30,000: left out
            dict(model="qwen3-0.6b", context=8000, block_n=32, num_stages=2, splits=1, min_split_tokens=0,
                 wrong=True)]
    entries = bench.table_entries(rows, chunk=16)
    assert len(entries) == 1
    key, fields = entries[0]
    assert key == [128, 2, 16, "prefill"]
    assert (fields["block_n"], fields["num_stages"], fields["num_splits"], fields["min_split_tokens"],
            fields["split_max_tokens"]) == (64, 3, 32, 256, tuning.PREFILL_SPLIT_SCRATCH_ROWS // 32)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(entries))
    monkeypatch.setattr(tuning, "PREFILL_TABLE", {})
    tuning.load_tables(str(path))
    got = tuning.prefill_config(128, 2, 9)
    assert (got.block_n, got.num_stages, got.num_splits) == (64, 3, 32)
    assert tuning.prefill_config(128, 2, 500) == tuning.default_prefill(128, 2, tuning.PREFILL_QLEN_BUCKETS[1])
