"""The same closed-loop workload in-process and through the server, in one run, as one table.

    python scripts/serve_compare.py --out DIR [--concurrency 1 16 64 256] [--max-new-tokens 128]
        [--tokenizer .tok/smollm2] [--api-server-count N] [--busy-poll-ms MS] [--client-procs N] -- ENGINE FLAGS (e.g. --config qwen2.5-0.5b-smolvocab
        --backend triton --dtype bfloat16 --max-num-pages 16384)

1. `python -m flashlet.bench` in-process with ENGINE FLAGS (token-id prompts; `--inprocess
   JSON` reuses an earlier run's record instead, to compare several server settings);
2. `python -m flashlet.server` with ENGINE FLAGS (+ --tokenizer) on a free port, then
   `python -m flashlet.bench --url` against it (text prompts, about one token per word; the
   server counts the exact prompt tokens; the streams shared by its client processes, see
   --client-procs), then SIGTERM;
3. one markdown table: output tok/s, TTFT p50/p99 and ITL p50 of each side, and the ratios;
   then the server's own diagnostics per level (GET /debug/stats around it, read by the bench:
   server/diagnostics.py) beside the in-process engine's steps/s, tokens per step and step
   time: where the server's time goes (DIAG_NOTES says what each column is); at the lowest
   level, each request's TTFT and the shape of the long token gaps (late deliveries against
   slow steps: Trace.itl_shape).
Every level runs at least --min-requests (64) requests: at concurrency 1, one outlier of 64
moves the TTFT p99 (between the two highest samples) less than one of 32 (near the highest).
And at least --requests-per-stream (16) a client: a level opens with every client sending at once,
which in-process lands in one step (one prefill for all, then decodes in lockstep) and through
the server one request at a time; at 4 requests a client that opening was a quarter of the level
(H200, 2026-12-04: concurrency 16 read 0.92 at 64 requests and 0.96 at 256, same tree).
Both runs write their JSON records into DIR (inprocess.json, server.json, server.log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workload_flags(args) -> list[str]:
    flags = ["--workload", "closed-loop", "--concurrency", *map(str, args.concurrency),
             "--max-new-tokens", str(args.max_new_tokens), "--prompt-len-range",
             *map(str, args.prompt_len_range), "--quiet"]
    if args.output_len_range:
        flags += ["--output-len-range", *map(str, args.output_len_range)]
    if args.num_requests:
        flags += ["--num-requests", str(args.num_requests)]
    else:
        flags += ["--min-requests", str(args.min_requests),
                  "--requests-per-stream", str(args.requests_per_stream)]
    return flags


def run_in_process(args, engine_flags: list[str], out: Path) -> dict:
    """The in-process run's record: run now, or an earlier run's (--inprocess), to compare several
    server settings against one."""
    path = Path(args.inprocess) if args.inprocess else out / "inprocess.json"
    if not args.inprocess:
        subprocess.run([sys.executable, "-m", "flashlet.bench", *engine_flags,
                        *_workload_flags(args), "--out", str(path)], check=True,
                       timeout=args.timeout)
    inproc = next(iter(json.loads(path.read_text())["backends"].values()))
    missing = set(args.concurrency) - {lv["concurrency"] for lv in inproc["levels"]}
    if missing:
        raise SystemExit(f"{path} has no level at concurrency {sorted(missing)}")
    return inproc


def run_server(args, engine_flags: list[str], out: Path) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server_flags = list(engine_flags)
    if args.tokenizer:
        server_flags += ["--tokenizer", args.tokenizer]
    if args.api_server_count is not None:  # else the server's default (from its CPU count)
        server_flags += ["--api-server-count", str(args.api_server_count)]
    if args.busy_poll_ms:
        server_flags += ["--busy-poll-ms", str(args.busy_poll_ms)]
    command = [sys.executable, "-m", "flashlet.server", "--port", str(port), "--no-access-log",
               "--max-waiting", "100000", *server_flags]
    with serving(command, url, out / "server.log", args.timeout):
        path = out / "server.json"
        client = ["--client-procs", str(args.client_procs)] if args.client_procs else []
        subprocess.run([sys.executable, "-m", "flashlet.bench", "--url", url,
                        *_workload_flags(args), *client, "--out", str(path)], check=True,
                       timeout=args.timeout)
        return json.loads(path.read_text())["results"]


@contextlib.contextmanager
def serving(command: list[str], url: str, log_path: Path, timeout: float, env=None):
    """A server started by `command` (its output into log_path), once its /health answers;
    SIGTERM (then SIGKILL after 60 s) when the block ends."""
    log = open(log_path, "w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}): see {log_path}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not get ready in time")
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def _ratio(a, b) -> str:
    return "–" if not a or not b else f"{a / b:.2f}"


def _first_ttft(level: dict) -> str:
    """The TTFT of the level's first request (the samples are in request order)."""
    ttft = level.get("samples", {}).get("ttft_ms") or []
    return f"{ttft[0]:.1f}" if ttft else "–"


