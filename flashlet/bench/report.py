"""The outputs: the JSON record, markdown tables for stdout, PNG plots (matplotlib, Agg).

The JSON record (schema "flashlet-bench/1"):
    workload, command, argv, date (UTC), git {commit, dirty}, params (the resolved sizes),
    env {device, device_name, torch, cuda, cudnn, transformers, triton, flashinfer, gpu_*, cpu},
    model {name, weights, num_params, dtype, config}, engine (EngineConfig as the engine resolved
    it, fused_decode* included, + num_pages),
    results (per workload, below), backends {name: results} (every --backend, in run order; the
    first is `results`), engines {name: engine}, peers {hf, hf-static: figures + ratio_* =
    first backend / theirs, or skipped / error}, notes, plots.
    closed-loop / url: results.levels[] = {concurrency, num_requests, completed, failed,
        prompt_tokens, output_tokens, output_tokens_requested, duration_s, output_tok_s,
        total_tok_s, requests_per_s, ttft_ms, itl_ms, step_ms ({n, mean, p50, p90, p99, min,
        max}), num_steps, num_preemptions, samples {ttft_ms[], itl_ms[]}}
    decode-sat: batch, prompt_len, decode_steps, decode_tokens, decode_tok_s, ms_per_step,
        step_ms, prefill_steps, prefill_s
    single: decode_tok_s, ms_per_token, ttft_ms, itl_ms, bytes_per_token {weights, kv, total},
        copy_bandwidth {gb_per_s, ...}, achieved_gb_per_s, fraction_of_bandwidth_limit
    offline: as one closed-loop level, plus total_time_s
    scheduler: scenarios {decode, mixed, mixed-evict}: us_per_step, meets_target, ...
    kernels: sweep (the rows of flashlet.kernels.bench.run_kernel_sweep), called_with
All times are in the unit their key names (ms, us, s).
"""

from __future__ import annotations

import json
from pathlib import Path

from flashlet.bench.common import ratio

TTFT_NOTE = ("TTFT counts from a request's submission to its first token, so it includes the "
             "time it waited to be scheduled (queue wait); for static-batch peers it runs from "
             "the start of the request's batch.")


