"""Host time of `StepBuffers.load` per step (the layout into the step buffers, its upload
queued, fed rows written): a 1-row and a 128-row decode padded to their graph sizes, every row
fed as under overlap, and a mixed step (decodes beside a prefill chunk).

    python lab/bench_step_load.py                # CUDA if present (pinned staging), else CPU
    python lab/bench_step_load.py --device cpu

On CUDA the time includes queuing the host-to-device copies (not their transfer: the device is
synchronized between repeats, outside the timing).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from flashlet.core.request import PLACEHOLDER
from flashlet.runner.batch import StepBuffers, StepRow, build_layout

PAGE_SIZE = 16
MAX_PAGES_PER_SEQ = 256


def decode_rows(num_seqs: int, rng: random.Random) -> list[StepRow]:
    """Decodes at contexts of 100-2000 tokens, each taking the previous step's token."""
    rows = []
    for b in range(num_seqs):
        start = rng.randrange(100, 2000)
        pages = list(range(b * MAX_PAGES_PER_SEQ, (b + 1) * MAX_PAGES_PER_SEQ))
        rows.append(StepRow([PLACEHOLDER], start, pages, True, b))
    return rows


def scenarios(rng: random.Random) -> dict[str, tuple]:
    """name -> (layout, pad_to)."""
    mixed = decode_rows(32, rng) + [StepRow(list(range(1, 513)), 0, list(range(9000, 9032)))]
    return {"decode-1": (build_layout(decode_rows(1, rng), PAGE_SIZE), 1),
            "decode-128": (build_layout(decode_rows(128, rng), PAGE_SIZE), 128),
            "decode-100-padded-128": (build_layout(decode_rows(100, rng), PAGE_SIZE), 128),
            "mixed-32+512": (build_layout(mixed, PAGE_SIZE), None)}


def time_load(buffers: StepBuffers, layout, pad_to, fed, repeats: int) -> float:
    """Median microseconds of one load."""
    sync = torch.cuda.synchronize if buffers.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()  # the staging is free, as ModelRunner.wait_inputs_staged makes it
        t0 = time.perf_counter_ns()
        buffers.load(layout, fed, pad_to=pad_to)
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return times[len(times) // 2] / 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    buffers = StepBuffers(8192, 256, 256 * MAX_PAGES_PER_SEQ, device, scratch_page=0,
                          page_size=PAGE_SIZE)
    fed = torch.arange(256, dtype=torch.int64, device=device)
    results = {}
    for name, (layout, pad_to) in scenarios(random.Random(0)).items():
        time_load(buffers, layout, pad_to, fed, 50)  # warm the view caches
        results[name] = time_load(buffers, layout, pad_to, fed, args.repeats)
        print(f"{name:24s} {results[name]:8.1f} us per load ({device.type})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.type, "us_per_load": results}, f, indent=1)


if __name__ == "__main__":
    main()
