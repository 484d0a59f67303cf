"""One stream's token gaps through the real server, read by two clients: is the one-stream ITL
tail the server's or the measuring client's (issue 32)?

    PYTHONPATH=. python lab/itl_clients.py [--requests 64] [--rounds 2] [--tokens 128]
        [--variants default api1 pinned busypoll] [--inprocess] -- SERVER-FLAGS
    e.g. -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16
            --max-num-pages 16384 --tokenizer .tok/smollm2

The server is `python -m flashlet.server` with SERVER-FLAGS plus each variant's:
- `default`: nothing more (the API process count from the CPU count);
- `api1`: `--api-server-count 1`;
- `busypoll`: `--busy-poll-ms 2` (the reading event loop does not sleep between step messages
  while requests are in flight: no wake-up on a token's way into the API process);
- `pinned`: the server started under `taskset` on every CPU but the last, then, once ready, the
  engine core's threads (the process on the GPU, from nvidia-smi) moved onto that last CPU, so
  no other server process wakes up on the core's CPU (needs nvidia-smi and taskset).
Each variant's server starts once; then the two clients take turns, `--rounds` times each, at
concurrency 1 with the bench's requests (prompts 32-768 words, `--tokens` new tokens,
ignore_eos):
- `bench`: `python -m flashlet.bench --url` (its asyncio + httptools client in a spawned, niced
  process: what every server figure in BENCHMARKS.md was read with);
- `raw`: this process on one blocking TCP socket (TCP_NODELAY), each read's arrival time given
  to every token its events carry, as the bench does.
`--inprocess` first runs the same closed loop in-process (the bench, SERVER-FLAGS without the
server-only ones) as the reference. Prints ITL p50 / p90 / p99 (ms) for each run, and
after each bench round the server's own side of it (`server_side`: the core's step time p50 /
p99, each API process's delivery and event-loop lag p99): which process the tail is in.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flashlet.bench.remote import text_specs  # noqa: E402
from scripts.api_overhead import free_port, stop_server, wait_ready  # noqa: E402

SERVER_ONLY = {"--tokenizer": 1, "--api-server-count": 1}  # flags the in-process bench lacks


def bench_flags(args, num_requests: int) -> list[str]:
    return ["--workload", "closed-loop", "--concurrency", "1", "--max-new-tokens",
            str(args.tokens), "--prompt-len-range", "32", "768", "--num-requests",
            str(num_requests), "--quiet"]


def itl_of(record: dict) -> np.ndarray:
    return np.array(itl_level(record)["samples"]["itl_ms"])


def server_side(record: dict) -> str:
    """Where a server's token gaps grew, from its own diagnostics around the level (`bench
    --url` records them: server/diagnostics.py): the engine core's step time as the core
    loop times it (p50 / p99), its loop's share sending, the kernel's preemptions of it a
    second; each API process's delivery (a step message's arrival to its SSE write) and
    event-loop lag p99. A tail in the core's steps is the engine's in that process; one in
    delivery or lag, the API process's; neither, the client's or the network's."""
    diag = itl_level(record).get("server_diag") or {}
    parts = []
    for c in diag.get("cores", []):
        q = c["step_ms"]
        parts.append(f"core step {q['p50']:.3f} / {q['p99']:.3f}, send {c['loop_share']['send']:.0%}, "
                     f"preempted {c['preempted_per_s'] or 0:.0f}/s")
    for a in diag.get("api_servers", []):
        parts.append(f"api{a['api_server']} delivery p99 {a['delivery_ms']['p99']:.3f}, "
                     f"loop lag p99 {a['loop_lag_ms']['p99']:.3f}")
    return "; ".join(parts) or "no server diagnostics"


def itl_level(record: dict) -> dict:
    levels = record["results"]["levels"] if "results" in record else \
        next(iter(record["backends"].values()))["levels"]
    return levels[0]


def run_bench(args, url: str | None, engine_flags: list[str], folder: Path, name: str):
    out = folder / f"{name}.json"
    target = ["--url", url] if url else engine_flags
    subprocess.run([sys.executable, "-m", "flashlet.bench", *target,
                    *bench_flags(args, args.requests), "--out", str(out)], check=True,
                   timeout=900, cwd=ROOT)
    record = json.loads(out.read_text())
    if url:
        print(f"  server side (ms): {server_side(record)}", flush=True)
    return itl_of(record)


def raw_requests(args, seed: int) -> list[bytes]:
    specs = text_specs(args.requests, (32, 768), (args.tokens, args.tokens), seed=seed)
    out = []
    for spec in specs:
        body = json.dumps({"prompt": spec.prompt, "max_new_tokens": spec.max_new_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        out.append(b"POST /generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
    return out


def run_raw(port: int, requests: list[bytes]) -> np.ndarray:
    """Token gaps (ms) of each request after the first token, requests one after another."""
    gaps = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for payload in requests:
            sock.sendall(payload)
            times, tail, end, done = [], b"", b"", False
            # to the chunked body's end ("0\r\n\r\n", after [DONE]): the socket's next
            # request must start clean
            while not (done and end.endswith(b"0\r\n\r\n")):
                chunk = sock.recv(1 << 16)
                t = time.perf_counter()
                if not chunk:
                    raise RuntimeError("the server closed the connection")
                end = (end + chunk)[-16:]
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if event.get("finish_reason") is None and "text" in event:
                        times.extend([t] * int(event.get("num_tokens", 1)))
            gaps.extend(np.diff(times) * 1e3)
    return np.array(gaps)


def core_pid() -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout.split()
    if len(out) != 1:
        raise RuntimeError(f"expected one process on the GPU, nvidia-smi lists {out}")
    return int(out[0])


def start_server(variant: str, server_flags: list[str], port: int, log) -> subprocess.Popen:
    flags = list(server_flags)
    prefix: list[str] = []
    cpus = sorted(os.sched_getaffinity(0))
    if variant == "api1":
        flags += ["--api-server-count", "1"]
    elif variant == "busypoll":
        flags += ["--busy-poll-ms", "2"]
    elif variant == "pinned":
        prefix = ["taskset", "-c", ",".join(map(str, cpus[:-1]))]
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "flashlet.server", "--port",
                             str(port), "--no-access-log", *flags], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    wait_ready(port, proc)
    if variant == "pinned":
        pid = core_pid()
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpus[-1]), str(pid)], check=True,
                       capture_output=True)
        print(f"pinned: engine core {pid} on CPU {cpus[-1]}; the rest on {cpus[0]}-{cpus[-2]}",
              flush=True)
    return proc


def summary(gaps: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(gaps, [50, 90, 99])
    return f"{p50:6.3f} {p90:6.3f} {p99:6.3f}  (n {gaps.size})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["default", "api1", "pinned"],
                   choices=["default", "api1", "pinned", "busypoll"])
    p.add_argument("--inprocess", action="store_true")
    p.add_argument("server_flags", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    server_flags = [f for f in args.server_flags if f != "--"]
    engine_flags, skip = [], 0
    for f in server_flags:
        if skip:
            skip -= 1
        elif f in SERVER_ONLY:
            skip = SERVER_ONLY[f]
        else:
            engine_flags.append(f)
    folder = Path(tempfile.mkdtemp(prefix="itl-clients-"))
    rows = []
    try:
        if args.inprocess:
            rows.append(("in-process", "-", run_bench(args, None, engine_flags, folder, "inproc")))
            print(f"in-process: {summary(rows[-1][2])}", flush=True)
        for variant in args.variants:
            port = free_port()
            with open(folder / f"server-{variant}.log", "w") as log:
                proc = start_server(variant, server_flags, port, log)
                try:
                    for r in range(args.rounds):
                        for client in ("bench", "raw"):
                            if client == "bench":
                                gaps = run_bench(args, f"http://127.0.0.1:{port}", [], folder,
                                                 f"{variant}-{r}")
                            else:
                                gaps = run_raw(port, raw_requests(args, seed=r))
                            rows.append((variant, client, gaps))
                            print(f"{variant} {client} round {r}: {summary(gaps)}", flush=True)
                finally:
                    stop_server(proc, timeout=60)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{'server':>10} {'client':>6}   ITL p50    p90    p99 (ms), rounds pooled")
    seen = []
    for variant, client, _ in rows:
        if (variant, client) in seen:
            continue
        seen.append((variant, client))
        pooled = np.concatenate([g for v, c, g in rows if (v, c) == (variant, client)])
        print(f"{variant:>10} {client:>6}  {summary(pooled)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