def public(x):
    """Drop private keys (leading underscore: e.g. raw output tokens) before writing JSON."""
    if isinstance(x, dict):
        return {k: public(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, list):
        return [public(v) for v in x]
    return x


def write_json(record: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(public(record), indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


KERNEL_COLUMNS = ("kernel", "batch", "context", "tokens", "n", "k", "triton_us", "reference_us",
                  "flashinfer_us", "triton_gbps", "triton_frac_copy_bw", "flashinfer_frac_copy_bw",
                  "speedup_vs_reference", "speedup_vs_flashinfer", "max_rel_err_vs_reference")


# ---- markdown ------------------------------------------------------------------------------
def fmt(x, digits: int | None = None) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if digits is not None:
        return f"{x:.{digits}f}"
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |")
    return "\n".join(lines)


def _ours(record: dict) -> list[tuple[str, dict]]:
    """(row label, results) of the server, or of every flashlet backend in the order they ran."""
    if "url" in record:  # a server's run: its one row
        return [("server", record["results"])]
    engines = record.get("engines") or {}

    def label(name):  # "auto" says what it resolved to; and where one stream ran fused
        engine = engines.get(name) or {}
        resolved = engine.get("backend", name)
        fused = ", fused decode" if engine.get("fused_decode") else ""
        return f"flashlet ({name}{fused})" if resolved == name else f"flashlet ({name}: {resolved}{fused})"

    return [(label(name), res) for name, res in record["backends"].items()]


def _peer_runs(record: dict) -> list[tuple[str, dict]]:
    return [(name, p) for name, p in (record.get("peers") or {}).items()]


def _engine_rows(ours, peers, row, key: str) -> list[list]:
    """`row(name, figures)` for every flashlet backend, then for every peer; each row ends in one
    `flashlet / peer` cell per peer: the backend's figure `key` over the peer's."""
    rows = [row(name, r) + [_x(ratio(r[key], p[key])) for _, p in peers] for name, r in ours]
    return rows + [row(name, p) + ["–"] * len(peers) for name, p in peers]


def _x(r) -> str:
    return "–" if r is None else f"{r:.2f}x"


def _ratio_headers(peers) -> list[str]:
    return [f"flashlet / {name}" for name, _ in peers]


def _skipped_lines(record: dict) -> list[str]:
    out = []
    for name, p in _peer_runs(record):
        if p.get("skipped"):
            out.append(f"- peer {name}: {p['skipped']}")
        elif p.get("error"):
            out.append(f"- peer {name}: error: {p['error']}")
    return out


def markdown(record: dict) -> str:
    wl = record["workload"]
    head = [f"### flashlet bench: {wl}", "", _setup_line(record), ""]
    body = {"closed-loop": _md_closed, "decode-sat": _md_decode, "single": _md_single,
            "offline": _md_offline, "scheduler": _md_sched, "kernels": _md_kernels,
            "long-prompt-gaps": _md_gaps, "url": _md_url}[wl](record)
    tail = _skipped_lines(record)
    return "\n".join(head + [body] + ([""] + tail if tail else [])) + "\n"


def _setup_line(record: dict) -> str:
    env, m, p = record.get("env", {}), record.get("model") or {}, record.get("params", {})
    bits = []
    if "url" in record:
        bits.append(f"server {record.get('url')}")
    elif record["workload"] == "kernels":
        called = record.get("results", {}).get("called_with", {})
        bits.append(f"{env.get('device')} ({env.get('device_name')})")
        bits.append(f"dtype {called.get('dtype', 'the sweep default')}")
        bits.append("shapes of " + (p.get("model") or "Qwen2.5-0.5B (the sweep default)"))
        if called.get("smoke"):
            bits.append("smoke mode (tiny shapes, not a timing)")
    elif record["workload"] == "scheduler":
        bits.append(f"cpu ({env.get('cpu')}, {env.get('torch_threads')} torch threads), tiny "
                    "one-layer model, no forward pass")
    else:
        bits.append(f"model {m.get('name', '?')}"
                    + (f" ({m['num_params'] / 1e6:.1f}M params)" if m.get("num_params") else ""))
        names = list(record["backends"])
        bits.append(("backend " if len(names) == 1 else "backends ") + ", ".join(names))
        bits.append(f"{env.get('device')} ({env.get('device_name')})")
        bits.append(f"dtype {m.get('dtype')}")
    for key in ("prompt_len_range", "output_len_range"):
        if key in p:
            lo, hi = p[key]
            bits.append(f"{key.split('_')[0]} {lo}" + (f"–{hi}" if hi != lo else "") + " tokens")
    bits.append(f"torch {env.get('torch')}" + (f", CUDA {env['cuda']}" if env.get("cuda") else ""))
    bits.append(f"commit {str(record.get('git', {}).get('commit', 'unknown'))[:10]}")
    return "; ".join(bits)


def _md_closed(record: dict) -> str:
    """At each concurrency level, one row per engine: every backend, then the peers."""
    ours = _ours(record)
    peers = [(n, p) for n, p in _peer_runs(record) if p.get("levels")]
    rows = []
    for c in [lv["concurrency"] for lv in ours[0][1]["levels"]]:
        ours_c = [(n, _level(r, c)) for n, r in ours]
        peers_c = [(n, _level(p, c)) for n, p in peers]
        rows += [[str(c)] + r for r in _engine_rows(ours_c, peers_c, _closed_row, "output_tok_s")]
    headers = ["concurrency", "engine", "requests", "output tok/s", "req/s", "TTFT p50 (ms)*",
               "TTFT p99 (ms)*", "ITL p50 (ms)", "ITL p99 (ms)", "mean step (ms)"]
    return "\n".join([table(headers + _ratio_headers(peers), rows), "", f"\\* {TTFT_NOTE}"])


def _level(run: dict, concurrency: int) -> dict:
    return next(m for m in run["levels"] if m["concurrency"] == concurrency)


def _closed_row(name: str, m: dict) -> list:
    return [name, m["completed"], m["output_tok_s"], m["requests_per_s"], m["ttft_ms"]["p50"],
            m["ttft_ms"]["p99"], m["itl_ms"]["p50"], m["itl_ms"]["p99"], m["step_ms"]["mean"]]


def _md_decode(record: dict) -> str:
    peers = [(n, p) for n, p in _peer_runs(record) if "decode_tok_s" in p]

    def row(name, m):
        e2e = m.get("end_to_end") or {}
        return [name, m["batch"], m["prompt_len"], m["decode_steps"], m["decode_tok_s"],
                e2e.get("decode_tok_s"), _x(e2e.get("over_steady")),
                m["ms_per_step"], m["step_ms"]["p50"], m["step_ms"]["p99"]]

    return table(["engine", "batch", "prompt", "decode steps", "decode tok/s (steady)",
                  "end to end tok/s", "end to end / steady", "ms/step",
                  "step p50 (ms)", "step p99 (ms)"] + _ratio_headers(peers),
                 _engine_rows(_ours(record), peers, row, "decode_tok_s")) + \
        "\n\nSteady: only pure-decode steps of the whole batch are timed (prefill excluded), " \
        "after a warm-up batch. End to end, measured first on the fresh engine: " \
        "batch x steps / (T(steps + 1 new tokens) - T(1 new token)), each T from submitting the " \
        "batch to its last token." + _e2e_step_lines(_ours(record)) + _start_lines(record)


def _md_gaps(record: dict) -> str:
    def row(name, m):
        itl, base, ttft = m["itl_ms"], m["baseline_itl_ms"], m["long_ttft_ms"]
        return [name, m["streams"], m["max_decode_step_tokens"], base["p50"], itl["p50"],
                itl["p99"], itl["max"], _x(m["itl_p99_over_p50"]), ttft["p50"], ttft["max"]]

    p = record.get("params", {})
    if "url" in record:  # through a server: words for tokens, the client's clock, bounds unknown here
        note = (f"\n\nITL: the streams' token gaps as the client read them, from the sending of "
                f"{p.get('gap_long_prompts')} prompts of {p.get('gap_long_prompt_len')} words (about a "
                f"token each) at once to the last one's first token; before: the {p.get('gap_baseline_steps')} "
                "tokens a stream just before. Long TTFT from their sending. The server's decode-step "
                "bound is its own flag.")
    else:
        note = (f"\n\nITL: the decoding streams' token gaps from the arrival of {p.get('gap_long_prompts')} "
                f"prompts of {p.get('gap_long_prompt_len')} tokens (all at once) to the last one's first "
                f"token; before: {p.get('gap_baseline_steps')} pure-decode steps just before they arrive. Long TTFT "
                "from their arrival.")
    return table(["engine", "streams", "decode-step tokens", "ITL p50 before (ms)",
                  "ITL p50 (ms)", "ITL p99 (ms)", "ITL max (ms)", "ITL p99 / p50",
                  "long TTFT p50 (ms)", "long TTFT max (ms)"],
                 [row(name, m) for name, m in _ours(record)]) + note


def _e2e_step_lines(runs) -> str:
    """Where each end-to-end T(D + 1) run went: its steps, their sum, the slowest ones."""
    lines = []
    for name, m in runs:
        e2e = m.get("end_to_end") or {}
        steps = (e2e.get("steps_ms") or {}).get("t_new")
        if not steps:
            continue
        slow = ", ".join(f"#{i} {ms:.1f}" for i, ms in e2e.get("slowest_steps_ms", []))
        lines.append(f"- {name}: T(D + 1) {e2e['t_new_s'] * 1e3:.1f} ms = {len(steps)} steps "
                     f"({sum(steps):.1f} ms inside step()), slowest (step #, ms): {slow}")
    return "\nEnd-to-end steps:\n" + "\n".join(lines) if lines else ""


def _md_single(record: dict) -> str:
    r = record["results"]
    peers = [(n, p) for n, p in _peer_runs(record) if "decode_tok_s" in p]

    def row(name, m):
        bw = m.get("copy_bandwidth", r["copy_bandwidth"])  # a peer's limit: the first backend's
        return [name, m["decode_tok_s"], m.get("end_to_end_tok_s"), m["ms_per_token"], m["ttft_ms"],
                m["bytes_per_token"]["total"] / 1e6, m["achieved_gb_per_s"], bw["gb_per_s"],
                f"{100 * m['fraction_of_bandwidth_limit']:.1f}%", m["bandwidth_limit_tok_s"]]

    headers = ["engine", "decode tok/s", "end to end tok/s", "ms/token", "TTFT (ms)", "MB read/token",
               "achieved GB/s", "copy GB/s", "of bandwidth limit", "limit tok/s"]
    return table(headers + _ratio_headers(peers),
                 _engine_rows(_ours(record), peers, row, "decode_tok_s")) + (
        f"\n\nOne stream, prompt {r['prompt_len']} tokens, {r['output_tokens']} tokens generated. "
        "Bytes per token: every weight once plus the mean K/V read; the limit is the copy "
        "bandwidth measured in this run on this device ((read + write) bytes / time).")


def _md_offline(record: dict) -> str:
    peers = [(n, p) for n, p in _peer_runs(record) if "output_tok_s" in p]

    def row(name, m):
        first = m.get("first_run") or {}
        return [name, m["completed"], m["prompt_tokens"], m["output_tokens"],
                first.get("output_tok_s"), first.get("duration_s"), m["output_tok_s"],
                m["total_time_s"], _x(m.get("first_over_repeat")), m["total_tok_s"],
                m["num_preemptions"]]

    return table(["engine", "requests", "input tokens", "output tokens", "first run output tok/s",
                  "first run (s)", "output tok/s", "total time (s)", "first / repeat",
                  "repeat total tok/s", "preemptions"] + _ratio_headers(peers),
                 _engine_rows(_ours(record), peers, row, "output_tok_s")) + \
        "\n\nEnd to end, from submitting every request to the last token. The first run comes " \
        "straight after engine start (no warm-up batch); output tok/s and total time are the " \
        "repeat's, fresh prompts of the same lengths. Peers: one run." + _start_lines(record)


def _start_lines(record: dict) -> str:
    """Engine start time per backend: load / warm-up (kernels compiled) / graph capture."""
    lines = []
    for name, eng in (record.get("engines") or {}).items():
        st = eng.get("start") or {}
        if "load_s" in st:
            lines.append(f"- {name} ({eng.get('backend', name)}): start {fmt(st['load_s'])} s load, "
                         f"{fmt(st['warmup_s'])} s warm-up, {fmt(st['capture_s'])} s graph capture"
                         + (f", {st.get('triton_compiles')} Triton kernels" if st.get("triton_compiles") is not None else ""))
    return ("\n\nEngine start:\n" + "\n".join(lines)) if lines else ""


def _md_sched(record: dict) -> str:
    r = record["results"]
    rows = []
    for name, s in r["scenarios"].items():
        u = s["us_per_step"]
        rows.append([name, s["running"], s["decodes"], s["prefill_chunks"], s["tokens_per_step"],
                     s["evicted_pages_per_step"], u["mean"], u["p50"], u["p99"],
                     "yes" if s["meets_target"] else "NO"])
    return table(["scenario", "running", "decodes", "prefill chunks", "tokens/step",
                  "evicted pages/step", "mean (us)", "p50 (us)", "p99 (us)", "mean < 1 ms"], rows) + \
        "\n\nCPU time of scheduler.schedule() + the step layout (InputBatch.apply + StepBuffers.load) " \
        "per step (no forward pass)."


def _md_kernels(record: dict) -> str:
    sweep = record["results"].get("sweep")
    rows = sweep.get("rows") if isinstance(sweep, dict) else sweep
    if isinstance(rows, list) and rows and all(isinstance(x, dict) for x in rows):
        headers = list(dict.fromkeys(k for x in rows for k in x))
        main = [h for h in KERNEL_COLUMNS if h in headers]
        if len(main) >= 3:  # the sweep's wide rows: its main columns (the JSON has them all)
            headers = main
        return table(headers, [[x.get(h) if not isinstance(x.get(h), str) else x[h]
                                for h in headers] for x in rows])
    return "```json\n" + json.dumps(sweep, indent=2, default=str)[:20000] + "\n```"


def _md_url(record: dict) -> str:
    r = record["results"]
    if r.get("mode") == "closed-loop":
        return _md_closed(record)
    return table(["mode", "rate (req/s)", "requests", "failed", "output tok/s", "req/s",
                  "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)"],
                 [["open-loop", r["rate"], r["completed"], r["failed"], r["output_tok_s"],
                   r["requests_per_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"],
                   r["itl_ms"]["p50"], r["itl_ms"]["p99"]]]) + \
        "\n\nMeasured by the client; TTFT from sending a request to its first text event."


# ---- plots ---------------------------------------------------------------------------------
def plot(record: dict, folder: str | Path) -> list[str]:
    """Write the workload's PNGs into `folder`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    wl, res = record["workload"], record["results"]
    written = []

    def save(fig, name):
        path = folder / name
        for ax in fig.axes:
            ax.title.set_fontsize(10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

    label = _plot_label(record)
    if res.get("levels"):
        ours = _ours(record)
        runs = [(n, r["levels"]) for n, r in ours + _peer_runs(record) if r.get("levels")]
        levels_c = [m["concurrency"] for m in res["levels"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, levels in runs:
            ax.plot([m["concurrency"] for m in levels], [m["output_tok_s"] for m in levels],
                    marker="o", label=name)
        _concurrency_axis(ax, "output tokens / s", f"throughput vs concurrency\n{label}", levels_c)
        save(fig, "throughput.png")
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, levels in runs:
            xs = [m["concurrency"] for m in levels]
            line, = ax.plot(xs, [m["ttft_ms"]["p50"] for m in levels], marker="o", label=f"{name} p50")
            ax.plot(xs, [m["ttft_ms"]["p99"] for m in levels], marker="^", linestyle="--",
                    color=line.get_color(), label=f"{name} p99")
        _concurrency_axis(ax, "TTFT (ms, incl. queue wait)", f"time to first token\n{label}", levels_c)
        save(fig, "ttft.png")
        for key, title in (("ttft_ms", "TTFT (ms, incl. queue wait)"), ("itl_ms", "inter-token latency (ms)")):
            # one panel per backend, a curve per concurrency level in each
            fig, axes = plt.subplots(1, len(ours), figsize=(6 * len(ours), 4), squeeze=False,
                                     sharex=True, sharey=True)
            for ax, (name, run) in zip(axes[0], ours):
                for m in run["levels"]:
                    _cdf(ax, m["samples"][key], f"c={m['concurrency']}")
                ax.set_xlabel(title)
                ax.set_title(f"{name} {title.split(' (')[0]} distribution\n{label}")
                ax.legend(fontsize=8)
            axes[0][0].set_ylabel("fraction of samples")
            save(fig, f"{key.split('_')[0]}_distribution.png")
    elif wl == "scheduler":
        import numpy as np

        fig, ax = plt.subplots(figsize=(6, 4))
        every = [v for s in res["scenarios"].values() for v in s["samples"]["us_per_step"]]
        lo, hi = max(min(every), 1e-1), max(max(every), 1000)
        bins = np.geomspace(lo * 0.9, hi * 1.1, 60)
        for name, s in res["scenarios"].items():
            ax.hist(s["samples"]["us_per_step"], bins=bins, alpha=0.6, label=name)
        ax.set_xscale("log")
        ax.axvline(1000, color="red", linestyle="--", label="1 ms target")
        ax.set_xlabel("schedule + layout (us per step)")
        ax.set_ylabel("steps")
        ax.set_title("scheduler CPU time per step")
        ax.legend()
        save(fig, "scheduler_us_per_step.png")
    elif wl in ("decode-sat", "single", "offline") or res.get("mode") == "open-loop":
        key = {"decode-sat": "decode_tok_s", "single": "decode_tok_s"}.get(wl, "output_tok_s")
        ours = _ours(record)
        peers = [(n, p) for n, p in _peer_runs(record) if key in p]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([n for n, _ in ours + peers], [r[key] for _, r in ours + peers],
               color=["tab:blue"] * len(ours) + ["tab:gray"] * len(peers))
        ax.tick_params(axis="x", labelrotation=15)
        if wl == "single":
            ax.axhline(res["bandwidth_limit_tok_s"], color="red", linestyle="--",
                       label="copy-bandwidth limit")
            ax.legend()
        ax.set_ylabel(key.replace("_", " ").replace("tok s", "tok/s"))
        ax.set_title(f"{wl}\n{label}")
        save(fig, "throughput.png")
        for key, title in (("step_ms", "decode step time (ms)"), ("itl_ms", "inter-token latency (ms)"),
                           ("ttft_ms", "TTFT (ms, incl. queue wait)")):
            series = [(n, r["samples"][key]) for n, r in ours if r.get("samples", {}).get(key)]
            if series:
                fig, ax = plt.subplots(figsize=(6, 4))
                for name, values in series:
                    _cdf(ax, values, name)
                ax.set_xlabel(title)
                ax.set_ylabel("fraction of samples")
                ax.set_title(f"{wl}: {title.split(' (')[0]} distribution\n{label}")
                ax.legend(fontsize=8)
                save(fig, f"{key.split('_')[0]}_distribution.png")
    return written


def _plot_label(record: dict) -> str:
    """A short subtitle: model, backend (when only one ran: the legends name several), device
    (titles must fit the figure)."""
    name = str((record.get("model") or {}).get("name") or record.get("url") or "")
    if name.startswith("embedded default"):
        name = "smollm2-135m-instruct"
    name = Path(name).name.removesuffix(".json") if "/" in name else name
    device = str(record.get("env", {}).get("device_name") or "")
    device = device if len(device) <= 32 else device[:30] + "…"
    backends = list(record.get("backends") or ())
    backend = backends[0] if len(backends) == 1 else None
    return " · ".join(x for x in (name, backend, device) if x)


def _concurrency_axis(ax, ylabel: str, title: str, levels=()) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    if levels:
        ax.set_xticks(sorted(levels))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("concurrency (clients)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _cdf(ax, values, label) -> None:
    import numpy as np

    v = np.sort(np.asarray(values, dtype=float))
    if v.size:
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label, drawstyle="steps-post")
