"""`python -m flashlet.server`: parse flags, start the engine cores and uvicorn, shut down cleanly.

This process is the API server (HTTP, tokenizing, detokenizing, SSE); the engine runs in
--data-parallel-size engine-core processes (core_client.py). Everything that can be checked
without the model is checked first (flags, sampling limits, that the backend runs on this
machine, that the port is free): bad usage is one line on stderr and exit code 2, a port that
cannot be bound exit code 1, and no engine core is started. Uvicorn then starts at once; the
cores load the model meanwhile (GET /health answers 503 until every core is ready).
SIGINT/SIGTERM: stop accepting, let in-flight requests finish for up to --shutdown-timeout
seconds, abort the rest, stop the cores, exit 0; during the model load, end the loading cores
and exit 0 at once. A model that fails to load: exit code 1. If a core dies, its requests in
flight end with a 500 error; while other cores live the server serves on ("degraded"); when the
last one dies (or any, with --exit-on-core-failure), /health answers 503 ("failed") and the
server exits with status 1 (a supervisor restarts it). A stalled core: core_client.py.

--api-server-count N (vLLM's flag; default from the CPUs this process may use: one below 8,
else a quarter of them, at most 4, as default_api_server_count says why): N API-server
processes serve the one port. On
Linux each has its own listening socket, all N bound here with SO_REUSEPORT before anything
starts and N - 1 handed to spawned children: the kernel spreads new connections over the
sockets that listen by a hash of the connection's addresses, so over many connections each
process gets its share (on one shared socket every process races to accept, and the one that
wins takes every connection waiting: at concurrency 256, 4 processes served 156 / 84 / 184 /
88 requests). Elsewhere they all accept on one shared socket. This process owns the engine
cores (core_client.py says how each core sends each request's outputs to the process that
sent it); each child attaches to them, runs the API warm-up (warmup.py) and only then listens
(a bound socket that does not listen gets no connections), so no child takes a connection
before it can serve it. /health (in any process) says ok, and this process logs "serving
on", only once every process has warmed up and accepts (flags in shared memory; /metrics:
flashlet_api_server_warm{api_server=K}). Responses carry `x-flashlet-api-server: K`. On
SIGINT/SIGTERM this process passes SIGTERM on to the children, all drain side by side, and
the cores stop once every child has exited. A dead core fails every process's open streams
and turns every /health 503 (each child watches the cores' pids); each child exits when this
process does. /metrics is per process: the HTTP counters are those of the process that
answered the scrape (label them by the header), the per-core gauges are the same in every
process. Data parallelism works with N > 1: each process routes on its own view
(core_client.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import uvicorn

from flashlet.config import CliParser, EngineConfig, check_backend_runs_here
from flashlet.core.engine import Engine
from flashlet.distributed import tp_worker
from flashlet.distributed.parallel import launched_rank
from flashlet.models.weights import EMBEDDED_MODEL_NAME
from flashlet.server.app import ServerConfig, create_app
from flashlet.server.core_client import (CORE_STALL_TIMEOUT_S, MAX_BUSY_POLL_S,
                                         STALLED_REQUEST_TIMEOUT_S,
                                         CoreClient)
from flashlet.server.diagnostics import ApiCounters, shared_rows
from flashlet.server.limits import HttpLimits, uvicorn_options
from flashlet.server.parsers import REASONING_PARSERS, TOOL_PARSERS

log = logging.getLogger("flashlet.server")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m flashlet.server",
        description="flashlet HTTP server: /generate, /generate_stream, an OpenAI-compatible "
                    "/v1 API and /metrics. With no --model it serves the embedded default model.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model (vLLM's `vllm serve MODEL`)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on "
                        "(default: %(default)s; 0.0.0.0 exposes the server to the network)")
    server.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    server.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every endpoint but /health")
    server.add_argument("--max-waiting", type=int, default=ServerConfig.max_waiting,
                        help="requests that may wait for a free running slot; beyond: 503 + "
                             "Retry-After (default: %(default)s)")
    server.add_argument("--served-model-name", default=None,
                        help="the model id of the /v1 API (default: from --model)")
    server.add_argument("--max-tokens-cap", type=int, default=None,
                        help="clamp every request's max tokens to this (finish_reason 'length')")
    server.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may run on after SIGINT/SIGTERM "
                             "before they are aborted")
    server.add_argument("--allow-special-tokens", action="store_true",
                        help="parse control tokens (e.g. <|im_start|>) written in prompts and "
                             "message content; only for trusted callers (default: off, such "
                             "text is encoded as plain text)")
    limits = HttpLimits()
    server.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes,
                        help="largest request body; beyond: 413 (default: %(default)s)")
    server.add_argument("--body-timeout", type=float, default=limits.body_timeout_s,
                        help="seconds a request body may take to arrive; beyond: 408 and the "
                             "connection is closed (default: %(default)s)")
    server.add_argument("--header-timeout", type=float, default=limits.header_timeout_s,
                        help="seconds a connection may take to send a complete request head "
                             "(default: %(default)s)")
    server.add_argument("--max-connections", type=int, default=limits.max_connections,
                        help="open HTTP connections at once; the next one gets 503 and is "
                             "closed (default: %(default)s)")
    server.add_argument("--max-url-bytes", type=int, default=limits.max_url_bytes,
                        help="longest request URL (path and query); beyond: 414 and the "
                             "connection is closed (default: %(default)s)")
    server.add_argument("--max-header-bytes", type=int, default=limits.max_header_bytes,
                        help="largest request header fields, all together; beyond: 431 and the "
                             "connection is closed (default: %(default)s)")
    server.add_argument("--max-headers", type=int, default=limits.max_headers,
                        help="most request header fields; beyond: 431 and the connection is "
                             "closed (default: %(default)s)")
    server.add_argument("--data-parallel-size", type=int, default=1,
                        help="engine-core processes behind this server (one per GPU on CUDA); "
                             "each request goes to the core where it would finish first (the "
                             "core's queue against the prefix it caches) (default: %(default)s)")
    server.add_argument("--exit-on-core-failure", action="store_true",
                        help="exit when any engine core dies (default: only when none is left; "
                             "meanwhile /health says 'degraded' and the others serve)")
    server.add_argument("--core-stall-timeout", type=float, default=CORE_STALL_TIMEOUT_S,
                        help="seconds an engine core with requests in flight may end no step "
                             "before /health calls it stalled (503 when no other core serves) "
                             "and no request is routed to it (default: %(default)s)")
    server.add_argument("--stalled-request-timeout", type=float,
                        default=STALLED_REQUEST_TIMEOUT_S,
                        help="seconds after which the requests of a stalled core that also "
                             "sends no heartbeat (stopped or hung) end with a 503 error "
                             "(default: %(default)s)")
    server.add_argument("--api-server-count", type=int, default=None,
                        help="API-server processes serving the port side by side (HTTP, "
                             "tokenizing, SSE), all fed by the same engine core(s) (default: "
                             "from the CPU count: 1 below 8 CPUs, else a quarter of them, at "
                             "most 4; 1 with --tensor-parallel-size > 1)")
    server.add_argument("--busy-poll-ms", type=float, default=0.0,
                        help="each API process's event loop polls for the engine's step "
                             "messages without sleeping for this long after each one while it "
                             "has requests in flight: the engine core's per-step send then wakes "
                             "no process (that wake-up's CPU off the core's loop, its latency off "
                             "each token), for a CPU spinning in each API process that streams "
                             "(default: 0, off; at most 1000)")
    server.add_argument("--tokenizer", default=None,
                        help="a folder with tokenizer files to use instead of the model's (e.g. "
                             "for random weights from --config)")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one, used instead of the "
                             "tokenizer's")
    server.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="how tool calls are read from a tool_choice 'auto' reply (vLLM's "
                             "names; default: from the chat template: llama3_json for Llama 3's, "
                             "mistral for Mistral's, else hermes)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice 'auto' is on "
                             "wherever the chat template shows the model its tools")
    server.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split <think>...</think> off the reply into reasoning_content "
                             "(default: off)")
    server.add_argument("--pooling", choices=["last", "mean"], default=ServerConfig.pooling,
                        help="/v1/embeddings: the final hidden state of the last prompt token "
                             "or the mean over the prompt, normalised (default: %(default)s)")
    server.add_argument("--allowed-origins", type=_origins, default=(),
                        help="CORS: origins whose web pages may call this server, comma-separated "
                             "or a JSON list (e.g. http://localhost:3000, or '*' for any)")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="log messages at this level and above (default: %(default)s)")
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="log one line per request")
    engine = parser.add_argument_group("engine")
    EngineConfig.add_cli_args(engine)
    # vLLM's names for some of the flags above (SUPPRESS: only set when given).
    engine.add_argument("--enable-prefix-caching", dest="enable_prefix_cache",
                        action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                        help="the same as --enable-prefix-cache")
    engine.add_argument("--block-size", dest="page_size", type=int, default=argparse.SUPPRESS,
                        help="the same as --page-size")
    engine.add_argument("--enforce-eager", dest="cuda_graph", action="store_false",
                        default=argparse.SUPPRESS, help="the same as --no-cuda-graph")
    return parser


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: a JSON list (vLLM's form) or comma-separated origins."""
    if text.lstrip().startswith("["):
        try:
            origins = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
    else:
        origins = [o.strip() for o in text.split(",")]
    return tuple(o for o in origins if o)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a Jinja template."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: not a file and not a Jinja template")


