"""CoreClient reads the engine cores' step socket on the event loop that serves its requests:
each output reaches its stream on that loop with no thread hand-off, a burst of step messages
for many requests arrives in order, a loop that closes hands the socket back (another loop's
requests still get their outputs), and stop() leaves no reader on the loop. A fake core (two
zmq sockets in this process) stands in for the engine-core process: no model, no spawn."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import msgspec
import pytest
import zmq

from flashlet.config import EngineConfig
from flashlet.core.sampling import SamplingParams
from flashlet.server import core_client
from flashlet.server.core_client import CoreClient
from flashlet.server.engine_loop import RequestStream, StreamError
from flashlet.server.messages import (AbortRequests, CoreInput, CoreOutput, CoreReady,
                                      Heartbeat, StepOutputs, output_rows)
from server_helpers import wait_push_connected

INFO = {"max_model_len": 256, "vocab_size": 1000, "page_size": 16, "num_pages": 64}


class FakeCore:
    """The engine-core side of the sockets: reads what the client sends, sends steps."""

    def __init__(self, client: CoreClient):
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(client._input_addr(0, client.api_server_index))
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(client._output_addr(client.api_server_index))
        self.decoder = msgspec.msgpack.Decoder(CoreInput)

    def send(self, msg) -> None:
        self.outbox.send(msgspec.msgpack.encode(msg))

    def step(self, outputs: list) -> None:
        self.send(StepOutputs(0, output_rows(outputs), {"time": time.monotonic()}))

    def received(self, timeout_ms: int = 5000):
        assert self.inbox.poll(timeout_ms), "the client sent nothing"
        return self.decoder.decode(self.inbox.recv())

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()


@pytest.fixture
def client_and_core(tmp_path):
    """A CoreClient attached as API process 1 of 2 to cores it does not own (so none is
    spawned; this process stands for the cores and their owner), made ready by the fake core."""
    yield from _attached(tmp_path)


@pytest.fixture
def busy_polling_client_and_core(tmp_path, monkeypatch, request):
    """As client_and_core, with a busy-poll window (--busy-poll-ms) of 60 s by default (above
    the flag's limit: no stall of a loaded machine outlasts it, so only the end of the requests
    or stop() ends the spin), or the test's `indirect` parameter in seconds."""
    monkeypatch.setattr(core_client, "MAX_BUSY_POLL_S", 60.0)
    yield from _attached(tmp_path, busy_poll_s=getattr(request, "param", 60.0))


def _attached(tmp_path, **options):
    pid = os.getpid()
    client = CoreClient(EngineConfig(device="cpu"), api_server_index=1, api_server_count=2,
                        ipc_dir=str(tmp_path), core_pids=[pid], owner_pid=pid, **options).start()
    core = FakeCore(client)
    try:
        wait_push_connected(client, core.inbox)
        core.send(CoreReady(0, INFO, None, pid))
        assert client.wait_ready(10), client.error
        yield client, core
    finally:
        client.stop(timeout=5)
        core.close()


def _streams(n: int) -> list[RequestStream]:
    return [RequestStream([1, 2, 3], SamplingParams(max_new_tokens=8)) for _ in range(n)]


async def _tokens_of(stream: RequestStream) -> list[int]:
    tokens = []
    while True:
        out = await asyncio.wait_for(stream.get(), 10)
        tokens += out.new_token_ids
        if out.finished:
            return tokens


async def _read_here(client: CoreClient) -> None:
    """Wait until the reader thread has handed the socket to the running loop."""
    for _ in range(1000):
        if client._reading_loop is asyncio.get_running_loop():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the event loop was never given the socket")


def test_outputs_reach_their_streams_on_the_event_loop_itself(client_and_core, monkeypatch):
    """The loop that submits reads the socket: each step message is handled on its thread,
    and each request gets its own tokens."""
    client, core = client_and_core
    handled_on = []
    handle = client._handle_frame
    monkeypatch.setattr(client, "_handle_frame",
                        lambda frame: (handled_on.append(threading.get_ident()), handle(frame)))

    async def run():
        streams = _streams(3)
        for stream in streams:
            client.submit(stream)
        ids = [core.received().request_ids[0] for _ in streams]
        assert ids == [s.request_id for s in streams] == [1, 3, 5]  # client 1 of 2: odd ids
        await _read_here(client)
        for step in range(4):
            core.step([CoreOutput(rid, [rid * 100 + step], finished=step == 3) for rid in ids])
        return await asyncio.gather(*map(_tokens_of, streams)), threading.get_ident()

    results, loop_thread = asyncio.run(run())
    assert results == [[rid * 100 + s for s in range(4)] for rid in (1, 3, 5)]
    assert handled_on and set(handled_on) == {loop_thread}


