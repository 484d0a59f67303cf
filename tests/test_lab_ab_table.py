"""lab/ab_table.py: an A/B's closed-loop pairs and N-stream runs side by side, from the JSON the
bench and fused_decode_bench.py write (the shapes below are theirs, trimmed to what it reads)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "ab_table.py"
spec = importlib.util.spec_from_file_location("ab_table", SCRIPT)
ab_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_table)


def loop_json(path: Path, tok_s: dict[int, float]) -> str:
    levels = [{"concurrency": c, "output_tok_s": v, "itl_ms": {"p50": 1.0}} for c, v in tok_s.items()]
    path.write_text(json.dumps({"workload": "closed-loop", "results": {"levels": levels}}))
    return str(path)


def streams_json(path: Path, per_stream: dict[int, float]) -> str:
    streams = {str(n): {"first_per_stream_tok_s": v - 1, "second_per_stream_tok_s": v, "decode_tok_s": v * n}
               for n, v in per_stream.items()}
    path.write_text(json.dumps({"default": {"start_s": 1.0, "prompt_len": 32, "streams": streams}}))
    return str(path)


def test_pairs_and_streams_side_by_side_with_changes_and_ratios(tmp_path, capsys):
    a = [loop_json(tmp_path / f"a{i}.json", {1: 1000.0, 4: 3000.0, 16: 8000.0}) for i in (1, 2)]
    b = [loop_json(tmp_path / "b1.json", {1: 1000.0, 4: 3300.0, 16: 8800.0}),
         loop_json(tmp_path / "b2.json", {1: 990.0, 4: 3150.0, 16: 8000.0})]
    sa = streams_json(tmp_path / "sa.json", {1: 2000.0, 16: 1100.0})
    sb = streams_json(tmp_path / "sb.json", {1: 1980.0, 16: 1320.0})
    assert ab_table.main(["--loop-a", *a, "--loop-b", *b, "--streams-a", sa, "--streams-b", sb]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| 1 | 4 | 3,000 | 3,300 | +10.0% |" in out
    assert "| 2 | 1 | 1,000 | 990 | -1.0% |" in out and "| 2 | 16 | 8,000 | 8,000 | +0.0% |" in out
    # per stream against c = 1: 3,000 / 4 / 1,000 = 0.75, 8,800 / 16 / 1,000 = 0.55
    assert "pair 1 per stream against c = 1: A c4 0.75 c16 0.50; B c4 0.82 c16 0.55" in out
    assert "| 1 | 2,000.0 | 1,980.0 | -1.0% |" in out and "| 16 | 1,100.0 | 1,320.0 | +20.0% |" in out


def test_unpaired_or_missing_inputs_are_refused(tmp_path, capsys):
    a = loop_json(tmp_path / "a.json", {1: 1.0})
    with pytest.raises(ValueError, match="pairs needed"):
        ab_table.main(["--loop-a", a, a, "--loop-b", a])
    with pytest.raises(SystemExit):
        ab_table.main(["--streams-a", a])  # without --streams-b
    with pytest.raises(SystemExit):
        ab_table.main([])
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"default": {"streams": {}}, "fused": {"streams": {}}}))
    with pytest.raises(ValueError, match="one path expected"):
        ab_table.main(["--streams-a", str(two), "--streams-b", str(two)])
