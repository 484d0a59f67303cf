"""How fast `bench --url`'s client can take SSE tokens, with no server cost behind them (a
benchmark tool for the load generator itself).

    python lab/client_ceiling.py [--streams 64 256] [--procs 1 2] [--tokens 128]
        [--requests-per-stream 4] [--step-ms 1] [--httpx]

A stub server in a subprocess (uvloop, one process) answers POST /generate_stream as flashlet's
server does (one `data: {"text": ...}` event per token, a final event with usage, `data:
[DONE]`, chunked, keep-alive), writing one event to every open stream per tick of `--step-ms`
(an engine step) and nothing else: its cost per token is one write of prebuilt bytes. The
client is the real one (flashlet.bench.remote's closed loop over `--procs` client processes);
`--httpx` adds, for one process, the httpx reader the bench used before (for comparison). Per
row: tokens/s received, the client processes' CPU time per token (user + system, all
processes), and the stub's CPU share (near 1.0: the stub, not the client, was the limit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ---- the stub server -------------------------------------------------------------------------
async def _stub(port: int, step_s: float) -> None:
    tick = asyncio.get_running_loop().create_future()

    async def ticker():
        nonlocal tick
        while True:
            await asyncio.sleep(step_s)
            tick.set_result(None)
            tick = asyncio.get_running_loop().create_future()

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    token = chunk(b'data: {"text": " w"}\n\n')
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")

    async def handle(reader, writer):
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in request.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b"{}"
                if request.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    continue
                n = json.loads(body).get("max_new_tokens", 16)
                writer.write(head)
                for _ in range(n):
                    await tick
                    writer.write(token)
                final = json.dumps({"text": "", "finish_reason": "length", "usage": {
                    "prompt_tokens": 8, "completion_tokens": n}}).encode()
                writer.write(chunk(b"data: " + final + b"\n\n") + chunk(b"data: [DONE]\n\n")
                             + b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    asyncio.ensure_future(ticker())
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# ---- the clients -----------------------------------------------------------------------------
async def _httpx_closed(url: str, streams: int, requests: int, tokens: int) -> int:
    """The bench's reader before flashlet/bench/sse.py: httpx's aiter_lines per event."""
    import httpx

    left = [requests]
    got = [0]
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async def loop():
            while left[0] > 0:
                left[0] -= 1
                async with client.stream("POST", "/generate_stream", json={
                        "prompt": "a b", "max_new_tokens": tokens}) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            event = json.loads(line[5:])
                            if event.get("finish_reason") is None:
                                got[0] += 1

        await asyncio.gather(*(loop() for _ in range(streams)))
    return got[0]


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, stub_pid: int, streams: int, procs: int, tokens: int, per_stream: int,
            use_httpx: bool) -> dict:
    from flashlet.bench import remote
    from flashlet.bench.common import NO_PROGRESS

    n = streams * per_stream
    stub0, self0, kids0 = _proc_cpu(stub_pid), _cpu(resource.RUSAGE_SELF), None
    t0 = time.perf_counter()
    if use_httpx:
        received = asyncio.run(_httpx_closed(url, streams, n, tokens))
        wall = time.perf_counter() - t0
        client_cpu = _cpu(resource.RUSAGE_SELF) - self0
    else:
        specs = remote.text_specs(n, (2, 2), (tokens, tokens), 0)
        task = NO_PROGRESS.task("", n)
        if procs > 1:
            with remote.ClientPool(procs) as pool:
                pids = [p.pid for p in pool.procs]
                remote._closed(url, specs[:procs], procs, 600, procs, pool, task)  # started
                kids0 = [_proc_cpu(p) for p in pids]
                t0 = time.perf_counter()
                trace = remote._closed(url, specs, streams, 600, procs, pool, task)
                wall = time.perf_counter() - t0
                client_cpu = sum(_proc_cpu(p) - c for p, c in zip(pids, kids0))
        else:
            trace = remote._closed(url, specs, streams, 600, 1, None, task)
            wall = time.perf_counter() - t0
            client_cpu = _cpu(resource.RUSAGE_SELF) - self0
        if trace.failed:
            raise RuntimeError(trace.extra.get("errors"))
        received = trace.output_tokens()
    return {"client": "httpx" if use_httpx else "flashlet.bench.sse", "streams": streams,
            "procs": procs, "tokens": received, "tok_s": received / wall,
            "client_cpu_us_per_token": client_cpu / received * 1e6,
            "stub_cpu_share": (_proc_cpu(stub_pid) - stub0) / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--httpx", action="store_true", help="also the old httpx reader (1 process)")
    p.add_argument("--stub-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stub_port is not None:
        import uvloop

        uvloop.run(_stub(args.stub_port, args.step_ms / 1000))
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stub = subprocess.Popen([sys.executable, __file__, "--stub-port", str(port),
                             "--step-ms", str(args.step_ms)])
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        print("| client | streams | procs | tok/s | client CPU us/token | stub CPU share |")
        print("|---|---|---|---|---|---|")
        runs = [(s, k, False) for s in args.streams for k in args.procs]
        if args.httpx:
            runs = [(s, 1, True) for s in args.streams] + runs
        for streams, procs, use_httpx in runs:
            r = measure(url, stub.pid, streams, procs, args.tokens, args.requests_per_stream,
                        use_httpx)
            print(f"| {r['client']} | {streams} | {procs} | {r['tok_s']:,.0f} | "
                  f"{r['client_cpu_us_per_token']:.1f} | {r['stub_cpu_share']:.2f} |", flush=True)
    finally:
        stub.terminate()
        stub.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