def test_a_burst_of_step_messages_for_many_requests_arrives_in_order(client_and_core):
    client, core = client_and_core
    num_requests, num_steps = 64, 50

    async def run():
        streams = _streams(num_requests)
        for stream in streams:
            client.submit(stream)
        await _read_here(client)
        for step in range(num_steps):  # sent at once, read as they come
            core.step([CoreOutput(s.request_id, [step], finished=step == num_steps - 1)
                       for s in streams])
        return await asyncio.gather(*map(_tokens_of, streams))

    assert asyncio.run(run()) == [list(range(num_steps))] * num_requests
    assert client.num_streams == 0 and client.cores[0].num_in_flight == 0


def test_a_closed_loop_hands_the_socket_back_and_other_loops_are_served(client_and_core):
    """A loop that read the socket and closed (a test client's, say) holds nothing up: the
    reader thread takes the socket back and the next loop's requests get their outputs, as do
    those of a loop that submits while another one reads."""
    client, core = client_and_core

    async def one_request(takes_the_socket: bool = False) -> list[int]:
        [stream] = _streams(1)
        client.submit(stream)
        rid = core.received().request_ids[0]
        core.step([CoreOutput(rid, [7])])
        core.step([CoreOutput(rid, [8], finished=True)])
        tokens = await _tokens_of(stream)
        # The reader thread hands the socket to this loop when it next wakes: under load that
        # can come after both tokens, which the thread then delivered itself.
        for _ in range(1000 if takes_the_socket else 0):
            if client._reading_loop is asyncio.get_running_loop():
                break
            await asyncio.sleep(0.01)
        return tokens

    assert asyncio.run(one_request(takes_the_socket=True)) == [7, 8]
    first_reader = client._reading_loop
    assert first_reader is not None and first_reader.is_closed()
    assert asyncio.run(one_request()) == [7, 8]  # the thread read it, or the new loop does

    started, ended = threading.Event(), threading.Event()
    other_loop = asyncio.new_event_loop()

    def run_other_loop():
        asyncio.set_event_loop(other_loop)
        other_loop.call_soon(started.set)
        other_loop.run_forever()
        ended.set()

    thread = threading.Thread(target=run_other_loop, daemon=True)
    thread.start()
    assert started.wait(5)
    try:
        # The other loop reads the socket; this one's request is delivered across threads.
        reads_there = asyncio.run_coroutine_threadsafe(one_request(), other_loop).result(10)
        assert reads_there == [7, 8]
        deadline = time.monotonic() + 5
        while client._reading_loop is not other_loop and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client._reading_loop is other_loop
        assert asyncio.run(one_request()) == [7, 8]
    finally:
        other_loop.call_soon_threadsafe(other_loop.stop)
        assert ended.wait(5)
        other_loop.close()


def test_stop_on_the_reading_loop_releases_its_fd_and_ends_the_streams(client_and_core):
    client, core = client_and_core

    async def run():
        [stream] = _streams(1)
        client.submit(stream)
        rid = core.received().request_ids[0]
        core.step([CoreOutput(rid, [4])])
        first = await asyncio.wait_for(stream.get(), 10)
        # The reader thread hands the socket to this loop when it next wakes: under load that
        # can come after the first token, which the thread then delivered itself.
        for _ in range(1000):
            if client._reading_loop is asyncio.get_running_loop():
                break
            await asyncio.sleep(0.01)
        assert client._reading_loop is asyncio.get_running_loop()
        fd = client._outbox_fd
        await asyncio.get_running_loop().run_in_executor(None, client.stop, 5)
        ended = await asyncio.wait_for(stream.get(), 10)  # the shutdown's 503
        return first, ended, asyncio.get_running_loop().remove_reader(fd)

    first, ended, was_watched = asyncio.run(run())
    assert first.new_token_ids == [4]
    assert ended.status == 503
    assert not was_watched  # stop() already took the reader off the loop
    assert client.stopped.is_set()
    assert isinstance(core.received(), AbortRequests)  # this process's request, in the core


def test_a_loop_without_fd_readers_is_served_by_the_reader_thread(client_and_core):
    """A loop that cannot watch an FD (Windows' proactor) is never asked again; the thread
    reads and wakes it, as before."""
    client, core = client_and_core

    class NoReaderLoop(asyncio.SelectorEventLoop):
        def add_reader(self, fd, callback, *args):
            raise NotImplementedError

    async def one_request() -> list[int]:
        [stream] = _streams(1)
        client.submit(stream)
        rid = core.received().request_ids[0]
        for _ in range(1000):  # the thread tried to hand the socket over, and took it back
            if client._loop_reading_unsupported and client._reading_loop is None:
                break
            await asyncio.sleep(0.01)
        core.step([CoreOutput(rid, [7])])
        core.step([CoreOutput(rid, [8], finished=True)])
        return await _tokens_of(stream)

    loop = NoReaderLoop()
    try:
        assert loop.run_until_complete(one_request()) == [7, 8]
        assert loop.run_until_complete(one_request()) == [7, 8]
    finally:
        loop.close()
    assert client._loop_reading_unsupported and client._reading_loop is None