def _model_argument(args: argparse.Namespace) -> None:
    """The positional MODEL is --model; giving both (differently) is an error."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag} and --model "
                             f"{args.model}")
        args.model = args.model_tag


def default_model_name(config: EngineConfig) -> str:
    if config.config is not None:
        return Path(config.config).stem
    if config.model is None:
        return EMBEDDED_MODEL_NAME
    path = Path(config.model)
    return path.name if path.exists() else config.model


FATAL_EXIT_DELAY_S = 2.0  # /health answers 503 "failed" this long before the server exits


class UvicornServer(uvicorn.Server):
    """uvicorn.Server that drains: after the signal, new generation requests get 503 and
    in-flight ones are aborted once `grace_s` has passed."""

    def __init__(self, config: uvicorn.Config, app, grace_s: float,
                 on_serving: Callable[[], None] | None = None,
                 warm_before_listening: bool = False,
                 on_shutdown: Callable[[], None] | None = None):
        super().__init__(config)
        self.app = app
        self.flashlet = app.state.server
        self.grace_s = grace_s
        self.on_serving = on_serving
        self.on_shutdown = on_shutdown
        # The API servers beyond the first: listen only once the warm-up has run (the
        # processes already listening on the port answer meanwhile).
        self.warm_before_listening = warm_before_listening
        self._warming: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self.flashlet.api_counters.start()
        if self.warm_before_listening:
            await self._warm_up_when_ready()
            if self.should_exit or not self.flashlet.loop.is_ready:
                self.should_exit = True
                return
            await super().startup(sockets)
            if not self.should_exit:  # it accepts now
                self._mark_warm()
            return
        await super().startup(sockets)
        self._warming = asyncio.ensure_future(self._warm_up_and_announce())

    async def _warm_up_and_announce(self) -> None:
        """The first process: its warm-up (it accepts already), then, with several API
        processes, the others' (each accepts once warm): only then does /health say ok and the
        log say "serving on"."""
        await self._warm_up_when_ready()
        if not self.flashlet.warmed_up:
            return
        self._mark_warm()
        while not self.flashlet.warm:
            if self.should_exit or self.flashlet.loop.error is not None:
                return
            await asyncio.sleep(0.02)
        if self.on_serving is not None:
            self.on_serving()

    def _mark_warm(self) -> None:
        flags = self.flashlet.api_servers_warm
        if flags is not None:
            flags[self.flashlet.api_server_index] = 1

    async def _warm_up_when_ready(self) -> None:
        """Once the engine cores are ready: the API path's warm-up."""
        client = self.flashlet.loop
        while not client.ready.is_set():  # polled: a thread blocked here would hold up exit
            if client.error is not None or client.stopped.is_set() or self.should_exit:
                return
            await asyncio.sleep(0.05)
        self.flashlet.start_warm_up(self.app)
        await self.flashlet._warm_up_task

    async def shutdown(self, sockets=None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        fs = self.flashlet
        fs.api_counters.stop()
        fs.draining = True
        inflight = fs.loop.num_streams + fs.loop.num_queued
        if inflight:
            log.info("shutting down: %d request(s) in flight; aborting any left after %.0f s",
                     inflight, self.grace_s)
        timer = asyncio.get_running_loop().call_later(self.grace_s, fs.loop.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _describe(client: CoreClient, config: EngineConfig, host: str, port: int, name: str,
              seconds: float, warm_up_s: float) -> str:
    info = client.cores[0].info
    cores = f"{client.num_cores} engine cores, each with " if client.num_cores > 1 else ""
    return (f"model {name} ({info['model_dir'] or config.config or 'random'}) loaded in "
            f"{seconds:.1f} s (API warm-up {warm_up_s:.2f} s) | backend {info['backend']} on "
            f"{info['device']} ({info['dtype']}) | "
            f"{cores}KV pool {info['num_pages']} pages x {info['page_size']} tokens = "
            f"{info['num_pages'] * info['page_size']} tokens ({info['kv_mib']:.0f} MiB, "
            f"{info.get('kv_cache_dtype', info['dtype'])}) | "
            f"context {info['max_model_len']} | serving on http://{host}:{port}")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_api_server_count(cpus: int, tensor_parallel_size: int = 1) -> int:
    """API processes when --api-server-count is not given. One process's HTTP, detokenizing
    and SSE fell behind the engine at 256 streams on the H200 (0.78 of in-process; 4 processes:
    0.91, issue 32), so a machine with CPUs to spare runs several: a quarter of its CPUs, the
    rest left to the engine cores, their tokenizer threads and the OS; at most 4, past which
    the engine core's one socket reader is the limit and each process only adds its memory
    (a tokenizer, the app). Below 8 CPUs, one: a second would take CPU from the engine core.
    Tensor parallelism runs one (its core starts worker processes of its own)."""
    if tensor_parallel_size > 1 or cpus < 8:
        return 1
    return min(4, cpus // 4)


def _check_server_args(args) -> HttpLimits:
    """Raise ValueError naming the first bad server flag; the API process count resolved."""
    _resolve_api_server_count(args)
    if args.max_waiting < 1:
        raise ValueError("--max-waiting must be >= 1")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise ValueError("--max-tokens-cap must be >= 1")
    if not args.shutdown_timeout >= 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    if not 0 < args.core_stall_timeout <= args.stalled_request_timeout:
        raise ValueError("need 0 < --core-stall-timeout <= --stalled-request-timeout, got "
                         f"{args.core_stall_timeout} and {args.stalled_request_timeout}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: any client sending an empty Bearer token would pass "
                         "(an unset variable in `--api-key $KEY`?); leave the flag out for no key")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty; leave the flag out to serve the model's own name")
    if not 0 <= args.busy_poll_ms <= MAX_BUSY_POLL_S * 1e3:
        raise ValueError(f"--busy-poll-ms must be in [0, {MAX_BUSY_POLL_S * 1e3:g}], got "
                         f"{args.busy_poll_ms}")
    if args.api_server_count > 1 and args.tensor_parallel_size > 1:
        raise ValueError("--api-server-count > 1 does not work with --tensor-parallel-size > 1 "
                         "(the engine core then starts its own worker processes)")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise ValueError(f"--tokenizer {args.tokenizer}: not a folder")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    try:
        return HttpLimits(max_request_bytes=args.max_request_bytes,
                          body_timeout_s=args.body_timeout, header_timeout_s=args.header_timeout,
                          max_connections=args.max_connections, max_url_bytes=args.max_url_bytes,
                          max_header_bytes=args.max_header_bytes, max_headers=args.max_headers)
    except ValueError as e:  # names the field: say the flag
        field = str(e).split(" ", 1)[0]
        flag = {"max_request_bytes": "--max-request-bytes", "body_timeout_s": "--body-timeout",
                "header_timeout_s": "--header-timeout",
                "max_connections": "--max-connections"}.get(field, "--" + field.replace("_", "-"))
        raise ValueError(f"{flag}{str(e)[len(field):]}") from None


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bind a listening socket now, before the model loads (OSError if it cannot be); uvicorn
    makes it listen when its process starts serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind_api_server_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """The listening socket of each of `count` API processes, all bound now (OSError if the
    port cannot be had): one socket each with SO_REUSEPORT on Linux, else one shared by all."""
    if count == 1 or not sys.platform.startswith("linux"):
        return [bind_socket(host, port)] * count
    # The plain bind first: it fails if anything holds the port, even another server's
    # SO_REUSEPORT group (which our sockets would otherwise silently join, and split its
    # connections with it); it also picks the port for --port 0. Only sockets of the same
    # effective user can join a SO_REUSEPORT group, so no other user can take a share of our
    # connections by binding the port with SO_REUSEPORT later.
    probe = bind_socket(host, port)
    port = probe.getsockname()[1]
    probe.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(bind_socket(host, port, reuse_port=True))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def make_app(args, client, name: str, limits: HttpLimits, chat_template: str | None, port: int,
             api_server: int, warm_flags=None, counter_rows=None):
    """The app and uvicorn's config of one API-server process (warm_flags: the API processes'
    shared warm flags, with --api-server-count > 1; counter_rows: their shared diagnostics
    counters)."""
    app = create_app(client, ServerConfig(model_name=name, api_key=args.api_key,
                                          max_waiting=args.max_waiting,
                                          max_tokens_cap=args.max_tokens_cap,
                                          allow_special_tokens=args.allow_special_tokens,
                                          limits=limits, chat_template=chat_template,
                                          allowed_origins=args.allowed_origins,
                                          tool_call_parser=args.tool_call_parser,
                                          reasoning_parser=args.reasoning_parser,
                                          pooling=args.pooling,
                                          scheduling_policy=args.scheduling_policy,
                                          warm_up=True))
    app.state.server.api_server_index = api_server
    app.state.server.api_servers_warm = warm_flags
    app.state.server.use_api_counters(ApiCounters(api_server, args.api_server_count,
                                                  counter_rows))
    if args.api_server_count > 1:
        app.add_middleware(ApiServerHeader, index=api_server)
    uv_config = uvicorn.Config(app, host=args.host, port=port, log_config=None,
                               log_level=args.log_level, access_log=args.access_log,
                               timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
                               lifespan="off", **uvicorn_options(app.state.limit_stats))
    return app, uv_config


class ApiServerHeader:
    """ASGI middleware: `x-flashlet-api-server: K` on every response (which process served)."""

    def __init__(self, app, index: int):
        self.app, self.header = app, (b"x-flashlet-api-server", str(index).encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def warm_flags(count: int):
    """One flag per API process in shared memory (None for one process): each sets its own once
    warm and accepting; /health in any process says ok only when all are set."""
    return multiprocessing.get_context("spawn").RawArray("b", count) if count > 1 else None


def start_api_servers(args, sockets: list[socket.socket], client: CoreClient, flags,
                      rows) -> list:
    """Spawn API-server processes 1 .. N-1, each on its socket, attached to client's cores."""
    spawn = multiprocessing.get_context("spawn")
    children = []
    core_pids = [core.pid for core in client.cores]
    for index in range(1, args.api_server_count):
        child = spawn.Process(target=run_api_server, name=f"flashlet-api{index}", daemon=True,
                              args=(args, index, sockets[index], client.ipc_dir, core_pids,
                                    os.getpid(), flags, rows))
        child.start()
        children.append(child)
    close_child_sockets(sockets)
    return children


def close_child_sockets(sockets: list[socket.socket]) -> None:
    """This process's copies of the children's own sockets (they hold theirs): a child that
    exits then closes its socket, and the kernel stops giving it connections."""
    for sock in sockets[1:]:
        if sock is not sockets[0]:
            sock.close()


def watch_api_servers(children: list, uv: "UvicornServer", died: threading.Event) -> None:
    """An API process that exits before the server stops is fatal, as a dead core is: the
    cores would queue its step messages for nobody. (Set `died`; the server exits 1.)"""
    while not uv.should_exit:
        for child in children:
            if child.exitcode is not None and not uv.should_exit:
                log.error("API server process %s exited (code %s); stopping", child.name,
                          child.exitcode)
                died.set()
                uv.should_exit = True
                return
        time.sleep(0.5)


def core_fault_options(args) -> dict:
    """CoreClient's handling of dead and stalled cores, and its busy-poll, from the flags."""
    return {"exit_on_core_failure": args.exit_on_core_failure,
            "stall_timeout_s": args.core_stall_timeout,
            "stalled_request_timeout_s": args.stalled_request_timeout,
            "busy_poll_s": args.busy_poll_ms / 1e3}


def run_api_server(args, index: int, sock: socket.socket, ipc_dir: str, core_pids: list[int],
                   owner_pid: int, flags, rows) -> None:
    """API-server process `index` (> 0): serve `sock` until SIGTERM or a failure.
    The first process checked every flag already."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api{index} %(name)s: %(message)s")
    engine_config = EngineConfig.from_cli(args).for_serving(
        args.max_decode_step_tokens is not None)
    limits = _check_server_args(args)
    name = args.served_model_name or default_model_name(engine_config)
    uv: UvicornServer | None = None

    def stop(*_) -> None:
        if uv is not None:
            uv.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    client = CoreClient(engine_config, args.data_parallel_size, args.tokenizer,
                        on_fatal=lambda error: threading.Timer(FATAL_EXIT_DELAY_S, stop).start(),
                        api_server_index=index, api_server_count=args.api_server_count,
                        ipc_dir=ipc_dir, core_pids=core_pids, owner_pid=owner_pid,
                        **core_fault_options(args))
    app, uv_config = make_app(args, client, name, limits, read_chat_template(args.chat_template),
                              sock.getsockname()[1], index, flags, rows)
    uv = UvicornServer(uv_config, app, args.shutdown_timeout, warm_before_listening=True)
    client.start()
    try:
        uv.run(sockets=[sock])
    finally:
        client.stop(timeout=5)
    sys.exit(1 if client.error is not None else 0)


def _resolve_api_server_count(args) -> None:
    if args.api_server_count is not None:
        args.api_server_count_reason = "--api-server-count"
        return
    cpus = usable_cpus()
    args.api_server_count = default_api_server_count(cpus, args.tensor_parallel_size)
    args.api_server_count_reason = (f"default for {cpus} CPUs; --api-server-count N sets it")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _model_argument(args)
        engine_config = EngineConfig.from_cli(args).for_serving(
            args.max_decode_step_tokens is not None)
        limits = _check_server_args(args)
        chat_template = read_chat_template(args.chat_template)
        check_backend_runs_here(engine_config)
    except (ValueError, OSError) as e:
        parser.error(str(e))  # one line, exit code 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("API server processes: %d (%s)", args.api_server_count,
             args.api_server_count_reason)
    if engine_config.tensor_parallel_size > 1 and launched_rank() != 0:
        # Under torchrun: this rank serves rank 0's engine (the worker loop), not HTTP; it
        # binds no port (rank 0 on the same host does).
        tp_worker.serve(Engine(engine_config))  # until rank 0 shuts down
        return 0
    try:
        sockets = bind_api_server_sockets(args.host, args.port, args.api_server_count)
    except OSError as e:
        print(f"{parser.prog}: error: cannot listen on {args.host}:{args.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    sock = sockets[0]
    port = sock.getsockname()[1]
    name = args.served_model_name or default_model_name(engine_config)
    uv: UvicornServer | None = None
    stop_requested = False

    def on_signal(signum, frame) -> None:
        # Before uvicorn installs its own handlers, and after it restores ours (uvicorn
        # re-raises the signal it caught once it has stopped: a clean shutdown exits 0).
        nonlocal stop_requested
        stop_requested = True
        if uv is not None:
            uv.should_exit = True

    def on_fatal(error: BaseException) -> None:
        if client.ready.is_set():  # it ran, then went down (a core or a TP worker died)
            log.error("stopping: %s", error)
        else:
            log.error("could not start the engine: %s", error)
        if uv is not None:
            threading.Timer(FATAL_EXIT_DELAY_S if client.ready.is_set() else 0.0,
                            lambda: setattr(uv, "should_exit", True)).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    t0 = time.monotonic()
    log.info("loading model %s (backend %s) in %d engine core(s)...",
             engine_config.model or name, engine_config.backend, args.data_parallel_size)
    client = CoreClient(engine_config, args.data_parallel_size, args.tokenizer, on_fatal,
                        api_server_count=args.api_server_count, **core_fault_options(args))

    def announce() -> None:
        report = app.state.server.warm_up_report
        log.info("%s", _describe(client, engine_config, args.host, port, name,
                                 time.monotonic() - t0, report.seconds))

    flags, rows = warm_flags(args.api_server_count), shared_rows(args.api_server_count)
    app, uv_config = make_app(args, client, name, limits, chat_template, port, 0, flags, rows)
    children: list = []  # the other API-server processes
    child_died = threading.Event()

    def stop_children() -> None:  # they drain side by side with this one
        for child in children:
            if child.is_alive():
                child.terminate()

    uv = UvicornServer(uv_config, app, args.shutdown_timeout, on_serving=announce,
                       on_shutdown=stop_children)
    uv.should_exit = stop_requested
    if stop_requested:
        close_child_sockets(sockets)
    else:
        client.start()
        children = start_api_servers(args, sockets, client, flags, rows)
        if children:
            threading.Thread(target=watch_api_servers, args=(children, uv, child_died),
                             name="flashlet-api-watch", daemon=True).start()
    try:
        uv.run(sockets=[sock])
    finally:
        stop_children()
        for child in children:  # the cores serve them until they have drained
            child.join(args.shutdown_timeout + 15)
            if child.is_alive():
                log.warning("API server process %s did not stop: killing it", child.name)
                child.kill()
                child.join(5)
        loading = not client.ready.is_set() and client.error is None
        # Stopped while the cores load: they are ended at once (a load cannot be interrupted,
        # and waiting for it is what a SIGTERM must not do).
        client.stop(timeout=30)
        if loading:
            log.info("server stopped while the model was loading")
            return 0 if stop_requested else 1
    if client.error is not None or child_died.is_set():
        return 1
    if not uv.started:
        return 1
    log.info("server stopped")
    return 0
