"""The engine core's compact messages against the obvious ones: a step's outputs as
output_rows sends them decode into the same CoreOutputs as whole CoreOutputs would; a prompt's
token ids as int32 bytes come out as the same checked list (and the same errors) as a list of
ints; a prompt's samples arrive and are added together; a burst is added a step's token budget
at a time. Then a real (tiny) engine behind EngineCore's message path gives the tokens the
engine gives directly."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from server_helpers import wait_until

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.core.request import RequestOutput
from flashlet.core.request_check import RequestError, RequestLimits
from flashlet.core.sampling import TokenLogprob
from flashlet.server import engine_core
from flashlet.server.engine_core import EngineCore
from flashlet.server.messages import (AbortRequests, AddRequests, CoreInput, CoreOutput,
                                      StepOutputs, api_server_of, output_rows,
                                      output_rows_by_api_server, pack_token_ids)

ENCODER = msgspec.msgpack.Encoder()
STEP_DECODER = msgspec.msgpack.Decoder(StepOutputs)


def _random_outputs(rng: random.Random, n: int) -> list:
    """A step's worth of outputs: mostly one token and going on, some finished (with every
    reason), with several or no tokens, with logprobs; and requests the core refused."""
    outputs = []
    for i in range(n):
        kind = rng.random()
        tokens = [rng.randrange(50_000) for _ in range(rng.choice([1, 1, 1, 0, 3]))]
        out = RequestOutput(1000 + i, tokens, False, num_cached_tokens=rng.choice([0, 16, 400]),
                            prompt_token_ids=[1, 2, 3])
        if kind < 0.2:
            out.finished = True
            out.finish_reason = rng.choice(["stop", "length", "abort", "error"])
            out.error = "sampling failed: boom" if out.finish_reason == "error" else None
        if kind > 0.8 and tokens:
            out.new_logprobs = [TokenLogprob(t, -rng.random(), [(t, -0.5), (7, -1.25)])
                                for t in tokens]
        if 0.5 < kind < 0.6:  # a first token with its prompt's logprobs (the first: None)
            out.prompt_logprobs = [None] + [TokenLogprob(t, -1.5, [(9, -0.25)], rank=4)
                                            for t in out.prompt_token_ids[1:]]
        outputs.append(out)
    outputs += [CoreOutput.refused(5000, "prompt is empty"),
                CoreOutput.refused(5001, "engine step failed: oops", 500)]
    rng.shuffle(outputs)
    return outputs


def test_output_rows_decode_into_the_same_core_outputs_as_whole_ones():
    rng = random.Random(0)
    stats = {"running": 3.0, "time": 1.5}
    for _ in range(20):
        outputs = _random_outputs(rng, rng.randrange(0, 60))
        compact = ENCODER.encode(StepOutputs(2, output_rows(outputs), stats))
        whole = ENCODER.encode(StepOutputs(2, [CoreOutput.of(o) for o in outputs], stats))
        got = STEP_DECODER.decode(compact)
        assert got == STEP_DECODER.decode(whole)
        assert got.core == 2 and got.stats == stats
        for row, out in zip(got.outputs, outputs, strict=True):
            assert isinstance(row, CoreOutput)
            for field in ("request_id", "new_token_ids", "num_cached_tokens", "finished",
                          "finish_reason", "error", "new_logprobs", "prompt_logprobs"):
                assert getattr(row, field) == getattr(out, field), field
            assert row.status == getattr(out, "status", 500)
        assert len(compact) <= len(whole)


def test_rows_split_by_api_process_are_each_process_outputs_rows_in_order():
    rng = random.Random(3)
    for count in (2, 3, 4):
        outputs = _random_outputs(rng, 80)
        split = output_rows_by_api_server(outputs, count)
        assert len(split) == count
        for k, rows in enumerate(split):
            mine = [o for o in outputs if api_server_of(o.request_id, count) == k]
            assert ENCODER.encode(rows) == ENCODER.encode(output_rows(mine))


def test_a_request_that_only_got_tokens_is_sent_as_three_fields():
    out = RequestOutput(7, [42], False, num_cached_tokens=32)
    [row] = msgspec.msgpack.decode(ENCODER.encode(output_rows([out])))
    assert row == [7, [42], 32]


# ---- prompts -------------------------------------------------------------------------------
LIMITS = RequestLimits(max_model_len=4096, vocab_size=1000, page_size=16, num_pages=512)


def _checked(check, ids):
    try:
        return check(ids)
    except RequestError as e:
        return ("error", e.message, e.param)


def test_a_prompt_as_int32_bytes_is_checked_as_the_same_list():
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(1, 800))] for _ in range(30)]
    prompts += [[], [0], [999], [1000], [-1], [5, -7, 3], [3, 2**31 - 1], [-2**31, 4]]
    for prompt in prompts:
        msg = AddRequests.of([1], prompt, [SamplingParams()])
        decoded = msgspec.msgpack.decode(ENCODER.encode(msg), type=CoreInput)
        array = decoded.prompt_token_ids()
        assert array.tolist() == prompt
        got = _checked(LIMITS.check_prompt_ids, array)
        assert got == _checked(LIMITS.check_prompt_ids, list(prompt))
        if not isinstance(got, tuple):
            assert type(got) is list and all(type(t) is int for t in got)


@pytest.mark.parametrize("dtype", ["<i4", ">i4", "<i8", "<u2", ">u4", "i1"])
def test_the_array_check_reads_every_integer_dtype(dtype):
    ids = np.array([0, 5, 99], dtype)
    assert LIMITS.check_prompt_ids(ids) == [0, 5, 99]
    for bad in ([5, 1000], [-1, 5]) if np.dtype(dtype).kind == "i" else ([5, 1000],):
        if np.dtype(dtype).itemsize == 1 and 1000 in bad:
            continue
        with pytest.raises(RequestError, match=r"in \[0, 1000\)"):
            LIMITS.check_prompt_ids(np.array(bad, dtype))
    for bad in (np.zeros(0, np.int32), np.zeros((2, 2), np.int32), np.ones(3, np.float32)):
        with pytest.raises(RequestError):
            LIMITS.check_prompt_ids(bad)


def test_token_ids_outside_int32_and_torn_bytes_are_refused():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        pack_token_ids([2**31])
    torn = AddRequests([1], b"\x01\x00\x00\x00\x02", [{}])
    with pytest.raises(ValueError):
        torn.prompt_token_ids()


# ---- the core adding a prompt's requests ---------------------------------------------------
class RecordingEngine:
    structured = None
    config = SimpleNamespace(max_num_batched_tokens=100)  # the core's tokens per receive

    def __init__(self):
        self.added, self.aborted, self.groups = [], [], []

    def add_request(self, prompt, params, request_id, after=None, group=None):
        self.added.append((request_id, LIMITS.check_prompt_ids(prompt), params.seed, after))
        self.groups.append((request_id, group, params.priority))

    def abort(self, request_id, finish_reason="abort"):
        self.aborted.append(request_id)


@contextlib.contextmanager
def _core(engine, outboxes=()):
    """An EngineCore around `engine` without sockets (its inbox is never read here)."""
    core = EngineCore(engine, 0, None, list(outboxes), os.getpid())
    try:
        yield core
    finally:
        core.compiler.shutdown()
        core.counters.gc.close()


def _received(core: EngineCore, msg) -> None:
    core._apply(msgspec.msgpack.decode(ENCODER.encode(msg), type=CoreInput))


def test_a_prompts_samples_are_added_together_after_the_first():
    with _core(RecordingEngine()) as core:
        params = [SamplingParams(temperature=1.0, seed=s) for s in (10, 11, 12)]
        _received(core, AddRequests.of([4, 8, 12], [3, 1, 4, 1, 5], params))
    assert core.engine.added == [(4, [3, 1, 4, 1, 5], 10, None), (8, [3, 1, 4, 1, 5], 11, 4),
                                 (12, [3, 1, 4, 1, 5], 12, 4)]
    assert core.unfinished == {4, 8, 12} and core.errors == []


def test_a_client_requests_group_and_priority_reach_the_engine():
    """The prompts of one completion request travel with one group (the scheduler lets other
    requests take turns with them), and each request's priority with its parameters."""
    with _core(RecordingEngine()) as core:
        _received(core, AddRequests.of([4, 8], [3, 1], [SamplingParams(priority=-2)] * 2, 4))
        _received(core, AddRequests.of([12], [5, 9], [SamplingParams()], 4))
        _received(core, AddRequests.of([16], [2], [SamplingParams(priority=7)]))
    assert core.engine.groups == [(4, 4, -2), (8, 4, -2), (12, 4, 0), (16, None, 7)]
    assert core.errors == []


