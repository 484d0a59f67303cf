"""How much host time one stream's step loop can take before the host paces it (issue 32: the
server's core loop adds its send and receive, ~48 us a step, to what in-process runs).

    PYTHONPATH=.:$CUTE python3 lab/host_slack.py [--config qwen2.5-0.5b] [--extra-us 0 10 20 40 80]
        [--wake-peer]     (also: after each step, one frame to a process asleep on a socket)
        [--streams 1 4 16] (that many requests decoding together; ms a step, and each row
                          count's captured decode graph replayed alone: its device time)

One request decodes `--tokens` tokens through `Engine.step()`, as the server's engine core
drives it; after each step the loop spins for EXTRA us (a stand-in for the core's send and
receive, on the same thread, holding the GIL as they do). Each EXTRA runs `--rounds` times,
interleaved. Where ms a token stays flat as EXTRA grows, the device paces the loop and the
host has that much slack; where it grows by EXTRA, the host paces it.

--wake-peer adds rows where each step instead sends a small frame over a Unix socket to a child
process blocked reading it (as the core's step message wakes an API process's event loop) and
polls a second socket (as the core reads its inbox): whether the wake-up, not the CPU time,
costs the loop (it did not show in the busy-wait rows while the server read ~20 us a token more).

--streams asks the same of 4 and 16 streams (issue 29's closed loop: a 4-row step reads 0.66 ms
against one row's 0.51): where the host paces a row count's steps, its graph replayed alone
reads well under the loop's ms a step and the added host time shows one for one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import select
import socket
import statistics
import time

import torch

from flashlet import Engine, EngineConfig, SamplingParams
from one_stream_pair import graph_us  # lab/ (this script's folder is on the path when run)


def _read_frames(sock: socket.socket) -> None:
    """The peer: block on the socket, read what comes, until it closes."""
    while sock.recv(1 << 16):
        pass


class Peer:
    """A child process asleep on one end of a Unix socket pair; `wake()` sends it a frame the
    size of a one-row step message and polls an idle socket, as the engine core's loop does."""

    def __init__(self):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.inbox, self._inbox_peer = socket.socketpair()
        self.proc = multiprocessing.get_context("fork").Process(target=_read_frames,
                                                                 args=(theirs,), daemon=True)
        self.proc.start()
        theirs.close()
        self.poll = select.poll()
        self.poll.register(self.inbox.fileno(), select.POLLIN)
        self.frame = bytes(230)

    def wake(self) -> None:
        self.sock.send(self.frame)
        self.poll.poll(0)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(timeout=5)


def decode_ms_per_token(engine: Engine, prompt: list[int], tokens: int, extra_s: float,
                        peer: Peer | None = None, streams: int = 1) -> float:
    """ms a decode step (one token of each stream) with `streams` requests in lockstep."""
    for i in range(streams):  # distinct prompts: no prefix shared past the first token
        engine.add_request([prompt[0] + i] + prompt[1:],
                           SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    while engine.step() == []:  # the prefill step (and the first token's)
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if peer is not None:
            peer.wake()
        if extra_s:
            until = time.perf_counter() + extra_s
            while time.perf_counter() < until:
                pass
    return (time.perf_counter() - t0) * 1000 / max(steps, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--extra-us", type=float, nargs="+", default=[0, 10, 20, 40, 80])
    p.add_argument("--wake-peer", action="store_true",
                   help="also rows that wake a sleeping peer process each step (no busy-wait)")
    p.add_argument("--streams", type=int, nargs="+", default=[1],
                   help="requests decoding together (a table for each count)")
    args = p.parse_args()
    peer = Peer() if args.wake_peer else None  # forked before CUDA starts in this process
    engine = Engine(EngineConfig(config=args.config, dtype=args.dtype, max_num_pages=4096))
    vocab = engine.model_config.vocab_size
    prompt = [(i * 7919 + 43) % vocab for i in range(32)]
    for streams in args.streams:
        decode_ms_per_token(engine, prompt, 64, 0.0, streams=streams)  # warm
    rows = [(x, None) for x in args.extra_us] + ([("peer", peer)] if peer else [])
    results = {}
    for streams in args.streams:
        times: dict = {x: [] for x, _ in rows}
        for _ in range(args.rounds):
            for x, with_peer in rows:
                extra = 0.0 if x == "peer" else x / 1e6
                times[x].append(decode_ms_per_token(engine, prompt, args.tokens, extra, with_peer,
                                                    streams))
        base = statistics.median(times[args.extra_us[0]])
        replay = graph_replay_ms(engine, streams)
        print(f"\n{args.config}, {streams} stream(s), fused path: {engine.runner.fused is not None}; "
              f"{args.tokens} tokens, {args.rounds} rounds; median ms a step; the {streams}-row "
              f"decode graph replayed alone: {replay if replay is None else f'{replay:.4f}'} ms")
        print("| extra host us a step | ms a step | rounds | added us a step |")
        print("|---:|---:|---|---:|")
        for x, _ in rows:
            med = statistics.median(times[x])
            label = "wake a peer (send + poll)" if x == "peer" else f"{x:g}"
            print(f"| {label} | {med:.4f} | {' '.join(f'{t:.4f}' for t in times[x])} | "
                  f"{(med - base) * 1000:+.1f} |")
        results[streams] = {"replay_ms": replay, **{str(x): t for x, t in times.items()}}
    if peer is not None:
        peer.close()
    print(json.dumps(results))


def graph_replay_ms(engine: Engine, rows: int, replays: int = 300) -> float | None:
    """The device time of the decode graph captured for `rows` rows (the fused path's token
    graph where it has one), replayed alone on its last step's inputs; None without one."""
    graphs = engine.runner.graphs
    keys = [k for k in graphs if k[0] == rows and k[1] == "tokens"] or \
        [k for k in graphs if k[0] == rows]
    if not keys or not torch.cuda.is_available():
        return None
    return graph_us(graphs[keys[0]][0], replays) / 1000


if __name__ == "__main__":
    main()
