"""Smoke runs of every workload of `python -m flashlet.bench` on a tiny model (CPU), checking the
JSON record, the markdown table, the plots, and that the figures add up."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img.std() > 0, f"{path} is blank"


def check_common(record, workload):
    assert record["schema"] == "flashlet-bench/1"
    assert record["workload"] == workload
    assert record["command"].startswith("python -m flashlet.bench")
    assert record["date"][:2] == "20" and "T" in record["date"]
    assert record["git"]["commit"] == "unknown" or len(record["git"]["commit"]) == 40
    env = record["env"]
    assert env["torch"] == torch.__version__ and env["device"] and env["device_name"]
    assert "cuda" in env and "transformers" in env


def check_latency(summary, n=None):
    assert summary["n"] > 0 if n is None else summary["n"] == n
    assert 0 <= summary["min"] <= summary["p50"] <= summary["p99"] <= summary["max"]
    assert summary["min"] <= summary["mean"] <= summary["max"]


def test_closed_loop_json_table_and_plots(run_bench, tiny_config, tmp_path):
    plots = tmp_path / "plots"
    out, _, rec = run_bench("--config", tiny_config, "--concurrency", 1, 3,
                            "--prompt-len-range", 8, 40, "--max-new-tokens", 5,
                            "--num-requests", 6, "--plot", plots)
    check_common(rec, "closed-loop")
    assert "partial" not in rec  # the checkpoints written during the run were replaced
    assert rec["model"]["num_params"] > 0 and rec["engine"]["backend"] == "torch"
    assert rec["params"]["prompt_len_range"] == [8, 40]
    levels = rec["results"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["num_requests"] == lv["completed"] == 6 and lv["failed"] == 0
        assert lv["output_tokens"] == lv["output_tokens_requested"] == 6 * 5
        assert 6 * 8 <= lv["prompt_tokens"] <= 6 * 40
        assert lv["duration_s"] > 0
        assert math.isclose(lv["output_tok_s"], lv["output_tokens"] / lv["duration_s"], rel_tol=1e-9)
        assert math.isclose(lv["requests_per_s"], 6 / lv["duration_s"], rel_tol=1e-9)
        check_latency(lv["ttft_ms"], 6)
        check_latency(lv["itl_ms"], 6 * 4)  # 5 tokens: 4 gaps per request
        check_latency(lv["step_ms"])
        assert lv["num_steps"] == lv["step_ms"]["n"] >= 5
        assert len(lv["samples"]["ttft_ms"]) == 6 and len(lv["samples"]["itl_ms"]) == 24
        # Every step's time is inside the level's wall time.
        assert lv["step_ms"]["mean"] * lv["num_steps"] <= lv["duration_s"] * 1e3 * 1.001
        assert lv["device_wait_ms"] == 0.0  # the CPU: no device to wait on (Engine.device_wait_s)
        cpu = lv["machine_cpu"]  # None where the level took no tick of CPU time, or not Linux
        assert cpu is None or (0 < cpu["busy"] <= 1 and 0 <= cpu["steal"] <= 1)
    assert any("queue wait" in n for n in rec["notes"])
    assert "| concurrency | engine |" in out and "TTFT p50 (ms)*" in out and "queue wait" in out
    names = {Path(p).name for p in rec["plots"]}
    assert names == {"throughput.png", "ttft.png", "ttft_distribution.png", "itl_distribution.png"}
    for p in rec["plots"]:
        check_png(p)


def test_peer_hf_same_weights_and_ratio(run_bench, tiny_qwen2):
    """--model folder: both sides read the same weights; greedy outputs agree token for token."""
    out, _, rec = run_bench("--model", tiny_qwen2, "--concurrency", 1, 2,
                            "--prompt-len-range", 4, 24, "--max-new-tokens", 6,
                            "--num-requests", 4, "--peer", "hf", "hf-static")
    hf = rec["peers"]["hf"]
    assert "skipped" not in hf and "error" not in hf
    ours = {lv["concurrency"]: lv for lv in rec["results"]["levels"]}
    for lv in hf["levels"]:
        assert lv["output_tokens"] == lv["output_tokens_requested"] == 4 * 6
        assert lv["output_tok_s"] > 0 and lv["ttft_ms"]["n"] == 4
        assert lv["token_match"] == {"compared": 4, "identical": 4, "first_token_identical": 4}
        assert math.isclose(lv["ratio_output_tok_s"],
                            ours[lv["concurrency"]]["output_tok_s"] / lv["output_tok_s"])
    static = rec["peers"]["hf-static"]  # the run is on the CPU: skipped, with the reason
    assert "CUDA" in static["skipped"] and "hf-static" in out and "levels" not in static
    assert "flashlet / hf" in out


def test_hf_twin_from_random_config_has_our_weights(tiny_config):
    """--config: the HF model is built from the engine's tensors; the logits must agree."""
    from flashlet import Engine, EngineConfig, SamplingParams
    from flashlet.bench.engines import hf_model_for

    engine = Engine(EngineConfig(config=tiny_config, device="cpu", max_num_pages=64))
    hf = hf_model_for(engine)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits[0, -1].float()
    engine.add_request(ids[0].tolist(), SamplingParams(max_new_tokens=1, ignore_eos=True))
    seen = []
    engine.observe_steps(lambda meta, logits: seen.append(logits.clone()))
    engine.step()
    ours = seen[0][0]  # the prompt's last position
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_decode_sat(run_bench, tiny_config, tmp_path):
    out, _, rec = run_bench("--config", tiny_config, "--workload", "decode-sat",
                            "--decode-batch", 4, "--decode-prompt-len", 20, "--decode-tokens", 6,
                            "--peer", "hf", "--plot", tmp_path / "p")
    check_common(rec, "decode-sat")
    r = rec["results"]
    assert r["decode_tokens"] == r["decode_tokens_requested"] == 4 * 6
    assert r["step_ms"]["n"] == 6 and r["num_preemptions"] == 0 and r["prefill_steps"] >= 1
    assert math.isclose(r["decode_tok_s"], 24 / r["decode_time_s"])
    assert math.isclose(r["ms_per_step"], r["step_ms"]["mean"])
    assert r["device_wait_ms"] == 0.0  # the CPU: no device to wait on (Engine.device_wait_s)
    hf = rec["peers"]["hf"]
    assert hf["decode_tokens"] == 24 and hf["decode_tok_s"] > 0
    assert math.isclose(hf["ratio_decode_tok_s"], r["decode_tok_s"] / hf["decode_tok_s"])
    assert "decode tok/s" in out and "| hf |" in out
    e2e = r["end_to_end"]  # T(7 new) - T(1 new), through add_request/step, before the warm-up
    assert e2e["new_tokens"] == 7 and e2e["t_new_s"] > 0 and e2e["t_1_new_s"] > 0
    assert len(e2e["steps_ms"]["t_new"]) > len(e2e["steps_ms"]["t_1_new"])
    # Wall clocks: on a loaded machine the cold T(1 new) can outlast T(7 new); then no rate.
    if e2e["t_new_s"] > e2e["t_1_new_s"]:
        assert math.isclose(e2e["decode_tok_s"], 4 * 6 / (e2e["t_new_s"] - e2e["t_1_new_s"]))
        assert math.isclose(e2e["over_steady"], e2e["decode_tok_s"] / r["decode_tok_s"])
    else:
        assert e2e["decode_tok_s"] is None and e2e["over_steady"] is None
    assert "end to end tok/s" in out and "Engine start:" in out
    for p in rec["plots"]:
        check_png(p)


