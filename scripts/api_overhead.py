"""The API process's own cost per streamed token, with no model behind it (a benchmark tool).

    python scripts/api_overhead.py [--streams 1 16 64 256] [--tokens 256] [--seconds 8]
        [--step-ms 0] [--endpoint /generate_stream] [--tokenizer DIR] [--out FILE.json]
        [--busy-poll-ms 0]      (the server's --busy-poll-ms)

It starts the real server (CoreClient + the FastAPI app + uvicorn, as `python -m
flashlet.server` does, warm-up included) in a subprocess whose engine-core process runs the
real EngineCore loop and zmq protocol around a trivial token source instead of an Engine: each
step gives every running request its next token (the prompt's own tokens again and again, so
they decode to words), after `--step-ms` of sleep (0: as fast as the API process takes them).
Closed-loop clients on raw sockets (cheaper than httpx, so that they load the CPU little)
stream `--tokens` tokens per request, for `--seconds` per level. Per level it reports the
streamed tokens/s, SSE events/s, tokens per event (above 1: the API process fell behind the
core and sent several tokens in one event), and the API process's CPU time per token and per
event (user + system, from /proc: what the server spends per token outside the engine; the
OpenAI endpoints ask for the usage chunk, which counts the tokens), with the core
process's steps/s and CPU per step (the EngineCore loop's own cost: the token source is a few
lines), and the server's own diagnostics (GET /debug/stats, server/diagnostics.py): the core
loop's time split and tokens per step, the request turnaround, the event-loop lag, the API
process's time in the garbage collector, its request intake and the clients' own turnaround.

Never used by the tests as a fake engine: the tests run the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from flashlet.core.request import RequestOutput  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
         "matches in the old town hall near the river").split()


# ---- the engine-core side: a token source with the Engine interface EngineCore uses ----------
class TokenSource:
    """Runs requests without a model: every step each running request gets one token."""

    def __init__(self, step_s: float, max_num_seqs: int = 1024):
        self.step_s = step_s
        self.requests: dict[int, SimpleNamespace] = {}
        self.num_steps = 0
        self.structured = None
        self.config = SimpleNamespace(page_size=16, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=1 << 20)
        self.model_config = SimpleNamespace(vocab_size=1 << 20)
        self.max_model_len, self.backend_name, self.model_dir = 1 << 20, "token-source", None
        self.device, self.dtype = "cpu", "none"
        self.device_wait_s = 0.0  # no device to wait on (Engine.device_wait_s)

    def add_request(self, prompt_token_ids, params, request_id, after=None, group=None) -> None:
        self.requests[request_id] = SimpleNamespace(  # (the core gives an int32 array)
            source=prompt_token_ids.tolist(), left=params.max_new_tokens, made=0)

    def step(self) -> list:
        if self.step_s:
            time.sleep(self.step_s)
        self.num_steps += 1
        outputs = []
        for rid, r in list(self.requests.items()):
            token = r.source[r.made % len(r.source)]
            r.made += 1
            r.left -= 1
            finished = r.left == 0
            if finished:
                del self.requests[rid]
            outputs.append(RequestOutput(  # the engine's own type: its fields cannot drift apart
                request_id=rid, new_token_ids=[token], finished=finished,
                finish_reason="length" if finished else None))
        return outputs

    def abort(self, request_id, finish_reason="abort") -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_integrity(self) -> None:
        pass

    def context_note(self) -> str:
        return ""

    def stats(self) -> dict:
        n = len(self.requests)
        return {"requests": n, "running": n, "waiting": 0, "num_steps": self.num_steps,
                "kv_cache_dtype": "none",
                "kv_pages_total": 1 << 16, "kv_pages_used": 0, "kv_pages_cached": 0,
                "kv_pool_bytes": 0, "num_preemptions": 0, "prefix_cache_hit_rate": 0.0}


def build_token_source(config, tokenizer=None) -> TokenSource:
    """CoreClient's `build_engine` in the core process (config.step_ms is ours)."""
    return TokenSource(float(os.environ.get("API_OVERHEAD_STEP_MS", "0")) / 1000)