def test_a_malformed_add_refuses_each_of_its_requests():
    with _core(RecordingEngine()) as core:
        _received(core, AddRequests([1, 2], pack_token_ids([5, 6]), [{}]))  # one params for two
        _received(core, AddRequests([3], b"\x05\x00\x00", [{}]))  # not whole int32s
        _received(core, AddRequests([4], pack_token_ids([5]), [{"temperature": -1.0}]))
    assert core.engine.added == [] and core.unfinished == set()
    assert [(e.request_id, e.finished, e.finish_reason, e.status) for e in core.errors] == [
        (1, True, "error", 400), (2, True, "error", 400), (3, True, "error", 400),
        (4, True, "error", 400)]
    assert "temperature" in core.errors[-1].error


def test_a_burst_is_added_a_steps_token_budget_at_a_time():
    import zmq

    ctx = zmq.Context()
    inbox, api = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://core-burst")
    api.connect("inproc://core-burst")
    try:
        with _core(RecordingEngine()) as core:
            core.inbox = inbox
            for rid in range(5):  # 40 prompt tokens each, against a budget of 100 a receive
                api.send(ENCODER.encode(AddRequests.of([rid], [rid + 1] * 40, [SamplingParams()])))
                api.send(ENCODER.encode(AbortRequests([99])))  # no tokens: does not count
            wait_until(lambda: inbox.poll(0), 5, "the burst to arrive")
            core._receive(wait=False)
            assert core.engine.aborted == [99] * 5  # read at once, whatever is queued
            core._add_queued()
            assert [added[0] for added in core.engine.added] == [0, 1, 2]  # 120 >= 100
            core._add_queued()
            assert [added[0] for added in core.engine.added] == [0, 1, 2, 3, 4]
    finally:
        inbox.close(linger=0)
        api.close(linger=0)
        ctx.term()


