"""The decode attention alone under Nsight Compute (issue 29, long contexts): one row of the
Qwen2.5-0.5B shape after `--kv-len` tokens, the fused path's one-launch form (its derived config,
or a table entry's with --table) and then the two-launch form (split kernel + merge kernel, the
batched table's bucket-1 config), each launched once after a warm-up, for `gpu_run.sh ncu-attn`:

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats --section SourceCounters --import-source yes \\
        --profile-from-start off --export attn -f python3 lab/ncu_attention.py --kv-len 30000
    ncu --import attn.ncu-rep --page details

Why: the one-launch form reads one row's 15 MB of KV a layer at 30,000 tokens in 23-24 us
(~0.6 TB/s) and the two-launch form's best in 12.9 (~1.2 TB/s), against 4.24 TB/s of copy
bandwidth (DECODE_NOTES.md); no timeline has said which stall (DRAM latency with too few bytes in
flight, the page-id -> K/V chain, the merge, the launch) holds them there.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("decode_attn_bench", ROOT / "scripts" / "decode_attn_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-len", type=int, default=30000)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--model", default="qwen2.5-0.5b", help="a shape of decode_attn_bench's one-launch sweep")
    p.add_argument("--table", action="store_true", help="the one-launch form's table entry, not its derived config")
    p.add_argument("--merge-group", type=int, default=0, help="the one-launch form's merge in two levels (merge_group)")
    args = p.parse_args(argv)
    import torch

    sys.path.insert(0, str(ROOT))
    from flashlet.attention.triton_backend import TritonBackend
    from flashlet.kernels import decode_attention as da
    from flashlet.kernels import tuning
    from flashlet.kvcache.kv_pool import KVPool

    bench = _bench()
    (model,) = bench.one_launch_models(args.model)
    device = "cuda"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    case = bench.Case(torch, args.rows, args.kv_len, "model", {**model, "layers": 2}, device)
    one = bench.derived_one_launch_variant(torch, model, args.rows, num_sms, device, pdl=False, table=args.table)
    one = bench.engine_form(replace(one, merge_group=args.merge_group), model)  # Qwen3's: rope_in, as the fused path
    one_launch = bench.make_one_launch_call(da, torch, case, one)
    pool = KVPool(1, 1, model["page_size"], model["num_kv_heads"], model["head_dim"], torch.bfloat16, device,
                  fused_rope=False)
    backend = TritonBackend(pool, model["num_q_heads"], num_sms=num_sms,
                            max_pages_per_seq=-(-args.kv_len // model["page_size"]))
    cfg = backend.decode_config(args.rows)
    splits = backend._splits_for(args.rows, cfg)
    two = bench.Variant(cfg.block_n, cfg.num_warps, cfg.num_stages, splits, prefetch=cfg.prefetch,
                        kv_pack=tuning.kv_pack_for(cfg, model["num_kv_heads"]), merge_in_kernel=cfg.merge_in_kernel)
    two_launch = bench.make_call(da, torch, case, two)
    for fn in (one_launch, two_launch):  # compiled and warm before the profiler opens
        fn(0)
        fn(1)
    torch.cuda.synchronize()
    print(f"one launch: {one}\ntwo launches: {two}", flush=True)
    torch.cuda.profiler.start()
    one_launch(0)
    two_launch(1)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
