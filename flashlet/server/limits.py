"""Limits on what one client can hold: request-body size and read time, open connections.

uvicorn (0.54, httptools or h11) has neither a body-size limit nor a body or header read timeout, and its
`limit_concurrency` only answers 503 to *requests* once the cap is reached while the idle
connections stay open. So:
- `LimitsMiddleware` (ASGI) answers 413 when Content-Length, or the bytes actually received,
  pass `max_request_bytes` (the body is never buffered beyond the cap), and 408 when the body
  has not arrived within `body_timeout_s` of the request start; both close the connection;
- `guarded_protocol()` is uvicorn's HTTP protocol (httptools, else h11) with a hard cap on open
  connections (the one past the cap gets a 503 and is closed at once), a timeout for a
  connection that holds no request in progress but does not send a complete request head
  (slowloris), and caps on a request head's URL length, header bytes and header count (414 /
  431, `HeadScanner`), counted on the bytes as they arrive, before the parser sees them:
  uvicorn's httptools path has no such caps and gathers a URL or a header value by
  concatenating each read to what came before, so a 50 MiB URL costs the event loop seconds
  of copying and every other request waits;
- `LimitsCollector` reports all of it in /metrics.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus

import h11
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

# Set in a request's scope by the protocol (guarded_protocol) once its body is read whole:
# receive() then gives the rest of it without waiting, so LimitsMiddleware arms no deadline
# (an asyncio.timeout per request cost ~3.5 us hot, ~1.5% of a stream's event-loop samples).
BODY_READ = "flashlet.body_read"

KiB = 2**10
MiB = 2**20
# A request line beyond its target: the method (OPTIONS is the longest standard one), two
# spaces, HTTP/1.1 and CRLF take 21 bytes; the rest is room for a longer extension method.
REQUEST_LINE_SLACK = 64


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = 4 * MiB  # a 128k-token prompt as text is ~0.5 MiB
    body_timeout_s: float = 30.0  # the whole body must arrive within this of the request start
    header_timeout_s: float = 30.0  # a connection with no request in progress and no full head
    max_connections: int = 1024  # open HTTP connections; the next one gets 503 and is closed
    keep_alive_s: int = 5  # uvicorn's idle keep-alive timeout
    # A request head: browsers and proxies stay far below these (nginx: 8 KiB a line, 32 KiB
    # in all by default; Node: 16 KiB); the API's requests carry a few short headers.
    max_url_bytes: int = 8 * KiB  # the request target (path and query); beyond: 414
    max_header_bytes: int = 64 * KiB  # the header fields together; beyond: 431
    max_headers: int = 100  # header fields; beyond: 431

    def __post_init__(self):
        for name in ("max_request_bytes", "body_timeout_s", "header_timeout_s",
                     "max_connections", "keep_alive_s", "max_url_bytes", "max_header_bytes",
                     "max_headers"):
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
        self.urls_too_long = 0  # answered 414
        self.heads_too_large = 0  # answered 431 (header bytes or count)


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
            if scope.get(BODY_READ):  # all here: nothing to wait for
                message = await receive()
            else:
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


class HeadScanner:
    """Counts one connection's request head as its bytes arrive: the request line (its target
    must fit max_url_bytes: 414), then the header lines (their bytes must fit max_header_bytes
    and their number max_headers: 431), up to the blank line that ends the head. Only the
    request line is kept (at most max_url_bytes + REQUEST_LINE_SLACK bytes); of header lines
    only their lengths. `reset()` once the parser has read the whole request: the next bytes
    are the next request's head."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.reset()

    def reset(self) -> None:
        self.open = True  # bytes are a head's (False: the body, until reset())
        self.request_line = bytearray()
        self.request_line_done = False
        self.header_bytes = 0
        self.header_lines = 0
        self.line_bytes = 0  # of the header line being received
        self.line_start = bytearray()  # its first two bytes

    def feed(self, data: bytes) -> tuple[int, str] | None:
        """Count `data`; (status, message) once the head breaks a limit, else None."""
        pos = 0
        while self.open and pos < len(data):
            newline = data.find(b"\n", pos)
            end = len(data) if newline < 0 else newline + 1
            refusal = (self._request_line_part(data[pos:end], newline >= 0)
                       if not self.request_line_done
                       else self._header_part(data, pos, end, newline >= 0))
            if refusal is not None:
                return refusal
            pos = end
        return None

    def _request_line_part(self, piece: bytes, line_ends: bool) -> tuple[int, str] | None:
        self.request_line += piece
        limit = self.limits.max_url_bytes
        if len(self.request_line) > limit + REQUEST_LINE_SLACK:
            return self._url_too_long()
        if not line_ends:
            return None
        line = bytes(self.request_line).strip()
        if not line:  # blank lines before a request line are ignored (RFC 9112, 2.2)
            self.request_line.clear()
            return None
        self.request_line_done = True
        first, last = line.find(b" "), line.rfind(b" ")
        target = line[first + 1:last] if first < last else line[first + 1:]
        return self._url_too_long() if first >= 0 and len(target) > limit else None

    def _header_part(self, data: bytes, pos: int, end: int,
                     line_ends: bool) -> tuple[int, str] | None:
        if self.line_bytes < 2:  # a line's first two bytes tell a blank one
            self.line_start += data[pos:min(end, pos + 2 - self.line_bytes)]
        self.header_bytes += end - pos
        self.line_bytes += end - pos
        if self.header_bytes > self.limits.max_header_bytes:
            return 431, (f"request header fields are larger than the limit of "
                         f"{self.limits.max_header_bytes} bytes (--max-header-bytes)")
        if not line_ends:
            return None
        if self.line_start in (b"\r\n", b"\n") and self.line_bytes == len(self.line_start):
            self.open = False  # CRLF or LF alone: the blank line that ends the head
            return None
        self.line_bytes = 0
        self.line_start = bytearray()
        self.header_lines += 1
        if self.header_lines > self.limits.max_headers:
            return 431, (f"request has more than {self.limits.max_headers} header fields "
                         f"(--max-headers)")
        return None

    def _url_too_long(self) -> tuple[int, str]:
        return 414, (f"request URL is longer than the limit of {self.limits.max_url_bytes} "
                     f"bytes (--max-url-bytes)")