def test_decode_sat_with_sampling_and_penalties(run_bench, tiny_config):
    _, _, rec = run_bench("--config", tiny_config, "--workload", "decode-sat",
                          "--decode-batch", 3, "--decode-prompt-len", 8, "--decode-tokens", 4,
                          "--temperature", 0.7, "--top-p", 0.9, "--presence-penalty", 0.5,
                          "--frequency-penalty", 0.5, "--repetition-penalty", 1.1)
    params = rec["params"]
    assert params["temperature"] == 0.7 and params["top_p"] == 0.9 and not params["greedy"]
    assert params["repetition_penalty"] == 1.1
    assert rec["results"]["decode_tokens"] == 3 * 4


def test_single_bandwidth(run_bench, tiny_config):
    out, _, rec = run_bench("--config", tiny_config, "--workload", "single",
                            "--single-tokens", 10, "--single-prompt-len", 8,
                            "--bandwidth-mib", 16, "--peer", "hf")
    check_common(rec, "single")
    r = rec["results"]
    assert r["output_tokens"] == r["output_tokens_requested"] == 10
    assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 and r["itl_ms"]["n"] == 9
    assert math.isclose(r["decode_tok_s"], 9 / r["decode_time_s"])
    bw = r["copy_bandwidth"]
    assert bw["gb_per_s"] > 0 and bw["bytes_per_copy"] == 2 * 16 * 2**20
    b = r["bytes_per_token"]
    # Tied embeddings, fp32: every parameter once.
    cfg = rec["model"]["config"]
    from flashlet.models.model import ModelConfig

    n_params = ModelConfig(**{**cfg, "eos_token_ids": tuple(cfg["eos_token_ids"])}).num_params()
    assert b["weights"] == 4 * n_params
    kv_per_token = 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["head_dim"] * 4
    assert math.isclose(b["kv"], kv_per_token * (8 + 10 / 2))
    assert math.isclose(r["achieved_gb_per_s"], b["total"] * r["decode_tok_s"] / 1e9)
    assert math.isclose(r["fraction_of_bandwidth_limit"], r["achieved_gb_per_s"] / bw["gb_per_s"])
    assert 0 < r["fraction_of_bandwidth_limit"] < 1
    hf = rec["peers"]["hf"]
    assert hf["output_tokens"] == 10 and hf["token_match"]["compared"] == 1
    assert "of bandwidth limit" in out
    # end to end: submission to the last token, TTFT included
    assert math.isclose(r["end_to_end_tok_s"], 10 / r["end_to_end_s"])
    assert r["end_to_end_s"] >= r["decode_time_s"] + r["ttft_ms"] / 1e3 - 1e-6


