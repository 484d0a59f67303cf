"""The one-launch decode attention (`_one_launch_kernel`) lowered for sm_90a by whichever Triton is
first on the path, as its launcher would launch it, with no GPU: ptxas's registers and spills,
the SASS instruction count and its global loads by width, and the PTX's PDL signal and wait, the
loads issued before the wait, the merge's acq_rel counters and its L1-bypassing loads. Every
pointer and stride gets the 16-byte divisibility the JIT's specialisation gives real pools. The
one owner of this lowering: tests/kernels/test_kern_decode.py runs `--variants` in a child (the
test process interprets its kernels). Run it under two Tritons to compare what each compiles
(issue 29: the GPU machine has 3.6, a user's install the pinned 3.7.1):

    PYTHONPATH=. python lab/triton_lowering.py                      # the venv's Triton (the pin)
    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:. python lab/triton_lowering.py             # the GPU machine's
    PYTHONPATH=. python lab/triton_lowering.py --set rope-in        # Qwen3's tiles, rope_in or not

The default set (PDL on, bf16 pool, the merge's constexprs and the look-back as the launcher sets
them for a plain decode step, none (a Tile's `verify`: a verify step's rows), the lean merge as
this process has it: on unless $FLASHLET_LEAN_MERGE says otherwise): the
0.5B's one-row and four-row derived config and its 16-row table entry, Qwen3's one-row and
four-row table entries with the rows made in the kernel (rope_in: one KV head a program on 8
warps, as `TritonBackend.rope_in_form` launches them), the Qwen2.5-1.5B's derived config.
`--set rope-in`: Qwen3's table entries at 1, 4 and 16 rows without and with rope_in (as the table
has them: KV heads packed), then the forms rope_in launches. `--json` prints one JSON line a
tile instead of the table; `--variants JSON` lowers a list of `Tile` field dicts, a line each
(`"partials": "fp32"` or `"bf16"`: the form that leaves its partials to the O GEMV, as the shapes
that merge in O launch it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashlet.kernels import decode_attention as da


@dataclasses.dataclass(frozen=True)
class Tile:
    """One launch of `_one_launch_kernel`: its shape, config and variant flags. rows: the step's
    rows; verify: rows of a verify step (the look-back compiled in, as `launch_lookback` gives
    it; a plain decode step's rows: none) unless lookback is given; kv: the pool's pointer type;
    lean: a $FLASHLET_LEAN_MERGE value (None: this process's)."""

    head_dim: int
    group: int
    kv_heads: int
    block_n: int
    warps: int
    stages: int
    splits: int
    rows: int = 1
    verify: bool = False
    lookback: int | None = None
    kv: str = "*bf16"
    rope_in: bool = False
    prefetch: bool = False
    merge_group: int = 0
    kv_pack: int = 1
    pdl: bool = True
    lean: str | None = None
    maxnreg: int | None = None  # a register cap (Triton's `maxnreg` option); None: ptxas's choice
    # "fp32" / "bf16": the splits' partials left to the O GEMV (PARTIALS_OUT, the merge in O);
    # None: merged in the kernel. Always passed: a constexpr left out would lower as a runtime argument.
    partials: str | None = None


TILES = {
    "qwen2.5-0.5b 1 row derived (256 x 64, 8 warps, 2 stages, 64 splits)": Tile(64, 7, 2, 256, 8, 2, 64),
    "qwen2.5-0.5b 4 rows derived (256 x 64, 8 warps, 2 stages, 64 splits)": Tile(64, 7, 2, 256, 8, 2, 64, rows=4),
    "qwen2.5-0.5b 16 rows entry (256 x 64, 8 warps, 2 stages, 2 splits)": Tile(64, 7, 2, 256, 8, 2, 2, rows=16),
    "qwen3-0.6b 1 row rope_in entry (64 x 128, 8 warps, 3 stages, 32 splits)":
        Tile(128, 2, 8, 64, 8, 3, 32, rope_in=True),
    "qwen3-0.6b 4 rows rope_in entry (64 x 128, 8 warps, 2 stages, 8 splits)":
        Tile(128, 2, 8, 64, 8, 2, 8, rows=4, rope_in=True),
    "qwen2.5-1.5b 1 row derived (32 x 128, 4 warps, 3 stages, 64 splits)": Tile(128, 6, 2, 32, 4, 3, 64),
}
# Qwen3-0.6B's ONE_LAUNCH_TABLE entries (1 / 4 / 16 rows) as the table has them, each without and
# with rope_in, then the forms rope_in launches (`triton_backend.rope_in_form`: one KV head a
# program, 8 warps at blocks of 8,192+ elements).
QWEN3_ENTRIES = ((1, 64, 4, 3, 32, 1), (4, 64, 8, 2, 8, 2), (16, 32, 4, 3, 4, 2))  # rows, bn, w, st, S, kv


def _rope_in_tiles() -> dict:
    from flashlet.attention.triton_backend import rope_in_form
    from flashlet.kernels.tuning import OneLaunchConfig

    tiles, forms = {}, {}
    for rows, bn, w, st, s, pack in QWEN3_ENTRIES:
        for rope in (False, True):
            tiles[f"qwen3 {rows} rows bn{bn} w{w} st{st} S{s} kv{pack}{' rope_in' if rope else ''}"] = \
                Tile(128, 2, 8, bn, w, st, s, rows=rows, rope_in=rope, kv_pack=pack)
        form = rope_in_form(OneLaunchConfig(block_n=bn, num_warps=w, num_stages=st, num_splits=s, kv_pack=pack), 128)
        forms[f"qwen3 {rows} rows bn{bn} w{form.num_warps} st{st} S{s} kv{form.kv_pack} rope_in"] = \
            Tile(128, 2, 8, bn, form.num_warps, st, s, rows=rows, rope_in=True, kv_pack=form.kv_pack)
    return {**tiles, **forms}


ROPE_IN_TILES = _rope_in_tiles()
SETS = {"default": TILES, "rope-in": ROPE_IN_TILES}
ROPE_ARGS = ("KNew", "VNew", "Pos", "CosSin", "QW", "KW", "KOut", "VOut")
ROPE_STRIDES = ("stride_knb", "stride_knh", "stride_vnb", "stride_vnh", "stride_cs")


def lower(t: Tile) -> dict:
    """`t` compiled for sm_90a: ptxas's and the SASS's counts, and the PTX's."""
    fn = da._one_launch_kernel
    names = fn.arg_names
    mid = "*fp32" if t.splits > 1 else "*bf16"  # one split: the launcher passes out for the unused scratch
    if t.partials:
        mid = "*bf16" if t.partials == "bf16" else "*fp32"
    sig = {n: "i32" for n in names}
    sig.update(Q="*bf16", K=t.kv, V=t.kv, O="*bf16", MidO=mid, MidLse="*fp32" if t.partials else mid, Counts="*i32",
               KvIndptr="*i32", KvIndices="*i32", KvLens="*i32", qk_scale="fp32", v_scale="fp32",
               KNew="*bf16", VNew="*bf16", Pos="*i64", CosSin="*fp32", QW="*bf16", KW="*bf16", KOut=t.kv,
               VOut=t.kv, norm_eps="fp32", k_inv_scale="fp32", v_inv_scale="fp32")
    lean = None if t.lean is None else da.lean_merge_parts(t.lean)
    consts = dict(NUM_Q_HEADS=t.group * t.kv_heads, NUM_KV_HEADS=t.kv_heads, GROUP=t.group,
                  GROUP_PAD=da.group_pad(t.group * t.kv_pack), HEAD_DIM=t.head_dim, PAGE_SIZE=16,
                  BLOCK_N=t.block_n, NUM_SPLITS=t.splits, INPUT_PRECISION=None, USE_PDL=t.pdl,
                  LOOKBACK=da.launch_lookback(t.rows, t.verify, t.pdl, t.rope_in) if t.lookback is None else t.lookback,
                  STEP_ROWS=da.MAX_LOOKBACK, KV_PACK=t.kv_pack, LONG_RULE=False, ROPE_IN=t.rope_in,
                  NEWEST_FIRST=t.rope_in and da.rope_in_newest_first(t.rows), QK_NORM=t.rope_in,
                  CACHE_FP8=t.kv == "*fp8e4nv", PREFETCH_PAGES=t.prefetch, EARLY_PAGE_BASE=False,
                  **da.one_launch_merge_constexprs(t.group, t.kv_pack, t.head_dim, t.splits,
                                                   merge_group=t.merge_group, lean=lean),
                  PARTIALS_OUT=t.partials is not None)
    if not t.rope_in:  # the arguments a launch without rows made in the kernel leaves at their defaults
        consts.update({n: None for n in ROPE_ARGS}, **{n: 0 for n in ROPE_STRIDES})
        consts.update(norm_eps=0.0, k_inv_scale=1.0, v_inv_scale=1.0)
    sig.update({c: "constexpr" for c in consts})
    aligned = [n for n in names if (n.startswith("stride") or n[0].isupper()) and n not in consts]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = dict(num_warps=t.warps, num_stages=t.stages, **({"launch_pdl": True} if t.pdl else {}),
                   **({"maxnreg": t.maxnreg} if t.maxnreg else {}))
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    lines = kernel.asm["ptx"].splitlines()
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    return dict(registers=int(re.search(r"Used (\d+) registers", info)[1]),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", info)[1]),
                instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),  # offsets of 4+ digits
                loads_128=len(re.findall(r"LDG\.E\.128", sass)), loads_64=len(re.findall(r"LDG\.E\.64", sass)),
                loads_32=len(re.findall(r"LDG\.E ", sass)), loads_16=len(re.findall(r"LDG\.E\.U16", sass)),
                launch=sum("griddepcontrol.launch_dependents" in line for line in lines), wait=len(wait),
                loads_before_wait=sum("ld.global" in line for line in lines[: wait[0]]) if wait else 0,
                atom_acq_rel=sum("atom.global.gpu.acq_rel.add" in line for line in lines),
                cg_loads=sum("ld.global.cg" in line for line in lines),
                ptxas=" ".join(line.strip() for line in info.splitlines() if "registers" in line or "spill" in line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=sorted(SETS), default="default", help="which tiles (default: default)")
    ap.add_argument("--json", action="store_true", help="one JSON line a tile, not the table")
    ap.add_argument("--variants", default=None,
                    help="a JSON list of Tile field dicts: lower each, one JSON line of its counts a line")
    args = ap.parse_args()
    if args.variants is not None:
        for fields in json.loads(args.variants):  # one process for all: its imports cost more than a compile
            print(json.dumps(lower(Tile(**fields))), flush=True)
        return
    rows = {name: lower(tile) for name, tile in SETS[args.set].items()}
    if args.json:
        for name, got in rows.items():
            print(json.dumps(dict(triton=triton.__version__, tile=name, **got)))
        return
    print(f"Triton {triton.__version__}, sm_90a")
    print("| tile | registers | spill bytes | SASS instructions | loads 128 / 64 / 32 / 16-bit "
          "| loads before the PDL wait |")
    print("|---|---:|---:|---:|---|---:|")
    for name, g in rows.items():
        print(f"| {name} | {g['registers']} | {g['spill_bytes']} | {g['instructions']:,} | "
              f"{g['loads_128']} / {g['loads_64']} / {g['loads_32']} / {g['loads_16']} | {g['loads_before_wait']} |")


if __name__ == "__main__":
    main()