# ---- the API process -------------------------------------------------------------------------
def serve(port: int, tokenizer: str, profile: str | None, busy_poll_ms: float = 0.0) -> None:
    import uvicorn

    from flashlet.config import EngineConfig
    from flashlet.server.app import ServerConfig, create_app
    from flashlet.server.cli import UvicornServer
    from flashlet.server.core_client import CoreClient
    from flashlet.server.limits import HttpLimits, uvicorn_options

    fatal: dict = {}  # a core that dies or fails to start ends this process with an error

    def on_fatal(error: BaseException) -> None:
        fatal["error"] = error
        if "server" in fatal:
            fatal["server"].should_exit = True

    client = CoreClient(EngineConfig(device="cpu", max_num_seqs=1024), 1, tokenizer,
                        on_fatal=on_fatal, build_engine=build_token_source,
                        busy_poll_s=busy_poll_ms / 1e3)
    app = create_app(client, ServerConfig(model_name="bench", max_waiting=1_000_000, warm_up=True,
                                          limits=HttpLimits(max_connections=4096)))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, lifespan="off",
                            **uvicorn_options(app.state.limit_stats))
    server = fatal["server"] = UvicornServer(config, app, grace_s=1.0)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the one it caught on exit
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    client.start()
    profiler = None
    if profile:  # the event loop's thread (where the per-token work runs)
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        server.run()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        client.stop(timeout=10)
    if "error" in fatal:
        raise SystemExit(f"the engine core failed: {fatal['error']}")


