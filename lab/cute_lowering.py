"""A CuTe GEMV plan compiled for sm_90a on a machine with no GPU: the DSL traces the plan with
stand-ins (`CuteGemv.stand_in`, as cute_precompile's workers do), lowers it to PTX and a cubin,
and only loading the cubin needs a driver. This script keeps the cubin (the DSL's
CUTE_DSL_KEEP_CUBIN) and reports what cuobjdump reads from it: registers, spills, shared memory,
the SASS instruction count, its global loads by width. So a kernel change is compiled, and its
register cost seen, before any device time is spent on it.

The DSL is not one of this project's CPU dependencies (the CPU suite runs without it). PyPI has
it for this Python; install it apart from the venv and put it on the path:

    .venv/bin/pip install --target /tmp/cutesite nvidia-cutlass-dsl==4.3.5
    export PYTHONPATH=.:/tmp/cutesite:/tmp/cutesite/nvidia_cutlass_dsl/python_packages
    .venv/bin/python lab/cute_lowering.py --config qwen2.5-0.5b --gemv o
    .venv/bin/python lab/cute_lowering.py --config qwen2.5-0.5b --gemv all --rows 1 4

cuobjdump comes with the venv's Triton (triton/backends/nvidia/bin). `--json` prints one JSON
line a plan.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

GEMVS = ("qkv", "o", "gate_up", "down", "qkv_rope", "lm_head")  # scripts/gemv_sweep.py's shape names


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def plans_for(config: str, gemv: str, rows: int, num_sms: int = 132):
    """The fused path's plan of each GEMV asked for at a preset's shape (TUNED_PLANS or the
    heuristic), the shapes as `scripts/gemv_sweep.py` names them (`shapes_for`)."""
    from flashlet.kernels.cute_gemv import plan_gemv

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from gemv_sweep import shapes_for

    shapes = shapes_for(config)
    extra = {"rows": rows} if rows > 1 else {}
    names = GEMVS if gemv == "all" else (gemv,)
    return [(name, plan_gemv(n, k, epilogue, num_sms=num_sms, pdl=True, norm=norm, rope=rope, **extra))
            for name, (n, k, epilogue, norm, rope) in ((name, shapes[name]) for name in names)]


def lower(plan, dump: str) -> dict:
    """`plan` compiled for sm_90a (the DSL dumping into `dump`, emptied first): cuobjdump's counts
    of its cubin."""
    from flashlet.kernels.cute_gemv import CuteGemv

    for f in glob.glob(os.path.join(dump, "*")):
        os.remove(f)
    error = None
    try:
        CuteGemv.stand_in(plan)._compile_now(None)
    except Exception as e:  # noqa: BLE001  (no driver: the load after the cubin fails)
        error = e
    cubins = glob.glob(os.path.join(dump, "*.cubin"))
    if not cubins:
        raise RuntimeError(f"no cubin for {plan.describe()}: {error}") from error
    ptx = Path(glob.glob(os.path.join(dump, "*.ptx"))[0]).read_text()
    usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubins[0]],
                           capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([_tool("cuobjdump"), "-sass", cubins[0]], capture_output=True, text=True,
                          check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    loads = {w: sum(f"LDG.E.{w}" in ln for ln in lines) for w in ("128", "64")}
    loads["32"] = sum(bool(re.search(r"LDG\.E(\.CONSTANT)?\s", ln)) for ln in lines)
    return dict(plan=plan.describe(), registers=int(regs.group(1)) if regs else None,
                stack=int(stack.group(1)) if stack else None, shared=int(shared.group(1)) if shared else None,
                sass=len(lines), ldg=loads, pdl_wait="griddepcontrol.wait" in ptx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="qwen2.5-0.5b")
    ap.add_argument("--gemv", default="o", choices=(*GEMVS, "all"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="cute_lowering_")
    # read once, when the DSL is imported: set before cute_available imports it
    os.environ.update(CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=dump,
                      CUTE_DSL_ARCH="sm_90a")
    logging.disable(logging.ERROR)  # the DSL logs the driver's absence at every load, at length
    from flashlet.kernels.cute_gemv import cute_available

    ok, why = cute_available()
    if not ok:
        print(f"needs the CuTe DSL on the path (see this script's docstring): {why}", file=sys.stderr)
        return 2
    for rows in args.rows:
        for name, plan in plans_for(args.config, args.gemv, rows):
            try:
                r = dict(config=args.config, gemv=name, rows=rows, **lower(plan, dump))
            except RuntimeError as e:  # a register-capped plan: the DSL asks the GPU for its carveout
                print(f"{args.config} {name:8s} rows {rows:2d}  {plan.describe():28s} not lowered here "
                      f"({'min_ctas: the DSL reads the GPU' if plan.min_ctas else str(e)[:120]})")
                continue
            if args.json:
                print(json.dumps(r))
            else:
                print(f"{args.config} {name:8s} rows {rows:2d}  {r['plan']:28s} regs {r['registers']} "
                      f"stack {r['stack']} smem {r['shared']}  sass {r['sass']}  ldg {r['ldg']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