def test_a_probe_on_the_reading_loop_fails_at_once_instead_of_waiting_on_itself(
        client_and_core):
    client, core = client_and_core

    async def run():
        [stream] = _streams(1)
        client.submit(stream)
        await _read_here(client)
        with pytest.raises(RuntimeError, match="another thread"):
            client.probe(timeout=30)
        client.abort(stream)

    asyncio.run(run())


def _record_select_timeouts(loop: asyncio.AbstractEventLoop) -> list:
    """The timeout of each wait of the loop's selector from now on (0: it polled, None or
    above 0: it could sleep)."""
    timeouts, select = [], loop._selector.select

    def recorded(timeout=None):
        timeouts.append(timeout)
        return select(timeout)

    loop._selector.select = recorded
    return timeouts


@pytest.mark.parametrize("busy_poll", [False, True])
def test_busy_poll_keeps_the_reading_loop_awake_while_requests_are_in_flight(busy_poll,
                                                                             request):
    """--busy-poll-ms: between step messages the reading loop only polls (never waits in its
    selector) while a request is in flight; once none is, it sleeps again. Off: it sleeps
    between messages as before. Either way each token reaches its stream."""
    client, core = request.getfixturevalue(
        "busy_polling_client_and_core" if busy_poll else "client_and_core")

    async def run():
        stream = _streams(1)[0]
        client.submit(stream)
        rid = core.received().request_ids[0]
        await _read_here(client)
        core.step([CoreOutput(rid, [5])])
        first = await asyncio.wait_for(stream.get(), 10)
        timeouts = _record_select_timeouts(asyncio.get_running_loop())
        await asyncio.sleep(0.05)  # no message meanwhile: the loop sleeps unless kept awake
        between = list(timeouts)
        core.step([CoreOutput(rid, [6], finished=True)])
        last = await asyncio.wait_for(stream.get(), 10)
        del timeouts[:]
        await asyncio.sleep(0.05)  # nothing in flight: sleeps either way
        return [first.new_token_ids, last.new_token_ids], between, list(timeouts)

    tokens, between, after = asyncio.run(run())
    assert tokens == [[5], [6]]
    slept = [t for t in between if t is None or t > 0]
    if busy_poll:
        assert len(between) > 10 and not slept, between[:20]
    else:
        assert slept and len(between) < 10, between[:20]
    assert any(t is None or t > 0 for t in after), after[:20]
    assert client._kept_awake is None


async def _first_token_read_here(client: CoreClient, core: FakeCore) -> RequestStream:
    """A request in flight whose first token the running loop has read (so it reads the
    socket, and a busy-poll window has started)."""
    stream = _streams(1)[0]
    client.submit(stream)
    rid = core.received().request_ids[0]
    await _read_here(client)
    core.step([CoreOutput(rid, [5])])
    assert (await asyncio.wait_for(stream.get(), 10)).new_token_ids == [5]
    return stream


async def _until_asleep(client: CoreClient, between=lambda: None, timeout: float = 10.0) -> bool:
    """Whether the reading loop stops being kept awake within `timeout` (calling `between`
    every 5 ms meanwhile)."""
    deadline = time.monotonic() + timeout
    while client._kept_awake is not None and time.monotonic() < deadline:
        between()
        await asyncio.sleep(0.005)
    return client._kept_awake is None


@pytest.mark.parametrize("busy_polling_client_and_core", [0.05], indirect=True)
def test_busy_poll_ends_with_its_window_when_a_core_only_sends_heartbeats(
        busy_polling_client_and_core):
    """A hung core (its heartbeat thread alive, no step) with a request in flight: the loop
    spins for the window after the last step message, then sleeps; a heartbeat (every 5 ms
    here, well inside the 50 ms window) renews nothing."""
    client, core = busy_polling_client_and_core

    async def run():
        stream = await _first_token_read_here(client, core)
        asleep = await _until_asleep(client, lambda: core.send(Heartbeat(0)))
        in_flight = client.num_streams
        client.abort(stream)
        return asleep, in_flight

    assert asyncio.run(run()) == (True, 1)


def test_stop_ends_the_busy_poll(busy_polling_client_and_core):
    """stop() with a request in flight, well inside the window: the loop sleeps again and
    the request ends with a 503."""
    client, core = busy_polling_client_and_core

    async def run():
        stream = await _first_token_read_here(client, core)
        kept_awake = client._kept_awake is asyncio.get_running_loop()  # a 60 s window
        await asyncio.to_thread(client.stop, 5)
        end = await asyncio.wait_for(stream.get(), 10)
        return kept_awake, await _until_asleep(client), end

    kept_awake, asleep, end = asyncio.run(run())
    assert kept_awake and asleep
    assert isinstance(end, StreamError) and end.status == 503, end
