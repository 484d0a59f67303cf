"""The one-launch decode attention lowered for sm_90a by whichever Triton is first on the path,
as the JIT lowers it (16-byte divisibility hints on every pointer and stride), with no GPU:
ptxas's registers and spills, the SASS instruction count and its global loads by width. Run it
under two Tritons to compare what each compiles (issue 29: the GPU machine has 3.6, a user's
install the pinned 3.7.1):

    PYTHONPATH=. python lab/triton_lowering.py                      # the venv's Triton (the pin)
    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:. python lab/triton_lowering.py             # the GPU machine's

Tiles (PDL on, bf16 pool, the merge's constexprs and the look-back as the launcher sets them,
the lean merge as this process has it: on unless $FLASHLET_LEAN_MERGE says otherwise): the 0.5B's
one-row and four-row derived config and its 16-row table entry, Qwen3's one-row and four-row table
entries with the rows made in the kernel (rope_in: one KV head a program on 8 warps, as
`TritonBackend.rope_in_form` launches them), the Qwen2.5-1.5B's derived config. `--json` prints
one JSON line a tile instead of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashlet.kernels import decode_attention as da

# name: (head_dim, group, KV heads, block_n, warps, stages, splits, rope_in, rows)
TILES = {
    "qwen2.5-0.5b 1 row derived (256 x 64, 8 warps, 2 stages, 64 splits)": (64, 7, 2, 256, 8, 2, 64, False, 1),
    "qwen2.5-0.5b 4 rows derived (256 x 64, 8 warps, 2 stages, 64 splits)": (64, 7, 2, 256, 8, 2, 64, False, 4),
    "qwen2.5-0.5b 16 rows entry (256 x 64, 8 warps, 2 stages, 2 splits)": (64, 7, 2, 256, 8, 2, 2, False, 16),
    "qwen3-0.6b 1 row rope_in entry (64 x 128, 8 warps, 3 stages, 32 splits)": (128, 2, 8, 64, 8, 3, 32, True, 1),
    "qwen3-0.6b 4 rows rope_in entry (64 x 128, 8 warps, 2 stages, 8 splits)": (128, 2, 8, 64, 8, 2, 8, True, 4),
    "qwen2.5-1.5b 1 row derived (32 x 128, 4 warps, 3 stages, 64 splits)": (128, 6, 2, 32, 4, 3, 64, False, 1),
}
ROPE_ARGS = ("KNew", "VNew", "Pos", "CosSin", "QW", "KW", "KOut", "VOut")
ROPE_STRIDES = ("stride_knb", "stride_knh", "stride_vnb", "stride_vnh", "stride_cs")


def lower(head_dim, group, kv_heads, block_n, warps, stages, splits, rope_in, rows) -> dict:
    fn = da._one_launch_kernel
    names = fn.arg_names
    sig = {n: "i32" for n in names}
    sig.update(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", MidO="*fp32", MidLse="*fp32", Counts="*i32",
               KvIndptr="*i32", KvIndices="*i32", KvLens="*i32", qk_scale="fp32", v_scale="fp32",
               KNew="*bf16", VNew="*bf16", Pos="*i64", CosSin="*fp32", QW="*bf16", KW="*bf16", KOut="*bf16",
               VOut="*bf16", norm_eps="fp32", k_inv_scale="fp32", v_inv_scale="fp32")
    consts = dict(NUM_Q_HEADS=group * kv_heads, NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=da.group_pad(group),
                  HEAD_DIM=head_dim, PAGE_SIZE=16, BLOCK_N=block_n, NUM_SPLITS=splits,
                  INPUT_PRECISION=None, USE_PDL=True, LOOKBACK=da.one_launch_lookback(rows), STEP_ROWS=da.MAX_LOOKBACK,
                  KV_PACK=1, LONG_RULE=False, ROPE_IN=rope_in, QK_NORM=rope_in, CACHE_FP8=False, PREFETCH_PAGES=False,
                  EARLY_PAGE_BASE=False, MERGE_GROUP=0, **da.one_launch_merge_constexprs(group, 1, head_dim, splits))
    if not rope_in:  # the arguments a launch without rows made in the kernel leaves at their defaults
        consts.update({n: None for n in ROPE_ARGS}, **{n: 0 for n in ROPE_STRIDES})
        consts.update(norm_eps=0.0, k_inv_scale=1.0, v_inv_scale=1.0)
    sig.update({c: "constexpr" for c in consts})
    aligned = [n for n in names if (n.startswith("stride") or n[0].isupper()) and n not in consts]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages, launch_pdl=True))
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
    return dict(registers=int(re.search(r"Used (\d+) registers", info)[1]),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", info)[1]),
                instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M)),
                loads_128=len(re.findall(r"LDG\.E\.128", sass)), loads_64=len(re.findall(r"LDG\.E\.64", sass)),
                loads_32=len(re.findall(r"LDG\.E ", sass)), loads_16=len(re.findall(r"LDG\.E\.U16", sass)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = {name: lower(*tile) for name, tile in TILES.items()}
    if args.json:
        for name, got in rows.items():
            print(json.dumps(dict(triton=triton.__version__, tile=name, **got)))
        return
    print(f"Triton {triton.__version__}, sm_90a")
    print("| tile | registers | spill bytes | SASS instructions | loads 128 / 64 / 32 / 16-bit |")
    print("|---|---:|---:|---:|---|")
    for name, g in rows.items():
        print(f"| {name} | {g['registers']} | {g['spill_bytes']} | {g['instructions']:,} | "
              f"{g['loads_128']} / {g['loads_64']} / {g['loads_32']} / {g['loads_16']} |")


if __name__ == "__main__":
    main()
