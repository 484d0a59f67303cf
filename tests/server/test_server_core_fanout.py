"""EngineCore's step messages with several API processes (--api-server-count): each output goes
to the process that sent its request; a process with no output in a step gets the stats alone
only every STATS_EVERY_S and when the core has gone idle, not every step (it would wake and
decode each one for nothing). No model: a stand-in engine and outboxes that record."""

from __future__ import annotations


import msgspec

from flashlet.server import engine_core
from flashlet.server.engine_core import EngineCore
from flashlet.server.messages import CoreOutput, StepOutputs


class Outbox:
    def __init__(self):
        self.sent: list[StepOutputs] = []

    def send(self, frame: bytes) -> None:
        self.sent.append(msgspec.msgpack.decode(frame, type=StepOutputs))


class Engine:
    def __init__(self):
        self.unfinished = True

    def has_unfinished(self) -> bool:
        return self.unfinished


def _core(monkeypatch, clock: list[float]):
    monkeypatch.setattr(engine_core, "core_stats", lambda engine, text_keys=None: {"running": 1.0})
    monkeypatch.setattr(engine_core.time, "monotonic", lambda: clock[0])
    outboxes = [Outbox(), Outbox()]
    core = EngineCore.__new__(EngineCore)  # no zmq, no compiler thread
    core.engine, core.core, core.outboxes = Engine(), 0, outboxes
    core.encoder, core.errors, core.next_stats_to_all = msgspec.msgpack.Encoder(), [], 0.0
    core.writers, core.text_stats = [None] * len(outboxes), ()
    return core, outboxes


def _out(request_id: int) -> CoreOutput:
    return CoreOutput(request_id, [7])


def test_a_process_without_outputs_gets_the_stats_at_a_bounded_rate(monkeypatch):
    clock = [100.0]
    core, (api0, api1) = _core(monkeypatch, clock)
    for step in range(10):  # 10 steps of 1 ms with outputs for process 0 only (even ids)
        core._send([_out(2 * step)])
        clock[0] += 0.001
    assert [len(m.outputs) for m in api0.sent] == [1] * 10
    assert len(api1.sent) == 1 and api1.sent[0].outputs == []  # the first: stats were due
    assert api1.sent[0].stats["running"] == 1.0
    clock[0] += engine_core.STATS_EVERY_S
    core._send([_out(20)])
    assert len(api1.sent) == 2  # due again
    core._send([_out(3)])  # an output of process 1: it gets its message at once
    assert [o.request_id for o in api1.sent[-1].outputs] == [3]
    core.engine.unfinished = False  # the core went idle: every process hears of it
    core._send([_out(22)])
    assert len(api1.sent) == 4 and api1.sent[-1].outputs == []


def test_one_api_process_gets_every_step(monkeypatch):
    core, (api0, _) = _core(monkeypatch, [0.0])
    core.outboxes = [api0]
    for step in range(5):
        core._send([])
    assert len(api0.sent) == 5


def test_a_steps_outputs_go_out_before_the_other_processes_stats(monkeypatch):
    """When every process is due the stats, the process with outputs in the step gets its
    message first: its stream's token does not wait for messages that carry none."""
    clock = [100.0]
    core, outboxes = _core(monkeypatch, clock)
    order = []
    for k, outbox in enumerate(outboxes):
        outbox.send = lambda frame, k=k: order.append(
            (k, len(msgspec.msgpack.decode(frame, type=StepOutputs).outputs)))
    core._send([_out(1)])  # an output for process 1; the stats are due for process 0 too
    assert order == [(1, 1), (0, 0)]