def _tokens_per_event(level: dict) -> str:
    events = level.get("token_events")
    return f"{level['output_tokens'] / events:.2f}" if events else "–"


def paired_levels(inproc: dict, server: dict):
    """(in-process level, server level) for each concurrency both runs have, in run order."""
    by_c = {lv["concurrency"]: lv for lv in server["levels"]}
    for lv in inproc["levels"]:
        if lv["concurrency"] in by_c:
            yield lv, by_c[lv["concurrency"]]


def table(inproc: dict, server: dict) -> str:
    head = ("| concurrency | requests | in-process tok/s | server tok/s | server / in-process | "
            "TTFT p50 in / server (ms) | TTFT p99 in / server (ms) | "
            "TTFT 1st request in / server (ms) | ITL p50 in / server (ms) | "
            "ITL p50 server / in-process | ITL p99 in / server (ms) | ITL p99 server / in-process | "
            "server tokens per SSE event | server failed |")
    lines = [head, "|" + "---|" * 14]
    for lv, sv in paired_levels(inproc, server):
        lines.append(
            f"| {lv['concurrency']} | {sv['num_requests']} | {lv['output_tok_s']:,.1f} | "
            f"{sv['output_tok_s']:,.1f} | {_ratio(sv['output_tok_s'], lv['output_tok_s'])} | "
            f"{lv['ttft_ms']['p50']:.1f} / {sv['ttft_ms']['p50']:.1f} | "
            f"{lv['ttft_ms']['p99']:.1f} / {sv['ttft_ms']['p99']:.1f} | "
            f"{_first_ttft(lv)} / {_first_ttft(sv)} | "
            f"{lv['itl_ms']['p50']:.2f} / {sv['itl_ms']['p50']:.2f} | "
            f"{_ratio(sv['itl_ms']['p50'], lv['itl_ms']['p50'])} | "
            f"{lv['itl_ms']['p99']:.2f} / {sv['itl_ms']['p99']:.2f} | "
            f"{_ratio(sv['itl_ms']['p99'], lv['itl_ms']['p99'])} | {_tokens_per_event(sv)} | "
            f"{sv['failed']} |")
    return "\n".join(lines)


def by_api_server(server: dict) -> str:
    """With several API processes: each level's TTFT p50 / p99 by the process that served."""
    lines = []
    for lv in server["levels"]:
        by = lv.get("by_api_server")
        if by:
            lines.append(f"TTFT by API process at concurrency {lv['concurrency']} (client procs "
                         f"{lv.get('client_procs', 1)}): " + "; ".join(
                             f"api{k}: {v['requests']} requests, p50 {v['ttft_ms']['p50']:.1f} / "
                             f"p99 {v['ttft_ms']['p99']:.1f} ms (the server's own: p50 "
                             f"{v['server_ttft_ms']['p50']:.1f})" for k, v in by.items()))
    return "\n".join(lines)


