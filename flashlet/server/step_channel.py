"""Messages between an API process and an engine core over plain Unix stream sockets.

A zmq send queues the message for zmq's I/O thread and wakes it; that thread writes to the
socket, the receiving process's I/O thread reads it and wakes the thread that reads it. Each
hand-off is a thread wake-up: CPU on the core's loop at every step (the eventfd write), and
latency on every token's way to its client. Here the core's loop writes the framed message
to the socket itself (non-blocking) and the API process's reader (its event loop) reads it
from the socket itself: one wake-up. zmq still carries heartbeats, a core's start-up and the
replies to probes, a core's step messages to an API process until that process's channel is
connected (core_client.py and engine_core.py say when), and, where a request channel cannot
be connected, what an API process sends that core.

The other way, everything an API process sends a core (requests, aborts, probes, shutdown)
goes over one connection per (API process, core) to the core's request listener, in order:
an abort never overtakes its request. The core listens before it says it is ready and names
the path in CoreReady; the API process connects on that message, before it sends the core
anything (what it sent earlier, a probe, waits for the connection), and falls back to zmq for
that core's whole life if it cannot connect: a pair never mixes the two.

Frames: a 4-byte little-endian length, then the msgpack message. The writer never blocks:
what the socket does not take now waits in a backlog, written before anything newer
(`flush`: the core waits for the socket to take it before it sleeps; an API process's reader
thread waits for each core's socket to take its backlog).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket

log = logging.getLogger("flashlet.server")

LENGTH_BYTES = 4
READ_BYTES = 1 << 20
SEND_BUFFER_BYTES = 8 << 20  # asked for; the kernel caps it (net.core.wmem_max)
_CLOSED = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)


def step_path(ipc_dir: str, api_server: int) -> str:
    return os.path.join(ipc_dir, f"steps{api_server}")


def request_path(ipc_dir: str, core: int) -> str:
    return os.path.join(ipc_dir, f"requests{core}")


def listen(path: str) -> socket.socket:
    """A listening socket (non-blocking): an API process's for its steps, a core's for requests."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    sock.setblocking(False)
    return sock


class FrameWriter:
    """The sending end of one channel: the core's to an API process, or an API process's to a
    core (`peer` names the other end in the log)."""

    def __init__(self, sock: socket.socket, peer: str = "an API process"):
        self.sock = sock
        self.peer = peer
        self.backlog = bytearray()
        self.closed = False

    @classmethod
    def connect(cls, path: str, peer: str = "an API process") -> "FrameWriter | None":
        """Connected to the process listening at `path`, or None if none listens (or its
        queue of connections is full: the connect never waits)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass
        return cls(sock, peer)

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
            log.warning("%s closed its end of the channel; what is sent to it is dropped",
                        self.peer)
            self.closed = True
            self.backlog.clear()
            return len(data)

    def close(self) -> None:
        self.closed = True
        self.backlog.clear()
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


class FrameListener:
    """A core's request listener and the API processes' connections to it: every whole frame
    that has arrived on any of them, read without waiting (each connection's in order)."""

    def __init__(self, sock: socket.socket, path: str | None = None):
        self.sock = sock
        self.path = path
        self.readers: dict[int, FrameReader] = {}
        # One poll(2) a step tells which connections have data (a busy core reads every step,
        # mostly nothing: a recv per connection would raise BlockingIOError each time).
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    @classmethod
    def open(cls, path: str) -> "FrameListener | None":
        """Listening at `path`, or None if it cannot (the API processes then use zmq)."""
        try:
            return cls(listen(path), path)
        except OSError as e:
            log.warning("cannot listen for requests at %s (%s): they come over zmq", path, e)
            return None

    def fds(self) -> list[int]:
        """What to wait on for something to read: the listener and each connection."""
        return [self.sock.fileno(), *self.readers]

    def read_frames(self) -> list[bytes]:
        frames = []
        for fd, _ in self._poll.poll(0):
            if fd == self.sock.fileno():
                frames += self._accept()
            elif fd in self.readers:
                frames += self._read(self.readers[fd])
        return frames

    def _accept(self) -> list[bytes]:
        """New connections, and what each has sent already."""
        frames = []
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return frames
            reader = FrameReader(sock)
            self.readers[reader.fileno()] = reader
            self._poll.register(reader.fileno(), select.POLLIN)
            frames += self._read(reader)

    def _read(self, reader: FrameReader) -> list[bytes]:
        frames = reader.read_frames()
        if reader.eof:  # that API process is gone (or stopped): a partial frame is dropped
            fd = reader.fileno()
            self._poll.unregister(fd)
            del self.readers[fd]
            reader.close()
        return frames

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        self.sock.close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
