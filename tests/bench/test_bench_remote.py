"""The --url client's pieces without a server: merging the client processes' records, the
shared clock, the process count and the SSE event parser."""

import multiprocessing
import time

import pytest

from flashlet.bench.common import Spec
from flashlet.bench.remote import Partial, _Events, client_procs, merge, split


def test_merge_puts_each_process_record_at_its_request():
    specs = [Spec("a b", 3, 2), Spec("c", 2, 1), Spec("d e f", 3, 3)]
    first = Partial(submit={0: 1.0, 2: 1.5}, token_times={0: [1.1, 1.2, 1.2], 2: [1.6, 1.7, 1.9]},
                    tokens={0: 3, 2: 3}, token_events=5, server_prompt_tokens=6, end=2.0,
                    api_server={0: "1", 2: "0"}, server_ttft={0: 80.0, 2: 60.0})
    second = Partial(submit={1: 1.0}, failed=1, errors=["HTTP 500: boom"], end=2.5)
    trace = merge(specs, 1.0, [first, second])
    assert (trace.start, trace.end) == (1.0, 2.5)
    assert trace.submit == [1.0, 1.0, 1.5]
    assert trace.token_times == [[1.1, 1.2, 1.2], [], [1.6, 1.7, 1.9]]
    assert [o if o is None else len(o) for o in trace.outputs] == [3, None, 3]
    m = trace.metrics()
    assert (m["completed"], m["failed"], m["output_tokens"]) == (2, 1, 6)
    assert m["ttft_ms"]["n"] == 2 and m["ttft_ms"]["max"] == pytest.approx(100.0)
    assert m["itl_ms"]["n"] == 4 and m["token_events"] == 5 and m["server_prompt_tokens"] == 6
    assert m["errors"] == ["HTTP 500: boom"]
    by = m["by_api_server"]
    assert {k: v["requests"] for k, v in by.items()} == {"0": 1, "1": 1}
    assert by["1"]["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert by["1"]["server_ttft_ms"]["p50"] == 80.0 and m["server_ttft_ms"]["mean"] == 70.0


def _child_clock(queue):
    queue.put(time.perf_counter())


def test_perf_counter_is_one_clock_across_processes():
    """What the merge relies on: a spawned process's perf_counter reads the parent's clock."""
    assert "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    before = time.perf_counter()
    proc = ctx.Process(target=_child_clock, args=(queue,))
    proc.start()
    child = queue.get(timeout=60)
    proc.join(10)
    assert before < child < time.perf_counter()


def test_client_process_count(monkeypatch):
    from flashlet.bench import remote

    monkeypatch.setattr(remote, "usable_cpus", lambda: 16)
    assert client_procs(None, 1) == 1 and client_procs(None, 32) == 1
    assert client_procs(None, 64) == 2 and client_procs(None, 256) == 8
    monkeypatch.setattr(remote, "usable_cpus", lambda: 4)
    assert client_procs(None, 256) == 2  # half the CPUs: the server shares the host
    monkeypatch.setattr(remote, "usable_cpus", lambda: 1)
    assert client_procs(None, 256) == 1
    assert client_procs(3, 2) == 2 and client_procs(3, 16) == 3  # at most one per stream
    assert split(7, 3) == [3, 2, 2] and sum(split(256, 6)) == 256


def test_events_split_across_reads_and_several_tokens_per_event():
    ev = _Events()
    ev.feed(1.0, b'data: {"text": "a"}\n\ndata: {"te')
    ev.feed(2.0, b'xt": "bc", "num_tokens": 2}\n\n')
    ev.feed(3.0, b'data: {"text": "", "finish_reason": "length", "usage": '
                 b'{"completion_tokens": 3, "prompt_tokens": 4}, "ttft_ms": 9.5}\n\ndata: [DONE]\n\n')
    assert ev.times == [1.0, 2.0, 2.0] and ev.events == 2 and ev.done
    assert ev.usage == {"completion_tokens": 3, "prompt_tokens": 4} and ev.server_ttft == 9.5
    with pytest.raises(RuntimeError, match="overloaded"):
        _Events().feed(1.0, b'data: {"error": "overloaded"}\n\n')


def test_the_connection_is_kept_alive_between_requests():
    """One connection serves request after request (a closed connection would land the next
    request on any API process, and pay a connect in its TTFT)."""
    import asyncio

    from flashlet.bench.sse import Connection

    async def main():
        async def handle(reader, writer):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
                             b"x-flashlet-api-server: 1\r\n\r\n5\r\nhello\r\n0\r\n\r\n")

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn, pieces, writers = Connection(f"http://127.0.0.1:{port}"), [], set()
        for _ in range(3):
            await conn.post_stream("/generate_stream", b"{}", lambda t, p: pieces.append(p))
            writers.add(id(conn._writer))
        assert conn.usable and len(writers) == 1 and conn.api_server == "1"
        assert b"".join(pieces) == b"hello" * 3
        conn.close()
        server.close()

    asyncio.run(main())


def test_a_client_process_imports_no_torch():
    """A spawned client process imports flashlet.bench.remote (its target) and nothing of the
    engine: it starts in well under a second, not the several of a torch import."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, flashlet.bench.remote; "
            "heavy = [m for m in ('torch', 'flashlet.core.engine', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   cwd=Path(__file__).resolve().parents[2])


def test_client_processes_yield_the_cpu_to_the_server():
    """The spawned client processes run at a lower priority than the bench (CLIENT_NICENESS),
    from their start (os.nice is their first step; the loop waits for it, 60 s at most)."""
    import os
    import time

    from flashlet.bench.remote import CLIENT_NICENESS, ClientPool

    ours = os.getpriority(os.PRIO_PROCESS, 0)
    with ClientPool(1) as pool:
        pid, deadline = pool.procs[0].pid, time.monotonic() + 60
        while os.getpriority(os.PRIO_PROCESS, pid) == ours and time.monotonic() < deadline:
            time.sleep(0.01)
        niceness = os.getpriority(os.PRIO_PROCESS, pid)
    assert niceness == min(ours + CLIENT_NICENESS, 19)


def test_itl_shape_tells_late_deliveries_from_slow_steps():
    """A token delivered late (a long gap, then a short one) against a slow step (a long gap,
    then a usual one); tokens of one read share a time (a 0 gap), as the client records them."""
    from flashlet.bench.trace import Trace

    step = 0.001
    late = [0.0, 1, 2, 3.9, 4.1, 5, 6, 7]  # token 3 late by 0.9 steps, token 4 on time
    slow = [0.0, 1, 2, 4, 5, 6, 7, 8]  # one step took two
    together = [0.0, 1, 2, 3, 3, 4, 5, 6]
    trace = Trace(requested=[8, 8, 8], prompt_lens=[1, 1, 1],
                  token_times=[[t * step for t in times] for times in (late, slow, together)])
    shape = trace.itl_shape()
    assert shape["median_ms"] == pytest.approx(1.0)
    # 21 gaps; long (> 1.5 steps): 1.9 (late), 2 (slow); late: 1.9 then 0.2
    assert shape["long"] == pytest.approx(2 / 21) and shape["late"] == pytest.approx(1 / 21)
    assert trace.metrics()["itl_shape"] == shape
    assert Trace(requested=[1], prompt_lens=[1], token_times=[[0.5]]).itl_shape() is None

