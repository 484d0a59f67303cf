"""`python -m flashlet.server`: parse flags, start the engine loop and uvicorn, shut down cleanly.

Uvicorn starts at once; the model loads on the engine thread meanwhile (GET /health answers
503 until it is ready). SIGINT/SIGTERM: stop accepting, let in-flight requests finish for up
to --shutdown-timeout seconds, abort the rest, stop the engine thread, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

import uvicorn

from flashlet.config import EngineConfig
from flashlet.server.app import ServerConfig, create_app
from flashlet.server.engine_loop import EngineLoop

log = logging.getLogger("flashlet.server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashlet.server",
        description="flashlet HTTP server: /generate, /generate_stream, an OpenAI-compatible "
                    "/v1 API and /metrics. With no --model it serves the embedded default model.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every endpoint but /health")
    server.add_argument("--max-waiting", type=int, default=ServerConfig.max_waiting,
                        help="queued (not yet running) requests allowed; beyond: 503 + Retry-After")
    server.add_argument("--served-model-name", default=None,
                        help="the model id of the /v1 API (default: from --model)")
    server.add_argument("--max-tokens-cap", type=int, default=None,
                        help="clamp every request's max tokens to this (finish_reason 'length')")
    server.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may run on after SIGINT/SIGTERM "
                             "before they are aborted")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
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
            f"{seconds:.1f} s | backend {engine.config.backend} on {engine.device} "
            f"({str(engine.dtype).removeprefix('torch.')}) | KV pool {pages} pages x "
            f"{page_size} tokens = {pages * page_size} tokens ({mib:.0f} MiB) "
            f"| context {engine.max_model_len} | serving on http://{host}:{port}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_config = EngineConfig.from_cli(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_waiting < 1:
        print("error: --max-waiting must be >= 1", file=sys.stderr)
        return 2
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
        log.info("%s", _describe(engine, args.host, args.port, name, time.monotonic() - t0))
        return engine

    uv: UvicornServer | None = None

    def on_fatal(error: BaseException) -> None:
        if loop.ready.is_set():  # it ran, then went down (a tensor-parallel worker died)
            log.error("the engine went down: %s", error)
        else:
            log.error("could not start the engine: %s", error)
        if uv is not None:
            uv.should_exit = True

    loop = EngineLoop(engine_factory=load, on_fatal=on_fatal)
    app = create_app(loop, ServerConfig(model_name=name, api_key=args.api_key,
                                        max_waiting=args.max_waiting,
                                        max_tokens_cap=args.max_tokens_cap))
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                               log_level=args.log_level, access_log=args.access_log,
                               timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
                               lifespan="off")
    uv = UvicornServer(uv_config, app, args.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has stopped, under the handlers it found
    # installed: make those no-ops so that a clean shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    loop.start()
    try:
        uv.run()
    finally:
        loop.stop(timeout=30)
    if loop.error is not None:
        return 1
    if not uv.started:
        return 1  # e.g. the port was taken
    log.info("server stopped")
    return 0
