"""lab/cached_prompt_call.py on the CPU (a tiny model; the device part where CUDA is): it runs end to end, and a
cached prompt's 1-token call computes only its last page (the prefix cache's hits, per call)."""

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "cached_prompt_call.py"
spec = importlib.util.spec_from_file_location("cached_prompt_call", SCRIPT)
cached_prompt_call = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cached_prompt_call)


def test_a_cached_prompt_call_hits_all_but_its_last_page(tiny_qwen2, capsys):
    cached_prompt_call.main(["--model", str(tiny_qwen2), "--prompt-lens", "40", "200", "--calls", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["prompt_len"] for r in rows] == [40, 200]
    for r in rows:
        assert len(r["call_ms"]) == 2 and all(ms > 0 for ms in r["call_ms"])
        assert r["queried_tokens_a_call"] == r["prompt_len"]
        # whole pages of 16, never the last token: 32 of 40, 192 of 200
        assert r["hit_tokens_a_call"] == (r["prompt_len"] - 1) // 16 * 16
        assert ("device_ms" in r) == torch.cuda.is_available()  # the device part where there is one
        assert len(r["host_top"]) == 6 and all(ms >= 0 for _, _, ms in r["host_top"])


def test_the_timeline_splits_a_call_into_four_parts_that_add_up():
    # a call from 0 to 1,000 us; device events 100-300, 250-400 (overlapping), 500-700, one past the end
    got = cached_prompt_call.timeline((0.0, 1000.0), [(500, 700), (100, 300), (250, 400), (950, 1200)])
    assert got == {"before_device_ms": 0.1, "device_busy_ms": 0.55, "device_gaps_ms": 0.35,
                   "after_device_ms": 0.0}
    assert sum(got.values()) == 1.0
    got = cached_prompt_call.timeline((0.0, 1000.0), [(200, 600)])
    assert got == {"before_device_ms": 0.2, "device_busy_ms": 0.4, "device_gaps_ms": 0.0,
                   "after_device_ms": 0.4}
    assert cached_prompt_call.timeline((0.0, 500.0), [])["before_device_ms"] == 0.5
