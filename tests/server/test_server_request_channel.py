"""What an API process sends an engine core (requests, aborts, probes, shutdown) over one Unix
socket per (API process, core) (step_channel.py): frames come out whole however the bytes
arrive, from several processes at once; an idle core wakes on them; a full socket never blocks
the sender nor reorders its messages (an abort never overtakes its request); what is sent
before the core said it is ready waits for the channel; a core that cannot be reached over one
gets everything over zmq; a closed core end refuses sends; and a real engine serves requests
that came this way."""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import threading
import time

import msgspec
import pytest
import zmq

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.server.core_client import CoreClient, CoreProcess
from flashlet.server.diagnostics import LoopCounters
from flashlet.server.engine_core import EngineCore, engine_info
from flashlet.server.engine_loop import RequestStream
from flashlet.server.messages import (AbortRequests, AddRequests, CoreInput, CoreReady, Probe)
from flashlet.server.step_channel import FrameListener, FrameWriter, request_path
from server_helpers import engine_greedy_tokens, wait_push_connected

INFO = {"max_model_len": 4096, "vocab_size": 1000, "page_size": 16, "num_pages": 1024}


def _framed(frame: bytes) -> bytes:
    return len(frame).to_bytes(4, "little") + frame


def _read_until(listener: FrameListener, count: int, timeout: float = 10.0) -> list[bytes]:
    frames, deadline = [], time.monotonic() + timeout
    while len(frames) < count:
        assert time.monotonic() < deadline, f"{len(frames)} of {count} frames arrived"
        frames += listener.read_frames()
        time.sleep(0.001)
    return frames


def test_frames_from_several_api_processes_come_out_whole_and_in_order(tmp_path):
    listener = FrameListener.open(str(tmp_path / "requests0"))
    a, b = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
    try:
        a.connect(listener.path)
        b.connect(listener.path)
        first = b"split across reads"
        data = _framed(first)
        for i in range(len(data)):  # a byte at a time, each read finding one more
            a.send(data[i:i + 1])
            frames = listener.read_frames()
            assert frames == ([first] if i == len(data) - 1 else [])
        from_a = [b"a" + bytes([i]) * i for i in range(200)]
        # a batch of requests with long prompts, 5 MiB: several reads
        from_b = [b"b" + bytes([i]) * i for i in range(200)] + [b"b" + os.urandom(5 << 20)]
        sender = threading.Thread(target=b.sendall, args=(b"".join(map(_framed, from_b)),))
        sender.start()
        a.sendall(b"".join(map(_framed, from_a)))  # many messages in one write
        got = _read_until(listener, len(from_a) + len(from_b))
        sender.join()
        assert [f for f in got if f[:1] == b"a"] == from_a  # each connection's in its order
        assert [f for f in got if f[:1] == b"b"] == from_b
        # an API process that exits mid-frame: its connection goes, nothing is made of the part
        a.send(_framed(b"never finished")[:7])
        a.close()
        assert _wait_for(lambda: not listener.read_frames() and len(listener.readers) == 1)
    finally:
        a.close()
        b.close()
        listener.close()
    assert not os.path.exists(tmp_path / "requests0")


