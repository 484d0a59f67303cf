"""One engine decode step's kernels under Nsight Compute: each kernel's own time, the DRAM bytes
it moved, its registers, occupancy and the warp stall reasons that dominate it (issue 29: where
a fused step's time goes when each kernel runs alone, without the PDL chain's overlap).

    ncu --clock-control none --target-processes all --profile-from-start off \\
        --graph-profiling node --metrics "$(python3 lab/ncu_step.py metrics)" --export step \\
        python3 lab/ncu_step.py run --config qwen2.5-0.5b --prompt-len 1000
    ncu --import step.ncu-rep --csv --page raw > raw.csv
    python3 lab/ncu_step.py summarize raw.csv

`gpu_run.sh ncu-step` runs both for each of NCU_CASES, then profiles the same step's attention
kernel with source counters (`summarize-source`: the lines of the kernel where its warps stall,
and in the SASS view the samples before and after its PDL wait). `run` starts an engine at default
settings (random weights at the preset's config), decodes `--streams` sequences past a cached
prompt of `--prompt-len` tokens, and opens the profiler (cudaProfilerStart) around exactly one
`Engine.step()` once every sequence is decoding: the kernels of one decode step (its CUDA
graph's nodes, profiled one by one) and nothing else. Under ncu each kernel runs alone and is
replayed for its counters: PDL's overlap of a kernel's start with the one before is gone, so
the sum of the kernels' times is the step as a chain of isolated kernels, against which the
step's real time (printed, measured before the profiler opens) shows what the chain overlaps.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
from collections import defaultdict

COPY_GBPS = 4240.0  # the H200's measured device-to-device copy bandwidth (BENCHMARKS.md)
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "launch__registers_per_thread", "launch__grid_size", "launch__block_size",
           "sm__warps_active.avg.pct_of_peak_sustained_active",
           "smsp__average_warp_latency_per_inst_issued.ratio",
           r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
TO_BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def run(args) -> None:
    import torch

    from flashlet import LLM, SamplingParams

    cuda = torch.cuda.is_available()  # without CUDA it runs the same steps, nothing to profile
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm = LLM(config=args.config, dtype="bfloat16", max_num_pages=args.max_num_pages)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = [[(i * 7919 + 43 + 101 * s) % vocab for i in range(args.prompt_len)] for s in range(args.streams)]
    llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # the prompts cached
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=args.warm_steps + 64, ignore_eos=True))
    for _ in range(args.warm_steps):  # past the prefill: every row decodes
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(16):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - t0) / 16 * 1e3
    if cuda:
        torch.cuda.profiler.start()
    engine.step()
    sync()
    if cuda:
        torch.cuda.profiler.stop()
    while engine.has_unfinished():
        engine.step()
    fused = engine.runner.fused is not None
    print(json.dumps({"ncu_step": args.config, "prompt_len": args.prompt_len, "streams": args.streams,
                      "fused": fused, "step_ms": round(step_ms, 4)}), file=sys.stderr)


def _rows(lines: list[str]) -> tuple[list[dict], dict]:
    """ncu's --csv --page raw: a header row, a units row (its ID cell empty), then one row a
    kernel. Lines before the header (ncu's own messages) are skipped."""
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return [], {}
    reader = list(csv.reader(lines[start:]))
    header, body = reader[0], reader[1:]
    units = {}
    if body and body[0] and body[0][0] == "":
        units, body = dict(zip(header, body[0])), body[1:]
    return [dict(zip(header, r)) for r in body if len(r) == len(header)], units


def _num(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameters."""
    name = re.sub(r"\(.*$", "", name)
    name = re.sub(r"<.*$", "", name)
    return (name.split("::")[-1].split() or ["?"])[-1][:48]  # no return type ("void ...")


def summarize(lines: list[str], out=sys.stdout) -> list[dict]:
    """Each kernel of the step, then the step's totals and each kernel family's."""
    rows, units = _rows(lines)
    kernels = []
    for r in rows:
        us = _num(r.get("gpu__time_duration.sum", ""))
        if us is None:
            continue
        us *= TO_US.get(units.get("gpu__time_duration.sum", "ns"), 1e-3)
        moved = 0.0
        for m in ("dram__bytes_read.sum", "dram__bytes_write.sum"):
            v = _num(r.get(m, ""))
            moved += (v or 0.0) * TO_BYTES.get(units.get(m, "byte"), 1)
        stalls = sorted(((STALL.match(k).group(1), _num(v) or 0.0) for k, v in r.items() if STALL.match(k)),
                        key=lambda kv: -kv[1])
        kernels.append(dict(name=short_name(r.get("Kernel Name", "?")), us=us, mb=moved / 1e6,
                            grid=r.get("launch__grid_size", "?"), block=r.get("launch__block_size", "?"),
                            regs=r.get("launch__registers_per_thread", "?"),
                            occupancy=_num(r.get("sm__warps_active.avg.pct_of_peak_sustained_active", "")),
                            cpi=_num(r.get("smsp__average_warp_latency_per_inst_issued.ratio", "")),
                            stalls=stalls[:3]))
    print(f"{'#':>3} {'kernel':<48} {'grid':>6} {'blk':>4} {'regs':>4} {'us':>8} {'MB':>7} {'x copy':>6} "
          f"{'occ%':>5} {'cyc/inst':>8}  top stalls (warps a issue)", file=out)
    for i, k in enumerate(kernels):
        share = k["mb"] / (k["us"] * COPY_GBPS / 1e3) if k["us"] else 0.0  # MB / (MB a us at copy speed)
        stalls = ", ".join(f"{n} {v:.1f}" for n, v in k["stalls"])
        print(f"{i:>3} {k['name']:<48} {k['grid']:>6} {k['block']:>4} {k['regs']:>4} {k['us']:>8.2f} "
              f"{k['mb']:>7.2f} {share:>6.2f} {k['occupancy'] or 0:>5.1f} {k['cpi'] or 0:>8.1f}  {stalls}", file=out)
    families = defaultdict(lambda: [0, 0.0, 0.0])
    for k in kernels:
        f = families[k["name"]]
        f[0] += 1
        f[1] += k["us"]
        f[2] += k["mb"]
    total_us = sum(k["us"] for k in kernels)
    total_mb = sum(k["mb"] for k in kernels)
    print(f"\nstep as isolated kernels: {len(kernels)} kernels, {total_us:.1f} us, {total_mb:.1f} MB "
          f"(at copy speed {total_mb / COPY_GBPS * 1e3:.1f} us)", file=out)
    print(f"{'kernel':<48} {'n':>4} {'us':>9} {'us each':>8} {'MB':>8} {'x copy':>6}", file=out)
    for name, (n, us, mb) in sorted(families.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<48} {n:>4} {us:>9.1f} {us / n:>8.2f} {mb:>8.1f} "
              f"{mb / (us * COPY_GBPS / 1e3) if us else 0:>6.2f}", file=out)
    return kernels


def summarize_source(lines: list[str], top: int = 25, out=sys.stdout) -> bool:
    """`ncu --import R --page source --csv --print-source cuda` (or `sass`: one row an
    instruction, its address first) -> the source lines with the most warp stall samples (where
    in a kernel its warps wait). Without a column it knows, it prints the report's first lines
    instead, so the next run can be read by eye, and returns False (the command exits 1)."""
    start = next((i for i, line in enumerate(lines) if "Source" in line and line.startswith('"')), None)
    rows = list(csv.reader(lines[start:])) if start is not None else []
    header = rows[0] if rows else []
    source = next((i for i, h in enumerate(header) if h.strip() == "Source"), None)
    samples = next((i for i, h in enumerate(header) if "Sampling" in h and "Not" not in h), None)
    line_no = next((i for i, h in enumerate(header) if h.strip() in ("#", "Line", "# Line", "Line No", "Address", "# Address")), None)
    if source is None or samples is None:
        print("source page not in a known shape; its first lines:", file=out)
        print("\n".join(lines[:40]), file=out)
        return False
    body = [r for r in rows[1:] if len(r) == len(header) and _num(r[samples]) is not None]
    total = sum(_num(r[samples]) for r in body) or 1.0
    print(f"{'line':>6} {'samples':>8} {'share':>6}  source ({header[samples]})", file=out)
    for r in sorted(body, key=lambda r: -_num(r[samples]))[:top]:
        where = r[line_no] if line_no is not None else ""
        print(f"{where:>6} {_num(r[samples]):>8.0f} {_num(r[samples]) / total:>6.1%}  {r[source].strip()[:110]}", file=out)
    # The SASS view of a PDL kernel: its griddepcontrol.wait is ACQBULK. Alone under ncu the
    # wait returns at once, so the samples before it (launch, parameters, work on inputs no
    # earlier kernel writes) are what a PDL chain overlaps with the kernel before.
    wait = next((i for i, r in enumerate(body) if r[source].split()[:1] == ["ACQBULK"]), None)
    if wait is not None:
        before = sum(_num(r[samples]) for r in body[:wait])
        print(f"before the PDL wait (ACQBULK, instruction {wait} of {len(body)}): {before:.0f} of "
              f"{total:.0f} samples ({before / total:.0%}); after it {total - before:.0f}", file=out)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the engine, with the profiler open around one decode step")
    r.add_argument("--config", default="qwen2.5-0.5b", help="a preset (random weights)")
    r.add_argument("--prompt-len", type=int, default=32)
    r.add_argument("--streams", type=int, default=1)
    r.add_argument("--warm-steps", type=int, default=24, help="steps before the profiled one")
    r.add_argument("--max-num-pages", type=int, default=2048,
                   help="the KV pool (kernel replay saves and restores what a kernel may write)")
    s = sub.add_parser("summarize", help="ncu's --csv --page raw output -> a table")
    s.add_argument("csv", nargs="?", default="-")
    src = sub.add_parser("summarize-source", help="ncu's --page source --csv output -> the lines that stall most")
    src.add_argument("csv", nargs="?", default="-")
    sub.add_parser("metrics", help="print the --metrics argument for ncu")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(args)
    elif args.cmd == "metrics":
        print(",".join(METRICS))
    elif args.cmd == "summarize-source":
        text = sys.stdin.read() if args.csv == "-" else open(args.csv).read()
        return 0 if summarize_source(text.splitlines()) else 1
    else:
        text = sys.stdin.read() if args.csv == "-" else open(args.csv).read()
        if not summarize(text.splitlines()):
            print("no kernel rows found (ncu's output above the table, if any, says why)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
