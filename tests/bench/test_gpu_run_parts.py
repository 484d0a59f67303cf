"""scripts/gpu_run.sh's parts run on the CPU with `python3` stubbed: the commands a part would
send to the GPU machine, in order, with the variables that steer them, and the sweep tables it
keeps for a later call's A/B. A part that runs the wrong command costs a device call to find out;
here it costs a test. The stub logs each command and writes an empty-but-named table where a
sweep is asked for one; merge_plans' `python3 -c` runs for real."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_run.sh"

STUB = r"""#!/usr/bin/env bash
# python3 for gpu_run.sh on a machine without a GPU: inline JSON snippets (merge_plans) run for
# real, the version lines print a stand-in, pip fails (no install), anything else is logged with
# the FLASHLET_* variables it sees.
if [[ $1 == -c ]]; then
  [[ $2 == *json* ]] && exec "$REAL_PY" "$@"
  echo "stub python3 -c"; exit 0
fi
[[ $1 == -m && $2 == pip ]] && exit 1
printf '%s| %s\n' "$(env | grep -E '^FLASHLET_[A-Z_]+=' | sort | tr '\n' ' ')" "$*" >> "$CALLS"
args=("$@")
for ((i = 0; i < ${#args[@]} - 1; i++)); do
  case ${args[i]} in
    --plans-out|--table-json) printf '[{"written_by": "%s"}]\n' "${args[*]}" > "${args[i + 1]}" ;;
  esac
done
exit 0
"""


@pytest.fixture
def gpu_run(tmp_path):
    """run(*parts, **env) -> (exit status, [(variables, command)]) of a copy of gpu_run.sh in a
    bare tree (no carried folders: nothing to install), python3 stubbed, its tables kept in
    tmp_path/keep across calls as /tmp is on a warm device."""
    if shutil.which("bash") is None:
        pytest.skip("no bash on this machine")
    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "gpu_run.sh")
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    (stub_dir / "python3").write_text(STUB)
    (stub_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls.txt"
    keep = tmp_path / "keep"

    def run(*parts: str, **env: str) -> tuple[int, list[tuple[str, str]]]:
        calls.write_text("")
        full = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHLET_", "GEMV_", "LEAN_", "LOOP_", "CACHED_"))}
        full.update(PATH=f"{stub_dir}:{os.environ['PATH']}", REAL_PY=sys.executable, CALLS=str(calls),
                    GPU_RUN_KEEP=str(keep), OUT=str(tmp_path / "out"), TRITON_PIN="0")
        full.update({"CUTE_OPTIONAL": "1", **env})  # no CuTe DSL here: the parts that ask for it run on
        proc = subprocess.run(["bash", str(root / "scripts" / "gpu_run.sh"), *parts], env=full,
                              capture_output=True, text=True, timeout=120)
        lines = [line.split("| ", 1) for line in calls.read_text().splitlines()]
        return proc.returncode, [(v.strip(), c) for v, c in lines]

    run.keep = keep
    return run


def test_a_part_asking_for_the_cute_dsl_is_skipped_where_it_is_missing(gpu_run):
    """A fresh machine without the DSL (not carried in that call): a part whose figures are the
    fused path's runs nothing and exits 2, where it would have labelled per-op readings as fused;
    a part that does not ask for the DSL runs; CUTE_OPTIONAL=1 runs the first anyway."""
    rc, calls = gpu_run("large-long", CUTE_OPTIONAL="0")
    assert rc == 2 and calls == []
    rc, calls = gpu_run("two-launch-long", CUTE_OPTIONAL="0")
    assert rc == 0 and calls[0][1].startswith("scripts/decode_attn_bench.py")
    rc, calls = gpu_run("large-long", "served-rows-ab", CUTE_OPTIONAL="0", SERVED_SET="SERVED_ROWS=8")
    assert rc == 2 and calls == []  # (each part asks; neither runs)
    rc, calls = gpu_run("large-long", LARGE_LONG_LENS="8000")
    assert rc == 0 and len(calls) == 4


def test_large_long_runs_per_op_the_default_and_one_launch_at_each_length(gpu_run):
    rc, calls = gpu_run("large-long", LARGE_LONG_CONFIG="llama-3.1-8b", LARGE_LONG_LENS="1000 8000")
    assert rc == 0
    *runs, (_, table) = calls
    assert [v for v, _ in runs] == ["", "", "FLASHLET_LONG_DECODE=one-launch"] * 2
    assert [c for _, c in runs[:3]] == [
        "lab/one_stream_pair.py per-op --config llama-3.1-8b --prompt-len 1000 --no-fused-decode",
        "lab/one_stream_pair.py default --config llama-3.1-8b --prompt-len 1000",
        "lab/one_stream_pair.py one-launch --config llama-3.1-8b --prompt-len 1000"]
    assert all("--prompt-len 8000" in c for _, c in runs[3:])
    assert table == "lab/one_stream_pair.py --table"


def test_served_rows_ab_runs_the_tree_then_each_setting(gpu_run):
    rc, calls = gpu_run("served-rows-ab", SERVED_ARGS="--quantization fp8", SERVED_CONC="8 16",
                        SERVED_SET="SERVED_ROWS_FP8_LARGE=16 SERVED_ROWS_FP8_LARGE=4")
    assert rc == 0
    assert [c.split()[:3] for _, c in calls] == [["-m", "flashlet.bench", "--config"],
                                                 ["lab/served_rows.py", "SERVED_ROWS_FP8_LARGE=16", "--config"],
                                                 ["lab/served_rows.py", "SERVED_ROWS_FP8_LARGE=4", "--config"]]
    assert all("--config qwen2.5-7b --quantization fp8 " in c and "--concurrency 8 16 " in c for _, c in calls)
    outs = [c.split("--out ")[1] for _, c in calls]
    assert [o.rsplit("/", 1)[1] for o in outs] == ["served-rows-tree.json", "served-rows-SERVED_ROWS_FP8_LARGE=16.json",
                                                   "served-rows-SERVED_ROWS_FP8_LARGE=4.json"]
    rc, calls = gpu_run("served-rows-ab")
    assert rc != 0 and len(calls) == 1  # the tree's run, then no SERVED_SET: the part stops


def test_gemv_rows_in_two_calls_merges_both_row_counts(gpu_run):
    """GEMV_ROWS=4 and GEMV_ROWS=16 in calls of their own (one sweep fills a call): the second
    call's merge holds both row counts' plans, which gemv-rows-ab then times."""
    rc, first = gpu_run("gemv-rows", GEMV_ROWS="4")
    assert rc == 0
    assert [c.split()[:6] for _, c in first] == [["scripts/gemv_sweep.py", "--config", "qwen2.5-0.5b", "--rows", "4", "--pdl"]]
    rc, second = gpu_run("gemv-rows", GEMV_ROWS="16")
    assert rc == 0 and "--rows 16" in second[0][1]
    merged = json.loads((gpu_run.keep / "gemv-rows-table.json").read_text())
    assert sorted("--rows 4" in e["written_by"] for e in merged) == [False, True]
    rc, ab = gpu_run("gemv-rows-ab")  # two interleaved closed-loop pairs, then N streams each way
    assert rc == 0
    *ab, (_, summary) = ab  # last: the pairs side by side
    assert [v for v, _ in ab] == ["", f"FLASHLET_GEMV_PLANS={gpu_run.keep / 'gemv-rows-table.json'}"] * 3
    assert all("-m flashlet.bench --config qwen2.5-0.5b" in c and "--concurrency 1 4 16" in c for _, c in ab[:4])
    assert all(c.startswith("scripts/fused_decode_bench.py --config qwen2.5-0.5b") and "--streams 1 2 4 8 16" in c
               for _, c in ab[4:])
    outs = [c.split("--out ")[1].split()[0] for _, c in ab[:4]] + [c.split("--json ")[1].split()[0] for _, c in ab[4:]]
    assert summary.split() == ["lab/ab_table.py", "--loop-a", outs[0], outs[2], "--loop-b", outs[1], outs[3],
                               "--streams-a", outs[4], "--streams-b", outs[5]]


def test_gemv_rows_ab_takes_a_kept_table_and_refuses_without_one(gpu_run, tmp_path):
    rc, calls = gpu_run("gemv-rows-ab")
    assert rc == 2 and calls == []  # nothing swept on this machine, no table named: nothing timed
    kept = tmp_path / "kept.json"
    kept.write_text("[]")
    rc, calls = gpu_run("gemv-rows-ab", GEMV_ROWS_TABLE=str(kept))
    assert rc == 0 and [v for v, _ in calls] == ["", f"FLASHLET_GEMV_PLANS={kept}"] * 3 + [""]


def test_lean_sweep_at_several_rows_then_the_closed_loop_at_qwen3(gpu_run):
    """LEAN_SWEEP_ROWS="4 8 16" sweeps those buckets; loop-table-ab times Qwen3's closed loop
    without and with that table, two interleaved pairs, then 1 / 4 / 16 streams after
    LOOP_PROMPT_LEN tokens each way; LOOP_CONFIG picks another preset."""
    rc, sweep = gpu_run("lean-sweep", LEAN_SWEEP_ROWS="4 8 16")
    assert rc == 0 and len(sweep) == 1
    variables, command = sweep[0]
    assert "--models qwen3-0.6b --rows 4 8 16 " in command and "FLASHLET_LEAN_MERGE=1" in variables
    table = gpu_run.keep / "lean-sweep-table.json"
    assert table.exists()
    rc, loop = gpu_run("loop-table-ab")
    assert rc == 0
    *loop, (_, summary) = loop  # last: the pairs and the streams side by side
    assert [v for v, _ in loop] == ["", f"FLASHLET_DECODE_TABLES={table}"] * 3
    assert all("--config qwen3-0.6b" in c and "--workload closed-loop" in c for _, c in loop[:4])
    assert all(c.startswith("scripts/fused_decode_bench.py --config qwen3-0.6b") and "--streams 1 4 16" in c
               and "--prompt-len 400" in c for _, c in loop[4:])
    outs = [c.split("--out ")[1].split()[0] for _, c in loop[:4]] + [c.split("--json ")[1].split()[0] for _, c in loop[4:]]
    assert summary.split() == ["lab/ab_table.py", "--loop-a", outs[0], outs[2], "--loop-b", outs[1], outs[3],
                               "--streams-a", outs[4], "--streams-b", outs[5]]
    rc, loop = gpu_run("loop-table-ab", LOOP_CONFIG="qwen2.5-1.5b", LOOP_PROMPT_LEN="1000")
    assert rc == 0 and all("--config qwen2.5-1.5b" in c for _, c in loop[:-1])
    assert all("--prompt-len 1000" in c for _, c in loop[4:-1])
    rc, calls = gpu_run("loop-table-ab", "gemv-rows-ab", GEMV_ROWS_TABLE=str(table))  # one call, two parts
    configs = [c.split("--config ")[1].split()[0] for _, c in calls if "--config " in c]
    assert rc == 0 and configs == ["qwen3-0.6b"] * 6 + ["qwen2.5-0.5b"] * 6
    assert [c.split()[0] for _, c in calls if "--config " not in c] == ["lab/ab_table.py"] * 2


def test_lean_sweep_takes_several_models_space_separated(gpu_run):
    """LEAN_SWEEP_MODELS="a b" reaches decode_attn_bench.py as its comma-separated --models (as
    one name with a space, the bench refused it: session 59's first sweep call)."""
    rc, sweep = gpu_run("lean-sweep", LEAN_SWEEP_MODELS="qwen2.5-0.5b llama-3.2-1b", LEAN_SWEEP_ROWS="4 8 16")
    assert rc == 0 and len(sweep) == 1
    assert "--models qwen2.5-0.5b,llama-3.2-1b --rows 4 8 16 " in sweep[0][1]


def test_one_launch_presets_ab_takes_the_kept_table(gpu_run):
    """The table kept in lab/tables for the next device session: one stream at each of the three
    presets after 1,000 tokens, without and with it, two interleaved pairs."""
    table = SCRIPT.parents[1] / "lab" / "tables" / "one-launch-presets-2026-12-05.json"
    rc, calls = gpu_run("one-launch-presets-ab", ONE_LAUNCH_TABLE_JSON=str(table))
    assert rc == 0
    runs = [c for _, c in calls if c.startswith("lab/one_stream_pair.py table=")]
    assert len(runs) == 12
    configs = [c.split("--config ")[1].split()[0] for c in runs]
    assert configs[:6] == ["qwen2.5-1.5b"] * 2 + ["llama-3.2-1b"] * 2 + ["tinyllama-1.1b"] * 2
    assert [v for v, c in calls if "table=sweep" in c] == [f"FLASHLET_DECODE_TABLES={table}"] * 6
    assert all("--prompt-len 1000" in c for c in runs)


def test_cached_prompt_times_each_split_setting_at_each_config(gpu_run):
    """CACHED_SPLITS="default 1": the tables' prefill splits, then none, at each config in turn;
    CACHED_LENS narrows the prompt lengths. Unset: the defaults only, at every length."""
    rc, calls = gpu_run("cached-prompt", CACHED_SPLITS="default 1", CACHED_LENS="8000 30000")
    assert rc == 0
    runs = [(v, c) for v, c in calls if c.startswith("lab/cached_prompt_call.py")]
    assert [(v, c.split("--config ")[1].split()[0]) for v, c in runs] == [
        ("", "qwen3-0.6b"), ("FLASHLET_PREFILL_SPLITS=1", "qwen3-0.6b"),
        ("", "qwen2.5-0.5b"), ("FLASHLET_PREFILL_SPLITS=1", "qwen2.5-0.5b")]
    assert all(c.endswith("--prompt-lens 8000 30000") for _, c in runs)
    rc, calls = gpu_run("cached-prompt")
    assert rc == 0 and [c for _, c in calls if c.startswith("lab/cached")] == [
        "lab/cached_prompt_call.py --config qwen3-0.6b", "lab/cached_prompt_call.py --config qwen2.5-0.5b"]


def test_the_short_prefill_sweep_keeps_a_table_its_ab_loads(gpu_run):
    """prefill-short-sweep: the bench at a 16-token chunk, its best kept; prefill-short-ab: the
    cached prompt's call without and with it, two interleaved pairs at each config."""
    rc, calls = gpu_run("prefill-short-ab")
    assert rc == 2 and calls == []  # no table kept yet: a note, nothing run
    rc, sweep = gpu_run("prefill-short-sweep")
    assert rc == 0 and len(sweep) == 1
    assert "--chunk 16 --decodes 0 --contexts 8000,30000" in sweep[0][1]
    table = gpu_run.keep / "prefill-short-table.json"
    assert table.exists() and f"--table-json {table}" in sweep[0][1]
    rc, calls = gpu_run("prefill-short-ab")
    assert rc == 0
    assert [(v, c.split("--config ")[1].split()[0]) for v, c in calls] == [
        ("", "qwen3-0.6b"), (f"FLASHLET_DECODE_TABLES={table}", "qwen3-0.6b"),
        ("", "qwen2.5-0.5b"), (f"FLASHLET_DECODE_TABLES={table}", "qwen2.5-0.5b")] * 2


def test_runs_one_after_another_in_one_out_keep_every_runs_json(gpu_run, tmp_path):
    """`a; b` in one device call: b's results.tgz holds a's JSON beside its own (session 55 lost
    a sweep's table when the next run's archive replaced the first's)."""
    import tarfile

    assert gpu_run("lean-sweep")[0] == 0
    assert gpu_run("prefill-short-sweep")[0] == 0
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"lean-sweep-table.json", "prefill-short-table.json"} <= names, names
    assert not (tmp_path / "out" / "json").exists()  # folded into the archive, as before


def test_base_ab_runs_the_base_trees_commands_from_inside_it(gpu_run, tmp_path):
    """base-ab: without BASE_TREE's flashlet/ it fails and times nothing; with one, the closed
    loop alternates base and tree (two pairs), then N streams each way, then the side-by-side
    table; the base's commands run from inside the base (PYTHONPATH's "." is then the base)."""
    base = tmp_path / "base"
    rc, calls = gpu_run("base-ab", BASE_TREE=str(base))
    assert rc == 2 and calls == []
    (base / "flashlet").mkdir(parents=True)
    stub = tmp_path / "bin" / "python3"
    stub.write_text(stub.read_text().replace('"$*" >> "$CALLS"', '"$PWD $*" >> "$CALLS"'))
    rc, calls = gpu_run("base-ab", BASE_TREE=str(base), LOOP_CONFIG="qwen2.5-0.5b")
    assert rc == 0
    *timed, (_, summary) = calls
    places = [c.split()[0] for _, c in timed]
    assert places == [str(base), str(tmp_path / "tree")] * 3
    assert all("--config qwen2.5-0.5b" in c for _, c in timed)
    assert all("--workload closed-loop" in c for _, c in timed[:4])
    assert all("scripts/fused_decode_bench.py" in c and "--streams 1 4 16" in c for _, c in timed[4:])
    assert summary.split()[1:3] == ["lab/ab_table.py", "--loop-a"]
    assert "base-none-1.json" in summary and "base-streams-tree.json" in summary


def test_step_timeline_profiles_one_row_at_the_defaults_at_each_config(gpu_run):
    rc, calls = gpu_run("step-timeline", TIMELINE_CONFIGS="qwen2.5-1.5b llama-3.2-1b", TIMELINE_LEN="8000")
    assert rc == 0
    assert [c for _, c in calls] == [
        f"scripts/profile_step.py --backend triton --fused-decode --fused-parts default --config {c} "
        "--batch 1 --prompt-len 8000 --rows 3 --timeline" for c in ("qwen2.5-1.5b", "llama-3.2-1b")]
    rc, calls = gpu_run("step-timeline", TIMELINE_CONFIGS="qwen2.5-0.5b", TIMELINE_BATCH="4")
    assert rc == 0 and [c.split(" --prompt-len")[0].split("--config ")[1] for _, c in calls] == ["qwen2.5-0.5b --batch 4"]


def test_step_plans_sweeps_each_gemv_at_each_config_in_the_engine(gpu_run):
    rc, calls = gpu_run("step-plans", STEP_PLANS_CONFIGS="tinyllama-1.1b", STEP_PLANS_GEMVS="qkv o")
    assert rc == 0
    assert [c.split(" --json")[0] for _, c in calls] == [
        f"lab/step_plan_sweep.py --config tinyllama-1.1b --gemv {g} --rows 1 --prompt-len 1000 --budget-s 200"
        for g in ("qkv", "o")]
    assert calls[1][1].endswith("step-plans-tinyllama-1.1b-o-1.json")
    rc, calls = gpu_run("step-plans", STEP_PLANS_CONFIGS="qwen2.5-0.5b", STEP_PLANS_GEMVS="down", STEP_PLANS_ROWS="4")
    assert rc == 0 and [c.split(" --prompt-len")[0] for _, c in calls] == [
        "lab/step_plan_sweep.py --config qwen2.5-0.5b --gemv down --rows 4"]
    assert calls[0][1].endswith("step-plans-qwen2.5-0.5b-down-4.json")


def test_o_plain_ab_interleaves_two_pairs_then_profiles_each_form(gpu_run):
    rc, calls = gpu_run("o-plain-ab", O_PLAIN_CONFIGS="qwen2.5-1.5b")
    assert rc == 0
    *runs, (_, table) = calls
    assert [c.split()[:2] for _, c in runs] == [["lab/one_stream_pair.py", "tree"], ["lab/o_plain_launch.py", "pair"]] * 2 + [
        ["scripts/profile_step.py", "--backend"], ["lab/o_plain_launch.py", "profile"]]
    assert all("--config qwen2.5-1.5b" in c and "--prompt-len 1000" in c for _, c in runs)
    assert all("--timeline" in c for _, c in runs[4:])
    assert table == "lab/one_stream_pair.py --table"


def test_no_part_starts_past_the_deadline(gpu_run, tmp_path):
    rc, calls = gpu_run("step-timeline", "step-plans", TIMELINE_CONFIGS="qwen2.5-0.5b", STEP_PLANS_CONFIGS="qwen2.5-0.5b",
                        GPU_RUN_DEADLINE="0")
    assert rc == 0 and calls == []
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "### part step-timeline not started" in log and "### part step-plans not started" in log
    rc, calls = gpu_run("step-timeline", TIMELINE_CONFIGS="qwen2.5-0.5b", GPU_RUN_DEADLINE="600")
    assert rc == 0 and len(calls) == 1


def test_merge_in_o_ab_tests_then_interleaves_the_forms_then_profiles(gpu_run):
    rc, calls = gpu_run("merge-in-o-ab", MERGE_AB_CONFIGS="qwen2.5-1.5b", MERGE_AB_FORMS="0 w8", MERGE_AB_LEN="3000",
                        MERGE_AB_TESTS="preset_shapes")
    assert rc == 0
    tests, *runs, (_, table) = calls
    assert "tests/kernels/test_merge_in_o.py" in tests[1] and "-k preset_shapes" in tests[1]
    pairs, profiles = runs[:6], runs[6:]
    assert [(env.strip(), c.split()[1]) for env, c in pairs] == [
        ("", "tree"), ("FLASHLET_MERGE_IN_O=0", "merge-0"), ("FLASHLET_MERGE_IN_O=w8", "merge-w8")] * 2
    assert all("--config qwen2.5-1.5b" in c and "--prompt-len 3000" in c for _, c in pairs)
    assert [env.strip() for env, _ in profiles] == ["", "FLASHLET_MERGE_IN_O=0"]
    assert all(c.startswith("scripts/profile_step.py") and "--timeline" in c for _, c in profiles)
    assert table == "lab/one_stream_pair.py --table"


def test_merge_in_o_ab_takes_a_form_as_its_environment(gpu_run):
    rc, calls = gpu_run("merge-in-o-ab", MERGE_AB_FORMS="FLASHLET_MERGE_PARTIALS=bf16,FLASHLET_MERGE_IN_O=w8g16 w4")
    assert rc == 0
    _, *runs, _ = calls
    both = ["FLASHLET_MERGE_IN_O=w8g16", "FLASHLET_MERGE_PARTIALS=bf16"]
    assert [(sorted(env.split()), c.split()[1]) for env, c in runs[:3]] == [
        ([], "tree"), (both, "merge-FLASHLET_MERGE_PARTIALS-bf16-FLASHLET_MERGE_IN_O-w8g16"),
        (["FLASHLET_MERGE_IN_O=w4"], "merge-w4")]
    assert sorted(runs[-1][0].split()) == both


def test_merge_rows_ab_interleaves_the_tree_with_each_row_limit(gpu_run):
    rc, calls = gpu_run("merge-rows-ab", MERGE_ROWS_N="4")
    assert rc == 0
    assert [env.strip() for env, _ in calls] == ["", "FLASHLET_MERGE_IN_O_ROWS=4"] * 2
    assert all(c.startswith("-m flashlet.bench --config qwen2.5-0.5b") and "--concurrency 1 4 16" in c
               for _, c in calls)
    assert [c.split("--out ")[1].rsplit("/", 1)[1] for _, c in calls] == [
        "merge-rows-tree-1.json", "merge-rows-4-1.json", "merge-rows-tree-2.json", "merge-rows-4-2.json"]


def _dsl_pack(version: str, root_dir: str) -> tuple[bytes, str]:
    """A stand-in CuTe DSL tree (the import root gpu_run.sh puts on the path, one file) packed as
    gpu_wheels.sh packs one: tarred, xz'd; returns the pack's bytes and its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = f"version = {version!r}\n".encode()
        info = tarfile.TarInfo(f"nvidia_cutlass_dsl/{root_dir}/cutlass/__init__.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    packed = lzma.compress(buf.getvalue())
    return packed, hashlib.sha256(packed).hexdigest()


def test_the_dsl_packs_install_over_two_calls_the_first_under_the_fallback(gpu_run, tmp_path):
    """gpu_wheels.sh's carries: .whl-cute/ holds 4.3.5 whole and the pin's smaller part, .whl-cute1/
    the pin's larger. The first call installs 4.3.5 and keeps the pin's part for later; the second
    (.whl-cute/ not carried) joins the pin's parts, checks them against the manifest, unpacks the
    tree and picks the newest version; a pack whose bytes do not match stays uninstalled."""
    tree, cute = tmp_path / "tree", tmp_path / "cute"
    old, old_sha = _dsl_pack("4.3.5", "python_packages")
    pin, pin_sha = _dsl_pack("4.8.1", "dsl_packages")
    first, second = tree / ".whl-cute", tree / ".whl-cute1"
    first.mkdir()
    (first / "cute-dsl-4.3.5.tar.part00").write_bytes(old)
    (first / "cute-dsl-4.3.5.manifest").write_text(f"{old_sha} 1 xz\n")
    half = len(pin) // 2
    (first / "cute-dsl-4.8.1.tar.part01").write_bytes(pin[half:])
    (first / "cute-dsl-4.8.1.manifest").write_text(f"{pin_sha} 2 xz\n")
    env = {"GPU_RUN_CUTE_ROOT": str(cute), "CUTE_OPTIONAL": "0"}

    rc, _ = gpu_run("setup", **env)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert rc == 0, log
    assert (cute / "4.3.5" / ".installed").is_file() and not (cute / "4.8.1").exists()
    assert (cute / "4.3.5/nvidia_cutlass_dsl/python_packages/cutlass/__init__.py").read_text() == "version = '4.3.5'\n"
    assert "CuTe DSL 4.8.1: 1 of 2 parts on this machine" in log

    shutil.rmtree(first)  # a carry not named in a call is not there
    second.mkdir()
    (second / "cute-dsl-4.8.1.tar.part00").write_bytes(pin[:half])
    (second / "cute-dsl-4.8.1.manifest").write_text(f"{pin_sha} 2 xz\n")
    rc, _ = gpu_run("setup", **env)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert rc == 0, log
    assert (cute / "4.8.1/nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py").read_text() == "version = '4.8.1'\n"
    assert list((tmp_path / "cute-parts").glob("*.part*")) == []  # installed parts are dropped

    # a pack that does not match its manifest: said, not installed, the installed one still used
    (second / "cute-dsl-4.9.0.tar.part00").write_bytes(pin)
    (second / "cute-dsl-4.9.0.manifest").write_text(f"{old_sha} 1 xz\n")
    rc, _ = gpu_run("setup", **env)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert rc == 0 and "CuTe DSL 4.9.0: the joined parts do not match their manifest" in log
    assert not (cute / "4.9.0" / ".installed").exists()
