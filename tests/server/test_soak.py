"""A short run of scripts/soak.py on random tiny weights: streams, aborts, disconnects and
preemption against a real server process; no 5xx, no leaked KV page, RSS flat."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from test_server_cli import TINY_CONFIG

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", REPO / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_soak(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    soak = _soak_module()
    # 16 pages of 4 tokens: one request (<= 24 + 40 tokens) always fits, a dozen do not. Six
    # seconds of load (two of them warm-up) made 232 requests here, each of soak.ACTIONS 17
    # times or more.
    args = soak.parse_args(["--duration", "6", "--concurrency", "12", "--max-prompt", "24",
                            "--max-new", "40", "--", "--config", str(config), "--page-size",
                            "4", "--max-num-pages", "16", "--max-num-seqs", "12"])
    result = soak.soak(args)
    assert result["ok"], json.dumps(result, indent=1)
    assert result["preemptions"] > 0, result  # the pool was too small for everyone at once
    assert result["status"].get("200", 0) > 10, result
    assert result["actions"].get("stream_abort", 0) + result["actions"].get("disconnect", 0) > 0
    assert result["actions"].get("pathological_guided", 0) > 0  # vLLM's guided_* refused too


def test_a_soak_survives_a_killed_core_under_data_parallel(tmp_path):
    """Issue 35: one of two engine cores killed mid-soak; its requests may fail with "engine
    core N died" (explained), everything else succeeds, nothing leaks, /health is degraded."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    soak = _soak_module()
    args = soak.parse_args(["--duration", "8", "--concurrency", "12", "--max-prompt", "24",
                            "--max-new", "40", "--kill-core-at", "3", "--", "--config",
                            str(config), "--page-size", "4", "--max-num-pages", "32",
                            "--max-num-seqs", "12", "--data-parallel-size", "2"])
    result = soak.soak(args)
    assert result["ok"], json.dumps(result, indent=1)
    assert result["status"].get("200", 0) > 10, result


def test_kill_core_at_needs_a_data_parallel_server_of_its_own():
    soak = _soak_module()
    for argv in (["--kill-core-at", "3"], ["--kill-core-at", "3", "--url", "http://127.0.0.1:1",
                                           "--", "--data-parallel-size", "2"]):
        with pytest.raises(SystemExit):
            soak.parse_args(argv)
