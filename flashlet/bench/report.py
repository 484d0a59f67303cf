"""The outputs: the JSON record, markdown tables for stdout, PNG plots (matplotlib, Agg).

The JSON record (schema "flashlet-bench/1"):
    workload, command, argv, date (UTC), git {commit, dirty}, params (the resolved sizes),
    env {device, device_name, torch, cuda, cudnn, transformers, triton, flashinfer, gpu_*, cpu},
    model {name, weights, num_params, dtype, config}, engine (EngineConfig + num_pages),
    results (per workload, below), peers {hf, hf-static: figures + ratio_* = ours / theirs, or
    skipped / error}, notes, plots.
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


KERNEL_COLUMNS = ("kernel", "batch", "context", "tokens", "triton_us", "reference_us",
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


def _peer_runs(record: dict) -> list[tuple[str, dict]]:
    return [(name, p) for name, p in (record.get("peers") or {}).items()]


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
            "url": _md_url}[wl](record)
    tail = _skipped_lines(record)
    return "\n".join(head + [body] + ([""] + tail if tail else [])) + "\n"


def _setup_line(record: dict) -> str:
    env, m, p = record.get("env", {}), record.get("model") or {}, record.get("params", {})
    bits = []
    if record["workload"] == "url":
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
        bits.append(f"backend {record.get('engine', {}).get('backend')}")
        bits.append(f"{env.get('device')} ({env.get('device_name')})")
        bits.append(f"dtype {m.get('dtype')}")
    for key in ("prompt_len_range", "output_len_range"):
        if key in p:
            lo, hi = p[key]
            bits.append(f"{key.split('_')[0]} {lo}" + (f"–{hi}" if hi != lo else "") + " tokens")
    bits.append(f"torch {env.get('torch')}" + (f", CUDA {env['cuda']}" if env.get("cuda") else ""))
    bits.append(f"commit {str(record.get('git', {}).get('commit', 'unknown'))[:10]}")
    return "; ".join(bits)


def _md_closed(record: dict, ours_name: str = "flashlet") -> str:
    res = record["results"]
    runs = [(ours_name, res)] + [(n, p) for n, p in _peer_runs(record) if p.get("levels")]
    rows = []
    for lv in res["levels"]:
        c = lv["concurrency"]
        for name, run in runs:
            m = next((x for x in run["levels"] if x["concurrency"] == c), None)
            if m is None:
                continue
            rows.append([str(c), name, m["completed"], m["output_tok_s"], m["requests_per_s"],
                         m["ttft_ms"]["p50"], m["ttft_ms"]["p99"], m["itl_ms"]["p50"],
                         m["itl_ms"]["p99"], m["step_ms"]["mean"]])
    out = [table(["concurrency", "engine", "requests", "output tok/s", "req/s",
                  "TTFT p50 (ms)*", "TTFT p99 (ms)*", "ITL p50 (ms)", "ITL p99 (ms)",
                  "mean step (ms)"], rows), "", f"\\* {TTFT_NOTE}"]
    peers = [(n, p) for n, p in runs[1:]]
    if peers:
        headers = ["concurrency", f"{ours_name} tok/s"]
        for n, _ in peers:
            headers += [f"{n} tok/s", f"{ours_name} / {n}"]
        rows = []
        for lv in res["levels"]:
            row = [str(lv["concurrency"]), lv["output_tok_s"]]
            for _, p in peers:
                m = next((x for x in p["levels"] if x["concurrency"] == lv["concurrency"]), {})
                row += [m.get("output_tok_s"), _x(m.get("ratio_output_tok_s"))]
            rows.append(row)
        out += ["", table(headers, rows)]
    return "\n".join(out)


def _x(r) -> str:
    return "–" if r is None else f"{r:.2f}x"


def _md_decode(record: dict) -> str:
    r = record["results"]
    rows = [["flashlet", r["batch"], r["prompt_len"], r["decode_steps"], r["decode_tok_s"],
             r["ms_per_step"], r["step_ms"]["p50"], r["step_ms"]["p99"], "–"]]
    for name, p in _peer_runs(record):
        if "decode_tok_s" in p:
            rows.append([name, p["batch"], p["prompt_len"], p["decode_steps"], p["decode_tok_s"],
                         p["ms_per_step"], p["step_ms"]["p50"], p["step_ms"]["p99"],
                         _x(p.get("ratio_decode_tok_s"))])
    return table(["engine", "batch", "prompt", "decode steps", "decode tok/s", "ms/step",
                  "step p50 (ms)", "step p99 (ms)", "flashlet / peer"], rows) + \
        "\n\nOnly pure-decode steps of the whole batch are timed (prefill excluded)."


def _md_single(record: dict) -> str:
    r = record["results"]
    bw = r["copy_bandwidth"]["gb_per_s"]

    def row(name, m, ratio):
        return [name, m["decode_tok_s"], m["ms_per_token"], m["ttft_ms"],
                m["bytes_per_token"]["total"] / 1e6, m["achieved_gb_per_s"], bw,
                f"{100 * m['fraction_of_bandwidth_limit']:.1f}%", m["bandwidth_limit_tok_s"], ratio]

    rows = [row("flashlet", r, "–")]
    for name, p in _peer_runs(record):
        if "decode_tok_s" in p:
            rows.append(row(name, p, _x(p.get("ratio_decode_tok_s"))))
    return table(["engine", "decode tok/s", "ms/token", "TTFT (ms)", "MB read/token",
                  "achieved GB/s", "copy GB/s", "of bandwidth limit", "limit tok/s",
                  "flashlet / peer"], rows) + (
        f"\n\nOne stream, prompt {r['prompt_len']} tokens, {r['output_tokens']} tokens generated. "
        "Bytes per token: every weight once plus the mean K/V read; the limit is the copy "
        "bandwidth measured in this run on this device ((read + write) bytes / time).")


def _md_offline(record: dict) -> str:
    r = record["results"]
    rows = [["flashlet", r["completed"], r["prompt_tokens"], r["output_tokens"], r["total_time_s"],
             r["output_tok_s"], r["total_tok_s"], r["num_preemptions"], "–"]]
    for name, p in _peer_runs(record):
        if "output_tok_s" in p:
            rows.append([name, p["completed"], p["prompt_tokens"], p["output_tokens"],
                         p["total_time_s"], p["output_tok_s"], p["total_tok_s"], "–",
                         _x(p.get("ratio_output_tok_s"))])
    return table(["engine", "requests", "input tokens", "output tokens", "total time (s)",
                  "output tok/s", "total tok/s", "preemptions", "flashlet / peer"], rows)


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
        "\n\nCPU time of scheduler.schedule() + buffers.fill() per step (no forward pass)."


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
        return _md_closed(record, ours_name="server")
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
        ours = "server" if wl == "url" else "flashlet"
        runs = [(ours, res["levels"])] + [(n, p["levels"]) for n, p in _peer_runs(record)
                                          if p.get("levels")]
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
            fig, ax = plt.subplots(figsize=(6, 4))
            for m in res["levels"]:
                _cdf(ax, m["samples"][key], f"c={m['concurrency']}")
            ax.set_xlabel(title)
            ax.set_ylabel("fraction of samples")
            ax.set_title(f"{ours} {title.split(' (')[0]} distribution\n{label}")
            ax.legend(fontsize=8)
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
        ax.set_xlabel("schedule + fill (us per step)")
        ax.set_ylabel("steps")
        ax.set_title("scheduler CPU time per step")
        ax.legend()
        save(fig, "scheduler_us_per_step.png")
    elif wl in ("decode-sat", "single", "offline") or res.get("mode") == "open-loop":
        key = {"decode-sat": "decode_tok_s", "single": "decode_tok_s"}.get(wl, "output_tok_s")
        names = ["flashlet"] + [n for n, p in _peer_runs(record) if key in p]
        values = [res[key]] + [p[key] for n, p in _peer_runs(record) if key in p]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(names, values, color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
        if wl == "single":
            ax.axhline(res["bandwidth_limit_tok_s"], color="red", linestyle="--",
                       label="copy-bandwidth limit")
            ax.legend()
        ax.set_ylabel(key.replace("_", " ").replace("tok s", "tok/s"))
        ax.set_title(f"{wl}\n{label}")
        save(fig, "throughput.png")
        dist = res.get("samples", {})
        for key, title in (("step_ms", "decode step time (ms)"), ("itl_ms", "inter-token latency (ms)"),
                           ("ttft_ms", "TTFT (ms, incl. queue wait)")):
            if dist.get(key):
                fig, ax = plt.subplots(figsize=(6, 4))
                _cdf(ax, dist[key], "flashlet")
                ax.set_xlabel(title)
                ax.set_ylabel("fraction of samples")
                ax.set_title(f"{wl}: {title.split(' (')[0]} distribution\n{label}")
                save(fig, f"{key.split('_')[0]}_distribution.png")
    return written


def _plot_label(record: dict) -> str:
    """A short subtitle: model, backend, device (titles must fit the figure)."""
    name = str((record.get("model") or {}).get("name") or record.get("url") or "")
    if name.startswith("embedded default"):
        name = "smollm2-135m-instruct"
    name = Path(name).name.removesuffix(".json") if "/" in name else name
    device = str(record.get("env", {}).get("device_name") or "")
    device = device if len(device) <= 32 else device[:30] + "…"
    backend = (record.get("engine") or {}).get("backend")
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
