"""The engine core's step messages to an API process over a plain Unix stream socket.

A zmq send queues the message for zmq's I/O thread and wakes it; that thread writes to the
socket, the receiving process's I/O thread reads it and wakes the thread that reads it. Each
hand-off is a thread wake-up: CPU on the core's loop at every step (the eventfd write), and
latency on every token's way to its client. Here the core's loop writes the framed message
to the socket itself (non-blocking) and the API process's reader (its event loop) reads it
from the socket itself: one wake-up. zmq still carries everything else (requests, probes,
heartbeats, a core's start-up), and a core's step messages to an API process go over zmq
until that process's channel is connected (core_client.py and engine_core.py say when).

Frames: a 4-byte little-endian length, then the msgpack message. The writer never blocks:
what the socket does not take now waits in a backlog, written before anything newer
(`flush`, and the core waits for the socket to take it before it sleeps).
"""

from __future__ import annotations

import errno
import logging
import os
import socket

log = logging.getLogger("flashlet.server")

LENGTH_BYTES = 4
READ_BYTES = 1 << 20
SEND_BUFFER_BYTES = 8 << 20  # asked for; the kernel caps it (net.core.wmem_max)
_CLOSED = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)


def step_path(ipc_dir: str, api_server: int) -> str:
    return os.path.join(ipc_dir, f"steps{api_server}")


def listen(path: str) -> socket.socket:
    """The API process's listening socket (non-blocking), one per process."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    sock.setblocking(False)
    return sock


class FrameWriter:
    """The core's end of one API process's channel."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.backlog = bytearray()
        self.closed = False

    @classmethod
    def connect(cls, path: str) -> "FrameWriter | None":
        """Connected to the API process listening at `path`, or None if none listens yet."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass
        sock.setblocking(False)
        return cls(sock)

    @property
    def pending(self) -> bool:
        return bool(self.backlog)

    def send(self, frame: bytes) -> None:
        """Write one frame now, or as much of it as the socket takes (the rest: backlog)."""
        data = len(frame).to_bytes(LENGTH_BYTES, "little") + frame
        if self.backlog:
            self.backlog += data
            self.flush()
            return
        sent = self._write(data)
        if sent < len(data):
            self.backlog += data[sent:]

    def flush(self) -> None:
        """Write what the backlog holds, as far as the socket takes it."""
        if self.backlog:
            del self.backlog[:self._write(self.backlog)]

    def _write(self, data) -> int:
        if self.closed:
            return len(data)  # nobody reads any more: dropped
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as e:
            if e.errno not in _CLOSED:
                raise
            log.warning("an API process closed its step channel; its step messages are dropped")
            self.closed = True
            self.backlog.clear()
            return len(data)

    def close(self) -> None:
        self.sock.close()


class FrameReader:
    """The API process's end of one core's connection: whole frames out of what arrives."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self.buffer = bytearray()
        self.eof = False
        # recv_into one buffer kept for the connection: a recv of READ_BYTES would allocate
        # (and free) that much for every step message
        self._chunk = memoryview(bytearray(READ_BYTES))

    def fileno(self) -> int:
        return self.sock.fileno()

    def read_frames(self) -> list[bytes]:
        """Every whole frame that has arrived (none if nothing has); sets `eof` when the core
        closed its end."""
        while True:
            try:
                size = self.sock.recv_into(self._chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.eof = True
                break
            if not size:
                self.eof = True
                break
            self.buffer += self._chunk[:size]
            if size < READ_BYTES:
                break
        return self._frames()

    def _frames(self) -> list[bytes]:
        frames, start, buffer = [], 0, self.buffer
        while len(buffer) - start >= LENGTH_BYTES:
            size = int.from_bytes(buffer[start:start + LENGTH_BYTES], "little")
            end = start + LENGTH_BYTES + size
            if end > len(buffer):
                break
            frames.append(bytes(buffer[start + LENGTH_BYTES:end]))
            start = end
        if start:
            del buffer[:start]
        return frames

    def close(self) -> None:
        self.sock.close()
