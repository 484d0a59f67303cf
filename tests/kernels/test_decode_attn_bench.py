"""scripts/decode_attn_bench.py on the CPU: the smoke sweep checks every config against the
reference, a wrong kernel is reported and never timed, and the printed table is tuning.py source."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import replace
import json
import sys
from pathlib import Path

import pytest
import torch

from flashlet.kernels import decode_attention as da
from flashlet.kernels import tuning

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "decode_attn_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("decode_attn_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs the interpreter on the CPU; "
                              "on a GPU the script itself is the check (it verifies every config)")


@CPU_ONLY
def test_smoke_sweep_checks_every_config_for_both_kv_dtypes(bench, tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["kv"] for r in rows} == {"model", "fp8"}
    assert {r["prefetch"] for r in rows} == {"none", "pages", "blocks"} and any(r["num_splits"] > 1 for r in rows)
    assert {r["kv_pack"] for r in rows} == {1, 2}  # one and two KV heads a program
    assert {r["merge_in_kernel"] for r in rows} == {False, True}  # split partials merged both ways
    assert all("error" not in r and r["rel_err"] < bench.TOLERANCE for r in rows)


@CPU_ONLY
def test_a_wrong_kernel_is_reported_not_timed(bench, monkeypatch, capsys):
    def zeros(*args, out, **kwargs):
        return out.zero_()

    monkeypatch.setattr(da, "decode_attention", zeros)
    assert bench.main(["--smoke", "--kv", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "ERROR output differs from the reference" in text and " ok " not in text


def test_stage1_judges_tiles_at_the_engines_warps_in_flight(bench):
    base = bench.Variant(64, 2, 3, 2, "pages")  # 2 warps, one KV head, 2 splits
    assert bench.stage1_variant((128, 4, 3, "pages", 2), base) == bench.Variant(128, 4, 3, 4, "pages", kv_pack=2)
    assert bench.stage1_variant((64, 4, 3, "pages", 1), base).num_splits == 2
    assert bench.stage1_variant((64, 1, 3, "pages", 1), base).num_splits == 4  # one warp: twice the programs
    packed = bench.Variant(128, 4, 3, 2, "pages", kv_pack=2)  # 4 warps, both heads, 2 splits
    assert bench.stage1_variant((64, 4, 3, "pages", 1), packed).num_splits == 1
    assert bench.stage1_variant((32, 1, 3, "pages", 2), packed).num_splits == 8
    assert bench.stage1_variant((32, 1, 3, "pages", 1), packed).num_splits == 4


def test_table_literal_is_tuning_source(bench):
    row = dict(block_n=128, num_warps=2, num_stages=3, num_splits=2, prefetch="pages", us=1.0)
    winners = {("fp8", 128, 2000): (row, None, None), ("model", 32, 8000): ({**row, "prefetch": "none"}, None, None),
               ("model", 1, 30000): (None, None, None)}
    entries = bench.table_entries(winners, bench.MODEL, tuning)
    assert set(entries) == {(64, 7, "fp8", 256), (64, 7, "model", 64)}
    scope = {"DecodeConfig": tuning.DecodeConfig}
    exec(bench.table_literal(entries), scope)
    assert scope["BATCHED_DECODE_TABLE"] == entries
    assert entries[(64, 7, "fp8", 256)].num_splits == 2 and entries[(64, 7, "fp8", 256)].prefetch == "pages"


def test_tiles_and_splits_stay_within_reason(bench):
    tiles = bench.viable_tiles()
    assert (64, 4, 2, "none", 1) in tiles and (64, 4, 3, "pages", 1) in tiles and (64, 2, 3, "pages", 2) in tiles
    assert len(tiles) == len(set(tiles)) <= 96
    assert set(bench.QUICK_TILES) <= set(tiles)
    table = {(c.block_n, c.num_warps, c.num_stages, c.prefetch, c.kv_pack) for c in tuning.BATCHED_DECODE_TABLE.values()}
    assert table <= set(bench.QUICK_TILES), "--quick would not time a tile the table holds"
    assert bench.split_candidates(128, 2, 132, 2000) == [1, 2, 4, 8]
    assert bench.split_candidates(1, 2, 132, 30000) == [32, 64, 128]
    assert all(8000 // s >= bench.MIN_SPLIT_TOKENS for s in bench.split_candidates(32, 2, 132, 8000))


@pytest.mark.slow  # ~10 s: two spawned processes import torch
@CPU_ONLY
def test_precompile_runs_every_variant_in_child_processes(bench, monkeypatch, capsys):
    """The spawn children import the script and launch each variant (here through the interpreter)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # spawn children take the parent's sys.path
    variants = [bench.Variant(16, 1, 1, 2), bench.Variant(16, 1, 3, 1, "pages")]
    bench.precompile("fp8", variants, bench.SMOKE_MODEL, jobs=2, device="cpu")
    assert "compiled 2 variants in 2 processes" in capsys.readouterr().out