def test_offline(run_bench, tiny_config):
    out, _, rec = run_bench("--config", tiny_config, "--workload", "offline",
                            "--num-requests", 6, "--prompt-len-range", 10, 50,
                            "--output-len-range", 2, 9, "--peer", "hf")
    check_common(rec, "offline")
    r = rec["results"]
    assert r["completed"] == 6 and r["output_tokens"] == r["output_tokens_requested"]
    assert 6 * 2 <= r["output_tokens"] <= 6 * 9
    assert math.isclose(r["output_tok_s"], r["output_tokens"] / r["total_time_s"])
    hf = rec["peers"]["hf"]
    assert hf["output_tokens"] == r["output_tokens"]  # the same requests, the same lengths
    assert hf["generated_tokens"] >= hf["output_tokens"]
    assert "total time (s)" in out
    first = r["first_run"]  # straight after engine start; the top-level figures are the repeat's
    assert first["completed"] == 6 and first["output_tokens"] == r["output_tokens"]
    assert first["first_engine_in_process"] is True
    assert math.isclose(r["first_over_repeat"], first["output_tok_s"] / r["output_tok_s"])
    assert "first run output tok/s" in out and "first / repeat" in out
    assert rec["engine"]["start"]["load_s"] > 0 and rec["engine"]["backend"] == "torch"


