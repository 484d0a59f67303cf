"""scripts/tune_triton.py on the CPU (Triton interpreter, a tiny shape): every config checked
against the reference, a winner per bucket, and the printed tables are valid tuning.py source."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from flashlet.kernels import tuning
from flashlet.kernels.tuning import DecodeConfig, PrefillConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tune_triton.py"


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("tune_triton", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_counts_fit_the_budget(tune, capsys):
    assert tune.main(["--plan"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    assert plan["main_kernel_compiles"] <= 150 and plan["timings"] <= 1500


def test_decode_candidates_are_distinct_split_choices(tune):
    cands = tune.decode_candidates(1, 2, 132, (64, 4, 2))
    keys = [(tuning.num_splits(1, 2, 132, c.waves, 64), c.min_split_tokens) for c in cands]
    assert len(keys) == len(set(keys)) and len(cands) > 1
    assert len(tune.decode_candidates(256, 8, 132, (64, 4, 2))) == 1  # unsplit: one choice


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU check of the script")
def test_tune_shape_on_a_tiny_shape(tune, monkeypatch):
    monkeypatch.setattr(tune, "WAVES", (1, 4))  # the interpreter is slow: few split choices
    monkeypatch.setattr(tune, "MIN_SPLITS", (16,))
    args = types.SimpleNamespace(
        buckets=[1, 4], contexts=[40], calls=1, tiles=[(16, 4, 2), (32, 4, 2)],
        prefill_tiles={"short": [(16, 16, 4, 2)], "long": [(16, 16, 4, 2), (32, 16, 4, 2)]},
        prefill_specs={"short": [[(2, 20)] * 2], "long": [[(20, 20)] * 2]},
        check_lens=(1, 20, 45), prefill_check=[(5, 20), (16, 16), (1, 30)])
    gen = torch.Generator().manual_seed(0)
    rows, dec, pre, ratio = tune.tune_shape("tiny", 16, 2, 1, args, tune.Bench(1, 1), 4, gen, None, torch.float32)
    assert set(dec) == {(16, 2, 1), (16, 2, 4)} and ratio is None
    assert set(pre) == {(16, 2, tuning.PREFILL_QLEN_BUCKETS[0]), (16, 2, tuning.PREFILL_QLEN_BUCKETS[-1])}
    assert all(r[3] and all(t > 0 for t in r[3]) for r in rows)
    source = tune.table_literals(dec, pre, {(16, 2, "decode"): "triton"})
    scope = {"DecodeConfig": DecodeConfig, "PrefillConfig": PrefillConfig}
    exec(source, scope)
    assert scope["DECODE_TABLE"] == dec and scope["PREFILL_TABLE"] == pre
    assert scope["BACKEND_PREFERENCE"] == {(16, 2, "decode"): "triton"}
