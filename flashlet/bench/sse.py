"""A lean HTTP/1.1 client for `--url`: one keep-alive connection, a POST whose streamed body
(SSE) is handed over read by read with its arrival time, and a GET.

httpx spends tens of microseconds of Python per SSE chunk (h11's parser, its stream layers):
at a few hundred streams it, not the server, set the ceiling of one client process. Here the
response goes through httptools (llhttp in C, the parser uvicorn uses; a pinned server
dependency) straight off an asyncio stream, so a read costs one parser call.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import time
from urllib.parse import urlparse

READ_SIZE = 1 << 16


class HttpError(RuntimeError):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body.decode(errors='replace')[:200]}")
        self.status = status


class _Response:
    """httptools' callbacks for one response: the body pieces since the last read."""

    def __init__(self):
        self.body: list[bytes] = []
        self.done = False
        self.api_server: str | None = None
        self.parser = None
        self.headers_done = False
        self.keep_alive = False

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # Read here: once the message is complete, llhttp's should_keep_alive() says False.
        self.keep_alive = self.parser.should_keep_alive()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-flashlet-api-server":  # --api-server-count > 1: who served
            self.api_server = value.decode(errors="replace")

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))

    def on_message_complete(self) -> None:
        self.done = True


class Connection:
    """One HTTP/1.1 connection to `url`'s host, reused request after request (keep-alive), one
    request at a time. After any failure it is closed; `usable` says so."""

    def __init__(self, url: str):
        u = urlparse(url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = _ssl.create_default_context() if u.scheme == "https" else None
        self.base = u.path.rstrip("/")
        self.host_header = f"{self.host}:{self.port}"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.api_server: str | None = None  # the last response's x-flashlet-api-server

    @property
    def usable(self) -> bool:
        return self._writer is not None

    async def open(self) -> None:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, ssl=self.ssl, limit=READ_SIZE)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET `path`: (status, body)."""
        body: list[bytes] = []
        status = await self._exchange("GET", path, b"", lambda t, piece: body.append(piece))
        return status, b"".join(body)

    async def post_stream(self, path: str, payload: bytes, on_body) -> None:
        """POST `payload` (JSON) to `path` and read the response to its end, calling
        on_body(arrival time, body bytes) for each network read that brought body bytes. A
        status other than 200 raises HttpError with the body; an exception from on_body ends
        the request (and the connection)."""
        error_body: list[bytes] = []
        accepted = None

        def piece_of(t: float, piece: bytes) -> None:
            nonlocal accepted
            if accepted is None:
                accepted = self._parser.get_status_code() == 200
            if accepted:
                on_body(t, piece)
            else:
                error_body.append(piece)

        status = await self._exchange("POST", path, payload, piece_of)
        if status != 200:
            raise HttpError(status, b"".join(error_body))

    async def _exchange(self, method: str, path: str, payload: bytes, on_body) -> int:
        """Send one request and read its response to the end: the status. Any failure closes
        the connection (its state is unknown); so does a server that does not keep it alive."""
        import httptools

        await self.open()
        head = (f"{method} {self.base}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        response = _Response()
        self._parser = parser = response.parser = httptools.HttpResponseParser(response)
        try:
            self._writer.write(head.encode() + payload)
            while not response.done:
                data = await self._reader.read(READ_SIZE)
                t = time.perf_counter()
                if not data:
                    if response.headers_done and not response.keep_alive:
                        break  # a body the server ends by closing (HTTP/1.0, no length)
                    raise ConnectionError("the server closed the connection before the response "
                                          "ended")
                parser.feed_data(data)
                if response.body:
                    piece = b"".join(response.body)
                    response.body.clear()
                    on_body(t, piece)
        except BaseException:
            self.close()
            raise
        self.api_server = response.api_server
        if not response.keep_alive:
            self.close()
        return parser.get_status_code()