def test_scheduler(run_bench, tmp_path):
    out, _, rec = run_bench("--workload", "scheduler", "--sched-running", 24,
                            "--sched-prefill-chunks", 4, "--sched-context", 40,
                            "--sched-steps", 20, "--max-num-batched-tokens", 128,
                            "--plot", tmp_path / "p")
    check_common(rec, "scheduler")
    sc = rec["results"]["scenarios"]
    assert set(sc) == {"decode", "mixed", "mixed-evict"}
    assert sc["decode"]["decodes"] == 24 and sc["decode"]["prefill_chunks"] == 0
    assert sc["mixed"]["decodes"] == 20 and sc["mixed"]["prefill_chunks"] == 4
    assert sc["mixed"]["tokens_per_step"] == 20 + 4 * ((128 - 20) // 4)
    assert sc["mixed"]["evicted_pages_per_step"] == 0 < sc["mixed-evict"]["evicted_pages_per_step"]
    for s in sc.values():
        check_latency(s["us_per_step"], 20)
        assert s["meets_target"] == (s["us_per_step"]["mean"] < 1000)
    assert "mean < 1 ms" in out
    for p in rec["plots"]:
        check_png(p)


def test_kernels_delegates(run_bench, monkeypatch, tiny_config):
    import importlib.machinery
    import types

    calls = {}

    def run_kernel_sweep(device=None, *, quick=False, smoke=False, num_kv_heads=None, log=None):
        calls.update(device=device, quick=quick, smoke=smoke, num_kv_heads=num_kv_heads)
        return [{"kernel": "decode_attention", "us": 12.5}, {"kernel": "rmsnorm", "us": 3.0}]

    mod = types.ModuleType("flashlet.kernels.bench")
    mod.__spec__ = importlib.machinery.ModuleSpec("flashlet.kernels.bench", None)
    mod.run_kernel_sweep = run_kernel_sweep
    monkeypatch.setitem(sys.modules, "flashlet.kernels.bench", mod)
    out, _, rec = run_bench("--workload", "kernels", "--kernels-quick", "--kernels-smoke",
                            "--device", "cpu", "--config", tiny_config)
    # Only what the signature takes; the model's shapes when --config is given.
    assert calls == {"device": "cpu", "quick": True, "smoke": True, "num_kv_heads": 2}
    assert rec["results"]["sweep"][0]["kernel"] == "decode_attention"
    assert "| kernel | us |" in out and "decode_attention" in out


def test_kernels_real_sweep_smoke(run_bench):
    """The real flashlet.kernels.bench in smoke mode (tiny shapes; the Triton interpreter on CPU)."""
    pytest.importorskip("flashlet.kernels.bench", reason="flashlet/kernels/bench.py is not in this tree")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out, _, rec = run_bench("--workload", "kernels", "--kernels-smoke", "--device", device)
    rows = rec["results"]["sweep"]
    assert rows and all("kernel" in r for r in rows)
    assert {"decode", "rms_norm"} <= {r["kernel"] for r in rows}
    assert rec["results"]["called_with"]["smoke"] is True
    assert "| kernel | batch | context |" in out


def test_module_entry_point(tiny_config, tmp_path):
    """`python -m flashlet.bench` itself (a subprocess: __main__, exit code, stdout table)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "flashlet.bench", "--config", tiny_config, "--workload", "single",
         "--single-tokens", "4", "--single-prompt-len", "4", "--bandwidth-mib", "8",
         "--no-warmup", "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    # the default backend, auto, is the torch backend on the CPU
    assert "| flashlet (auto: torch) |" in proc.stdout and (tmp_path / "r.json").exists()


def test_allow_preemption_keeps_counts_exact(run_bench, tiny_config):
    """A pool too small for every client at once: refused by default (see the bad-input tests),
    run with --allow-preemption; preempted requests still produce exactly what they asked."""
    _, _, rec = run_bench("--config", tiny_config, "--concurrency", 4, "--num-requests", 4,
                          "--prompt-len-range", 30, 32, "--max-new-tokens", 24,
                          "--max-num-pages", 12, "--allow-preemption")
    lv = rec["results"]["levels"][0]
    assert rec["engine"]["num_pages"] == 12
    assert lv["completed"] == 4 and lv["output_tokens"] == lv["output_tokens_requested"] == 96
    assert lv["num_preemptions"] >= 1


def test_hf_static_runner_shapes_on_cpu(tiny_qwen2):
    """The hf-static peer's code path (static cache sized once, rows and prompt length padded
    to one shape) without the compile that only CUDA gets: the same tokens as the dynamic one."""
    from transformers import AutoModelForCausalLM

    from flashlet.bench.common import make_specs
    from flashlet.bench.peers import HFRunner

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    specs = make_specs(5, (3, 20), (2, 6), 256, seed=1, stream=1)  # 3 batches of 2, the last short
    dyn = HFRunner(model, "cpu", static=False).trace(specs, 2)
    sta = HFRunner(model, "cpu", static=True).trace(specs, 2)
    assert sta.outputs == dyn.outputs
    assert [len(o) for o in sta.outputs] == [s.max_new_tokens for s in specs]
    assert sta.extra["padded_prompt_len"] == max(s.prompt_len for s in specs)
    longest = max(s.max_new_tokens for s in specs)
    assert sta.extra["generated_tokens"] == 3 * 2 * longest  # every batch: 2 rows, longest output


def test_a_failing_peer_keeps_our_figures(run_bench, tiny_config, monkeypatch):
    from flashlet.bench import peers

    def broken(self, *a, **k):
        raise RuntimeError("generate broke")

    monkeypatch.setattr(peers.HFRunner, "generate", broken)
    out, _, rec = run_bench("--config", tiny_config, "--workload", "single", "--single-tokens", 4,
                            "--single-prompt-len", 4, "--bandwidth-mib", 8, "--peer", "hf")
    assert rec["results"]["decode_tok_s"] > 0
    assert rec["peers"]["hf"]["error"] == "RuntimeError: generate broke"
    assert "peer hf: error: RuntimeError: generate broke" in out


# ---- several backends in one run -----------------------------------------------------------
# triton is the second backend: on CUDA, else on the CPU in the Triton interpreter (the top-level
# conftest sets TRITON_INTERPRET=1 when there is no GPU); tiny workloads keep that quick.
MULTI_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check_backend_rows(out, rec, key):
    """A row per backend whose `flashlet / hf` cell is its figure `key` over the peer's."""
    lines = out.splitlines()
    assert "| flashlet / hf |" in lines[4]  # the table's header
    theirs = rec["peers"]["hf"][key]
    for name, r in rec["backends"].items():
        row = next(line for line in lines if line.startswith(f"| flashlet ({name}) |"))
        assert row.endswith(f"| {r[key] / theirs:.2f}x |"), row
    assert next(line for line in lines if line.startswith("| hf |")).endswith("| – |")


