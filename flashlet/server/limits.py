"""Limits on what one client can hold: request-body size and read time, open connections.

uvicorn (0.54, httptools or h11) has neither a body-size limit nor a body or header read timeout, and its
`limit_concurrency` only answers 503 to *requests* once the cap is reached while the idle
connections stay open. So:
- `LimitsMiddleware` (ASGI) answers 413 when Content-Length, or the bytes actually received,
  pass `max_request_bytes` (the body is never buffered beyond the cap), and 408 when the body
  has not arrived within `body_timeout_s` of the request start; both close the connection;
- `guarded_protocol()` is uvicorn's HTTP protocol (httptools, else h11) with a hard cap on open
  connections (the one past the cap gets a 503 and is closed at once) and a timeout for a
  connection that holds no request in progress but does not send a complete request head
  (slowloris);
- `LimitsCollector` reports all of it in /metrics.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

MiB = 2**20


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = 4 * MiB  # a 128k-token prompt as text is ~0.5 MiB
    body_timeout_s: float = 30.0  # the whole body must arrive within this of the request start
    header_timeout_s: float = 30.0  # a connection with no request in progress and no full head
    max_connections: int = 1024  # open HTTP connections; the next one gets 503 and is closed
    keep_alive_s: int = 5  # uvicorn's idle keep-alive timeout

    def __post_init__(self):
        for name in ("max_request_bytes", "body_timeout_s", "header_timeout_s",
                     "max_connections", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class LimitStats:
    """Counters shared by the middleware, the protocol and the metrics collector (all on the
    server's event loop thread)."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.open_connections = 0
        self.connections_refused = 0
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.bodies_too_large = 0


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the limit of {limit} bytes "
                              f"(--max-request-bytes)", headers={"Connection": "close"})


class BodyTimeout(HTTPException):
    def __init__(self, seconds: float):
        super().__init__(408, f"request body not received within {seconds:g} s "
                              f"(--body-timeout)", headers={"Connection": "close"})


def _error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                 if status < 500 else "server_error",
                                 "param": None, "code": None}}).encode()


class LimitsMiddleware:
    """Caps the request body and the time to receive it.

    A declared Content-Length over the cap is refused before the app runs. Otherwise the
    wrapped `receive` counts bytes and watches the deadline while the body is incomplete and
    raises BodyTooLarge / BodyTimeout (HTTPExceptions: FastAPI passes them through its body
    parsing to the app's error handler, which answers in the OpenAI error shape). Once the
    body is complete, receive() is the plain one again (handlers wait on it for a disconnect)."""

    def __init__(self, app, stats: LimitStats):
        self.app = app
        self.stats = stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limits, stats = self.stats.limits, self.stats
        declared = _content_length(scope)
        if declared is not None and declared > limits.max_request_bytes:
            stats.bodies_too_large += 1
            return await _respond(send, BodyTooLarge(limits.max_request_bytes))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_s
        state = {"received": 0, "more": scope.get("method") not in ("GET", "HEAD")}

        async def guarded_receive():
            if not state["more"]:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                stats.body_timeouts += 1
                raise BodyTimeout(limits.body_timeout_s) from None
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                state["more"] = message.get("more_body", False)
                if state["received"] > limits.max_request_bytes:
                    stats.bodies_too_large += 1
                    raise BodyTooLarge(limits.max_request_bytes)
            else:
                state["more"] = False
            return message

        await self.app(scope, guarded_receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _respond(send, error: HTTPException) -> None:
    body = _error_body(error.status_code, error.detail)
    await send({"type": "http.response.start", "status": error.status_code,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def http_protocol_base() -> type:
    """uvicorn's httptools protocol when httptools is installed (its parser is C: a streamed
    token's SSE chunk costs several times less than through h11's Python), else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return H11Protocol
    return HttpToolsProtocol


def guarded_protocol(stats: LimitStats, base: type | None = None) -> type:
    """uvicorn's HTTP protocol (`base`, default http_protocol_base()) with a connection cap and
    a request-head timeout."""
    limits = stats.limits
    refusal = _error_body(503, "too many open connections; retry later")
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
               b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
               + str(len(refusal)).encode() + b"\r\n\r\n" + refusal)

    class GuardedProtocol(base or http_protocol_base()):
        _head_timer: asyncio.TimerHandle | None = None
        _counted = False

        def connection_made(self, transport):
            super().connection_made(transport)
            if stats.open_connections >= limits.max_connections:
                stats.connections_refused += 1
                transport.write(refusal)
                transport.close()
                return
            self._counted = True
            stats.open_connections += 1
            self._arm_head_timer()

        def connection_lost(self, exc):
            if self._counted:
                self._counted = False
                stats.open_connections -= 1
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is None and not self._in_request():
                self._arm_head_timer()  # the start of a next request's head

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self._in_request():
                return  # a request runs: its body has its own timeout (LimitsMiddleware)
            if self.cycle is not None and self.timeout_keep_alive_task is not None:
                return  # idle between requests: uvicorn's keep-alive timeout closes it
            stats.header_timeouts += 1
            self.transport.close()

    return GuardedProtocol


def uvicorn_options(stats: LimitStats) -> dict:
    """The uvicorn.Config arguments that apply these limits."""
    return {"http": guarded_protocol(stats), "timeout_keep_alive": stats.limits.keep_alive_s,
            "limit_concurrency": None}


class LimitsCollector:
    def __init__(self, stats: LimitStats):
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("flashlet_http_connections_open", "Open HTTP connections",
                                value=float(s.open_connections))
        yield GaugeMetricFamily("flashlet_http_connections_max",
                                "Open HTTP connections allowed (--max-connections)",
                                value=float(s.limits.max_connections))
        yield GaugeMetricFamily("flashlet_http_max_request_bytes",
                                "Largest request body accepted (--max-request-bytes)",
                                value=float(s.limits.max_request_bytes))
        yield GaugeMetricFamily("flashlet_http_body_timeout_seconds",
                                "Time allowed to receive a request body (--body-timeout)",
                                value=float(s.limits.body_timeout_s))
        for name, doc, value in (
                ("flashlet_http_connections_refused", "Connections closed at once: over "
                 "--max-connections", s.connections_refused),
                ("flashlet_http_header_timeouts", "Connections closed: no complete request "
                 "head within --header-timeout", s.header_timeouts),
                ("flashlet_http_body_timeouts", "Requests answered 408: body not received "
                 "within --body-timeout", s.body_timeouts),
                ("flashlet_http_bodies_too_large", "Requests answered 413: body over "
                 "--max-request-bytes", s.bodies_too_large)):
            yield CounterMetricFamily(name, doc, value=float(value))
