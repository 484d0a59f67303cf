"""The API process's time from a request's arrival at the app to its endpoint's first line,
json_body.ModelBodyRoute against FastAPI's own handler (issue 32's "handler" hop, in-process).

    PYTHONPATH=. python -m lab.bench_body_route [--endpoint /generate_stream] [--requests 3000]

Two apps as create_app builds them (every middleware), one with plain APIRoutes, the hot
endpoints replaced by a stub that notes the time and answers at once; the bench's request
(a 400-word prompt) sent straight into each app's ASGI callable, the two apps taking turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import types

from fastapi.responses import Response
from fastapi.routing import APIRoute

from flashlet.server import ServerConfig, create_app
from flashlet.server.json_body import ModelBodyRoute

ENDPOINTS = ("/generate_stream", "/v1/chat/completions")


def build(fast: bool, entered: list):
    original = ModelBodyRoute.get_route_handler
    if not fast:
        ModelBodyRoute.get_route_handler = APIRoute.get_route_handler
    try:
        app = create_app(types.SimpleNamespace(on_step_message=None), ServerConfig())
    finally:
        ModelBodyRoute.get_route_handler = original

    async def endpoint(body, request=None):
        entered.append(time.perf_counter())
        return Response(b"")

    for route in app.routes:
        if isinstance(route, APIRoute) and route.path in ENDPOINTS:
            route.dependant.call = endpoint
    return app


def request_body(endpoint: str) -> bytes:
    words = " ".join(f"word{i % 50}" for i in range(400))
    if endpoint == "/generate_stream":
        return json.dumps({"prompt": words, "max_new_tokens": 32}).encode()
    return json.dumps({"model": "default", "messages": [{"role": "user", "content": words}],
                       "max_tokens": 32, "stream": True}).encode()


async def time_one(app, entered: list, path: str, body: bytes) -> float:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2),
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message):
        pass

    start = time.perf_counter()
    await app(scope, receive, send)
    return (entered[-1] - start) * 1e3


async def main(endpoint: str, requests: int) -> None:
    body = request_body(endpoint)
    entered = {"FastAPI's handler": [], "ModelBodyRoute": []}
    apps = {name: build(name == "ModelBodyRoute", marks) for name, marks in entered.items()}
    times = {name: [] for name in apps}
    for i in range(requests + 300):  # the first 300 warm up
        for name, app in apps.items():
            ms = await time_one(app, entered[name], endpoint, body)
            if i >= 300:
                times[name].append(ms)
    for name, values in times.items():
        values.sort()
        print(f"{endpoint} {name}: p10 {values[len(values) // 10]:.4f} ms, "
              f"p50 {statistics.median(values):.4f} ms ({len(values)} requests)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", default="/generate_stream", choices=ENDPOINTS)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    asyncio.run(main(args.endpoint, args.requests))