def server_side_ttft(server: dict) -> str:
    """The server's own TTFT (from its handler's start to the first token in the API process,
    the final event's ttft_ms) beside the client's: the rest is HTTP and the client."""
    parts = [f"c={lv['concurrency']}: {lv['server_ttft_ms']['p50']:.1f} / "
             f"{lv['ttft_ms']['p50']:.1f}" for lv in server["levels"] if lv.get("server_ttft_ms")]
    return ("TTFT p50, the server's own / the client's (ms): " + "; ".join(parts)) if parts else ""


def ttft_by_request(inproc: dict, server: dict, concurrency: int = 1) -> str:
    """Every request's TTFT in the order sent, at one level: a first-request outlier shows."""
    lines = []
    for name, record in (("in-process", inproc), ("server", server)):
        level = next((lv for lv in record["levels"] if lv["concurrency"] == concurrency), None)
        if level is not None:
            ttft = level.get("samples", {}).get("ttft_ms") or []
            lines.append(f"TTFT by request at concurrency {concurrency}, {name} (ms): "
                         + " ".join(f"{t:.1f}" for t in ttft))
    return "\n".join(lines)


def itl_shape(inproc: dict, server: dict, concurrency: int = 1) -> str:
    """The long token gaps at one level, and how many of them were tokens delivered late (a
    long gap, then a short one: Trace.itl_shape) rather than slow steps."""
    parts = []
    for name, record in (("in-process", inproc), ("server", server)):
        level = next((lv for lv in record["levels"] if lv["concurrency"] == concurrency), None)
        shape = level.get("itl_shape") if level else None
        if shape:
            parts.append(f"{name} {100 * shape['long']:.1f}% long, {100 * shape['late']:.1f}% "
                         f"late (median {shape['median_ms']:.3f} ms)")
    if not parts:
        return ""
    return (f"ITL gaps at concurrency {concurrency} over 1.5x the median (long), and those followed "
            f"by one under half of it (late: delivered late, not made late): " + "; ".join(parts))


def _ms(q: dict | None) -> str:
    """A quantiles() figure: "p50 / p99 / max" (ms)."""
    if not q or q.get("p50") is None:
        return "–"
    return f"{q['p50']:.2f} / {q['p99']:.2f} / {q['max']:.2f}"


