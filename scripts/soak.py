"""Soak a flashlet server: streams, aborts, disconnects, preemption and structured-output
requests that must be refused (poison and pathological schemas, as OpenAI's response_format and
as vLLM's guided_* / structured_outputs) for a bounded time, then
check that nothing went wrong: no 5xx (as the clients saw it and as /metrics counted it), no
KV page still held by a request once the server is idle, the server's RSS flat.

    python scripts/soak.py --duration 120                       # starts its own server
    python scripts/soak.py --duration 60 -- --config tiny.json  # server flags after --
    python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running server
    python scripts/soak.py --kill-core-at 20 -- --data-parallel-size 2   # a core dies at 20 s

Loopback only: it refuses any other host. Without --url it starts `python -m flashlet.server`
on 127.0.0.1 with a small KV pool (so that requests get preempted), and stops it at the end.
Prompts are token ids (any model, with or without a tokenizer). Exit code 0 when every check
passes; the summary is one JSON object on stdout. With --kill-core-at S (its own server, data
parallel), one engine core is killed S seconds into the load: the requests it held may fail
with "engine core N died" (counted apart, as explained), every other request must still
succeed, and /health must say "degraded" at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DEFAULT_SERVER_ARGS = ["--max-num-pages", "64", "--max-num-seqs", "32"]
GRACE_S = 30.0  # how long requests may run on after the deadline
ACTIONS = ("generate", "stream", "stream_abort", "completion_stream_abort", "disconnect",
           "chat_or_completion", "poison_schema", "pathological_schema", "pathological_guided")
# Structured-output requests the server must refuse with a 400 at once (issue 35): an integer
# bound the core's messages cannot carry, and schemas that would compile for minutes, fetch a
# URL or admit nothing.
POISON_SCHEMA = {"type": "integer", "maximum": 2**70}
PATHOLOGICAL_SCHEMAS = ({"type": "string", "pattern": "^(a|a?)+b$"},
                        {"type": "string", "pattern": "^a{10000}$"},
                        {"enum": [f"v{i}" for i in range(100_000)]},
                        {"$ref": "http://127.0.0.1:9/schema.json"},
                        {"not": {}})
# The same through vLLM's structured-output fields (guided_*, structured_outputs), and more
# choices than a request may list: each a 400 at once too.
PATHOLOGICAL_GUIDED = ({"guided_regex": "^(a|a?)+b$"}, {"guided_regex": "a{10000}"},
                       {"structured_outputs": {"regex": "(x|x?)+"}},
                       {"guided_json": {"$ref": "http://127.0.0.1:9/schema.json"}},
                       {"guided_json": '{"not": {}}'},
                       {"guided_choice": [f"c{i}" for i in range(5000)]})
REFUSAL_S = 30.0  # a refusal slower than this stalled somewhere


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, server_args = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server on loopback (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="its process id, for the RSS check")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--max-requests", type=int, default=20000, help="stop after this many")
    p.add_argument("--concurrency", type=int, default=24, help="clients at once (default 24)")
    p.add_argument("--max-prompt", type=int, default=48, help="longest prompt, in tokens")
    p.add_argument("--max-new", type=int, default=64, help="most new tokens per request")
    p.add_argument("--rss-slack-mib", type=float, default=96.0,
                   help="RSS growth allowed between the end of warm-up and the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-core-at", type=float, default=None, metavar="S",
                   help="kill one engine core S seconds into the load (needs its own server "
                        "with --data-parallel-size >= 2 and one API process)")
    args = p.parse_args(argv)
    args.server_args = server_args or DEFAULT_SERVER_ARGS
    if args.kill_core_at is not None and (args.url or "--data-parallel-size" not in server_args
                                          or "--api-server-count" in server_args):
        p.error("--kill-core-at needs its own server (no --url), --data-parallel-size >= 2 and "
                "one API process")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url must be on loopback ({', '.join(sorted(LOOPBACK))})")
    return args


# ---- the server ------------------------------------------------------------------------------
def start_server(server_args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashlet.server", "--host", "127.0.0.1", "--port", str(port),
         "--no-access-log", "--log-level", "warning", *server_args],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready within 600 s")


def rss_mib(pid: int | None) -> float | None:
    """The resident memory of the server: its process and its children (the engine cores)."""
    if pid is None:
        return None
    total = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1]) / 1024
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in (children.read_text().split() if children.exists() else ()):
        try:
            total += rss_mib(int(child)) or 0.0
        except FileNotFoundError:  # it exited meanwhile
            pass
    return total


def kill_an_engine_core(server_pid: int) -> int:
    """SIGKILL the server's last spawned child (an engine core: with one API process, the
    multiprocessing spawns are the cores); its pid."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    cores = [int(pid) for pid in children
             if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(max(cores), signal.SIGKILL)
    return max(cores)