def _wait_for(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_idle_core_wakes_on_its_request_channel_and_an_abort_follows_its_request(tmp_path):
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("inproc://idle-core-requests")
    core = EngineCore.__new__(EngineCore)  # its loop's receiving alone: no engine
    core.inbox, core.writers, core.step_paths, core.outboxes, core.receives = inbox, [], None, [], 0
    core.requests = FrameListener.open(request_path(str(tmp_path), 0))
    core.decoder, core.counters = msgspec.msgpack.Decoder(CoreInput), LoopCounters()
    core.queued_adds, core.queued_ids = collections.deque(), set()
    api = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert not core._wait_for_inbox(50)  # nothing sent: it sleeps the whole timeout
        api.connect(core.requests.path)
        add = AddRequests.of([1, 3], list(range(3000)), [SamplingParams()] * 2)
        frames = b"".join(_framed(msgspec.msgpack.encode(m)) for m in (add, AbortRequests([1])))
        threading.Timer(0.05, api.sendall, (frames,)).start()
        assert core._wait_for_inbox(10_000)  # the connection, then its messages
        assert _wait_for(lambda: (core._receive(wait=False), core.queued_ids == {3})[1])
        (queued,) = core.queued_adds
        assert queued.request_ids == [3] and core.queued_ids == {3}  # 1 was dropped unrun
        assert len(queued.prompt_token_ids()) == 3000
        core._receive(wait=False)  # nothing more: returns at once
        assert len(core.queued_adds) == 1
    finally:
        api.close()
        core.requests.close()
        inbox.close(linger=0)
        ctx.term()


class FakeCore:
    """A core's sockets for an attached CoreClient: its request listener (or zmq inbox) for
    what the client sends, a zmq socket for its CoreReady."""

    def __init__(self, client: CoreClient, listen: bool = True, receive_buffer: int = 0):
        self.ctx = zmq.Context()
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(client._output_addr(client.api_server_index))
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(client._input_addr(0, client.api_server_index))
        self.path = request_path(client.ipc_dir, 0)
        self.listener = FrameListener.open(self.path) if listen else None
        if receive_buffer:  # inherited by the accepted connection
            self.listener.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.decoder = msgspec.msgpack.Decoder(CoreInput)

    def ready(self, path: str | None) -> None:
        info = INFO if path is None else {**INFO, "request_path": path}
        self.outbox.send(msgspec.msgpack.encode(CoreReady(0, info, None, os.getpid())))

    def received_over_channel(self, count: int) -> list:
        return [self.decoder.decode(f) for f in _read_until(self.listener, count)]

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()


@pytest.fixture
def attached(tmp_path):
    """A CoreClient attached as API process 1 of 2 to a core it does not own (no spawn)."""
    pid = os.getpid()
    client = CoreClient(EngineConfig(device="cpu"), api_server_index=1, api_server_count=2,
                        ipc_dir=str(tmp_path), core_pids=[pid], owner_pid=pid).start()
    cores = []

    def make_core(**kw) -> FakeCore:
        cores.append(FakeCore(client, **kw))
        return cores[-1]

    yield client, make_core
    client.stop(timeout=5)
    for core in cores:
        core.close()


def _streams(n: int, prompt_len: int) -> list[RequestStream]:
    return [RequestStream(list(range(prompt_len)), SamplingParams(max_new_tokens=4))
            for _ in range(n)]


def test_a_full_channel_never_blocks_the_sender_nor_reorders_its_messages(attached):
    """A probe sent before the core is ready goes first; then 300 requests of 2,000 tokens
    and their aborts while the core reads nothing: the socket fills, the sends return, and the
    reader thread writes the rest as the core reads, every abort after its request."""
    client, make_core = attached
    core = make_core(receive_buffer=16384)
    client._send(client.cores[0], Probe(1))  # before CoreReady: held
    core.ready(core.path)
    assert client.wait_ready(10), client.error
    writer = client.cores[0].requests
    assert writer is not None and client.cores[0].held is None
    writer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # fills sooner

    async def submit_and_abort() -> list[RequestStream]:
        streams = _streams(300, 2000)
        for stream in streams:
            client.submit(stream)
        for stream in streams:
            client.abort(stream)
        return streams

    streams = asyncio.run(submit_and_abort())
    assert writer.pending  # the socket is full (nobody read): the rest waits here
    got = core.received_over_channel(1 + 2 * len(streams))
    assert isinstance(got[0], Probe) and got[0].api_server == 1
    ids = [s.request_id for s in streams]
    assert [m.request_ids for m in got[1:301]] == [[i] for i in ids]
    assert all(len(m.prompt_token_ids()) == 2000 for m in got[1:301])
    assert [m.request_ids for m in got[301:]] == [[i] for i in ids]
    assert all(isinstance(m, AbortRequests) for m in got[301:])
    assert _wait_for(lambda: not writer.pending)
    assert not core.inbox.poll(100)  # nothing over zmq


def test_a_core_without_a_channel_gets_everything_over_zmq_in_order(attached):
    """CoreReady names a path nobody listens at: the probe held before it, and every message
    after, go over zmq for the core's whole life."""
    client, make_core = attached
    core = make_core(listen=False)
    wait_push_connected(client, core.inbox)
    client._send(client.cores[0], Probe(1))
    core.ready(os.path.join(client.ipc_dir, "nobody-listens"))
    assert client.wait_ready(10), client.error
    assert client.cores[0].requests is None

    async def submit_one() -> RequestStream:
        (stream,) = _streams(1, 5)
        client.submit(stream)
        client.abort(stream)
        return stream

    stream = asyncio.run(submit_one())
    got = []
    while len(got) < 3:
        assert core.inbox.poll(5000)
        got.append(msgspec.msgpack.Decoder(CoreInput).decode(core.inbox.recv()))
    assert [type(m) for m in got] == [Probe, AddRequests, AbortRequests]
    assert got[1].request_ids == got[2].request_ids == [stream.request_id]


def test_a_closed_core_end_refuses_sends_instead_of_keeping_them(attached):
    client, make_core = attached
    core = make_core()
    core.ready(core.path)
    assert client.wait_ready(10), client.error
    core.received_over_channel(0)  # accepted
    assert _wait_for(lambda: core.listener.read_frames() == [] and core.listener.readers)
    core.listener.close()  # the core is gone
    frame = msgspec.msgpack.encode(Probe(1))
    with client._lock:
        sent = [client._send_frame_locked(client.cores[0], frame) for _ in range(3)]
    assert sent[-1] is False and client.cores[0].requests.closed
    assert not client.cores[0].requests.pending


def test_a_real_engine_serves_requests_that_came_over_the_channel(tiny_qwen2, tmp_path):
    """The engine's own greedy tokens for a request sent over the request channel; an abort
    of a second request, sent right behind it, frees its pages before it runs."""
    config = EngineConfig(model=str(tiny_qwen2), max_num_pages=64, page_size=16)
    prompt, params = [5, 9, 2, 7], SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = engine_greedy_tokens(config, prompt, params)

    aloop = asyncio.new_event_loop()
    client = CoreClient(EngineConfig(device="cpu"), ipc_dir=str(tmp_path))
    ctx = client._zmq
    inbox = ctx.socket(zmq.PUSH)
    inbox.bind(client._input_addr(0, 0))
    client.cores.append(CoreProcess(0, None, inbox, os.getpid(), awaits_channel=True))
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.connect(client._input_addr(0, 0))
    core_out.connect(client._output_addr(0))
    engine = Engine(config)
    path = request_path(client.ipc_dir, 0)
    core = EngineCore(engine, 0, core_in, [core_out], os.getpid(), None,
                      FrameListener.open(path))
    try:
        client._core_ready(CoreReady(0, {**engine_info(engine), "request_path": path}, None,
                                     os.getpid()))
        assert client.cores[0].requests is not None

        async def make_streams():
            return RequestStream(prompt, params), RequestStream(prompt, params)

        stream, aborted = aloop.run_until_complete(make_streams())
        client.submit_group([stream])
        client.submit_group([aborted])
        client.abort(aborted)
        assert core._wait_for_inbox(5000)
        core._receive(wait=False)  # all three were written before: read in one go
        assert core.queued_ids == {stream.request_id}  # the abort came after its request
        core._add_queued()
        while engine.has_unfinished():
            core._send(core._step())
        deadline = time.monotonic() + 10
        while not (stream.items and stream.items[-1].finished):
            assert time.monotonic() < deadline, "the outputs never arrived"
            if client._outbox.poll(10):
                client._drain()
            aloop.run_until_complete(asyncio.sleep(0))  # the deliveries' call_soon_threadsafe
        got = [t for item in stream.items for t in item.new_token_ids]
        assert got == expected
        assert not core_in.poll(0)  # nothing came over zmq
        engine.check_integrity()
        assert engine.stats()["requests"] == 0
    finally:
        core.close_step_channels()
        core_in.close(linger=0)
        core_out.close(linger=0)
        client._close()
        aloop.close()


def test_a_drain_cut_short_by_its_timeout_leaves_only_the_unsent_rest(tmp_path):
    """stop() drains the backlogs (the reader thread, which writes them otherwise, has
    stopped); a drain that times out after writing part of one must not write that part again
    in the next: the core would read a corrupt stream."""
    client = CoreClient(EngineConfig(device="cpu"), ipc_dir=str(tmp_path))
    inbox = client._zmq.socket(zmq.PUSH)
    client.cores.append(CoreProcess(0, None, inbox, os.getpid()))
    api_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    api_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    api_end.setblocking(False)
    client.cores[0].requests = FrameWriter(api_end, "engine core 0")
    frames = [bytes([i]) * 10_000 for i in range(100)]
    try:
        with client._lock:
            for frame in frames:
                client._send_frame_locked(client.cores[0], frame)
        assert client.cores[0].requests.pending
        received = bytearray(core_end.recv(65536))  # room for part of the backlog, not all
        client._drain_requests(0.05)  # nobody reads on: it writes what fits, then gives up
        assert client.cores[0].requests.pending
        reader = threading.Thread(target=lambda: received.extend(_recv_to_eof(core_end)))
        reader.start()
        client._drain_requests(10)  # the core reads again: the rest goes out
        assert not client.cores[0].requests.pending
        client.cores[0].requests.close()
        reader.join(10)
        assert bytes(received) == b"".join(_framed(f) for f in frames)
    finally:
        core_end.close()
        client._close()


def _recv_to_eof(sock: socket.socket) -> bytes:
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
    return bytes(data)