def test_backends_single_fresh_engine_each(run_bench, tiny_config, monkeypatch):
    """Each backend on its own engine (the previous one released first), a checkpoint after
    each, the peer once at the end; `results` and `engine` stay the first backend's."""
    from flashlet.bench import engines, report

    events, checkpoints = [], []
    build, release, write_json = engines.build_engine, engines.release, report.write_json

    def logged_build(cfg):
        events.append(f"build {cfg.backend}")
        return build(cfg)

    def logged_release(engine):
        if engine is not None:
            events.append(f"release {engine.config.backend}")
        release(engine)

    def logged_write_json(record, path):
        checkpoints.append((record.get("partial", False), list(record["backends"]),
                            list(record.get("peers", ()))))
        return write_json(record, path)

    monkeypatch.setattr(engines, "build_engine", logged_build)
    monkeypatch.setattr(engines, "release", logged_release)
    monkeypatch.setattr(report, "write_json", logged_write_json)
    out, _, rec = run_bench("--device", MULTI_DEVICE, "--config", tiny_config,
                            "--workload", "single", "--backend", "torch", "triton",
                            "--single-tokens", 6, "--single-prompt-len", 8, "--bandwidth-mib", 8,
                            "--no-warmup", "--peer", "hf")
    assert events == ["build torch", "release torch", "build triton", "release triton"]
    both = ["torch", "triton"]
    assert checkpoints == [(True, ["torch"], []), (True, both, []), (True, both, ["hf"]),
                           (False, both, ["hf"])]
    assert list(rec["backends"]) == list(rec["engines"]) == both
    assert rec["results"] == rec["backends"]["torch"] and rec["engine"] == rec["engines"]["torch"]
    for name, r in rec["backends"].items():
        assert rec["engines"][name]["backend"] == name
        assert r["output_tokens"] == r["output_tokens_requested"] == 6 and r["itl_ms"]["n"] == 5
        assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0
        assert r["bytes_per_token"] == rec["results"]["bytes_per_token"]  # one model, one KV size
    same = [{k: v for k, v in e.items() if k not in ("backend", "num_pages", "start")}
            for e in rec["engines"].values()]
    assert same[0] == same[1]  # nothing but the backend differs
    hf = rec["peers"]["hf"]
    assert hf["output_tokens"] == 6 and hf["token_match"]["compared"] == 1
    first = rec["results"]["decode_tok_s"]
    assert math.isclose(hf["ratio_decode_tok_s"], first / hf["decode_tok_s"])
    assert "backends torch, triton" in out
    check_backend_rows(out, rec, "decode_tok_s")


