"""The fused path with its O GEMV launched in plain stream order (no PDL), everything else as
the engine builds it: does the one-row attention's span in the step shrink when the kernels
after it (O, then gate+up, then down) no longer start during it and stream their weights beside
its dependent loads? (FUSED_NOTES.md, "Session 66".) O without PDL starts only once the attention
grid has finished, and gate+up, which waits for O's CTAs to signal, only once O has: the price
is their launches and gate+up's early weight loads.

    python3 lab/o_plain_launch.py pair o-plain --config qwen2.5-1.5b --prompt-len 1000
    python3 lab/o_plain_launch.py profile --backend triton --fused-decode --fused-parts default \\
        --config qwen2.5-1.5b --prompt-len 1000 --timeline
    python3 lab/o_plain_launch.py --config qwen2.5-1.5b --dtype bfloat16 --workload single    # the harness
"""

from __future__ import annotations

import dataclasses
import os
import sys

from flashlet.kernels.cute_gemv import CuteGemv
from flashlet.runner import fused_decode


def patch_o_plain() -> None:
    """FusedDecode's GEMVs built as before, then O set up again from its own plan with PDL off
    (the same knobs: planned anew, pdl=False would miss the tuned table's PDL entries)."""
    build = fused_decode.FusedDecode._build_gemvs

    def build_o_plain(self, m, device):
        gemvs = build(self, m, device)
        plain = CuteGemv.__new__(CuteGemv)  # the same plan (its knobs, tuned or not), PDL off
        plain._setup(device, dataclasses.replace(gemvs.o.plan, pdl=False, late_g=False))
        return dataclasses.replace(gemvs, o=plain)

    fused_decode.FusedDecode._build_gemvs = build_o_plain


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    patch_o_plain()
    print("the O GEMV launches without PDL", file=sys.stderr)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lab/, whatever the cwd
    from one_stream_pair import run_patched

    run_patched(sys.argv[1:])