def test_a_request_of_many_long_prompts_does_not_hold_a_short_one_in_the_inbox():
    """64 prompts of one client request (one group), each near a receive's token budget, then a
    short request of another: the first add takes one prompt of each group, so the short one
    reaches the scheduler at once (issue 35, item 7), and the rest follow a budget at a time."""
    with _core(RecordingEngine()) as core:
        for rid in range(64):
            core.queued_adds.append(AddRequests.of([rid], [rid + 1] * 90, [SamplingParams()], 7))
            core.queued_ids.add(rid)
        core.queued_adds.append(AddRequests.of([100], [5, 6, 7], [SamplingParams()], 100))
        core.queued_ids.add(100)
        core._add_queued()  # 0 and 100 first, then in order while the budget (100) lasts
        assert [added[0] for added in core.engine.added] == [0, 100, 1]
        assert 100 not in core.queued_ids and len(core.queued_adds) == 62


# ---- a real engine behind the message path ---------------------------------------------------
class Outbox:
    def __init__(self):
        self.sent: list[StepOutputs] = []

    def send(self, frame: bytes) -> None:
        self.sent.append(STEP_DECODER.decode(frame))


def test_the_core_message_path_gives_the_engines_own_tokens(tiny_qwen2):
    config = EngineConfig(model=str(tiny_qwen2), max_num_pages=256, page_size=16)
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(3, 90))] for _ in range(6)]
    greedy = SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=2)

    direct = Engine(config)
    for i, prompt in enumerate(prompts):
        direct.add_request(prompt, greedy, request_id=i)
    expected: dict[int, list] = {}
    while direct.has_unfinished():
        for out in direct.step():
            expected.setdefault(out.request_id, []).extend(
                zip(out.new_token_ids, [lp.token_id for lp in out.new_logprobs or []]))

    outbox = Outbox()
    with _core(Engine(config), [outbox]) as core:
        for i, prompt in enumerate(prompts):
            _received(core, AddRequests.of([i], prompt, [greedy]))
        request = core.engine.scheduler.requests[0]
        assert type(request.prompt_token_ids) is list
        assert all(type(t) is int for t in request.prompt_token_ids)
        while core.engine.has_unfinished():
            core._send(core._step())
    got: dict[int, list] = {}
    for message in outbox.sent:
        for row in message.outputs:
            got.setdefault(row.request_id, []).extend(
                zip(row.new_token_ids, [lp.token_id for lp in row.new_logprobs or []]))
            assert row.finished == (row.finish_reason == "length")
    assert got == expected
    assert all(len(v) == 9 for v in got.values())
    assert core.unfinished == set()


