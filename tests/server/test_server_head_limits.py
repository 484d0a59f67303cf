"""Request-head caps (issue 35, item 4): a URL over --max-url-bytes is a 414 and header fields
over --max-header-bytes or --max-headers a 431, each answered and closed as soon as the cap is
passed, not after the flood has been read (and copied) whole; /health stays fast meanwhile."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from server_helpers import MODEL_NAME, ServerThread

from flashlet.server import ServerConfig, create_app
from flashlet.server.limits import HeadScanner, HttpLimits, LimitStats, guarded_protocol

LIMITS = HttpLimits(max_url_bytes=4096, max_header_bytes=16384, max_headers=40)
FLOOD_BYTES = 8 * 2**20  # what a flood offers: far past every cap, quick to send on loopback
CHUNK = 65536


@pytest.fixture(scope="module")
def head_limited(engine_loop):
    app = create_app(engine_loop, ServerConfig(model_name=MODEL_NAME, limits=LIMITS))
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def _flood(port: int, head: bytes, filler: bytes) -> tuple[bytes, int]:
    """Send `head`, then `filler` repeated up to FLOOD_BYTES, reading as it goes; stop once the
    server answers or closes. The reply and the bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head)
    sent, reply, chunk = len(head), b"", filler * (CHUNK // len(filler))
    try:
        while sent < FLOOD_BYTES and not reply:
            sock.sendall(chunk)
            sent += len(chunk)
            if select.select([sock], [], [], 0)[0]:
                reply = sock.recv(65536)
                if not reply:
                    break  # closed without an answer
    except OSError:  # reset by the server: its answer may still be in our buffer
        pass
    sock.settimeout(10)
    try:
        while part := sock.recv(65536):
            reply += part
    except OSError:
        pass
    sock.close()
    return reply, sent


def _status_and_error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def _health_latencies(url: str, done: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(timeout=30) as client:
        while not done.is_set() or not latencies:
            t0 = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    return latencies


FLOODS = {  # name: (head, filler, status, flag named in the message)
    "url": (b"GET /health?q=", b"a", 414, "--max-url-bytes"),
    "one long header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Flood: ", b"b", 431,
                        "--max-header-bytes"),
    "many headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-F: 1\r\n", 431,
                     "--max-headers"),
}


@pytest.mark.parametrize("name", list(FLOODS))
def test_head_flood_is_refused_at_its_cap_while_health_stays_fast(head_limited, name):
    head, filler, status, flag = FLOODS[name]
    done, result = threading.Event(), {}

    def flood():
        try:
            result["reply"], result["sent"] = _flood(head_limited.port, head, filler)
        finally:
            done.set()

    thread = threading.Thread(target=flood)
    thread.start()
    latencies = _health_latencies(head_limited.url, done)
    thread.join()
    got, error = _status_and_error(result["reply"])
    assert got == status and flag in error["message"], (got, error)
    assert error["type"] == "invalid_request_error"
    # Answered while the flood was still being sent, not once it had been read whole.
    assert result["sent"] < FLOOD_BYTES, result["sent"]
    assert max(latencies) < 1.0, latencies


def test_heads_within_the_caps_are_served_on_one_connection(head_limited):
    """Requests on a keep-alive connection are each counted from their own start: many under
    the caps pass, a GET and a POST with a body alike."""
    headers = {f"x-h{i}": "v" * 300 for i in range(30)}  # 30 fields, ~9.5 KiB
    with httpx.Client(base_url=head_limited.url, timeout=60) as client:
        for _ in range(3):
            assert client.get("/health?q=" + "a" * 3000, headers=headers).status_code == 200
            r = client.post("/v1/completions", headers=headers, json={
                "model": MODEL_NAME, "prompt": "hi " * 100, "max_tokens": 1})
            assert r.status_code == 200, r.text


def test_head_refusals_are_counted_in_metrics(head_limited):
    _flood(head_limited.port, *FLOODS["url"][:2])
    _flood(head_limited.port, *FLOODS["many headers"][:2])
    metrics = httpx.get(head_limited.url + "/metrics").text
    for name in ("flashlet_http_urls_too_long_total", "flashlet_http_heads_too_large_total"):
        value = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith(name + " "))
        assert value >= 1, name