def test_summary_reports_each_shape_against_the_engine_and_the_fp8_speed_up(bench, capsys):
    def row(label, us):
        return dict(block_n=64, num_warps=4, num_stages=3, num_splits=2, prefetch="pages", label=label, us=us,
                    gbps=100.0 / us)

    winners = {("model", 128, 2000): (row("a", 40.0), row("b", 50.0), row("c", 70.0)),
               ("fp8", 128, 2000): (row("d", 25.0), None, row("c", 60.0))}
    bench.summarize(winners, bench.MODEL, tuning)
    text = capsys.readouterr().out
    assert "B=128 L=2000 kv=model: a 40.00 us" in text and "[b: 50.00 us, 2 GB/s; c: 70.00 us" in text
    assert "[not timed; c: 60.00 us" in text
    assert "fp8 KV is 1.60x the speed of bf16 KV" in text and "BATCHED_DECODE_TABLE" in text


def test_table_json_round_trips_into_tuning(bench, tmp_path, monkeypatch):
    """An engine run can take the sweep's winners without editing tuning.py."""
    row = dict(block_n=128, num_warps=4, num_stages=3, num_splits=2, prefetch="pages", kv_pack=2, us=1.0)
    entries = bench.table_entries({("fp8", 128, 2000): (row, None, None)}, bench.MODEL, tuning)
    path = tmp_path / "table.json"
    bench.write_table_json(entries, str(path))
    monkeypatch.setattr(tuning, "BATCHED_DECODE_TABLE", {})
    assert tuning.load_tables(str(path)) == entries
    assert tuning.batched_decode_config(64, 7, 128, "fp8").kv_pack == 2


def test_a_table_json_with_a_field_this_tree_lacks_is_refused_whole(tmp_path, monkeypatch):
    """A sweep's file from another tree (a removed field such as core_dots) names the entry
    and changes no table, not even by its valid entries."""
    path = tmp_path / "table.json"
    good = [[128, 2, 1], {"block_n": 64, "num_warps": 4, "num_stages": 3}]
    path.write_text(json.dumps([good, [[128, 2, 4], {"block_n": 64, "core_dots": False}]]))
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {})
    with pytest.raises(ValueError, match=r"table.json: the entry .*core_dots"):
        tuning.load_tables(str(path))
    assert tuning.ONE_LAUNCH_TABLE == {}
    path.write_text(json.dumps([[128, 2, 1]]))  # not a pair
    with pytest.raises(ValueError, match="not a \\[key, config fields\\] pair"):
        tuning.load_tables(str(path))
    path.write_text(json.dumps({"block_n": 64}))  # not a list of entries
    with pytest.raises(ValueError, match="not a \\[key, config fields\\] pair"):
        tuning.load_tables(str(path))
    path.write_text("[[128, 2")  # cut short
    with pytest.raises(ValueError, match="table.json: not a readable sweep table"):
        tuning.load_tables(str(path))
    with pytest.raises(ValueError, match="missing.json: not a readable sweep table"):
        tuning.load_tables(str(tmp_path / "missing.json"))


