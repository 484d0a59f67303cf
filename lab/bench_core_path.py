"""Host cost of the engine-core process's messages, around a tiny model on the CPU: what the
server pays per step and per request beyond the engine's own step (issue 13).

    python lab/bench_core_path.py [--rows 256] [--finished 2] [--logprobs 0]
        [--requests 128] [--rounds 7]

The real EngineCore and CoreClient, joined by real zmq ipc sockets in this one process (no
HTTP, no spawned process), over a tiny random Qwen2 with --rows requests decoding. Four figures
in this thread's CPU time (time.thread_time: on a shared machine the wall clock also counts the
time other processes hold the core; zmq's own I/O thread is not counted), each the median over
--rounds rounds of its mean:
- core send, us per step: EngineCore._step's work on one step's outputs and _send (the step
  message built, encoded and written to the API process's step channel, as the server does;
  `--channel zmq`: queued to zmq, as before that channel). engine.step() is replaced by one
  real step's outputs, --finished of them marked finished (a closed loop of 128-token
  requests at 256 streams finishes two a step), so that only the core's own work is timed.
- api read, us per step: the API process's reader thread on that message (decode, each
  request's output to its stream, one event-loop call) and the event loop handing them out.
- api submit, us per request: CoreClient.submit_group (AddRequests built, encoded, sent), for
  prompts of 32-768 random token ids (as issue 13's load).
- core receive, us per request: EngineCore._receive (decode + engine.add_request).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's flashlet and test helpers
from conftest import save_tiny_model  # noqa: E402

from flashlet import Engine, EngineConfig, SamplingParams  # noqa: E402
from flashlet.server.core_client import CoreClient, CoreProcess  # noqa: E402
from flashlet.server.engine_core import EngineCore, engine_info  # noqa: E402
from flashlet.server.messages import CoreReady  # noqa: E402
from flashlet.server.step_channel import FrameWriter, step_path  # noqa: E402
from flashlet.server.engine_loop import RequestStream  # noqa: E402

VOCAB = 32000  # ids above 256: Python's small-int cache would flatter the decode


def decoding_engine(folder: str, rows: int, logprobs: int | None) -> Engine:
    engine = Engine(EngineConfig(model=folder, backend="torch", max_num_pages=20000,
                                 max_num_seqs=max(rows, 1) + 512))
    params = SamplingParams(max_new_tokens=3000, ignore_eos=True, logprobs=logprobs)
    for b in range(rows):
        engine.add_request([(b * 7 + i) % VOCAB for i in range(100)], params,
                           request_id=10**9 + b)  # not the client's ids
    # A step's token budget (256 on the CPU) takes two or three 100-token prompts: a step
    # taken before all are computed gives far fewer rows than --rows.
    while len(engine.step()) < rows:  # every prompt computed: each request decoding
        pass
    return engine


class Harness:
    """An EngineCore and a CoreClient wired together in this process."""

    def __init__(self, engine: Engine, channel: str = "socket"):
        import zmq

        self.engine = engine
        self.aloop = asyncio.new_event_loop()
        self.client = CoreClient(EngineConfig(device="cpu"))
        ctx = self.client._zmq
        inbox = ctx.socket(zmq.PUSH)  # the client's side, as CoreClient.start binds it
        inbox.bind(self.client._input_addr(0, 0))
        self.client.cores.append(CoreProcess(0, None, inbox, os.getpid()))
        core_in = ctx.socket(zmq.PULL)
        core_in.connect(self.client._input_addr(0, 0))
        core_out = ctx.socket(zmq.PUSH)
        core_out.connect(self.client._output_addr(0))
        self.core = EngineCore(engine, 0, core_in, [core_out], os.getppid())
        self.client._core_ready(CoreReady(0, engine_info(engine), None, os.getpid()))
        if channel == "socket":  # connected as at the API process's first request
            self.core.writers[0] = FrameWriter.connect(step_path(self.client.ipc_dir, 0))
            self.client._accept_cores()
            self.reader = self.client._step_readers[0]

    def step_frame(self) -> bytes:
        """The step message the core just sent, as the API process receives it."""
        if self.core.writers[0] is None:
            return self.client._outbox.recv()
        frames = self.reader.read_frames()
        assert len(frames) == 1, len(frames)
        return frames[0]

    def stream(self, prompt: list[int], params: SamplingParams) -> RequestStream:
        async def make():
            return RequestStream(prompt, params)
        return self.aloop.run_until_complete(make())

    def close(self) -> None:
        for core in self.client.cores:
            core.inbox.close(linger=0)
        self.core.inbox.close(linger=0)
        self.core.outboxes[0].close(linger=0)
        self.core.close_step_channels()
        self.client._close()
        self.aloop.close()


def step_outputs(engine: Engine, finished: int) -> list:
    """One real step's outputs, the first `finished` marked as their request's last."""
    outputs = engine.step()
    for i in range(min(finished, len(outputs))):
        out = outputs[i]
        outputs[i] = dataclasses.replace(out, finished=True, finish_reason="length",
                                         token_ids=[1] * 128, logprobs=out.new_logprobs)
    return outputs


def time_steps(h: Harness, outputs: list, steps: int) -> tuple[float, float]:
    """(core send, api read) in us per step."""
    client, core = h.client, h.core
    streams = {out.request_id: h.stream([1, 2], SamplingParams()) for out in outputs}
    for rid, s in streams.items():
        s.request_id = rid
    h.engine.step = lambda: outputs
    send = read = 0.0
    for _ in range(steps):
        core.unfinished.update(streams)
        client._streams.update(streams)
        client.cores[0].num_in_flight = len(streams)
        t0 = time.thread_time()
        core._send(core._step())
        t1 = time.thread_time()
        frame = h.step_frame()
        t2 = time.thread_time()
        client._handle(client._decoder.decode(frame))
        h.aloop.run_until_complete(asyncio.sleep(0))  # the event loop hands them out
        t3 = time.thread_time()
        send, read = send + t1 - t0, read + t3 - t2
        for s in streams.values():
            s.items.clear()
    del h.engine.step
    return send / steps * 1e6, read / steps * 1e6


def time_requests(h: Harness, prompts: list[list[int]]) -> tuple[float, float]:
    """(api submit, core receive) in us per request."""
    params = SamplingParams(max_new_tokens=128)
    streams = [h.stream(p, params) for p in prompts]
    t0 = time.thread_time()
    for s in streams:
        h.client.submit_group([s])
    t1 = time.thread_time()
    time.sleep(0.05)  # zmq's io thread delivers them all
    t2 = time.thread_time()
    while True:  # read them all, add a step's token budget at a time: until none is left
        h.core._receive(wait=False)
        h.core._add_queued()
        if not h.core.queued_adds:
            break
    t3 = time.thread_time()
    added = sum(s.request_id in h.core.unfinished for s in streams)
    for s in streams:  # untimed: out of the engine and the client again
        h.engine.abort(s.request_id)
        h.core.unfinished.discard(s.request_id)
        h.client._streams.pop(s.request_id, None)
    h.engine.step()
    if h.core.errors:
        raise RuntimeError(f"requests refused: {h.core.errors[0]}")
    assert added == len(prompts), "not every request reached the core"
    n = len(prompts)
    return (t1 - t0) / n * 1e6, (t3 - t2) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="requests decoding")
    ap.add_argument("--finished", type=int, default=2, help="of them finishing in the step")
    ap.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    ap.add_argument("--requests", type=int, default=128, help="requests added per round")
    ap.add_argument("--steps", type=int, default=200, help="steps per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--channel", choices=["socket", "zmq"], default="socket",
                    help="how step messages travel: the step channel (the server's) or zmq")
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = save_tiny_model("qwen2", tempfile.mkdtemp(prefix="tiny-core-"), num_hidden_layers=1,
                             hidden_size=32, intermediate_size=32, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=VOCAB,
                             max_position_embeddings=4096)
    engine = decoding_engine(str(folder), args.rows, args.logprobs)
    h = Harness(engine, args.channel)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(32, 768))]
               for _ in range(args.requests)]
    outputs = step_outputs(engine, args.finished)
    figures = {"core send us/step": [], "api read us/step": [],
               "api submit us/request": [], "core receive us/request": []}
    try:
        for _ in range(args.rounds):
            send, read = time_steps(h, outputs, args.steps)
            submit, receive = time_requests(h, prompts)
            for key, value in zip(figures, (send, read, submit, receive)):
                figures[key].append(value)
    finally:
        h.close()
    print(f"rows={args.rows} finished={args.finished} logprobs={args.logprobs} "
          f"channel={args.channel} "
          f"(prompts 32-768 ids, mean {statistics.mean(map(len, prompts)):.0f})")
    for key, values in figures.items():
        print(f"  {key}: {statistics.median(values):.1f}  "
              f"(rounds: {' '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
