"""scripts/prefill_split_bench.py on the CPU: every config is checked against the reference before
it would be timed, and a wrong kernel is reported (exit 1), never timed."""

from __future__ import annotations

import json

import pytest
import torch

from flashlet.kernels import prefill_attention as pa
from tests.conftest import load_script

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs the interpreter on the CPU; "
                              "on a GPU the script itself is the check (it verifies every config)")
FEW = ["--smoke", "--contexts", "40", "--splits", "2", "--min-split-tokens", "16"]


@CPU_ONLY
def test_smoke_checks_every_config(tmp_path):
    out = tmp_path / "rows.json"
    assert load_script("prefill_split_bench").main([*FEW, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["splits"]) for r in rows] == [("tiny-g3", 1), ("tiny-g3", 2), ("tiny-g2", 1), ("tiny-g2", 2)]
    assert all(r["max_rel_err"] < 1e-5 and "ms_24_layers" not in r and not r.get("wrong") for r in rows)


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
    for bad in (["--models", "llama"], ["--contexts", "100", "--chunk", "448"], ["--splits", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    args = bench.parse_args(["--splits", "4,8"])
    assert args.splits == (1, 4, 8) and args.contexts == bench.CONTEXTS and args.chunk == 448