def metrics(url: str) -> dict[str, float]:
    """Unlabelled samples by name, engine figures summed over the engine cores (label `core`),
    plus `http_5xx`: the 5xx responses the server counted."""
    out: dict[str, float] = {"http_5xx": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("flashlet_http_requests_total{") and re.search(r'status="5\d\d"', name):
            out["http_5xx"] += float(value)
        elif re.fullmatch(r'\w+\{core="\d+"\}', name):
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
        elif "{" not in name:
            out[name] = float(value)
    return out


# ---- the clients -----------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.status: dict[str, int] = {}
        self.actions: dict[str, int] = {}
        self.errors: list[str] = []
        self.requests = 0

    def saw(self, status: int | str) -> None:
        self.status[str(status)] = self.status.get(str(status), 0) + 1

    def saw_response(self, r: httpx.Response) -> None:
        """Its status; a 5xx from an engine core killed on purpose counts as `core_died`."""
        self.saw("core_died" if r.status_code >= 500 and CORE_DIED.search(r.text)
                 else r.status_code)

    def saw_error_event(self, line: str) -> None:
        if CORE_DIED.search(line):
            self.saw("core_died_in_stream")
        else:
            self.errors.append(f"error event: {line[:200]}")


CORE_DIED = re.compile(r"engine core \d+ died")


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, args,
                      tally: Tally) -> None:
    action = rng.choice(ACTIONS)
    tally.actions[action] = tally.actions.get(action, 0) + 1
    prompt = [rng.randrange(2, 250) for _ in range(rng.randint(1, args.max_prompt))]
    new = rng.randint(1, args.max_new)
    body = {"prompt": prompt, "max_new_tokens": new, "ignore_eos": rng.random() < 0.7,
            "temperature": rng.choice([0.0, 0.0, 0.8]), "seed": rng.randrange(1000)}
    if action == "generate":
        r = await client.post(url + "/generate", json=body)
        tally.saw_response(r)
        if r.status_code == 200 and len(r.json()["token_ids"]) > new:
            tally.errors.append(f"more tokens than asked: {r.text[:200]}")
    elif action in ("stream", "stream_abort"):
        stop_after = rng.randint(1, 4) if action == "stream_abort" else None
        async with client.stream("POST", url + "/generate_stream", json=body) as r:
            tally.saw(r.status_code)
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events += 1
                    if "[DONE]" in line or (stop_after is not None and events >= stop_after):
                        break  # leaving the block drops the connection: an abort
                    if '"error"' in line:
                        tally.saw_error_event(line)
    elif action == "completion_stream_abort":
        oai = {"model": args.model_name, "prompt": prompt, "max_tokens": new, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=oai) as r:
            tally.saw(r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
    elif action == "disconnect":  # gone before the answer
        try:
            r = await client.post(url + "/generate", json={**body, "max_new_tokens": args.max_new,
                                                           "ignore_eos": True},
                                  timeout=rng.uniform(0.05, 0.5))
            tally.saw_response(r)
        except httpx.TimeoutException:
            tally.saw("client_timeout")
    elif action in ("poison_schema", "pathological_schema", "pathological_guided"):
        if action == "pathological_guided":
            constraint = rng.choice(PATHOLOGICAL_GUIDED)
        else:
            schema = POISON_SCHEMA if action == "poison_schema" else rng.choice(PATHOLOGICAL_SCHEMAS)
            constraint = {"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "soak", "schema": schema}}}
        t0 = time.monotonic()
        r = await client.post(url + "/v1/completions", json={
            "model": args.model_name, "prompt": prompt, "max_tokens": new,
            "n": rng.choice([1, 16]), **constraint})
        tally.saw_response(r)
        if r.status_code != 400 and not CORE_DIED.search(r.text):  # a killed core's: explained
            tally.errors.append(f"{action} answered {r.status_code}: {r.text[:200]}")
        if time.monotonic() - t0 > REFUSAL_S:
            tally.errors.append(f"{action} refused after {time.monotonic() - t0:.1f} s")
    else:
        r = await client.post(url + "/v1/completions", json={
            "model": args.model_name if rng.random() < 0.9 else "no-such-model",  # 404s too
            "prompt": prompt, "max_tokens": new})
        tally.saw_response(r)


async def client_loop(url: str, deadline: float, args, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=300) as client:
        while time.monotonic() < deadline and tally.requests < args.max_requests:
            tally.requests += 1
            try:
                await one_request(client, url, rng, args, tally)
            except httpx.HTTPError as e:
                tally.errors.append(f"{type(e).__name__}: {e}")


async def load(url: str, seconds: float, args, tally: Tally, seed: int) -> None:
    """Clients start requests until the deadline; what still runs GRACE_S after it is cut
    off (the client disconnects: one more abort for the server to clean up)."""
    deadline = time.monotonic() + seconds
    clients = asyncio.gather(*(client_loop(url, deadline, args, tally, seed * 1000 + i)
                               for i in range(args.concurrency)))
    try:
        await asyncio.wait_for(clients, seconds + GRACE_S)
    except TimeoutError:
        tally.saw("cut_at_deadline")


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m.get("flashlet_requests_running", 1) == m.get("flashlet_requests_waiting", 1) == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def soak(args) -> dict:
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = start_server(args.server_args)
        pid = proc.pid
    try:
        args.model_name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        # 5xx from before the soak do not count: /health answers 503 while the model loads.
        five_xx_before = metrics(url)["http_5xx"]
        warm_s = max(2.0, args.duration * 0.2)
        tally = Tally()
        asyncio.run(load(url, warm_s, args, tally, args.seed))  # caches, pools, allocator
        wait_idle(url)
        rss_warm = rss_mib(pid)
        t0 = time.monotonic()
        killer = None
        if args.kill_core_at is not None:
            killer = threading.Timer(args.kill_core_at, kill_an_engine_core, (pid,))
            killer.start()
        asyncio.run(load(url, args.duration - warm_s, args, tally, args.seed + 1))
        if killer is not None:
            killer.join()
        m = wait_idle(url)
        rss_end = rss_mib(pid)
        leaked = m.get("flashlet_kv_pages_used", -1) - m.get("flashlet_kv_pages_cached", 0)
        five_xx = sum(n for s, n in tally.status.items() if s.startswith("5"))
        # A killed core's 500s, and those of requests whose clients left before the answer.
        explained = tally.status.get("core_died", 0) + tally.status.get("client_timeout", 0)
        server_5xx = m["http_5xx"] - five_xx_before
        checks = {
            "no 5xx seen by clients": five_xx == 0,
            "no 5xx counted by the server": server_5xx == 0 if args.kill_core_at is None
            else server_5xx <= explained,
            "no client errors": not tally.errors,
            "idle at the end": m.get("flashlet_requests_running") == 0
            and m.get("flashlet_requests_waiting") == 0,
            "no leaked KV pages": leaked == 0,
            "RSS flat": rss_warm is None or rss_end - rss_warm <= max(args.rss_slack_mib,
                                                                      0.1 * rss_warm),
        }
        if args.kill_core_at is not None:
            checks["degraded, not down, after the kill"] = httpx.get(
                url + "/health", timeout=30).json().get("status") == "degraded"
        return {"ok": all(checks.values()), "checks": checks, "requests": tally.requests,
                "status": tally.status, "actions": tally.actions, "errors": tally.errors[:10],
                "preemptions": m.get("flashlet_preemptions_total", 0.0),
                "kv_pages_leaked": leaked, "rss_mib_after_warmup": rss_warm,
                "rss_mib_end": rss_end, "seconds": round(time.monotonic() - t0 + warm_s, 1),
                "url": url}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv=None) -> int:
    args = parse_args(argv)
    result = soak(args)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
