"""How long a preset's fused-path GEMVs take to trace and compile on the host, one after another
and in cute_precompile's worker processes (no GPU needed: the plans are traced with stand-ins
for CUTE_DSL_ARCH, sm_90a unless set).

    PYTHONPATH=<the CuTe DSL's dsl_packages>:<its folder>:. python lab/gemv_trace_time.py \\
        [--config qwen2.5-0.5b] [--workers 0 2 8]

The plans are built as FusedDecode builds them for rows 1, 2, 4, 8 and 16 (the QKV GEMV with
the RoPE epilogue over a 64k-page pool, O, gate-up, down, the LM head and its argmax), with
the GPU's SM count given as 132 (the H200's). 0 workers: in this process, one after another.
Each count prints the seconds until every plan's file is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashlet.kernels import cute_precompile  # noqa: E402
from flashlet.kernels.cute_gemv import CuteGemv, RopeShape  # noqa: E402
from flashlet.models.weights import preset_config  # noqa: E402

ROWS = (1, 2, 4, 8, 16)


def plans_of(config: dict, pool_pages: int = 65536, page_size: int = 16) -> list:
    h, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    q, kv, inter, vocab = heads * d, kv_heads * d, config["intermediate_size"], config["vocab_size"]
    rope = RopeShape(d, heads, kv_heads, config["max_position_embeddings"], pool_pages * page_size)
    eps = config.get("rms_norm_eps", 1e-6)
    bias = "bias_rope_kv" if config.get("model_type") == "qwen2" else "rope_kv"
    plans = []
    for m in ROWS:
        head = dict(device="cpu", pdl=True, **({"rows": m} if m > 1 else {}))
        gemv = dict(head, **({"mma": True} if m > 1 else {}))
        normed, head_normed = dict(norm=True, eps=eps, **gemv), dict(norm=True, eps=eps, **head)
        plans += [CuteGemv(q + 2 * kv, h, bias, rope=rope, **normed).plan,
                  CuteGemv(h, q, "residual", **gemv).plan,
                  CuteGemv(2 * inter, h, "silu_mul", **normed).plan,
                  CuteGemv(h, inter, "residual", **gemv).plan,
                  CuteGemv(vocab, h, "none", **head_normed).plan,
                  CuteGemv(vocab, h, "argmax", **head_normed).plan]
    return plans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen2.5-0.5b")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = p.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    plans = plans_of(preset_config(args.config))
    for workers in args.workers:
        folder = Path(tempfile.mkdtemp(prefix="gemv-trace-"))
        t0 = time.perf_counter()
        if workers == 0:
            for i, plan in enumerate(plans):
                compiled = CuteGemv.stand_in(plan)._compile_now(None)
                compiled.export_to_c(str(folder), f"k{i}", function_prefix=f"flashlet_gemv_k{i}")
        else:
            job = cute_precompile.Precompile([(plan, f"k{i}") for i, plan in enumerate(plans)],
                                             folder, os.environ["CUTE_DSL_ARCH"], workers=workers)
            missing = sum(not job.wait(f"k{i}") for i in range(len(plans)))
            job.close()
            assert not missing, f"{missing} plans not compiled"
        print(f"{args.config}: {len(plans)} plans, {workers or 'no'} workers: "
              f"{time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
