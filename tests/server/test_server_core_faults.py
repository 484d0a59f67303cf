"""Faults between the API process and its engine cores (issue 35): cores that lose their API
process exit within seconds (kill -9 included, busy or idle); a core that stops stepping while
it has work turns /health 503 with the reason, its requests end with an error after a bound,
and it recovers when it steps again; with data parallel, a dead core's requests fail while the
live cores keep serving and /health says "degraded". Tiny random model (token ids in and out).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from server_helpers import REPO, ServerProcess, ServerThread, parse_sse, wait_until

from flashlet import EngineConfig
from flashlet.server import CoreClient, ServerConfig, create_app
from flashlet.server.core_client import _pid_alive

pytestmark = pytest.mark.slow

ORPHAN_EXIT_S = 5  # the bound: cores gone this long after their API process


def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), max_num_pages=128, page_size=16, **kw)


def _core_pids(log: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"engine core \d+ ready \(pid (\d+)\)", log)]


def _assert_gone_within(pids: list[int], seconds: float) -> None:
    wait_until(lambda: not any(_pid_alive(pid) for pid in pids), seconds,
               f"engine cores {pids} to exit", interval=0.1)


def _stream_in_background(url: str, body: dict) -> threading.Event:
    """Start a streaming request; the event is set once its first token arrived."""
    first = threading.Event()

    def run():
        try:
            with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        first.set()
        except httpx.HTTPError:  # the server was killed under it
            pass

    threading.Thread(target=run, daemon=True).start()
    return first


# ---- item 5: orphaned cores ------------------------------------------------------------------
def test_cores_exit_within_seconds_of_a_kill_9_of_the_api_process(tiny_qwen2):
    """Two cores, one busy with a long stream, one idle: both gone within 5 s."""
    p = ServerProcess("--model", str(tiny_qwen2), "--max-num-pages", "128",
                      "--data-parallel-size", "2", "--no-access-log")
    try:
        wait_until(lambda: "serving on" in p.log or p.proc.poll() is not None, 180,
                   "the server to load its model", interval=0.1)
        assert p.proc.poll() is None, p.log
        pids = _core_pids(p.log)
        assert len(pids) == 2, p.log
        body = {"prompt": [3, 4, 5], "max_new_tokens": 400, "ignore_eos": True}
        assert _stream_in_background(p.url, body).wait(60), "no token came"
        p.proc.kill()  # SIGKILL: the API process runs no clean-up at all
        p.proc.wait(10)
        _assert_gone_within(pids, ORPHAN_EXIT_S)
    finally:
        p.kill()


ORPHAN_SCRIPT = textwrap.dedent("""
    import asyncio, sys, threading
    from flashlet import EngineConfig, SamplingParams
    from flashlet.server import CoreClient
    from flashlet.server.engine_loop import RequestStream

    client = CoreClient(EngineConfig(model=sys.argv[1], max_num_pages=128))
    # Started from a thread that then ends: no parent-death signal (it would follow that
    # thread), so only the core's watch on its parent can end it.
    starter = threading.Thread(target=client.start)
    starter.start()
    starter.join()
    assert client.wait_ready(180), client.error

    async def main():
        stream = RequestStream([3, 4, 5], SamplingParams(max_new_tokens=400, ignore_eos=True))
        client.submit(stream)
        await stream.get()  # the core is busy stepping now
        print("pids", *[core.pid for core in client.cores], flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def test_a_busy_core_exits_on_its_parent_watch_alone(tiny_qwen2):
    """The backstop for where the kernel's signal does not apply: the core's own thread sees
    its parent gone, in the middle of its steps."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tiny_qwen2)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids "), line
        pids = [int(pid) for pid in line.split()[1:]]
        assert all(_pid_alive(pid) for pid in pids)
        proc.kill()
        proc.wait(10)
        _assert_gone_within(pids, ORPHAN_EXIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
