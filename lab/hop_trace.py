"""Where one stream's time goes through the server, hop by hop (issue 32).

    PYTHONPATH=. python -m lab.hop_trace [--requests 40] [--tokens 32] [--out FILE.json]
        [--endpoint /generate_stream --prompt-words 400]   (the bench's request: flashlet.bench --url)
        [--endpoint /v1/chat/completions]   (the prompt as one user message, the chat template)
        [--tokenizer DIR]      (default .tok/smollm2: python scripts/export_tokenizer.py)
        [--config PRESET --dtype bfloat16 --backend triton]   (a GPU: random weights, that shape)
        [--busy-poll-ms 0]     (the server's --busy-poll-ms)
        [--profile FILE]       (cProfile of the API process's event-loop thread, pstats format)

It starts the real server (CoreClient, one engine-core process, the FastAPI app, uvicorn, the
engine config as the CLI makes it) in a subprocess over a tiny random Qwen2 on the CPU (or with
--config, random weights of that preset's shape on the default device) with the SmolLM2
tokenizer, and one closed-loop client on a raw socket streams /v1/completions requests one
after another. Both processes are patched (the core's through CoreClient's `build_engine` hook,
which runs in it) to log a timestamp at each hop: HTTP received, body parsed (the handler
runs), tokenized, sent to the core, core received, added, step done, output sent, API
received, handed to the stream, SSE written, client received. All clocks are
time.perf_counter (CLOCK_MONOTONIC: one clock across processes on Linux). It prints the p10,
median, p90, p99 and max of each hop before the first token, between tokens (where a token
gap's tail comes from), and from a request's last token (sent by the core) to the next
request's add in the core (the response's end reaching the client, the client's next send,
that request's way in: at one stream the device idles meanwhile). On a shared machine the
p10 is the hop's own cost; the others add the time a process waited for a CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for scripts/ (the server start-up helpers)
from scripts.api_overhead import free_port, wait_ready  # noqa: E402
TTFT_HOPS = ["c_send", "http", "handler", "tok", "submitted", "core_recv", "added", "step_done",
             "core_sent", "api_recv", "push", "sse", "c_recv"]
TOKEN_HOPS = ["core_sent_prev", "step_start", "step_done", "core_sent", "api_recv", "push",
              "sse", "c_recv"]


class Log:
    """Timestamped hop names, written to a file (one per process) on flush."""

    def __init__(self, path: str):
        self.path, self.events = path, []

    def __call__(self, name: str, t: float | None = None) -> None:
        self.events.append((name, time.perf_counter() if t is None else t))

    def flush(self) -> None:
        with open(self.path, "a") as f:
            f.writelines(f"{name} {t!r}\n" for name, t in self.events)
        self.events.clear()


# ---- the engine-core process -----------------------------------------------------------------
def traced_build(config, tokenizer=None):
    """CoreClient's build_engine, in the core process: patch EngineCore, build the engine."""
    from flashlet.server import engine_core
    from flashlet.server.engine_core import EngineCore

    log = Log(os.path.join(os.environ["HOP_TRACE_DIR"], "core.txt"))
    receive, add_queued, step, send = (EngineCore._receive, EngineCore._add_queued,
                                       EngineCore._step, EngineCore._send)

    def _receive(self, *args, **kwargs):
        before = len(self.queued_adds)
        receive(self, *args, **kwargs)
        if len(self.queued_adds) > before:
            log("core_recv")

    def _add_queued(self):
        had = bool(self.queued_adds)
        add_queued(self)
        if had:
            log("added")

    def _step(self):
        start = time.perf_counter()
        outputs = step(self)
        if outputs:  # a step that only launched the next one (overlap) is not a token's
            log("step_start", start)
            log("step_done")
        return outputs

    def _send(self, outputs):  # each send's time is taken before it: the message may be
        start = time.perf_counter()  # read before this process runs on
        send(self, outputs)
        if outputs:
            log("core_sent", start)
            if any(out.finished for out in outputs):
                log.flush()

    EngineCore._receive, EngineCore._add_queued = _receive, _add_queued
    EngineCore._step, EngineCore._send = _step, _send
    return engine_core.build_engine(config, tokenizer)