# ---- the clients -----------------------------------------------------------------------------
def request_bytes(endpoint: str, prompt: str, tokens: int) -> bytes:
    if endpoint == "/generate_stream":
        body = {"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": True}
    elif endpoint == "/v1/completions":
        body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
    else:
        body = {"model": "bench", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
    data = json.dumps(body).encode()
    return (f"POST {endpoint} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def one_stream(port: int, payload: bytes, deadline: float, tally: dict) -> None:
    """One closed-loop client on a keep-alive connection: a request, read to `[DONE]`, again."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            writer.write(payload)
            buf = b""
            while b"data: [DONE]" not in buf:
                chunk = await reader.read(65536)
                if not chunk:
                    raise RuntimeError("the server closed the connection")
                buf += chunk
            while not buf.endswith(b"0\r\n\r\n"):  # the chunked body's terminator
                buf += await reader.read(65536)
            tally["events"] += buf.count(b"data: ") - 1 - (b'"choices":[]' in buf)  # not
            # [DONE] nor the OpenAI endpoints' last event (usage, which tokens_per_event needs)
            tally["tokens"] += completion_tokens(buf)
            tally["requests"] += 1
    finally:
        writer.close()


def completion_tokens(response: bytes) -> int:
    """The output tokens of one streamed response, from its last event with usage (or counted
    from `num_tokens` / one per text event when there is none)."""
    events = [line[6:] for line in response.split(b"\n") if line.startswith(b"data: {")]
    for event in reversed(events):
        usage = json.loads(event).get("usage")
        if usage:
            return usage["completion_tokens"]
    return sum(json.loads(e).get("num_tokens", 1) for e in events)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_pid(api_pid: int) -> int:
    """The engine-core process: the API process's child (spawn's resource tracker aside)."""
    for child in Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes() and \
                b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise RuntimeError("no engine-core process found")


def core_steps(port: int) -> float:
    from flashlet.bench.remote import server_steps

    return sum(server_steps(f"http://127.0.0.1:{port}") or [0])


async def level(port: int, pid: int, streams: int, payload: bytes, seconds: float) -> dict:
    from flashlet.bench.remote import server_debug_stats
    from flashlet.server.diagnostics import level_figures

    tally = {"events": 0, "tokens": 0, "requests": 0}
    core = core_pid(pid)
    url = f"http://127.0.0.1:{port}"
    steps0, core0, debug0 = core_steps(port), cpu_seconds(core), server_debug_stats(url)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*(one_stream(port, payload, t0 + seconds, tally) for _ in range(streams)))
    cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - t0
    steps, core_cpu = core_steps(port) - steps0, cpu_seconds(core) - core0
    diag = level_figures(debug0, server_debug_stats(url), wall)
    return {"streams": streams, "wall_s": wall, "requests": tally["requests"],
            "core_steps_s": steps / wall, "core_cpu_us_per_step": core_cpu / max(steps, 1) * 1e6,
            "tokens": tally["tokens"], "tok_s": tally["tokens"] / wall,
            "events_s": tally["events"] / wall,
            "tokens_per_event": tally["tokens"] / max(tally["events"], 1),
            "api_cpu_s": cpu, "api_cpu_us_per_token": cpu / max(tally["tokens"], 1) * 1e6,
            "api_cpu_us_per_event": cpu / max(tally["events"], 1) * 1e6,
            "api_cpu_share": cpu / wall, "server_diag": diag}


def diagnosis(diag: dict) -> str:
    """The server's own figures (GET /debug/stats): core 0's loop, API process 0's lags."""
    core, api = diag["cores"][0], diag["api_servers"][0]

    def ms(q):
        return "-" if q["p50"] is None else f"{q['p50']:.2f} / {q['p99']:.2f}"

    share = " / ".join(f"{100 * core['loop_share'][p]:.1f}"
                       for p in ("step", "send", "receive", "idle"))
    return (f"{share} | {core['tokens_per_step'] or 0:.1f} | {ms(core['turnaround_ms'])} | "
            f"{ms(api['loop_lag_ms'])} | "
            f"{100 * api['gc_share']:.2f} ({api['gc_full']}, {api['gc_long']}) | "
            f"{ms(api['intake_ms'])} | {ms(api['client_gap_ms'])} | "
            f"{ms(api['delivery_ms'])}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API process exited ({proc.returncode})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not get ready")


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (the server's graceful stop), then SIGKILL if it has not exited in `timeout` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--seconds", type=float, default=8.0, help="per level")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="the token source's sleep per step (0: as fast as it is asked)")
    p.add_argument("--endpoint", default="/generate_stream",
                   choices=["/generate_stream", "/v1/completions", "/v1/chat/completions"])
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder (default: the embedded model's)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile", default=None,
                   help="cProfile the API process's event loop thread into this file")
    p.add_argument("--busy-poll-ms", type=float, default=0.0,
                   help="the server's --busy-poll-ms (default: 0, off)")
    p.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_port is not None:
        serve(args.serve_port, args.tokenizer, args.profile, args.busy_poll_ms)
        return 0
    if args.tokenizer is None:
        from flashlet.models.weights import embedded_model_dir

        args.tokenizer = str(embedded_model_dir())
    port = free_port()
    env = {**os.environ, "API_OVERHEAD_STEP_MS": str(args.step_ms)}
    proc = subprocess.Popen([sys.executable, __file__, "--serve-port", str(port),
                             "--tokenizer", args.tokenizer,
                             "--busy-poll-ms", str(args.busy_poll_ms),
                             *(["--profile", args.profile] if args.profile else [])], env=env)
    results = []
    try:
        wait_ready(port, proc)
        prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
        payload = request_bytes(args.endpoint, prompt, args.tokens)
        print(f"| streams | tok/s | SSE events/s | tokens/event | API CPU us/token | API CPU "
              f"share | API CPU us/event | core steps/s | core CPU us/step | "
              f"core loop step / send / receive / idle % | core tokens/step | "
              f"turnaround p50 / p99 ms | event-loop lag p50 / p99 ms | "
              f"API GC % (full, > 5 ms) | intake p50 / p99 ms | client gap p50 / p99 ms | "
              f"delivery p50 / p99 ms "
              f"|  ({args.endpoint}, {args.tokens} tokens/request, step {args.step_ms} ms, "
              f"busy-poll {args.busy_poll_ms} ms)")
        print("|---" * 17 + "|")
        for streams in args.streams:
            r = asyncio.run(level(port, proc.pid, streams, payload, args.seconds))
            results.append(r)
            print(f"| {streams} | {r['tok_s']:,.0f} | {r['events_s']:,.0f} | "
                  f"{r['tokens_per_event']:.2f} | {r['api_cpu_us_per_token']:.1f} | "
                  f"{r['api_cpu_share']:.2f} | {r['api_cpu_us_per_event']:.1f} | "
                  f"{r['core_steps_s']:,.0f} | "
                  f"{r['core_cpu_us_per_step']:.0f} | {diagnosis(r['server_diag'])} |",
                  flush=True)
    finally:
        stop_server(proc)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "levels": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
