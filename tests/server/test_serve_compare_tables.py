"""scripts/serve_compare.py's tables from records shaped as its two runs write them (the
server's with the diagnostics that `bench --url` adds per level): every row has its header's
columns, and the figures land in their columns."""

from __future__ import annotations

from flashlet.server import diagnostics
from flashlet.server.diagnostics import NUM_BUCKETS, ApiCounters, LoopCounters, level_figures
from tests.conftest import load_script


def _summary(p50: float) -> dict:
    return {"n": 10, "mean": p50, "p50": p50, "p90": p50, "p99": 2 * p50, "min": p50,
            "max": 2 * p50}


def _levels(concurrencies, server: bool) -> list[dict]:
    levels = []
    for c in concurrencies:
        level = {"concurrency": c, "num_requests": 64, "output_tok_s": 1000.0 * c,
                 "duration_s": 10.0, "output_tokens": 8192, "num_steps": 1024 if not server else 0,
                 "ttft_ms": _summary(20.0), "itl_ms": _summary(2.0), "step_ms": _summary(2.0),
                 "failed": 0, "samples": {"ttft_ms": [20.0, 21.0]}}
        if server:
            level["token_events"] = 4096
            level["server_diag"] = _diag()
        levels.append(level)
    return levels


def _diag() -> dict:
    core = LoopCounters()
    api = ApiCounters(0, 2)
    try:
        before = {"cores": [{"loop": core.snapshot()}], "api_servers": api.snapshot()}
        for _ in range(4):
            core.step_done(0.002, 0, 0)
        row = api.rows
        row[0], row[1], row[2], row[3] = 1.5, 10.0, 100, 400  # cpu, wall, events, tokens
        row[diagnostics._LAG + 3] += 5  # loop-lag samples in a low bucket
        after = {"cores": [{"loop": core.snapshot()}], "api_servers": api.snapshot()}
    finally:
        core.gc.close()
    assert len(after["api_servers"][0]["loop_lag"]) == NUM_BUCKETS
    return level_figures(before, after, 10.0)


def test_both_tables_have_their_headers_columns():
    sc = load_script("serve_compare")
    inproc = {"levels": _levels([1, 64], server=False)}
    server = {"levels": _levels([1, 64], server=True)}
    for text in (sc.table(inproc, server), sc.diagnostics_table(inproc, server)):
        lines = text.splitlines()
        assert len(lines) == 4
        columns = {line.count("|") for line in lines}
        assert len(columns) == 1, text
    diag = sc.diagnostics_table(inproc, server).splitlines()[2]
    assert "| 1 | 102 / c0 0 |" in diag  # in-process steps/s (1024 in 10 s) / the core's
    assert "a0 0.15 (0/s), a1 0.00 (0/s)" in diag  # CPU busy: 1.5 s of 10, never preempted
    assert "a0 4.00, a1 –" in diag  # tokens per event
    assert diag.count("a0 0.05 / 0.05 / 0.05") == 1  # the loop lag: 5 samples in bucket 3


def test_the_main_table_gives_itl_p99_of_both_sides_and_their_ratio():
    sc = load_script("serve_compare")
    inproc = {"levels": _levels([1], server=False)}
    server = {"levels": _levels([1], server=True)}
    server["levels"][0]["itl_ms"] = _summary(3.0)  # p99 6.0 against the in-process 4.0
    row = sc.table(inproc, server).splitlines()[2]
    assert "| 4.00 / 6.00 | 1.50 |" in row


def test_the_itl_shape_line_gives_both_sides_long_and_late_gaps():
    sc = load_script("serve_compare")
    inproc = {"levels": _levels([1], server=False)}
    server = {"levels": _levels([1], server=True)}
    inproc["levels"][0]["itl_shape"] = {"median_ms": 0.46, "long": 0.001, "late": 0.0}
    server["levels"][0]["itl_shape"] = {"median_ms": 0.456, "long": 0.113, "late": 0.09}
    line = sc.itl_shape(inproc, server, 1)
    assert "in-process 0.1% long, 0.0% late (median 0.460 ms)" in line
    assert "server 11.3% long, 9.0% late (median 0.456 ms)" in line
    assert sc.itl_shape({"levels": _levels([1], False)}, {"levels": _levels([1], True)}, 1) == ""