def test_an_abort_takes_effect_at_the_next_step_behind_24_queued_prompts(tiny_qwen2):
    """24 prompts of a whole step's token budget each arrive, then aborts: of a running
    request and of the last queued one. The next step (not the 25th) ends the running one,
    and the queued one is never added; the others run, and no page is left held."""
    import zmq

    config = EngineConfig(model=str(tiny_qwen2), max_num_pages=256, page_size=16,
                          max_num_seqs=32, max_num_batched_tokens=64)
    ctx = zmq.Context()
    inbox, api = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://core-abort")
    api.connect("inproc://core-abort")
    outbox = Outbox()
    long = SamplingParams(max_new_tokens=400, ignore_eos=True)
    short = SamplingParams(max_new_tokens=1, ignore_eos=True)
    try:
        with _core(Engine(config), [outbox]) as core:
            core.inbox = inbox
            api.send(ENCODER.encode(AddRequests.of([1000], [5, 6, 7], [long])))
            core.run_once()
            assert 1000 in core.engine.scheduler.requests
            for rid in range(24):
                api.send(ENCODER.encode(AddRequests.of([rid], [rid + 2] * 64, [short])))
            api.send(ENCODER.encode(AbortRequests([1000])))
            api.send(ENCODER.encode(AbortRequests([23])))
            wait_until(lambda: core.inbox.poll(0), 5, "the messages to arrive")
            steps, sent = core.counters.steps, len(outbox.sent)
            core.run_once()
            assert core.counters.steps == steps + 1
            ended = {(row.request_id, row.finish_reason) for message in outbox.sent[sent:]
                     for row in message.outputs if row.finished}
            assert (1000, "abort") in ended
            assert 1000 not in core.engine.scheduler.requests and 1000 not in core.unfinished
            while core.engine.has_unfinished() or core.queued_adds:
                core.run_once()
            finished = [row.request_id for message in outbox.sent for row in message.outputs
                        if row.finished]
            assert sorted(finished) == [*range(23), 1000]  # 23 never ran, nor was refused
            core.engine.check_integrity()
            stats = core.engine.stats()
            assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats
    finally:
        inbox.close(linger=0)
        api.close(linger=0)
        ctx.term()


