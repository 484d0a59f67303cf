"""scripts/bench_summary.py and scripts/start_time.py --table: the compact tables gpu_run.sh's
issue-14 parts end in, read from real bench records and start lines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_rows_hold_end_to_end_beside_steady(run_bench, tiny_config, tmp_path, capsys):
    _, _, rec = run_bench("--config", tiny_config, "--workload", "offline", "--num-requests", 3,
                          "--prompt-len-range", 5, 9, "--output-len-range", 2, 4)
    path = tmp_path / "offline.json"
    path.write_text(json.dumps(rec))
    summary = _load("bench_summary")
    (row,) = summary.rows_of(path)
    r = rec["results"]
    assert row[1:4] == ["offline", rec["model"]["name"], "auto->torch"]
    assert row[5:8] == [r["first_run"]["output_tok_s"], r["output_tok_s"], r["first_over_repeat"]]
    assert summary.main([str(path)]) == 0
    assert "| offline | offline |" in capsys.readouterr().out


def test_start_table_names_what_auto_resolved_to(tmp_path):
    line = {"label": "cold", "backend": "auto", "resolved": "triton", "start_s": 12.5, "load_s": 2.0,
            "warmup_s": 8.0, "capture_s": 2.5, "graphs": 9, "triton_compiles": 21, "first_request_s": 0.2}
    path = tmp_path / "start.jsonl"
    path.write_text(json.dumps(line) + "\n")
    text = _load("start_time").table([path])
    assert "| cold | auto (triton) | 12.50 | 2.00 | 8.00 | 2.50 | - | - | 9 | 21 | 0.20 | - |" in text
    path.write_text(json.dumps({**line, "backend": "triton", "fused_decode": True,
                                "cute_gemvs": 12, "cute_compile_s": 1.75, "cute_from_disk": 12}) + "\n")
    assert ("| cold | triton +fused | 12.50 | 2.00 | 8.00 | 2.50 | 1.75 | 12 | 9 | 21 | 0.20 | - |"
            in _load("start_time").table([path]))
    workers = {"workers": 4, "plans": 12, "files": 11, "first_file_s": 6.04, "last_file_s": 9.5, "waited_s": 7.0}
    path.write_text(json.dumps({**line, "backend": "triton", "fused_decode": True, "cute_gemvs": 12,
                                "cute_compile_s": 7.25, "cute_from_disk": 11, "cute_precompile": workers}) + "\n")
    assert ("| 7.25 | 11 | 9 | 21 | 0.20 | 11/12 in 4: 6.0-9.5 s |" in _load("start_time").table([path]))


def test_labels_say_where_one_stream_ran_fused():
    """The bench tables' engine labels: what auto resolved to, and the fused decode path where
    the engine ran it (engine.config reports the default's choice)."""
    from flashlet.bench.report import _ours

    record = {"workload": "single", "backends": {"triton": {}, "auto": {}, "torch": {}},
              "engines": {"triton": {"backend": "triton", "fused_decode": True},
                          "auto": {"backend": "triton", "fused_decode": True},
                          "torch": {"backend": "torch", "fused_decode": False}}}
    assert [label for label, _ in _ours(record)] == [
        "flashlet (triton, fused decode)", "flashlet (auto: triton, fused decode)", "flashlet (torch)"]