def test_table_json_reaches_a_fresh_engine_process_through_the_environment(bench, tmp_path):
    """FLASHLET_DECODE_TABLES=PATH: a fresh process (an engine run) starts with the file's entries."""
    import json
    import os
    import subprocess
    import sys

    row = dict(block_n=32, num_warps=1, num_stages=3, num_splits=8, prefetch="pages", kv_pack=1, us=1.0)
    entries = bench.table_entries({("fp8", 128, 2000): (row, None, None)}, bench.MODEL, tuning)
    path = tmp_path / "table.json"
    bench.write_table_json(entries, str(path))
    code = ("import json; from flashlet.kernels import tuning; "
            "c = tuning.batched_decode_config(64, 7, 128, 'fp8'); print(json.dumps([c.num_splits, c.num_warps]))")
    env = {**os.environ, "FLASHLET_DECODE_TABLES": str(path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [8, 1]
    env["FLASHLET_DECODE_TABLES"] = str(tmp_path / "missing.json")  # a wrong path: said so at import
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "ValueError: FLASHLET_DECODE_TABLES: " in out.stderr and "missing.json" in out.stderr
    env.pop("FLASHLET_DECODE_TABLES")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) != [8, 1]  # the table's own entry without it


# ---- --one-launch: the fused decode path's attention ----------------------------------------------


@CPU_ONLY
def test_one_launch_smoke_sweep_checks_every_variant(bench, tmp_path):
    """Every row checked against the reference; the sweep covers KV heads a program, split caps,
    smallest splits, the long-row rule and the wide merge, at one and several rows."""
    out = tmp_path / "rows.json"
    assert bench.main(["--smoke", "--one-launch", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert all("error" not in r and r["rel_err"] < bench.TOLERANCE for r in rows)
    assert {r["batch"] for r in rows} == set(bench.SMOKE_ONE_LAUNCH["rows"])
    assert {r["kv_pack"] for r in rows} == {1, 2} and len({r["num_splits"] for r in rows}) >= 3
    assert {r["min_split_tokens"] for r in rows} >= set(bench.SMOKE_MIN_SPLITS)
    assert any(r["long_from_tokens"] and r["kv_len"] >= r["long_from_tokens"] for r in rows)
    assert not any(r["long_from_tokens"] and r["kv_len"] < r["long_from_tokens"] for r in rows), \
        "a rule that cannot fire is timed as the rule-free variant"
    assert {r["merge_splits"] for r in rows} == {None, bench.SMOKE_WIDE_MERGE}
    assert {r["prefetch_pages"] for r in rows} == {False, True}  # page ids carried ahead, checked too
    assert {r["merge_group"] for r in rows} == {0, *bench.SMOKE_MERGE_GROUPS}  # the merge in two levels, checked


def test_a_rope_in_variant_makes_its_rows_and_is_checked_against_the_rope_reference(bench, monkeypatch):
    """rope_in=True launches the config as the backend launches Qwen3's (rope_in_form: one KV
    head a program) with the rows made in the kernel, checked against the RoPE reference then
    attention, which the plain reference is not (a launch that ignored rope_in would fail)."""
    model = dict(bench.SMOKE_ONE_LAUNCH_MODELS[0], qk_norm=True)
    case = bench.Case(torch, 2, 37, "model", model, "cpu")
    sweep = bench.Sweep(torch, da, True, budget_s=1e9, repeats=1, copy=None)
    launched = []
    real = da.decode_attention_one_launch
    monkeypatch.setattr(da, "decode_attention_one_launch", lambda *a, **kw: launched.append(kw) or real(*a, **kw))
    v = bench.OneLaunchVariant(16, 1, 2, 4, 16, kv_pack=2, pdl=False, rope_in=True)
    row = sweep.measure(case, v)
    assert "error" not in row and row["rel_err"] < bench.TOLERANCE and "rope-in" in row["label"]
    assert launched[0]["rope_in"] is not None and launched[0]["kv_heads_per_program"] == 1
    assert bench._rel_err(sweep.reference(case, rope_in=True), sweep.reference(case)) > 0.01
    assert sweep.measure(case, replace(v, kv_pack=1)) is row and len(launched) == 1  # the same launch: timed once
    plain = sweep.measure(case, replace(v, rope_in=False))  # the same case's pool, untouched by the rope_in launch
    assert "error" not in plain and launched[1]["rope_in"] is None and launched[1]["kv_heads_per_program"] == 2


def test_the_sweep_times_qwen3_with_its_rows_made_in_the_kernel(bench):
    """Every variant the one-launch sweep may time at Qwen3's shape carries rope_in (the fused
    path's default there: fused_decode.ROPE_IN_ATTENTION), none at the 0.5B's; --rope-in off
    times Qwen3's without."""
    shape = dict(contexts=(300, 1000), long=(8000,))
    for rope_in, want in (("auto", {"qwen3-0.6b": {True}, "qwen2.5-0.5b": {False}}),
                          ("off", {"qwen3-0.6b": {False}, "qwen2.5-0.5b": {False}})):
        items = bench._one_launch_items([(m, 1) for m in bench.ONE_LAUNCH_MODELS], shape, 132, True, "cpu", rope_in)
        got = {}
        for model, _, v in items:
            got.setdefault(model["name"], set()).add(v.rope_in)
        assert got == want, rope_in


def test_one_launch_derived_variant_is_what_the_backend_launches(bench):
    """The sweep's baseline is TritonBackend's derived config at the fused path's shapes."""
    got = {(m["name"], rows): bench.derived_one_launch_variant(torch, m, rows, 132, "cpu", True)
           for m in bench.ONE_LAUNCH_MODELS for rows in (1, 16)}
    assert got[("qwen2.5-0.5b", 1)] == bench.OneLaunchVariant(256, 8, 2, 64, 256)
    assert got[("qwen2.5-0.5b", 16)] == bench.OneLaunchVariant(256, 8, 2, 16, 256)
    assert got[("qwen3-0.6b", 16)] == bench.OneLaunchVariant(32, 4, 3, 8, 256)


def test_one_launch_candidates_stay_within_reason(bench):
    model = bench.ONE_LAUNCH_MODELS[0]
    derived = bench.OneLaunchVariant(256, 8, 2, 16, 256)
    short = bench.stage2_variants([(256, 8, 2, 1), (64, 4, 2, 2)], 16, (300, 1000), model, 132, False, derived)
    assert all(v.min_split_tokens >= v.block_n and v.num_splits <= bench.ONE_LAUNCH_MAX_SPLITS for v in short)
    assert all(16 * (2 // v.kv_pack) * v.num_splits <= 4 * 132 for v in short)
    assert not any(v.long_from_tokens or v.merge_splits or v.prefetch_pages or v.merge_group
                   for v in short)  # no long context
    one = bench.OneLaunchVariant(256, 8, 2, 64, 256)
    long = bench.stage2_variants([(64, 4, 3, 1)], 1, (300, 1000, 8000, 30000), model, 132, False, one)
    assert any(v.long_from_tokens for v in long) and any(v.merge_splits == 16 for v in long)
    assert {v for v in long if v.prefetch_pages} == {replace(v, prefetch_pages=True) for v in long if not v.prefetch_pages}
    assert all(v.long_split_tokens >= v.block_n for v in long if v.long_from_tokens)
    assert {v.merge_group for v in long} == {0, *bench.MERGE_GROUPS}
    assert all(v.merge_group < v.num_splits and v.min_split_tokens == max(bench.ONE_LAUNCH_MIN_SPLITS)
               for v in long if v.merge_group)
    ruled = bench.OneLaunchVariant(64, 4, 3, 64, 256, long_from_tokens=2048, long_split_tokens=64)
    assert ruled.at_length(1000) == bench.OneLaunchVariant(64, 4, 3, 64, 256) and ruled.at_length(8000) == ruled
    assert bench.one_launch_splits(16, 2, 1, 132, 16) == [2, 4, 8, 16]
    assert bench.wide_merge(bench.ONE_LAUNCH_MODELS[1], 1) == 8  # head_dim 128


def test_one_launch_entries_are_tuning_source_and_round_trip(bench, tmp_path, monkeypatch):
    """A bucket's winner becomes an entry only where it beat the derived config by more than
    the noise margin; the printed
    literal is tuning.py source; --table-json loads into ONE_LAUNCH_TABLE."""
    model = bench.ONE_LAUNCH_MODELS[0]
    derived = bench.OneLaunchVariant(256, 8, 2, 16, 256)
    win = bench.OneLaunchVariant(64, 4, 3, 4, 128, kv_pack=2)

    def res(ref, *scored):
        return dict(derived_variant=derived, derived=ref, best=min(scored, key=lambda vg: sum(vg[1].values())),
                    scored=list(scored))

    results = {("qwen2.5-0.5b", 16): (model, None, res({300: 9.0, 1000: 10.0}, (win, {300: 5.0, 1000: 6.0}))),
               ("qwen2.5-0.5b", 4): (model, None, res({300: 4.0}, (derived, {300: 4.0}))),
               # 1% faster: inside the timing noise (ENTRY_MARGIN), so no entry
               ("qwen2.5-0.5b", 8): (model, None, res({300: 5.0}, (win, {300: 4.95})))}
    entries = bench.one_launch_entries(results, tuning)
    assert entries == {(64, 7, 16): win.config(tuning)}
    scope = {"OneLaunchConfig": tuning.OneLaunchConfig}
    exec(bench.one_launch_table_literal(entries), scope)
    assert scope["ONE_LAUNCH_TABLE"] == entries
    path = tmp_path / "table.json"
    bench.write_table_json(entries, str(path))
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {})
    assert tuning.load_tables(str(path)) == entries
    assert tuning.one_launch_table_config(64, 7, 12) == win.config(tuning)


def test_a_bucket_with_long_contexts_gets_an_entry_a_side(bench, tmp_path, monkeypatch):
    """One row's bucket (contexts on both sides of ONE_LAUNCH_LONG_CONTEXT): its entry is the best
    over the short contexts, and a long entry the best over the long ones where it beats what
    long rows would run without it (the short entry) by the margin; it loads into
    ONE_LAUNCH_LONG_TABLE."""
    model = bench.ONE_LAUNCH_MODELS[0]
    derived = bench.OneLaunchVariant(256, 8, 2, 64, 256)
    short_win = bench.OneLaunchVariant(256, 8, 2, 32, 256)
    long_win = bench.OneLaunchVariant(64, 2, 3, 64, 128, prefetch_pages=True)
    ref = {300: 6.4, 1000: 6.5, 8000: 13.6, 30000: 24.3}
    scored = [(short_win, {300: 6.0, 1000: 6.1, 8000: 13.5, 30000: 23.0}),
              (long_win, {300: 9.0, 1000: 9.5, 8000: 8.0, 30000: 13.0})]
    results = {("qwen2.5-0.5b", 1): (model, None, dict(derived_variant=derived, derived=ref, best=scored[0],
                                                        scored=scored))}
    entries = bench.one_launch_entries(results, tuning)
    assert entries == {(64, 7, 1): short_win.config(tuning), (64, 7, 1, "long"): long_win.config(tuning)}
    scope = {"OneLaunchConfig": tuning.OneLaunchConfig}
    exec(bench.one_launch_table_literal(entries), scope)
    assert scope["ONE_LAUNCH_LONG_TABLE"] == {(64, 7, 1): long_win.config(tuning)}
    path = tmp_path / "table.json"
    bench.write_table_json(entries, str(path))
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {})
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {})
    assert tuning.load_tables(str(path)) == entries
    assert tuning.one_launch_table_config(64, 7, 1, long=True) == long_win.config(tuning)
    assert tuning.one_launch_table_config(64, 7, 1) == short_win.config(tuning)
    # Long rows already as fast under the short entry: no long entry.
    scored[1] = (long_win, {300: 9.0, 1000: 9.5, 8000: 13.4, 30000: 22.8})
    assert bench.one_launch_entries(results, tuning) == {(64, 7, 1): short_win.config(tuning)}
    path.write_text(json.dumps([[[64, 7, 1, "short"], {"block_n": 64}]]))
    with pytest.raises(ValueError, match="a key of"):
        tuning.load_tables(str(path))


def test_one_launch_models_are_named_shapes(bench):
    """--models picks the sweep's shapes (the per-op path's larger presets among them); the
    derived config there is what the backend launches (Qwen2.5-7B: no table entry)."""
    assert bench.one_launch_models(None) == bench.ONE_LAUNCH_MODELS
    (seven,) = bench.one_launch_models("qwen2.5-7b")
    assert (seven["num_q_heads"], seven["num_kv_heads"], seven["head_dim"]) == (28, 4, 128)
    assert [m["name"] for m in bench.one_launch_models("qwen3-0.6b,qwen2.5-1.5b")] == ["qwen3-0.6b", "qwen2.5-1.5b"]
    with pytest.raises(SystemExit, match="unknown"):
        bench.one_launch_models("qwen2.5-72b")
    assert bench.derived_one_launch_variant(torch, seven, 1, 132, "cpu", True) == bench.OneLaunchVariant(32, 4, 3, 64, 256)
    assert bench.parse_args(["--one-launch", "--models", "qwen2.5-7b"]).models == "qwen2.5-7b"


def test_the_batched_sweep_runs_one_named_shape_keyed_by_it(bench, tmp_path, monkeypatch):
    """--models picks the batched sweep's shape too (one: its table entries are keyed by its
    head_dim and group): Qwen3-0.6B's winner at one row is the BATCHED_DECODE_TABLE entry its
    two-launch long steps read."""
    assert bench.batched_model(None) is bench.MODEL
    qwen3 = bench.batched_model("qwen3-0.6b")
    with pytest.raises(SystemExit, match="one shape"):
        bench.batched_model("qwen3-0.6b,qwen2.5-1.5b")
    row = dict(block_n=32, num_warps=4, num_stages=3, num_splits=128, prefetch="pages", kv_pack=1, us=1.0)
    entries = bench.table_entries({("model", 1, 30000): (row, None, None)}, qwen3, tuning)
    assert list(entries) == [(128, 2, "model", 1)]
    path = tmp_path / "table.json"
    bench.write_table_json(entries, str(path))
    monkeypatch.setattr(tuning, "BATCHED_DECODE_TABLE", {})
    tuning.load_tables(str(path))
    assert tuning.batched_decode_config(128, 2, 1, "model").num_splits == 128


def test_one_launch_shapes_are_their_presets(bench):
    """Every shape the sweep may time is the preset of its name (layers, heads, head_dim), so a
    table entry measured at it is the key (head_dim, group, rows) the engine looks up."""
    presets = Path(__file__).resolve().parents[2] / "flashlet" / "presets"
    for m in bench.ONE_LAUNCH_MODELS + bench.ONE_LAUNCH_MORE_MODELS:
        cfg = json.loads((presets / f"{m['name']}.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        assert (m["layers"], m["num_q_heads"], m["num_kv_heads"], m["head_dim"]) == (
            cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim), m["name"]
        assert m.get("qk_norm", False) == (cfg["model_type"] == "qwen3"), m["name"]  # its rope_in variants' norms


def test_a_two_launch_long_entry_loads_from_a_table_file(tmp_path, monkeypatch):
    """A long key whose value is tuning.TWO_LAUNCH (what long-attn-ab can measure) loads as such."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps([[[64, 7, 1, "long"], "two-launch"]]))
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {})
    assert tuning.load_tables(str(path)) == {(64, 7, 1, "long"): tuning.TWO_LAUNCH}
    assert tuning.one_launch_table_config(64, 7, 1, long=True) == tuning.TWO_LAUNCH


def test_a_null_config_removes_a_built_in_entry(tmp_path, monkeypatch):
    """A key whose config is null (tuning.DERIVED) takes that bucket back to its derived config,
    in whichever table the key names; the other keys of the file load as usual."""
    entry = tuning.ONE_LAUNCH_TABLE[(128, 2, 16)]
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {(128, 2, 16): entry, (128, 2, 4): entry})
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {(64, 7, 1): tuning.TWO_LAUNCH})
    path = tmp_path / "table.json"
    path.write_text(json.dumps([[[128, 2, 16], None], [[64, 7, 1, "long"], None],
                                [[128, 2, 8], dataclasses.asdict(entry)]]))
    assert tuning.load_tables(str(path)) == {(128, 2, 16): None, (64, 7, 1, "long"): None, (128, 2, 8): entry}
    assert tuning.ONE_LAUNCH_TABLE == {(128, 2, 4): entry, (128, 2, 8): entry}
    assert tuning.ONE_LAUNCH_LONG_TABLE == {}
    assert tuning.one_launch_table_config(128, 2, 16) is None