def _raw_response(status: int, message: str, extra: bytes = b"") -> bytes:
    """A whole HTTP/1.1 error response in the OpenAI error shape, for a connection the
    protocol answers and closes without the app."""
    body = _error_body(status, message)
    reason = HTTPStatus(status).phrase.encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % (status, reason, extra, len(body))) + body


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
    refusal = _raw_response(503, "too many open connections; retry later", b"retry-after: 1\r\n")

    class GuardedProtocol(base or http_protocol_base()):
        _head_timer: asyncio.TimerHandle | None = None
        _counted = False
        _head: HeadScanner | None = None  # None: refused, nothing more is read

        def connection_made(self, transport):
            super().connection_made(transport)
            if stats.open_connections >= limits.max_connections:
                stats.connections_refused += 1
                transport.write(refusal)
                transport.close()
                return
            self._counted = True
            stats.open_connections += 1
            self._head = HeadScanner(limits)
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
            if self._head is None:
                return
            if self._head.open and (refused := self._head.feed(data)) is not None:
                return self._refuse_head(*refused)
            super().data_received(data)
            if not self._head.open and _h11_request_read(self):
                self._head.reset()
                self._body_read()
            if self._head_timer is None and not self._in_request():
                self._arm_head_timer()  # the start of a next request's head

        def on_message_complete(self) -> None:  # httptools: the request is read whole
            super().on_message_complete()
            self._body_read()
            if self._head is not None:
                # Bytes of a pipelined request that came in the same read as this request's
                # end were passed to the parser uncounted: at most one read (256 KiB).
                self._head.reset()

        def _body_read(self) -> None:
            """The request's body is all here (BODY_READ, in the scope its app is given)."""
            if self.cycle is not None:
                self.cycle.scope[BODY_READ] = True

        def _refuse_head(self, status: int, message: str) -> None:
            self._head = None
            if status == 414:
                stats.urls_too_long += 1
            else:
                stats.heads_too_large += 1
            if not self._in_request():  # else a response is under way: just close
                self.transport.write(_raw_response(status, message))
            self.transport.close()

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


def _h11_request_read(protocol) -> bool:
    """Under h11: the request is read whole (h11's side of the cycle is DONE)."""
    conn = getattr(protocol, "conn", None)
    return conn is not None and conn.their_state is h11.DONE


def uvicorn_options(stats: LimitStats) -> dict:
    """The uvicorn.Config arguments that apply these limits."""
    limits = stats.limits
    # h11 refuses (400) a head past its buffer cap; above ours, our 414 / 431 come first.
    h11_cap = limits.max_url_bytes + REQUEST_LINE_SLACK + limits.max_header_bytes + 1
    return {"http": guarded_protocol(stats), "timeout_keep_alive": limits.keep_alive_s,
            "limit_concurrency": None, "h11_max_incomplete_event_size": h11_cap}


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
                 "--max-request-bytes", s.bodies_too_large),
                ("flashlet_http_urls_too_long", "Requests answered 414: URL over "
                 "--max-url-bytes", s.urls_too_long),
                ("flashlet_http_heads_too_large", "Requests answered 431: header fields over "
                 "--max-header-bytes or --max-headers", s.heads_too_large)):
            yield CounterMetricFamily(name, doc, value=float(value))
