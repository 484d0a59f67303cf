"""ptxas's registers and spills for the one-launch decode kernel with and without rope_in (the
rows made in the kernel), at Qwen3's heads (16 query / 8 KV heads of 128), lowered for sm_90a on
this machine (no GPU: Triton's bundled ptxas; the lowering of tests/kernels/test_kern_decode.py).

    PYTHONPATH=. python lab/rope_in_lowering.py

Each line: (splits, pdl, block_n, warps, head_dim, look-back, pool dtype, rope_in, KV heads a
program), the loads before the PDL wait, ptxas's spill and register lines. The first rows are
Qwen3's ONE_LAUNCH_TABLE entries at 1, 4 and 16 rows; the last the forms rope_in launches
(`TritonBackend.rope_in_form`: one KV head a program, 8 warps at blocks of 8,192+ elements).
"""

import json
import os
import subprocess
import sys

from tests.kernels.test_kern_decode import _LOWER

VARIANTS = [
    (32, True, 64, 4, 128, 0, "*bf16", False, False, 1), (32, True, 64, 4, 128, 0, "*bf16", True, False, 1),
    (8, True, 64, 8, 128, 4, "*bf16", False, False, 2), (8, True, 64, 8, 128, 4, "*bf16", True, False, 2),
    (4, True, 32, 4, 128, 16, "*bf16", False, False, 2), (4, True, 32, 4, 128, 16, "*bf16", True, False, 2),
    (32, True, 64, 8, 128, 0, "*bf16", True, False, 1), (8, True, 64, 8, 128, 4, "*bf16", True, False, 1),
    (4, True, 32, 4, 128, 16, "*bf16", True, False, 1),
]


def main() -> None:
    code = (_LOWER.replace("lookback, kv, rope_in, prefetch):", "lookback, kv, rope_in, prefetch, kv_pack=1):")
            .replace("KV_PACK=1,", "KV_PACK=kv_pack,")
            .replace("NUM_Q_HEADS=14, NUM_KV_HEADS=2, GROUP=7", "NUM_Q_HEADS=16, NUM_KV_HEADS=8, GROUP=2"))
    if code.count("kv_pack") != 2 or "GROUP=2" not in code:
        raise SystemExit("the test's lowering changed shape: update this script")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(VARIANTS)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    for variant, line in zip(VARIANTS, proc.stdout.strip().splitlines()):
        got = json.loads(line)
        info = [x.strip() for x in got["ptxas"].splitlines() if "spill" in x or "registers" in x]
        print(variant, got["loads_before_wait"], " | ".join(info))


if __name__ == "__main__":
    main()
