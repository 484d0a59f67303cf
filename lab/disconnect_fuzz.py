"""Clients that go away at random points, against a server started by this script (`python -m
flashlet.server`, its default flags plus any given after `--`): rounds of 1-24 concurrent
raw-socket requests (chat, completions, the Responses API; streamed or not; n, best_of,
json_object, prompt_logprobs), each dropped at a random point (mid-body, just after sending,
after some of the answer, after a delay) or read to its end. After each round nothing may be
running or waiting and no KV page held but by the prefix cache (/metrics); an answer read to
its end must be a 200, or a 400 that says why. Exits non-zero on the first round that breaks
either, and names it; prints the server log's tracebacks at the end.

    PYTHONPATH=. python lab/disconnect_fuzz.py --rounds 40 -- --model /path/to/model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.serve_compare import _free_port, serving  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", "again"]
DROPS = ["none", "none", "mid_body", "after_send", "after_bytes", "after_delay"]


def metrics(url: str) -> dict[str, float]:
    """/metrics summed over labels, by name."""
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            key = key.split("{")[0]
            try:
                totals[key] = totals.get(key, 0.0) + float(value)
            except ValueError:
                pass
    return totals


def random_request(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one request of a random kind and shape."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 200)))
    tokens = rng.randint(1, max_tokens)
    stream = rng.random() < 0.6
    kind = rng.choice(["chat", "completions", "responses"])
    if kind == "responses":
        body = {"input": prompt, "max_output_tokens": tokens, "temperature": rng.choice([0, 0.8])}
        return "/v1/responses", {**body, "stream": True} if stream else body
    body = {"max_tokens": tokens, "temperature": rng.choice([0, 0.8]),
            "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    elif rng.random() < 0.2 and kind == "completions" and not stream:
        body["best_of"] = 2
    if rng.random() < 0.2:
        body["response_format"] = {"type": "json_object"}
    if rng.random() < 0.2:
        body["prompt_logprobs"] = 1
    if stream:
        body["stream"] = True
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def one_client(port: int, rng: random.Random, max_tokens: int, statuses: dict) -> None:
    path, body = random_request(rng, max_tokens)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    drop = rng.choice(DROPS)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if drop == "mid_body":
            writer.write(head + data[:rng.randint(0, len(data) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.random() * 0.2)
            return
        writer.write(head + data)
        await writer.drain()
        if drop in ("after_send", "after_delay"):
            await asyncio.sleep(rng.random() * (0.05 if drop == "after_send" else 1.0))
            return
        limit = rng.randint(1, 3000) if drop == "after_bytes" else None
        answer = b""
        while True:
            chunk = await asyncio.wait_for(reader.read(4096), 120)
            if not chunk:
                break
            answer += chunk
            if limit is not None and len(answer) >= limit:
                return
            if _complete(answer):
                break
        status = int(answer.split(b" ", 2)[1])
        statuses[status] = statuses.get(status, 0) + 1
        if status != 200 and not (status == 400 and b'"error"' in answer):
            raise AssertionError(f"{path} {body}: {answer[:500]!r}")
    finally:
        writer.close()


def _complete(answer: bytes) -> bool:
    """Whether a whole HTTP response is in (by its length, or a chunked body's last chunk)."""
    head, sep, rest = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    if b"chunked" in head.lower():
        return rest.endswith(b"0\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return len(rest) >= length


async def one_round(port: int, seed: int, max_tokens: int, statuses: dict) -> None:
    rng = random.Random(seed)
    clients = [one_client(port, random.Random(rng.random()), max_tokens, statuses)
               for _ in range(rng.randint(1, 24))]
    await asyncio.gather(*clients)


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    """The metrics once nothing runs or waits and every used page is the prefix cache's; raises
    with the last reading if that does not come within timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m.get("flashlet_requests_running") == 0 and m.get("flashlet_requests_waiting") == 0
                and m.get("flashlet_kv_pages_used") == m.get("flashlet_kv_pages_cached")):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout:g} s: " + ", ".join(
                f"{k} {m.get(k)}" for k in ("flashlet_requests_running", "flashlet_requests_waiting",
                                            "flashlet_kv_pages_used", "flashlet_kv_pages_cached")))
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=96, help="the most new tokens a request asks")
    p.add_argument("--idle-timeout", type=float, default=20.0, help="seconds a round may take to drain")
    p.add_argument("--log", default="/tmp/disconnect_fuzz_server.log", help="the server's log")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: server flags")
    args = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "flashlet.server", "--port", str(port),
               "--max-tokens-cap", str(args.max_tokens), *(a for a in args.server_args if a != "--")]
    statuses: dict[int, int] = {}
    with serving(command, url, Path(args.log), timeout=600):
        for i in range(args.rounds):
            try:
                asyncio.run(one_round(port, i, args.max_tokens, statuses))
                wait_idle(url, args.idle_timeout)
            except AssertionError as e:
                sys.exit(f"round {i}: {e}")
            if i % 10 == 0:
                print(f"round {i}: answers read to the end by status {statuses}", flush=True)
    tracebacks = Path(args.log).read_text(errors="replace").count("Traceback")
    print(f"{args.rounds} rounds, answers by status {statuses}; the server log's tracebacks: {tracebacks}")
    if tracebacks:
        sys.exit(1)


if __name__ == "__main__":
    main()