def _f(x, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _machine(level: dict) -> str:
    """A level's machine_cpu: 'busy% (stolen%)' of all CPUs' time (– without it)."""
    cpu = level.get("machine_cpu")
    return "–" if not cpu else f"{100 * cpu['busy']:.0f}% ({100 * cpu['steal']:.1f}%)"


def _preempted(figures: dict) -> str:
    """' (N/s)': a process's involuntary context switches a second, where the reading has them."""
    rate = figures.get("preempted_per_s")
    return "" if rate is None else f" ({rate:,.0f}/s)"


def _gc(name: str, figures: dict) -> str:
    return (f"{name} {100 * figures['gc_share']:.2f} ({figures['gc_full']}, "
            f"{figures['gc_long']})")


def diagnostics_table(inproc: dict, server: dict) -> str:
    """The server's own view of each level (GET /debug/stats around it, diagnostics.py) beside
    the in-process engine's: where the server's time goes. Per core (cN) and API process (aK)."""
    head = ("| concurrency | steps/s in / server | tokens per step (mean batch) in / server | "
            "step ms mean in / server | of it blocked on the device (ms) in / server | "
            "server step ms p99 / max | core loop: step / send / receive / idle (% of level) | "
            "core CPU busy (preempted a second) | machine CPUs busy (stolen) in / server | "
            "turnaround p50 / p99 / max (ms) | API CPU busy (preempted a second) | API tokens per event | "
            "API event-loop lag p50 / p99 / max (ms) | "
            "step message delivery p50 / p99 / max (ms) | API intake p50 / p99 / max (ms) | "
            "client's own turnaround p50 / p99 / max (ms) | "
            "GC % of level (full collections, pauses > 5 ms) |")
    lines = [head, "|" + "---|" * 17]
    for lv, sv in paired_levels(inproc, server):
        diag = sv.get("server_diag")
        if not diag:
            continue
        steps_in = lv["num_steps"] / max(lv["duration_s"], 1e-9)
        batch_in = lv["output_tokens"] / lv["num_steps"] if lv["num_steps"] else None
        cores, api = diag["cores"], diag["api_servers"]
        lines.append(
            f"| {lv['concurrency']} | {steps_in:,.0f} / "
            + ", ".join(f"c{i} {c['steps_per_s']:,.0f}" for i, c in enumerate(cores))
            + f" | {_f(batch_in)} / " + ", ".join(f"c{i} {_f(c['tokens_per_step'])}"
                                                   for i, c in enumerate(cores))
            + f" | {_f(lv['step_ms']['mean'])} / " + ", ".join(
                f"c{i} {_f(c['step_ms_mean'])}" for i, c in enumerate(cores))
            + f" | {_f(lv.get('device_wait_ms'))} / " + ", ".join(
                f"c{i} {_f(c.get('device_wait_ms_mean'))}" for i, c in enumerate(cores))
            + " | " + ", ".join(f"c{i} {_f(c['step_ms']['p99'])} / {_f(c['step_ms']['max'])}"
                                for i, c in enumerate(cores))
            + " | " + ", ".join(f"c{i} " + " / ".join(
                f"{100 * c['loop_share'][p]:.1f}" for p in ("step", "send", "receive", "idle"))
                for i, c in enumerate(cores))
            + " | " + ", ".join(f"c{i} {_f(c.get('cpu_busy'))}{_preempted(c)}"
                                for i, c in enumerate(cores))
            + f" | {_machine(lv)} / {_machine(sv)}"
            + " | " + ", ".join(f"c{i} {_ms(c['turnaround_ms'])}" for i, c in enumerate(cores))
            + " | " + ", ".join(f"a{a['api_server']} {_f(a['busy'])}{_preempted(a)}" for a in api)
            + " | " + ", ".join(f"a{a['api_server']} {_f(a['tokens_per_event'])}" for a in api)
            + " | " + ", ".join(f"a{a['api_server']} {_ms(a['loop_lag_ms'])}" for a in api)
            + " | " + ", ".join(f"a{a['api_server']} {_ms(a['delivery_ms'])}" for a in api)
            + " | " + ", ".join(f"a{a['api_server']} {_ms(a['intake_ms'])}" for a in api)
            + " | " + ", ".join(f"a{a['api_server']} {_ms(a['client_gap_ms'])}" for a in api)
            + " | " + ", ".join(_gc(f"c{i}", c) for i, c in enumerate(cores))
            + ", " + ", ".join(_gc(f"a{a['api_server']}", a) for a in api)
            + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


DIAG_NOTES = ("Server diagnostics (GET /debug/stats before and after each level; shares and "
              "rates over the level's duration): tokens per step = output tokens / steps (the "
              "mean number of requests that got a token per step); blocked on the device: of a "
              "step's time, the host's wait reading the tokens of the step before (steps overlap "
              "the device: near the step's time the device paces the loop, near 0 the host "
              "does); the core loop's step / send "
              "(encode + zmq send of the step's outputs) / receive (decode and add the new "
              "requests) / idle (the rest: waiting for requests); core CPU busy: the core "
              "process's CPU seconds (all threads) / level seconds, and preempted: the kernel's "
              "involuntary context switches of it a second (other processes wanting its CPU); "
              "machine CPUs: the share of all the machine's CPU time busy, and stolen by the "
              "hypervisor for other guests (/proc/stat), over each side's level; turnaround: from a request's "
              "finish in the core to the next request's arrival there (matched first in, first "
              "out); API CPU busy = the process's CPU seconds (all threads) / level seconds (preempted: as the core's); "
              "event-loop lag: lateness of a 10 ms asyncio timer; delivery: a step message's "
              "send in the core to its decoding in the API process's reader thread; intake: a "
              "request's handler start to its submission to a core (validation, tokenizing); "
              "client's own turnaround: on a keep-alive connection, from a response's end to the "
              "next request's start (the load generator's share of the turnaround); GC: the time in "
              "Python's garbage collector, with the full collections and the pauses over 5 ms. "
              "Latencies come from buckets 1.25x wide (each figure is its bucket's upper edge).")


NOTES = ("Closed loop, the same lengths on both sides (prompt lengths uniform in the range, "
         "max_new_tokens each, ignore_eos). In-process prompts are token ids; the server's are "
         "text, about one token per word. TTFT and ITL are per token: in-process when the engine "
         "hands the token out, through the server when the client reads its SSE event: tokens "
         "that came in one event (the server fell behind the engine; see tokens per SSE event) "
         "share its arrival time, so ITL reads 0 between them. Random "
         "weights at the qwen2.5-0.5b shape with the vocabulary of the embedded SmolLM2 tokenizer "
         "(49152 instead of 151936: preset qwen2.5-0.5b-smolvocab) so that every sampled id "
         "decodes; the output head is 3x narrower than the real model's.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len-range", type=int, nargs=2, default=[32, 768])
    p.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="output lengths drawn from this range instead of --max-new-tokens each: "
                        "in-process, equal lengths keep a closed loop's requests in lockstep "
                        "(they start, prefill and finish together), which a server's "
                        "turnaround breaks; varied lengths desynchronize both sides alike")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--min-requests", type=int, default=64,
                   help="requests per level at least (so that p99 at concurrency 1 is a "
                        "percentile; default %(default)s)")
    p.add_argument("--requests-per-stream", type=int, default=16,
                   help="requests per level at least this many times the concurrency (default "
                        "%(default)s: a level's start, when in-process every client arrives in the "
                        "same step and through the server one at a time, is a sixteenth of it)")
    p.add_argument("--tokenizer", default=None, help="the server's --tokenizer")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="the server's --api-server-count (API processes; default: the "
                        "server's own default, from its CPU count)")
    p.add_argument("--busy-poll-ms", type=float, default=0.0,
                   help="the server's --busy-poll-ms (default: 0, off)")
    p.add_argument("--client-procs", type=int, default=None,
                   help="the bench's --client-procs (load-generator processes; default: the "
                        "bench's, one per 32 streams)")
    p.add_argument("--inprocess", default=None, metavar="JSON",
                   help="reuse this in-process record (an earlier run's inprocess.json, the same "
                        "engine flags and workload) instead of running it again")
    p.add_argument("--timeout", type=float, default=900)
    args, engine_flags = p.parse_known_args(argv)
    engine_flags = [f for f in engine_flags if f != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    inproc = run_in_process(args, engine_flags, out)
    server = run_server(args, engine_flags, out)
    print(table(inproc, server))
    print()
    diagnostics = diagnostics_table(inproc, server)
    if diagnostics:
        print(diagnostics)
        print()
        print(DIAG_NOTES)
        print()
    print(ttft_by_request(inproc, server, min(args.concurrency)))
    print()
    for extra in (itl_shape(inproc, server, min(args.concurrency)), server_side_ttft(server),
                  by_api_server(server)):
        if extra:
            print(extra)
            print()
    print(NOTES)
    print(f"engine flags: {' '.join(engine_flags)}; concurrency {args.concurrency}, "
          f"{args.max_new_tokens} new tokens, prompts {args.prompt_len_range[0]}-"
          f"{args.prompt_len_range[1]} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
