"""The API process's own time per request, stage by stage, in one process (issue 32).

    PYTHONPATH=. python lab/api_stages.py [--requests 400] [--tokens 128] [--prompt-words 400]
        [--endpoint /generate_stream] [--tokenizer .tok/smollm2] [--cold] [--profile FILE]

The bench's request (flashlet.bench --url: a text prompt of --prompt-words words from its word
list, a fresh one each, streamed) sent straight into the app's ASGI callable as create_app builds
it (every middleware, the real handler) around a CoreClient that has no core process: its real
submit path (admission, routing, the AddRequests frame, the write to a request channel, here a
socket pair whose other end is drained) and its real delivery path (a StepOutputs frame per
token, made as an engine core makes it, decoded and handed to the stream by
CoreClient._handle_frame). No HTTP server and no second process: what is left is the API
process's Python, timed at each stage's edge with time.perf_counter (the median over requests
of each stage, and of each streamed token's delivery -> write):

  handler    the app called -> the endpoint's first await (middleware, body read, validation)
  tokenized  -> the prompt's token ids (the model context, the tokenizer)
  submit     -> CoreClient.submit_group called (token budget, SamplingParams, streams,
             detokenizer, Generation)
  sent       -> the frame written to the core's request channel (its encoding, routing)
  headers    -> the response's start written (the handler returns, the response starts)
  token      per token but the last: the step message handled -> its SSE event written
  last       the last token's step message handled -> the response's end written
  done       -> the app's call returned (the response's teardown, the middlewares' ends)

--cold sleeps 2 ms and reads 32 MiB between requests, and sleeps --step-ms between tokens: the
caches and the CPU as a server between requests finds them (the hot loop's figures are the
code's own cost, the cold ones several times that: a running server's hops, lab/hop_trace.py,
read like the cold ones). Run it against another tree's package (PYTHONPATH=that tree) to A/B.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import json
import os
import socket
import statistics
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["handler", "tokenized", "submit", "sent", "headers"]


def stub_client(tokenizer_dir: str, max_model_len: int):
    """A CoreClient whose one core is a socket pair: the real submit and delivery code."""
    import msgspec

    from flashlet.core.request_check import RequestLimits
    from flashlet.models.weights import load_tokenizer
    from flashlet.server.core_client import CoreClient, CoreProcess
    from flashlet.server.messages import CoreReady, Heartbeat, ProbeReply, StepOutputs
    from flashlet.server.router import PrefixRouter
    from flashlet.server.step_channel import FrameWriter

    client = CoreClient.__new__(CoreClient)
    ours, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    core_end.setblocking(False)
    core = CoreProcess(0, None, None, pid=os.getpid())
    core.requests = FrameWriter(ours, "the stub core")
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = len(tokenizer)
    client.__dict__.update(
        cores=[core], _streams={}, _ids=itertools.count(), _lock=threading.Lock(),
        _encoder=msgspec.msgpack.Encoder(), router=PrefixRouter(1, 16), _routers={},
        limits=RequestLimits(max_model_len, vocab, 16, 1 << 16), tokenizer=tokenizer,
        ready=threading.Event(), stopped=threading.Event(), error=None, _stopping=False,
        busy_poll_s=0.0, _reading_loop=None, _loop_to_read=None, _delivering_on=None,
        _loop_reading_unsupported=False, on_step_message=None, api_server_index=0,
        api_server_count=1, num_cores=1, _probes={},
        _decoder=msgspec.msgpack.Decoder(StepOutputs | CoreReady | ProbeReply | Heartbeat))
    client.config = type("Config", (), {"max_num_seqs": 1024})()
    client.ready.set()
    client.core_end = core_end
    return client


def drain(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 20):
            pass
    except BlockingIOError:
        pass


def step_frame(encoder, request_id: int, token: int, finished: bool) -> bytes:
    """One step's message for one request, as an engine core makes it (engine_core._send)."""
    from flashlet.core.request import RequestOutput
    from flashlet.server.messages import StepOutputs, output_rows

    out = RequestOutput(request_id=request_id, new_token_ids=[token], finished=finished,
                        finish_reason="length" if finished else None)
    stats = {"requests": 1, "running": 1, "waiting": 0, "num_steps": 1000, "kv_pages_total":
             65536, "kv_pages_used": 30, "kv_pages_cached": 0, "kv_pool_bytes": 1 << 30,
             "num_preemptions": 0, "prefix_cache_hit_rate": 0.0, "num_requests": 1,
             "time": time.monotonic()}
    return encoder.encode(StepOutputs(0, output_rows([out]), stats))


