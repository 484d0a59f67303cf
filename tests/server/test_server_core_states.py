"""CoreClient's view of its cores, on a clock of its own (no processes, no sleeping): a core
with requests in flight that sends nothing for the stall bound is stalled (routed around,
/health's reason), an idle one never is; after the request bound its requests end with a
503 and are aborted in it, unless its heartbeat says it is alive in a long step; its next
message makes it usable again; a dead core's requests
fail and the others take the new ones; the last one's death is fatal."""

from __future__ import annotations

import asyncio
import shutil

import msgspec
import pytest

from flashlet import EngineConfig, SamplingParams
from flashlet.core.request_check import RequestLimits
from flashlet.server import core_client
from flashlet.server.core_client import CoreClient, CoreProcess
from flashlet.server.engine_loop import NotReady, RequestStream, StreamError
from flashlet.server.messages import AbortRequests, CoreInput, Heartbeat, StepOutputs
from flashlet.server.router import PrefixRouter


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Inbox:
    """A core's inbox: what the client sent it, decoded."""

    def __init__(self):
        self.sent = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sent.append(msgspec.msgpack.decode(frame, type=CoreInput))

    def close(self, linger: int = 0) -> None:
        pass


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(core_client, "time", clock)
    return clock


@pytest.fixture
def make_client(clock):
    clients = []

    def make(num_cores: int = 2, **kw) -> CoreClient:
        fatal = []
        client = CoreClient(EngineConfig(device="cpu"), num_cores, on_fatal=fatal.append,
                            stall_timeout_s=8.0, stalled_request_timeout_s=60.0, **kw)
        client.fatal = fatal
        client.cores = [CoreProcess(i, None, Inbox(), pid=0) for i in range(num_cores)]
        client.limits = RequestLimits(512, 1000, 16, 64)
        client.router = PrefixRouter(num_cores, 16)
        client.ready.set()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client._close()
        shutil.rmtree(client.ipc_dir, ignore_errors=True)  # stop() would; _close() does not


def _submit(client: CoreClient, prompt: list[int]) -> RequestStream:
    stream = RequestStream(prompt, SamplingParams(max_new_tokens=4))
    client.submit(stream)
    return stream


def _heard_from(client: CoreClient, core: int) -> None:
    client._handle(StepOutputs(core, [], {"time": 0.0}))


def test_a_silent_busy_core_is_stalled_routed_around_ended_and_recovers(make_client, clock):
    async def main():
        client = make_client()
        a, b = _submit(client, [1, 2, 3]), _submit(client, [4, 5, 6])
        assert (a.core, b.core) == (0, 1)  # the least loaded each time
        clock.now += 5
        _heard_from(client, 1)
        clock.now += 3.1  # core 0: 8.1 s of silence with a request; core 1: 3.1 s
        client._check_stalls()
        assert [c.usable for c in client.cores] == [False, True] and client.is_ready
        assert client.core_problems() == ["engine core 0 stalled: no step and no heartbeat "
                                          "(stopped or hung) for 8 s with 1 requests in flight"]
        assert [c["up"] for c in client.core_stats()] == [0.0, 1.0]
        assert _submit(client, [7, 8, 9]).core == 1  # (1 vs 1 in flight: core 0 otherwise)
        clock.now += 52  # 60.1 s of silence: its request ends, and is aborted in it
        _heard_from(client, 1)  # (core 1 steps on)
        client._check_stalls()
        item = await a.get()
        assert isinstance(item, StreamError) and item.status == 503
        assert "engine core 0 stalled" in item.message
        assert client.cores[0].inbox.sent[-1] == AbortRequests([a.request_id])
        assert client.cores[0].num_in_flight == 0 and not client.cores[0].usable
        _heard_from(client, 0)  # it runs again
        assert client.core_problems() == [] and client.cores[0].usable

    asyncio.run(main())


def test_an_idle_core_is_never_stalled_and_new_work_starts_its_clock(make_client, clock):
    async def main():
        client = make_client(1)
        clock.now += 3600
        client._check_stalls()
        assert client.cores[0].usable
        _submit(client, [1, 2])
        clock.now += 7.9
        client._check_stalls()
        assert client.cores[0].usable
        clock.now += 0.2
        client._check_stalls()
        assert not client.cores[0].usable and not client.is_ready
        with pytest.raises(NotReady, match="engine core 0 stalled"):
            _submit(client, [3, 4])

    asyncio.run(main())


def test_a_dead_core_fails_its_requests_and_the_last_ones_death_is_fatal(make_client):
    async def main():
        client = make_client()
        a, b = _submit(client, [1, 2, 3]), _submit(client, [4, 5, 6])
        client._core_died(client.cores[0], "engine core 0 died (exit code -9)")
        item = await a.get()
        assert isinstance(item, StreamError) and item.status == 500
        assert "engine core 0 died" in item.message
        assert client.fatal == [] and client.is_ready and client.num_streams == 1
        assert all(_submit(client, [i, 9]).core == 1 for i in range(4))
        client._core_died(client.cores[1], "engine core 1 died (exit code -9)")
        assert len(client.fatal) == 1 and not client.is_ready
        assert isinstance(await b.get(), StreamError)

    asyncio.run(main())


def test_exit_on_core_failure_makes_the_first_death_fatal(make_client):
    client = make_client(exit_on_core_failure=True)
    client._core_died(client.cores[1], "engine core 1 died (exit code -9)")
    assert len(client.fatal) == 1 and "engine core 1 died" in str(client.error)


def test_what_a_dead_core_sent_before_it_died_is_dropped(make_client):
    client = make_client()
    client._core_died(client.cores[0], "engine core 0 died (exit code -9)")
    client._handle(StepOutputs(0, [], {"time": 0.0, "running": 3.0}))
    assert client.core_stats()[0]["up"] == 0.0 and "running" not in client.core_stats()[0]


def test_a_core_alive_in_one_long_step_is_stalled_but_keeps_its_requests(make_client, clock):
    """Its heartbeat comes (a CPU step over a long prompt): /health says so, but the request
    is not ended; it ends when the step does."""
    async def main():
        client = make_client(1)
        a = _submit(client, [1, 2, 3])
        for _ in range(70):
            clock.now += 1
            client._handle(Heartbeat(0))
            client._check_stalls()
        assert client.core_problems() == ["engine core 0 stalled: its process runs, but no "
                                          "step ended for 70 s with 1 requests in flight"]
        assert client.num_streams == 1 and not a.items and client.cores[0].inbox.sent[1:] == []
        _heard_from(client, 0)
        assert client.core_problems() == []

    asyncio.run(main())
