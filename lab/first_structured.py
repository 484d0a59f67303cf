"""A fresh server's first requests with a response_format: how long each takes, from a server
started by this script (`python -m flashlet.server`, its default flags plus any given after
`--`), once it says it is ready and `--settle` seconds more. The first such request used to
wait for the engine core's grammar compile worker to start (its imports: seconds on a busy
machine); each core now starts it when it starts (engine_core._start_grammar_worker).

    PYTHONPATH=. python lab/first_structured.py --settle 8 -- --model /path/to/model
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.serve_compare import _free_port, serving  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settle", type=float, default=8.0, help="seconds to wait after ready")
    p.add_argument("--requests", type=int, default=3, help="requests, one after another")
    p.add_argument("--log", default="/tmp/first_structured_server.log", help="the server's log")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: server flags")
    args = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "flashlet.server", "--port", str(port),
               *(a for a in args.server_args if a != "--")]
    with serving(command, url, Path(args.log), timeout=600):
        time.sleep(args.settle)
        for i in range(args.requests):
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_object"}})
            print(f"request {i + 1}: HTTP {r.status_code}, {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
