"""How much host time one stream's step loop can take before the host paces it (issue 32: the
server's core loop adds its send and receive, ~48 us a step, to what in-process runs).

    PYTHONPATH=.:$CUTE python3 lab/host_slack.py [--config qwen2.5-0.5b] [--extra-us 0 10 20 40 80]
        [--wake-peer]     (also: after each step, one frame to a process asleep on a socket)

One request decodes `--tokens` tokens through `Engine.step()`, as the server's engine core
drives it; after each step the loop spins for EXTRA us (a stand-in for the core's send and
receive, on the same thread, holding the GIL as they do). Each EXTRA runs `--rounds` times,
interleaved. Where ms a token stays flat as EXTRA grows, the device paces the loop and the
host has that much slack; where it grows by EXTRA, the host paces it.

--wake-peer adds rows where each step instead sends a small frame over a Unix socket to a child
process blocked reading it (as the core's step message wakes an API process's event loop) and
polls a second socket (as the core reads its inbox): whether the wake-up, not the CPU time,
costs the loop (it did not show in the busy-wait rows while the server read ~20 us a token more).
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
                        peer: Peer | None = None) -> float:
    engine.add_request(prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
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
    args = p.parse_args()
    peer = Peer() if args.wake_peer else None  # forked before CUDA starts in this process
    engine = Engine(EngineConfig(config=args.config, dtype=args.dtype, max_num_pages=4096))
    vocab = engine.model_config.vocab_size
    prompt = [(i * 7919 + 43) % vocab for i in range(32)]
    decode_ms_per_token(engine, prompt, 64, 0.0)  # warm
    rows = [(x, None) for x in args.extra_us] + ([("peer", peer)] if peer else [])
    times: dict = {x: [] for x, _ in rows}
    for _ in range(args.rounds):
        for x, with_peer in rows:
            extra = 0.0 if x == "peer" else x / 1e6
            times[x].append(decode_ms_per_token(engine, prompt, args.tokens, extra, with_peer))
    if peer is not None:
        peer.close()
    base = statistics.median(times[args.extra_us[0]])
    print(f"{args.config}, fused path: {engine.runner.fused is not None}; {args.tokens} tokens, "
          f"{args.rounds} rounds; median ms a token")
    print("| extra host us a step | ms a token | rounds | added us a token |")
    print("|---:|---:|---|---:|")
    for x, _ in rows:
        med = statistics.median(times[x])
        label = "wake a peer (send + poll)" if x == "peer" else f"{x:g}"
        print(f"| {label} | {med:.4f} | {' '.join(f'{t:.4f}' for t in times[x])} | "
              f"{(med - base) * 1000:+.1f} |")
    print(json.dumps({str(x): t for x, t in times.items()}))


if __name__ == "__main__":
    main()