@pytest.mark.parametrize("workload,argv,key,tokens", [
    ("decode-sat", ["--decode-batch", 2, "--decode-prompt-len", 6, "--decode-tokens", 3],
     "decode_tok_s", "decode_tokens"),
    ("offline", ["--num-requests", 3, "--prompt-len-range", 4, 12, "--output-len-range", 2, 4],
     "output_tok_s", "output_tokens"),
])
def test_backends_batch_workloads(run_bench, tiny_config, tmp_path, workload, argv, key, tokens):
    out, _, rec = run_bench("--device", MULTI_DEVICE, "--config", tiny_config,
                            "--workload", workload, "--backend", "triton", "torch", *argv,
                            "--no-warmup", "--peer", "hf", "--plot", tmp_path / "p")
    assert list(rec["backends"]) == ["triton", "torch"]  # in the order given
    assert rec["results"] == rec["backends"]["triton"]
    for r in rec["backends"].values():  # the same requests, every token produced
        assert r[tokens] == r[f"{tokens}_requested"] == rec["results"][tokens] > 0
        assert r[key] > 0
    check_backend_rows(out, rec, key)
    for p in rec["plots"]:
        check_png(p)


def test_backends_closed_loop_rows_and_plots(run_bench, tiny_config, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    legends = {}
    savefig = Figure.savefig

    def keep_legends(fig, path, **kwargs):
        legends[Path(path).name] = [t.get_text() for ax in fig.axes if ax.get_legend()
                                    for t in ax.get_legend().get_texts()]
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_legends)
    out, _, rec = run_bench("--device", MULTI_DEVICE, "--config", tiny_config,
                            "--backend", "torch", "triton", "--concurrency", 1, 2,
                            "--num-requests", 2, "--prompt-len-range", 4, 12,
                            "--max-new-tokens", 3, "--no-warmup", "--plot", tmp_path / "p")
    levels = {name: r["levels"] for name, r in rec["backends"].items()}
    assert list(levels) == ["torch", "triton"]
    for torch_lv, triton_lv in zip(levels["torch"], levels["triton"]):
        assert torch_lv["prompt_tokens"] == triton_lv["prompt_tokens"]  # the same requests
        for lv in (torch_lv, triton_lv):
            assert lv["completed"] == 2 and lv["output_tokens"] == 6
            assert lv["output_tokens"] == lv["output_tokens_requested"]
            assert lv["output_tok_s"] > 0
    for c in (1, 2):
        for name in ("torch", "triton"):
            assert f"| {c} | flashlet ({name}) | 2 |" in out
    assert legends["throughput.png"] == ["flashlet (torch)", "flashlet (triton)"]
    assert legends["ttft.png"][::2] == ["flashlet (torch) p50", "flashlet (triton) p50"]
    assert legends["ttft_distribution.png"] == ["c=1", "c=2"] * 2  # a panel per backend
    for p in rec["plots"]:
        check_png(p)


def test_long_prompt_gaps(run_bench, tiny_config):
    """Streams decode while long prompts arrive; with a decode-step budget every step of the
    window carries at most that many tokens, the long prompts all get their first token, and
    the gaps are measured over the window (one per stream per step)."""
    out, _, rec = run_bench("--config", tiny_config, "--workload", "long-prompt-gaps",
                            "--gap-streams", 4, "--gap-stream-prompt-len", 8,
                            "--gap-long-prompts", 2, "--gap-long-prompt-len", 300,
                            "--gap-baseline-steps", 5, "--max-num-batched-tokens", 256,
                            "--max-decode-step-tokens", 36)
    check_common(rec, "long-prompt-gaps")
    r, p = rec["results"], rec["params"]
    assert (r["streams"], r["max_decode_step_tokens"], r["max_num_batched_tokens"]) == (4, 36, 256)
    # 600 prompt tokens at 32 a step beside 4 decodes: at least 19 steps, each gap one step.
    assert r["window_steps"] >= 19 and r["itl_ms"]["n"] >= 4 * 18
    assert r["baseline_itl_ms"]["n"] == 4 * 5 and r["long_ttft_ms"]["n"] == 2
    assert len(r["long_ttft_ms_each"]) == 2 and all(t > 0 for t in r["long_ttft_ms_each"])
    assert r["itl_p99_over_p50"] == r["itl_ms"]["p99"] / r["itl_ms"]["p50"]
    assert p["gap_stream_tokens"] > 5 + 2 * 19
    assert "ITL p99 / p50" in out and "long TTFT p50 (ms)" in out
