"""`python -m torchlet.bench` on a tiny random-weight config: one row per version, skips with
their reason, speed-ups relative to the previous rung that ran, and the JSON output."""

import json

import pytest
import torch

from torchlet import bench


def test_bench_runs_versions_on_random_weights(tiny_model_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    config = tiny_model_dirs["qwen2"] / "config.json"
    argv = ["--config", str(config), "--versions", "v00", "v02", "v07", "v08",
            "--batch-sizes", "1", "4", "--max-new-tokens", "3", "--markdown", "--json", str(out)]
    bench.main(argv)
    table = capsys.readouterr().out
    assert "| version | tok/s b=1 | x prev b=1 | tok/s b=4 | x prev b=4 | note |" in table
    rows = {row["version"]: row for row in json.loads(out.read_text())["rows"]}
    names = ["v00_full_recompute", "v02_kv_cache", "v07_cuda_graph", "v08_paged_gqa_py"]
    assert list(rows) == names
    for version in ["v00_full_recompute", "v02_kv_cache", "v08_paged_gqa_py"]:
        assert all(value > 0 for value in rows[version]["tok_s"].values())
    v00, v02, v08 = rows["v00_full_recompute"], rows["v02_kv_cache"], rows["v08_paged_gqa_py"]
    assert v02["speedup"]["4"] == pytest.approx(v02["tok_s"]["4"] / v00["tok_s"]["4"])
    if not torch.cuda.is_available():
        assert "needs CUDA" in rows["v07_cuda_graph"]["note"]
        assert rows["v07_cuda_graph"]["tok_s"]["1"] is None
        # the speed-up skips over the rung that could not run
        assert v08["speedup"]["1"] == pytest.approx(v08["tok_s"]["1"] / v02["tok_s"]["1"])


def test_named_configs_travel_with_the_package():
    path = bench.resolve_config_path("qwen2.5-0.5b")
    assert json.loads(path.read_text())["model_type"] == "qwen2"
    with pytest.raises(SystemExit, match="qwen2.5-0.5b"):
        bench.resolve_config_path("no-such-config")


def test_version_prefixes_select_versions():
    assert bench.select_versions(["v01", "v10"]) == [
        "v01_0_ragged_batch", "v01_1_split_gqa", "v10_triton_paged_gqa"]
    with pytest.raises(SystemExit, match="unknown versions"):
        bench.select_versions(["v99"])