def request_body(endpoint: str, prompt: str, tokens: int) -> bytes:
    if endpoint == "/generate_stream":  # as flashlet.bench --url sends it
        body = {"prompt": prompt, "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    elif endpoint == "/v1/completions":
        body = {"model": "flashlet", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                "stream": True}
    else:
        body = {"model": "flashlet", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens, "ignore_eos": True, "stream": True}
    return json.dumps(body).encode()


class Marks:
    def __init__(self):
        self.t: dict[str, float] = {}
        self.tokens: list[float] = []

    def __call__(self, name: str) -> None:
        self.t.setdefault(name, time.perf_counter())


def patch(marks: Marks) -> None:
    """Stage marks at the edges (each a perf_counter call and a dict write)."""
    from flashlet.server import core_client, frontend

    context, prompt_ids, chat_ids = (frontend.Server.context, frontend.Server.prompt_ids,
                                     frontend.ModelContext.chat_ids)
    submit_group = core_client.CoreClient.submit_group
    send_frame = core_client.CoreClient._send_frame_locked

    async def _context(self):
        marks("handler")
        return await context(self)

    async def _prompt_ids(self, *args, **kwargs):
        ids = await prompt_ids(self, *args, **kwargs)
        marks("tokenized")
        return ids

    async def _chat_ids(self, *args, **kwargs):
        ids = await chat_ids(self, *args, **kwargs)
        marks("tokenized")
        return ids

    def _submit_group(self, *args, **kwargs):
        marks("submit")
        return submit_group(self, *args, **kwargs)

    def _send_frame_locked(self, core, frame):
        sent = send_frame(self, core, frame)
        marks("sent")
        return sent

    frontend.Server.context, frontend.Server.prompt_ids = _context, _prompt_ids
    frontend.ModelContext.chat_ids = _chat_ids
    core_client.CoreClient.submit_group = _submit_group
    core_client.CoreClient._send_frame_locked = _send_frame_locked


async def one_request(app, client, marks: Marks, path: str, body: bytes, tokens: int,
                      step_s: float) -> dict:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    gone = asyncio.get_running_loop().create_future()

    async def receive():
        if messages:
            return messages.pop()
        await gone
        return {"type": "http.disconnect"}

    written = asyncio.Event()
    out = bytearray()

    async def send(message):
        now = time.perf_counter()
        if message["type"] == "http.response.start":
            marks("headers")
            if message["status"] != 200:
                raise RuntimeError(f"status {message['status']}")
            return
        out.extend(message.get("body", b""))
        marks.tokens.append(now)
        if not message.get("more_body", False):
            marks("end")
        written.set()

    marks.t.clear()
    marks.tokens.clear()
    start = time.perf_counter()
    call = asyncio.ensure_future(app(scope, receive, send))
    while "headers" not in marks.t:
        await asyncio.sleep(0)
        if call.done():
            call.result()
            raise RuntimeError("the request ended before its response started")
    for _ in range(4):  # the response's tasks reach their waits
        await asyncio.sleep(0)
    rid = next(iter(client._streams))
    drain(client.core_end)
    delivered, encoder = [], client._encoder
    chat = path == "/v1/chat/completions"
    for i in range(tokens):
        frame = step_frame(encoder, rid, 1000 + i % 50, i == tokens - 1)
        if step_s:
            time.sleep(step_s)
        while chat and i == 0 and not marks.tokens:  # the role chunk comes before any token
            await asyncio.sleep(0)
        written.clear()
        delivered.append(time.perf_counter())
        client._deliver_on_loop(client._handle_frame, frame)
        await written.wait()
    await call
    done = time.perf_counter()
    if not gone.done():
        gone.set_result(None)
    writes = marks.tokens[1:] if chat else marks.tokens  # (the role chunk)
    if len(writes) < tokens:  # an event per token, then the end (its final event, [DONE])
        raise RuntimeError(f"{len(writes)} writes for {tokens} tokens: {bytes(out[-300:])}")
    t = marks.t
    edges = [start] + [t[s] for s in STAGES]
    stages = {s: (b - a) * 1e3 for s, a, b in zip(STAGES, edges, edges[1:])}
    stages["token"] = [(w - d) * 1e3 for d, w in zip(delivered[:-1], writes[:-1])]
    stages["last"] = (t["end"] - delivered[-1]) * 1e3
    stages["done"] = (done - t["end"]) * 1e3
    stages["total API time"] = (t["headers"] - start + sum(stages["token"]) / 1e3
                                + done - delivered[-1]) * 1e3
    return stages


async def run(args) -> dict:
    from flashlet.bench.remote import text_specs
    from flashlet.server import ServerConfig, create_app

    marks = Marks()
    patch(marks)
    client = stub_client(args.tokenizer, args.max_model_len)
    app = create_app(client, ServerConfig(model_name="flashlet"))
    server = app.state.server
    client._reading_loop = asyncio.get_running_loop()
    ctx = await server.context()
    if ctx.encoder is not None:
        await ctx.encoder.warm_up_async()
    n = args.requests + args.warm_up
    specs = text_specs(n, (args.prompt_words, args.prompt_words), (1, 1), seed=args.seed)
    bodies = [request_body(args.endpoint, s.prompt, args.tokens) for s in specs]
    junk = bytearray(32 << 20) if args.cold else None
    results: dict[str, list] = {}
    profiler = cProfile.Profile() if args.profile else None
    for i, body in enumerate(bodies):
        if junk is not None:
            time.sleep(0.002)
            sum(memoryview(junk)[::64])  # every cache line of 32 MiB: the caches start cold
        if profiler is not None and i == args.warm_up:
            profiler.enable()
        stages = await one_request(app, client, marks, args.endpoint, body, args.tokens,
                                   args.step_ms / 1e3 if args.cold else 0.0)
        if i >= args.warm_up:
            for name, value in stages.items():
                results.setdefault(name, []).extend(value if isinstance(value, list)
                                                    else [value])
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warm-up", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--endpoint", default="/generate_stream",
                        choices=["/generate_stream", "/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--tokenizer", default=str(ROOT / ".tok" / "smollm2"))
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--cold", action="store_true",
                        help="cold caches between requests, --step-ms sleeps between tokens")
    parser.add_argument("--step-ms", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", help="cProfile the timed requests into this file")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    medians = {name: statistics.median(values) for name, values in results.items()}
    if args.json:
        print(json.dumps(medians))
        return
    import flashlet

    print(f"{args.endpoint}, {args.prompt_words} words, {args.tokens} tokens, "
          f"{'cold' if args.cold else 'hot'}, {args.requests} requests "
          f"({Path(flashlet.__file__).parent.parent})")
    print("| stage | p10 us | p50 us | p90 us |\n|---|---:|---:|---:|")
    for name, values in results.items():
        values = sorted(values)
        p10, p90 = values[len(values) // 10], values[9 * len(values) // 10]
        print(f"| {name} | {p10 * 1e3:.1f} | {medians[name] * 1e3:.1f} | {p90 * 1e3:.1f} |")


if __name__ == "__main__":
    main()
