"""`python -m flashlet.server`: parse flags, start the engine loop and uvicorn, shut down cleanly.

Everything that can be checked without the model is checked first (flags, sampling limits,
that the backend runs on this machine, that the port is free): bad usage is one line on
stderr and exit code 2, a port that cannot be bound exit code 1, and no model is loaded.
Uvicorn then starts at once; the model loads on the engine thread meanwhile (GET /health
answers 503 until it is ready). SIGINT/SIGTERM at any moment: stop accepting, let in-flight
requests finish for up to --shutdown-timeout seconds, abort the rest, exit 0; during the
model load, exit 0 at once (the load cannot be interrupted, so the process does not wait
for it). A model that fails to load: exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import uvicorn

from flashlet.config import CliParser, EngineConfig, check_backend_runs_here
from flashlet.server.app import ServerConfig, create_app
from flashlet.server.engine_loop import EngineLoop
from flashlet.server.limits import HttpLimits, uvicorn_options

log = logging.getLogger("flashlet.server")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m flashlet.server",
        description="flashlet HTTP server: /generate, /generate_stream, an OpenAI-compatible "
                    "/v1 API and /metrics. With no --model it serves the embedded default model.")
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
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="log messages at this level and above (default: %(default)s)")
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="log one line per request")
    engine = parser.add_argument_group("engine")
    EngineConfig.add_cli_args(engine)
    return parser


def default_model_name(config: EngineConfig) -> str:
    from flashlet.weights import EMBEDDED_MODEL_NAME

    if config.config is not None:
        return Path(config.config).stem
    if config.model is None:
        return EMBEDDED_MODEL_NAME
    path = Path(config.model)
    return path.name if path.exists() else config.model


class UvicornServer(uvicorn.Server):
    """uvicorn.Server that drains: after the signal, new generation requests get 503 and
    in-flight ones are aborted once `grace_s` has passed."""

    def __init__(self, config: uvicorn.Config, app, grace_s: float):
        super().__init__(config)
        self.flashlet = app.state.server
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        fs = self.flashlet
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


def _describe(engine, host: str, port: int, name: str, seconds: float) -> str:
    stats, page_size = engine.stats(), engine.config.page_size
    pages, mib = stats["kv_pages_total"], stats["kv_pool_bytes"] / 2**20
    return (f"model {name} ({engine.model_dir or engine.config.config or 'random'}) loaded in "
            f"{seconds:.1f} s | backend {engine.backend_name} on {engine.device} "
            f"({str(engine.dtype).removeprefix('torch.')}) | KV pool {pages} pages x "
            f"{page_size} tokens = {pages * page_size} tokens ({mib:.0f} MiB) "
            f"| context {engine.max_model_len} | serving on http://{host}:{port}")


def _check_server_args(args) -> HttpLimits:
    """Raise ValueError naming the first bad server flag."""
    if args.max_waiting < 1:
        raise ValueError("--max-waiting must be >= 1")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise ValueError("--max-tokens-cap must be >= 1")
    if not args.shutdown_timeout >= 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    try:
        return HttpLimits(max_request_bytes=args.max_request_bytes,
                          body_timeout_s=args.body_timeout, header_timeout_s=args.header_timeout,
                          max_connections=args.max_connections)
    except ValueError as e:  # names the field: say the flag
        field = str(e).split(" ", 1)[0]
        flag = {"max_request_bytes": "--max-request-bytes", "body_timeout_s": "--body-timeout",
                "header_timeout_s": "--header-timeout",
                "max_connections": "--max-connections"}.get(field, field)
        raise ValueError(f"{flag}{str(e)[len(field):]}") from None


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads (OSError if it cannot be)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_config = EngineConfig.from_cli(args)
        limits = _check_server_args(args)
        check_backend_runs_here(engine_config)
    except ValueError as e:
        parser.error(str(e))  # one line, exit code 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"{parser.prog}: error: cannot listen on {args.host}:{args.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    name = args.served_model_name or default_model_name(engine_config)
    from flashlet.parallel import launched_rank

    if engine_config.tensor_parallel_size > 1 and launched_rank() != 0:
        # Under torchrun: this rank serves rank 0's engine (the worker loop), not HTTP.
        from flashlet.engine import Engine

        Engine(engine_config)  # returns only by SystemExit(0) once rank 0 shuts down
        return 0

    def load():
        from flashlet.engine import Engine

        t0 = time.monotonic()
        log.info("loading model %s (backend %s)...", engine_config.model or name,
                 engine_config.backend)
        engine = Engine(engine_config)
        log.info("%s", _describe(engine, args.host, port, name, time.monotonic() - t0))
        return engine

    uv: UvicornServer | None = None
    stop_requested = False

    def on_signal(signum, frame) -> None:
        # Before uvicorn installs its own handlers, and after it restores ours.
        nonlocal stop_requested
        stop_requested = True
        if uv is not None:
            uv.should_exit = True

    def on_fatal(error: BaseException) -> None:
        if loop.ready.is_set():  # it ran, then went down (a tensor-parallel worker died)
            log.error("the engine went down: %s", error)
        else:
            log.error("could not start the engine: %s", error)
        if uv is not None:
            uv.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    loop = EngineLoop(engine_factory=load, on_fatal=on_fatal)
    app = create_app(loop, ServerConfig(model_name=name, api_key=args.api_key,
                                        max_waiting=args.max_waiting,
                                        max_tokens_cap=args.max_tokens_cap,
                                        allow_special_tokens=args.allow_special_tokens,
                                        limits=limits))
    uv_config = uvicorn.Config(app, host=args.host, port=port, log_config=None,
                               log_level=args.log_level, access_log=args.access_log,
                               timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
                               lifespan="off", **uvicorn_options(app.state.limit_stats))
    uv = UvicornServer(uv_config, app, args.shutdown_timeout)
    uv.should_exit = stop_requested
    loop.start()
    try:
        uv.run(sockets=[sock])
    finally:
        if not loop.ready.is_set() and loop.error is None:
            # Stopped while the model loads: the loader thread cannot be interrupted, and
            # waiting for it (or leaving it to interpreter shutdown, where torch's threads
            # abort the process) is what a SIGTERM must not do. Leave now.
            log.info("server stopped while the model was loading")
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0 if stop_requested else 1)
        loop.stop(timeout=30)
    if loop.error is not None:
        return 1
    if not uv.started:
        return 1
    log.info("server stopped")
    return 0
