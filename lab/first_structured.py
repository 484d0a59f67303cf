"""A fresh server's first requests with a response_format: how long each takes, from a server
started by this script (`python -m flashlet.server`, its default flags plus any given after
`--`), once it says it is ready and `--settle` seconds more. The first such request used to
wait for the engine core's grammar compile worker to start (its imports: seconds on a busy
machine); each core now starts it when it starts (engine_core._start_grammar_worker).

    PYTHONPATH=. python lab/first_structured.py --settle 8 -- --model /path/to/model
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settle", type=float, default=8.0, help="seconds to wait after ready")
    p.add_argument("--requests", type=int, default=3, help="requests, one after another")
    p.add_argument("--log", default="/tmp/first_structured_server.log", help="the server's log")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: server flags")
    args = p.parse_args()
    flags = [a for a in args.server_args if a != "--"]
    port = free_port()
    with open(args.log, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "flashlet.server", "--port", str(port), *flags],
                                  stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: see {args.log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        time.sleep(args.settle)
        for i in range(args.requests):
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_object"}})
            print(f"request {i + 1}: HTTP {r.status_code}, {time.perf_counter() - t0:.3f} s")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
