"""Engine start time, split into load / warm-up / graph capture, as one JSON line; or a table.

    python scripts/start_time.py --config qwen2.5-0.5b --backend triton --label cold --append start.jsonl
    python scripts/start_time.py --table start.jsonl

Run it once with empty kernel caches (TRITON_CACHE_DIR, FLASHINFER_WORKSPACE_BASE and
FLASHLET_CUTE_CACHE pointed at fresh folders: "cold") and once more with the same folders
("warm"); gpu_run.sh's `start` part does. The line also says how many Triton kernels warm-up
compiled or loaded, with the fused decode path how many CuTe GEMVs it readied, in how long (part
of capture_s) and how many of them came from the disk cache (cute_from_disk) or worker
processes (cute_precompile: when their files came), and, as a
check that warm-up is complete, the time of a first request after start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(args) -> dict:
    t0 = time.perf_counter()
    import torch

    from flashlet import Engine, EngineConfig, SamplingParams
    from flashlet.kernels import cute_disk_cache

    imported = time.perf_counter() - t0
    t1 = time.perf_counter()
    engine = Engine(EngineConfig(config=args.config, backend=args.backend, dtype="bfloat16",
                                 max_num_pages=args.max_num_pages))
    total = time.perf_counter() - t1
    t2 = time.perf_counter()  # one request of 300 + 32 tokens: fast only if nothing compiles now
    engine.add_request(list(range(1, 301)), SamplingParams(max_new_tokens=32, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    first_request = time.perf_counter() - t2
    s = engine.start_report
    return {"label": args.label, "config": args.config, "backend": args.backend,
            "resolved": engine.backend_name, "fused_decode": engine.config.fused_decode,
            "import_s": imported, "start_s": total,
            "load_s": s["load_s"], "warmup_s": s["warmup_s"], "capture_s": s["capture_s"],
            "graphs": s.get("graphs"), "triton_compiles": s.get("triton_compiles"),
            "cute_gemvs": s.get("cute_gemvs"), "cute_compile_s": s.get("cute_compile_s"),
            "cute_from_disk": s.get("cute_from_disk"), "cute_precompile": s.get("cute_precompile"),
            "first_request_s": first_request,
            "triton_cache": os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache"),
            "flashinfer_cache": os.environ.get("FLASHINFER_WORKSPACE_BASE", "~"),
            "cute_cache": str(cute_disk_cache.cache_dir() or "off")}


def table(paths) -> str:
    rows = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    head = ("label", "backend", "start_s", "load_s", "warmup_s", "capture_s", "cute_compile_s", "cute_from_disk",
            "graphs", "triton_compiles", "first_request_s", "cute_workers")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        w = r.get("cute_precompile")  # the workers' files: first and last, s from their start
        r["cute_workers"] = (f"{w['files']}/{w['plans']} in {w['workers']}: {w['first_file_s']:.1f}-"
                             f"{w['last_file_s']:.1f} s" if w and w.get("files") else None)
        cells = [f"{r.get(k):.2f}" if isinstance(r.get(k), float) else "-" if r.get(k) is None
                 else str(r.get(k)) for k in head]  # "-": not measured (no fused path, older lines)
        cells[1] = r["backend"] if r["backend"] == r.get("resolved") else f"{r['backend']} ({r.get('resolved')})"
        cells[1] += " +fused" if r.get("fused_decode") else ""  # the default's CuTe compiles included
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="triton")
    p.add_argument("--label", default="")
    p.add_argument("--max-num-pages", type=int, default=8192)
    p.add_argument("--append", type=Path, help="also append the JSON line to this file")
    p.add_argument("--table", nargs="+", metavar="JSONL", help="print the table of these lines")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    line = json.dumps(measure(args))
    print(line, flush=True)
    if args.append:
        with args.append.open("a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