# ---- the API process -------------------------------------------------------------------------
def serve(port: int, engine_args: dict, tokenizer: str, busy_poll_ms: float = 0.0,
          profile: str | None = None) -> None:
    import uvicorn

    from flashlet.config import EngineConfig
    from flashlet.server import app as app_module
    from flashlet.server import core_client, frontend
    from flashlet.server.app import ServerConfig, create_app
    from flashlet.server.cli import UvicornServer
    from flashlet.server.core_client import CoreClient
    from flashlet.server.engine_loop import RequestStream
    from flashlet.server.limits import uvicorn_options

    log = Log(os.path.join(os.environ["HOP_TRACE_DIR"], "api.txt"))
    patch_api(log, app_module, core_client, frontend, RequestStream)
    engine_config = EngineConfig(**engine_args).for_serving(False)  # as the CLI's default
    client = CoreClient(engine_config, 1, tokenizer, build_engine=traced_build,
                        busy_poll_s=busy_poll_ms / 1e3)
    app = create_app(client, ServerConfig(model_name="tiny", warm_up=True))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, lifespan="off",
                            **uvicorn_options(app.state.limit_stats))
    server = UvicornServer(config, app, grace_s=1.0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    client.start()
    profiler = cProfile.Profile() if profile else None
    try:
        if profiler is not None:
            profiler.enable()
        server.run()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        log.flush()
        client.stop(timeout=10)


def patch_api(log: Log, app_module, core_client, frontend, RequestStream) -> None:
    app_call = app_module.FlashletApp.__call__
    prompt_ids = frontend.Server.prompt_ids
    chat_ids = frontend.ModelContext.chat_ids
    context = frontend.Server.context
    send_frame = core_client.CoreClient._send_frame_locked
    handle_frame = core_client.CoreClient._handle_frame
    deliver = core_client.CoreClient._deliver
    push = RequestStream.push
    frame_time = [0.0]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/generate")):
            log("http")

            async def timed_send(message):
                if message.get("body"):
                    log("sse")
                await send(message)

            return await app_call(self, scope, receive, timed_send)
        return await app_call(self, scope, receive, send)

    async def _context(self):  # the handler's first await: the body is parsed
        log("handler")
        return await context(self)

    async def _prompt_ids(self, *args, **kwargs):
        ids = await prompt_ids(self, *args, **kwargs)
        log("tok")
        return ids

    async def _chat_ids(self, *args, **kwargs):  # the chat endpoint's tokenizing
        ids = await chat_ids(self, *args, **kwargs)
        log("tok")
        return ids

    def _send_frame_locked(self, core, frame):
        log("submitted")
        return send_frame(self, core, frame)

    def _handle_frame(self, frame):
        frame_time[0] = time.perf_counter()
        handle_frame(self, frame)

    def _deliver(self, msg):
        if msg.outputs:
            log("api_recv", frame_time[0])
        deliver(self, msg)

    def _push(self, item):
        push(self, item)
        log("push")

    app_module.FlashletApp.__call__ = __call__
    frontend.Server.prompt_ids = _prompt_ids
    frontend.ModelContext.chat_ids = _chat_ids
    frontend.Server.context = _context
    core_client.CoreClient._send_frame_locked = _send_frame_locked
    core_client.CoreClient._handle_frame = _handle_frame
    core_client.CoreClient._deliver = _deliver
    RequestStream.push = _push


# ---- the client and the analysis ---------------------------------------------------------------
SHORT_PROMPT = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge " \
    "boxing matches"


def request_bytes(tokens: int, endpoint: str = "/v1/completions",
                  prompt: str = SHORT_PROMPT) -> bytes:
    if endpoint == "/generate_stream":  # as flashlet.bench --url sends it
        body = {"prompt": prompt, "max_new_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
    elif endpoint == "/v1/chat/completions":  # the prompt as one user message
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens, "ignore_eos": True, "stream": True}
    else:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                "stream": True}
    data = json.dumps(body).encode()
    return (f"POST {endpoint} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def payloads(args) -> list[bytes]:
    """One request per --requests: the short prompt, or (--prompt-words) the bench's text
    prompts of that many words, a fresh one each (no prefix-cache hits)."""
    if not args.prompt_words:
        return [request_bytes(args.tokens, args.endpoint)] * args.requests
    from flashlet.bench.remote import text_specs

    words = (args.prompt_words, args.prompt_words)
    return [request_bytes(args.tokens, args.endpoint, spec.prompt)
            for spec in text_specs(args.requests, words, (args.tokens, args.tokens), seed=0)]


def run_client(port: int, requests: list[bytes], log: Log) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for payload in requests:
            log("c_send")
            sock.sendall(payload)
            buf = b""
            while not buf.endswith(b"0\r\n\r\n"):
                chunk = sock.recv(65536)
                t = time.perf_counter()
                if not chunk:
                    raise RuntimeError("the server closed the connection")
                for _ in range(chunk.count(b"data: {")):
                    log("c_recv", t)
                buf += chunk
            log("c_done", t)


def read_events(folder: str) -> list[tuple[float, str]]:
    events = []
    for name in ("api.txt", "core.txt", "client.txt"):
        path = Path(folder, name)
        if path.exists():
            for line in path.read_text().split("\n"):
                if line:
                    hop, t = line.split()
                    events.append((float(t), hop))
    return sorted(events)


def split_requests(events) -> list[dict[str, list[float]]]:
    """Per request (from one c_send to the next), each hop's times in order."""
    requests = []
    for t, hop in events:
        if hop == "c_send":
            requests.append({})
        if requests:
            requests[-1].setdefault(hop, []).append(t)
    return requests


def drop_role_chunks(requests) -> None:
    """A chat stream's first event (the assistant role) is sent before the first token: leave
    it out of the SSE and client hops, which then time the tokens' events only."""
    for r in requests:
        for hop in ("sse", "c_recv"):
            r[hop] = r.get(hop, [])[1:]


def hop_gaps(requests, skip: int) -> tuple[dict, dict]:
    """(before the first token: hop -> [ms]), (between tokens: hop -> [ms])."""
    first, later = {}, {}
    for r in requests[skip:]:
        if not all(r.get(h) for h in TTFT_HOPS):
            continue
        times = [r[h][0] for h in TTFT_HOPS]
        for hop, a, b in zip(TTFT_HOPS[1:], times, times[1:]):
            first.setdefault(hop, []).append((b - a) * 1e3)
        first.setdefault("TTFT (client)", []).append((r["c_recv"][0] - r["c_send"][0]) * 1e3)
        n = len(r["core_sent"])
        if any(len(r[h]) < n for h in ("api_recv", "push", "sse", "c_recv", "step_start")):
            continue  # tokens merged into one event somewhere: not matched one to one
        for j in range(1, n):
            times = [r["core_sent"][j - 1], r["step_start"][j], r["step_done"][j],
                     r["core_sent"][j], r["api_recv"][j], r["push"][j], r["sse"][j],
                     r["c_recv"][j]]
            for hop, a, b in zip(TOKEN_HOPS[1:], times, times[1:]):
                later.setdefault(hop, []).append((b - a) * 1e3)
            later.setdefault("ITL (client)", []).append(
                (r["c_recv"][j] - r["c_recv"][j - 1]) * 1e3)
    return first, later


def turnaround_gaps(requests, skip: int) -> dict:
    """Between one request's last token and the next request's start in the core (what an
    idle device waits at one stream): hop -> [ms]."""
    gaps = {}
    for r, nxt in zip(requests[skip:], requests[skip + 1:]):
        if not (r.get("core_sent") and r.get("c_done") and nxt.get("added")):
            continue
        times = [r["core_sent"][-1], r["c_done"][-1], nxt["c_send"][0], nxt["added"][0]]
        for hop, a, b in zip(["response ended (client)", "next request sent", "next added"],
                             times, times[1:]):
            gaps.setdefault(hop, []).append((b - a) * 1e3)
        gaps.setdefault("core idle (last sent -> next added)", []).append(
            (times[-1] - times[0]) * 1e3)
    return gaps


def table(title: str, gaps: dict) -> str:
    lines = [f"{title}", "| hop (time since the previous) | p10 ms | p50 ms | p90 ms | p99 ms "
             "| max ms | n |", "|---|---:|---:|---:|---:|---:|---:|"]
    for hop, values in gaps.items():
        values = sorted(values)
        p10, p90, p99 = (values[min(len(values) - 1, int(q * len(values)))]
                         for q in (0.1, 0.9, 0.99))
        lines.append(f"| {hop} | {p10:.3f} | {statistics.median(values):.3f} | {p90:.3f} "
                     f"| {p99:.3f} | {values[-1]:.3f} | {len(values)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--endpoint", default="/v1/completions",
                        choices=["/v1/completions", "/generate_stream", "/v1/chat/completions"])
    parser.add_argument("--prompt-words", type=int, default=0,
                        help="the bench's text prompts of this many words (0: a short one)")
    parser.add_argument("--skip", type=int, default=5, help="warm-up requests left out")
    parser.add_argument("--out")
    parser.add_argument("--tokenizer", default=str(ROOT / ".tok" / "smollm2"))
    parser.add_argument("--config", help="a preset: random weights of its shape, on the "
                        "default device (none: a tiny random Qwen2 on the CPU)")
    parser.add_argument("--dtype")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--busy-poll-ms", type=float, default=0.0,
                        help="the server's --busy-poll-ms (default: 0, off)")
    parser.add_argument("--profile", help="write a cProfile of the API process's event-loop "
                        "thread here (pstats format)")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)  # PORT ENGINE-ARGS-JSON
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), json.loads(args.serve[1]), args.tokenizer, args.busy_poll_ms,
              args.profile)
        return
    folder = tempfile.mkdtemp(prefix="hop-trace-")
    if args.config:
        engine_args = {"config": args.config, "dtype": args.dtype, "backend": args.backend}
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import save_tiny_model

        model = save_tiny_model("qwen2", os.path.join(folder, "model"), vocab_size=49152)
        engine_args = {"model": str(model), "device": "cpu"}
    port = free_port()
    env = {**os.environ, "HOP_TRACE_DIR": folder, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "lab.hop_trace", "--serve", str(port),
                               json.dumps(engine_args), "--tokenizer", args.tokenizer,
                               "--busy-poll-ms", str(args.busy_poll_ms),
                               *(["--profile", str(Path(args.profile).resolve())]
                                 if args.profile else [])],
                              env=env, cwd=ROOT)
    try:
        wait_ready(port, server)
        log = Log(os.path.join(folder, "client.txt"))
        run_client(port, payloads(args), log)
        log.flush()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    events = read_events(folder)
    shutil.rmtree(folder, ignore_errors=True)
    requests = split_requests(events)
    if args.endpoint == "/v1/chat/completions":
        drop_role_chunks(requests)
    first, later = hop_gaps(requests, args.skip)
    between = turnaround_gaps(requests, args.skip)
    report = "\n\n".join([table("Before the first token", first),
                           table("Between tokens", later),
                           table("From the last token to the next request", between)])
    print(report)
    if args.out:
        Path(args.out).write_text(json.dumps({"first": first, "later": later,
                                              "between": between}))


if __name__ == "__main__":
    main()
