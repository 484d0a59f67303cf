"""The engine core's step messages over a plain Unix socket (step_channel.py): frames come out
whole however the bytes arrive, a full socket never blocks the core nor reorders its frames,
and a real core and API process use the channel (not zmq) once the process sent a request."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket

import zmq

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.server.core_client import CoreClient, CoreProcess
from flashlet.server.engine_core import EngineCore, engine_info
from flashlet.server.messages import CoreReady
from flashlet.server.engine_loop import RequestStream
from flashlet.server.step_channel import FrameReader, FrameWriter, step_path
from server_helpers import engine_greedy_tokens


def _pair(buffer_bytes: int | None = None) -> tuple[FrameWriter, FrameReader]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if buffer_bytes is not None:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    a.setblocking(False)
    return FrameWriter(a), FrameReader(b)


def test_frames_come_out_whole_when_split_across_reads_or_joined_in_one():
    writer, reader = _pair()
    try:
        frame = b"step message"
        data = len(frame).to_bytes(4, "little") + frame
        writer.sock.send(data[:3])  # not even the whole length
        assert reader.read_frames() == []
        writer.sock.send(data[3:9])
        assert reader.read_frames() == []
        writer.sock.send(data[9:])
        assert reader.read_frames() == [frame]
        frames = [bytes([i]) * i for i in range(40)] + [b"x" * (3 << 20)]  # and one of 3 MiB
        received = []
        for f in frames:
            writer.send(f)
            received += reader.read_frames()
        while writer.pending or len(received) < len(frames):
            writer.flush()
            received += reader.read_frames()
        assert received == frames and not reader.eof
    finally:
        writer.close()
        reader.close()


def test_a_full_socket_keeps_the_frames_in_order_and_never_blocks_the_core():
    writer, reader = _pair(buffer_bytes=4096)
    try:
        frames = [i.to_bytes(4, "little") * 300 for i in range(200)]  # 1.2 kB each
        for f in frames:  # nobody reads meanwhile: the socket fills, the rest waits
            writer.send(f)
        assert writer.pending
        received = []
        while len(received) < len(frames):
            received += reader.read_frames()
            writer.flush()
        assert received == frames and not writer.pending
    finally:
        writer.close()
        reader.close()


def test_a_closed_api_end_drops_the_cores_frames_instead_of_failing_its_loop():
    writer, reader = _pair()
    reader.close()
    writer.send(b"nobody reads this")
    writer.send(b"nor this")
    assert writer.closed and not writer.pending
    writer.close()


def test_a_real_core_sends_its_steps_over_the_channel_once_the_process_sent_a_request(
        tiny_qwen2):
    """Before this API process's first request the core's (stats-only) messages go over zmq;
    from that request on, over the step channel, and the stream gets the engine's own greedy
    tokens from it, none over zmq."""
    config = EngineConfig(model=str(tiny_qwen2), max_num_pages=64, page_size=16)
    prompt, params = [5, 9, 2, 7], SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = engine_greedy_tokens(config, prompt, params)

    aloop = asyncio.new_event_loop()
    client = CoreClient(EngineConfig(device="cpu"))
    ctx = client._zmq
    inbox = ctx.socket(zmq.PUSH)
    inbox.bind(client._input_addr(0, 0))
    client.cores.append(CoreProcess(0, None, inbox, os.getpid()))
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.connect(client._input_addr(0, 0))
    core_out.connect(client._output_addr(0))
    engine = Engine(config)
    core = EngineCore(engine, 0, core_in, [core_out], os.getpid(),
                      [step_path(client.ipc_dir, 0)])
    try:
        client._core_ready(CoreReady(0, engine_info(engine), None, os.getpid()))
        core._send([])  # no request of this process yet: over zmq
        assert client._outbox.poll(5000)
        client._drain()

        async def make_stream():
            return RequestStream(prompt, params)

        stream = aloop.run_until_complete(make_stream())
        client.submit_group([stream])
        assert core_in.poll(5000)
        core._receive(wait=False)
        core._add_queued()
        assert core.writers[0] is not None
        while engine.has_unfinished():
            core._send(core._step())
        client._read_step_channels()
        aloop.run_until_complete(asyncio.sleep(0))  # the deliveries' call_soon_threadsafe
        got = [t for item in stream.items for t in item.new_token_ids]
        assert got == expected and stream.items[-1].finished
        assert not client._outbox.poll(100)  # nothing came over zmq
    finally:
        core.close_step_channels()
        core_in.close(linger=0)
        core_out.close(linger=0)
        client._close()
        shutil.rmtree(client.ipc_dir, ignore_errors=True)  # stop() would; _close() does not
        shutil.rmtree(client.ipc_dir, ignore_errors=True)
        aloop.close()


def test_an_idle_core_writes_its_backlog_while_it_waits_for_requests():
    """The API process fell behind and the socket filled; then the core has nothing to run.
    Waiting for its next request, it still writes what it holds back (else the streams' last
    tokens would wait for that request), in order."""
    import zmq

    writer, reader = _pair(buffer_bytes=4096)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("inproc://idle-core")
    core = EngineCore.__new__(EngineCore)  # its loop's waiting alone: no engine
    core.inbox, core.writers, core.requests = inbox, [writer], None
    try:
        frames = [i.to_bytes(4, "little") * 300 for i in range(100)]
        for f in frames:
            writer.send(f)
        assert writer.pending
        received = []
        while len(received) < len(frames):
            received += reader.read_frames()  # the API process catches up...
            assert not core._wait_for_inbox(200)  # ...and no request comes meanwhile
        assert received == frames and not writer.pending
    finally:
        writer.close()
        reader.close()
        inbox.close(linger=0)
        ctx.term()