class CompilingEngine(RecordingEngine):
    """A grammar compile that lasts until `release` is set; nothing else to run."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.structured = SimpleNamespace(compile=lambda fmt: self.release.wait(30),
                                          is_cached=lambda fmt: False, check=lambda fmt: None,
                                          cancel=lambda fmt: None, close=lambda: None)

    def has_unfinished(self):
        return False

    def stats(self):
        return {"requests": 0.0}


def test_a_core_waiting_on_a_grammar_compile_still_reports(monkeypatch):
    """A long compile is not silence: the API process would call the core stalled."""
    import zmq

    monkeypatch.setattr(engine_core, "HEARTBEAT_S", 0.0)  # every loop: counted, not timed
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("inproc://core-compile")
    outbox = Outbox()
    try:
        with _core(CompilingEngine(), [outbox]) as core:
            core.inbox = inbox
            constrained = SamplingParams(response_format={"type": "json_object"})
            _received(core, AddRequests.of([7], [1, 2, 3], [constrained]))
            assert 7 in core.compiling
            for _ in range(3):
                core.run_once()
            core.engine.release.set()
            assert len(outbox.sent) == 3 and all(m.outputs == [] for m in outbox.sent)
    finally:
        inbox.close(linger=0)


class CountingSocket:
    """A real zmq socket whose receives are counted (each recv's flags go to `recvs`)."""

    def __init__(self, socket, recvs: list):
        self.socket, self.recvs = socket, recvs

    def recv(self, flags=0):
        self.recvs.append(flags)
        return self.socket.recv(flags)

    def get(self, option):
        return self.socket.get(option)


def test_the_reader_drains_every_waiting_message_without_recv_raising_again():
    """CoreClient's reader takes every queued step message in one pass and asks the socket
    whether more wait, instead of a recv that raises zmq.Again once per step (its cost)."""
    import zmq

    from flashlet.server.core_client import CoreClient

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://reader-drain")
        push.connect("inproc://reader-drain")
        for i in range(3):
            push.send(msgspec.msgpack.encode(i))
        assert pull.poll(5000)
        recvs, handled = [], []

        client = CoreClient.__new__(CoreClient)
        client._outbox, client._decoder = CountingSocket(pull, recvs), msgspec.msgpack.Decoder()
        client._handle = handled.append
        while len(handled) < 3:  # (inproc may hand them over in more than one batch)
            assert client._drain()
            if len(handled) < 3:
                assert pull.poll(5000)
        assert handled == [0, 1, 2] and len(recvs) == 3  # no recv found nothing
        pull.close()
        assert not client._drain()  # a closed socket: the reader stops
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def test_core_reads_its_inbox_without_a_recv_that_finds_nothing():
    """A busy core reads its inbox every step, mostly empty: it asks the socket whether a
    message waits instead of a recv that raises zmq.Again (as CoreClient's reader does)."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://core-inbox")
        push.connect("inproc://core-inbox")
        recvs = []

        with _core(RecordingEngine()) as core:
            core.inbox = CountingSocket(pull, recvs)
            core._receive(wait=False)
            assert recvs == []  # nothing waited: nothing read
            push.send(msgspec.msgpack.encode(AbortRequests([7])))
            assert pull.poll(5000)
            core._receive(wait=False)
        assert len(recvs) == 1 and core.engine.aborted == [7]  # the one message, no read after
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


class ChannelsStub:
    """A core's request listener with `connected` API processes' channels and nothing to read."""

    def __init__(self, connected: int):
        self.readers = dict.fromkeys(range(connected))

    def read_frames(self) -> list:
        return []


class AskingSocket:
    """A zmq inbox that counts how often the core asks it whether a message waits."""

    def __init__(self, waiting: list):
        self.asked, self.waiting = 0, waiting

    def get(self, option):
        self.asked += 1
        return engine_core.POLLIN if self.waiting else 0

    def recv(self, flags=0):
        return self.waiting.pop(0)


@pytest.mark.parametrize("connected", [2, 1])
def test_a_busy_core_asks_its_zmq_inbox_every_read_until_every_channel_is_connected(connected):
    """With every API process on its request channel (two here), nothing comes over zmq: a busy
    core asks its inbox once in ZMQ_CHECK_EVERY reads (a backstop, which still finds a message
    there); with one process not connected, at every read."""
    reads = 3 * engine_core.ZMQ_CHECK_EVERY
    with _core(RecordingEngine(), outboxes=[None, None]) as core:
        core.requests, core.inbox = ChannelsStub(connected), AskingSocket([])
        for _ in range(reads):
            core._receive(wait=False)
        assert core.inbox.asked == (3 if connected == 2 else reads)
        core.inbox.waiting.append(msgspec.msgpack.encode(AbortRequests([7])))
        for _ in range(engine_core.ZMQ_CHECK_EVERY):
            core._receive(wait=False)
    assert core.engine.aborted == [7]


def test_the_plain_pollin_is_zmqs():
    import zmq

    assert engine_core.POLLIN == zmq.POLLIN


def test_step_message_stats_are_the_engines_numbers_with_names_left_out(tiny_qwen2):
    """core_stats with the name keys found once (as each step message takes them) is the
    engine's stats without the names: the same as the filtered copy, numbers only."""
    engine = Engine(EngineConfig(model=str(tiny_qwen2), max_num_pages=64))
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    engine.step()
    keys = engine_core.text_stat_keys(engine)
    assert keys == ("kv_cache_dtype",)
    expected = {k: v for k, v in engine.stats().items() if not isinstance(v, str)}
    expected["num_requests"] = expected["requests"]
    assert engine_core.core_stats(engine, keys) == engine_core.core_stats(engine) == expected
    assert all(isinstance(v, (int, float)) for v in expected.values())