# ---- the scanner alone --------------------------------------------------------------------
def _scan(data: bytes, limits: HttpLimits = LIMITS, step: int | None = None):
    scanner = HeadScanner(limits)
    pieces = [data] if step is None else [data[i:i + step] for i in range(0, len(data), step)]
    for piece in pieces:
        if (refusal := scanner.feed(piece)) is not None:
            return refusal[0]
    return "open" if scanner.open else "done"


def _head(target_len: int = 10, num_headers: int = 3, value_len: int = 5,
          newline: bytes = b"\r\n") -> bytes:
    lines = [b"GET /" + b"a" * (target_len - 1) + b" HTTP/1.1"]
    lines += [b"X-%d: " % i + b"v" * value_len for i in range(num_headers)]
    return newline.join(lines) + newline + newline


@pytest.mark.parametrize("step", [None, 1, 7])
def test_scanner_limits_are_exact_however_the_bytes_arrive(step):
    assert _scan(_head(target_len=4096), step=step) == "done"
    assert _scan(_head(target_len=4097), step=step) == 414
    assert _scan(_head(num_headers=40), step=step) == "done"
    assert _scan(_head(num_headers=41), step=step) == 431
    fits = (16384 - 2) // 40 - len(b"X-10: \r\n")  # 40 fields, the blank line: 16,384 bytes
    assert _scan(_head(num_headers=40, value_len=fits - 1), step=step) == "done"
    assert _scan(_head(num_headers=40, value_len=fits + 1), step=step) == 431
    assert _scan(_head(newline=b"\n"), step=step) == "done"  # bare LF, as llhttp accepts
    assert _scan(b"\r\n\r\n" + _head(), step=step) == "done"  # blank lines before a request
    assert _scan(_head()[:-2], step=step) == "open"  # the head has not ended yet
    for short_line in (b" \n", b"a\n", b"\r\r\n"):  # not blank: the head goes on
        assert _scan(_head()[:-2] + short_line, step=step) == "open"


def test_scanner_counts_each_request_from_its_reset():
    scanner = HeadScanner(LIMITS)
    for _ in range(100):  # 100 x 30 fields: each request's own count
        assert scanner.feed(_head(num_headers=30)) is None and not scanner.open
        scanner.reset()


# ---- h11 (uvicorn's parser where httptools is missing): the same caps ------------------------
def test_h11_protocol_answers_414_and_431_too():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    stats = LimitStats(LIMITS)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=guarded_protocol(stats, H11Protocol)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        for name in ("url", "many headers"):
            head, filler, status, flag = FLOODS[name]
            got, error = _status_and_error(_flood(port, head, filler)[0])
            assert got == status and flag in error["message"]
        with httpx.Client(timeout=30) as client:  # keep-alive: each request counted anew
            for _ in range(3):
                assert client.get(f"http://127.0.0.1:{port}/", headers={
                    f"x-h{i}": "v" for i in range(30)}).text == "ok"
    finally:
        server.should_exit = True
        thread.join(30)


# ---- the body read whole: LimitsMiddleware's receive arms no deadline ----------------------
@pytest.mark.parametrize("base", ["httptools", "h11"])
def test_the_protocol_marks_a_request_whose_body_is_read_whole(base):
    """BODY_READ is in the scope before the app runs when the body came with the head, and only
    once the rest arrived when it came later (till then the body's deadline holds)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from flashlet.server.limits import BODY_READ

    seen = []

    async def app(scope, receive, send):
        at_start = scope.get(BODY_READ, False)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        seen.append((at_start, scope.get(BODY_READ, False), body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol = HttpToolsProtocol if base == "httptools" else H11Protocol
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=guarded_protocol(LimitStats(LIMITS), protocol)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
    try:
        while not server.started:
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(head + b"0123456789")  # whole
            assert client.recv(4096).endswith(b"ok")
            client.sendall(head + b"01234")  # half, then the rest
            time.sleep(0.3)
            client.sendall(b"56789")
            assert client.recv(4096).endswith(b"ok")
    finally:
        server.should_exit = True
        thread.join(30)
    assert seen == [(True, True, b"0123456789"), (False, True, b"0123456789")]
