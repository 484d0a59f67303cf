"""The one-launch attention's merge in two levels (`merge_group`), the kernel alone (issue 29, long
contexts): one row of a one-launch sweep shape after each `--kv-lens` tokens, the derived config
(its last program merges every partial), the same with each `--groups` size, with page ids carried
ahead too, and the two-launch form (split kernel + merge kernel), each checked against the
reference and timed over the layers as `decode_attn_bench.py` times them (PDL on, as the fused
step launches it), then written as a long entry for an engine A/B:

    PYTHONPATH=. python3 lab/merge_group_ab.py [--model qwen2.5-0.5b] [--kv-lens 8000 30000]
        [--groups 4 8] [--table] [--table-json /tmp/merge-group.json]
    FLASHLET_LEAN_MERGE=1 PYTHONPATH=. python3 lab/merge_group_ab.py ...   (the lean merge: `gpu_run.sh lean-merge`)
    PYTHONPATH=. python3 lab/merge_group_ab.py --smoke      (CPU: the interpreter checks, no times)

Why: at 30,000 tokens the one-launch kernel ran 28.5 us where its SMs were busy ~10 us; the
rest was its last program merging 59 partials alone (Nsight Compute, FUSED_NOTES.md "A
long-context graph for one row"). --table-json writes the best grouped variant (by the geometric
mean over the lengths) as a `[[head_dim, group, 1, "long"], fields]` entry that
`FLASHLET_DECODE_TABLES` loads (`gpu_run.sh merge-group-ab`); --two-launch-json the two-launch
form's one-row entry (BATCHED_DECODE_TABLE's, which long steps at this shape run by default) at
128 splits.
Qwen3's one-launch variants run as the fused path launches them: the rows made in the kernel
(per-head norms, RoPE, the K/V write), in the backend's form for them (one KV head a program, 8
warps at wide blocks; `--rope-in off`: without); the entries written are the configs, which the
engine puts in that form.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_attention import ROOT, _bench  # noqa: E402  (decode_attn_bench.py, loaded by path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b", help="a shape of decode_attn_bench's one-launch sweep")
    p.add_argument("--kv-lens", type=int, nargs="+", default=[8000, 30000])
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8])
    p.add_argument("--table", action="store_true",
                   help="start from the one-row bucket's ONE_LAUNCH_TABLE entry, not the derived config")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--table-json", default=None, help="write the best grouped variant as a long entry here")
    p.add_argument("--two-launch-json", default=None,
                   help="write the two-launch form's one-row entry at the wider split cap here")
    p.add_argument("--rope-in", choices=("auto", "off"), default="auto",
                   help="auto: the one-launch variants as the fused path launches them (Qwen3's with the rows made "
                        "in the kernel, decode_attn_bench.engine_form); off: without. The two-launch rows are "
                        "always without (the engine runs a RoPE kernel before them, not timed here)")
    p.add_argument("--json", default=None, help="write {variant: {kv_len: us}} and the failures here")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny lengths, checked, not timed")
    args = p.parse_args(argv)
    if args.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    sys.path.insert(0, str(ROOT))
    from flashlet.kernels import decode_attention as da
    from flashlet.kernels import tuning

    bench = _bench()
    (model,) = bench.one_launch_models(args.model)
    device = "cpu" if args.smoke else "cuda"
    num_sms = 4 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    lens = [200, 600] if args.smoke else args.kv_lens
    groups = [2] if args.smoke else args.groups
    sweep = bench.Sweep(torch, da, args.smoke, budget_s=1e9, repeats=args.repeats, copy=None)
    derived = bench.derived_one_launch_variant(torch, model, 1, num_sms, device, pdl=not args.smoke,
                                               table=args.table)
    if args.smoke:  # blocks the interpreter runs in seconds, splits enough to group
        derived = replace(derived, block_n=16, num_warps=1, min_split_tokens=16, num_splits=16)
    derived = bench.engine_form(derived, model, args.rope_in)
    base = "table" if args.table else "derived"
    variants = {base: derived}
    for g in groups:
        if g < derived.num_splits:
            variants[f"mg{g}"] = replace(derived, merge_group=g)
            variants[f"mg{g} pages"] = replace(derived, merge_group=g, prefetch_pages=True)
    # The two-launch form's best split tile at 30,000 tokens (DECODE_NOTES: bn64 w2 st3 S128, page ids
    # ahead) in one launch, at twice the default cap (a measured entry may pass it), grouped.
    wide = 16 if args.smoke else 128
    small = bench.OneLaunchVariant(16 if args.smoke else 64, 1 if args.smoke else 2, 3, wide,
                                   16 if args.smoke else 128, pdl=derived.pdl, prefetch_pages=True,
                                   rope_in=derived.rope_in)
    variants[f"bn{small.block_n} S{wide} pages"] = small
    for g in groups + [2 * max(groups)]:
        variants[f"bn{small.block_n} S{wide} mg{g} pages"] = replace(small, merge_group=g)
    times: dict[str, dict[int, float]] = {}
    failed = []
    for n in lens:
        case = bench.Case(torch, 1, n, "model", {**model, "layers": 2 if args.smoke else model["layers"]}, device)
        two = bench.engine_variant(tuning, case, num_sms)  # the two-launch form as the engine launches it
        two_wide = replace(two, num_splits=wide)
        for name, v in [*variants.items(), ("two-launch", two), (f"two-launch S{wide}", two_wide)]:
            row = sweep.measure(case, v)
            if row is None or "error" in row:
                failed.append((name, n, (row or {}).get("error", "out of time")))
                continue
            times.setdefault(name, {})[n] = row.get("us", 1.0)
    lean = ",".join(sorted(da.LEAN_MERGE)) or "off"
    print(f"\n{args.model}, one row, us a layer (PDL {'off: the interpreter' if args.smoke else 'on'}; "
          f"{'the table' if args.table else 'derived'}: {derived.label()}; lean merge {lean}"
          f"{'; one launch with its rows made in the kernel' if derived.rope_in else ''}):")
    print(f"{'variant':<26}" + "".join(f"{n:>10,}" for n in lens))
    for name, t in times.items():
        print(f"{name:<26}" + "".join(f"{t[n]:>10.2f}" if n in t else f"{'-':>10}" for n in lens))
    for name, n, why in failed:
        print(f"FAILED {name} at {n}: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            model=args.model, base=derived.label(), lean_merge=sorted(da.LEAN_MERGE),
            labels={k: v.label() for k, v in [*variants.items(), ("two-launch", two), (f"two-launch S{wide}", two_wide)]},
            us=times, failed=failed), indent=1))
    if args.table_json:
        grouped = [k for k in variants if k != base and len(times.get(k, {})) == len(lens)]
        if not grouped:
            print("no grouped variant ran at every length: no table written")
            return 1
        best = min(grouped, key=lambda k: sum(math.log(times[k][n]) for n in lens))
        entry = [[model["head_dim"], model["num_q_heads"] // model["num_kv_heads"], 1, "long"],
                 asdict(variants[best].config(tuning))]
        Path(args.table_json).write_text(json.dumps([entry], indent=1))
        print(f"the long entry ({best}) written to {args.table_json}")
    if args.two_launch_json:  # the one-row bucket's BATCHED_DECODE_TABLE config, its split cap widened
        group = model["num_q_heads"] // model["num_kv_heads"]
        cfg = tuning.batched_decode_config(model["head_dim"], group, 1, "model")
        entry = [[model["head_dim"], group, "model", 1], asdict(replace(cfg, num_splits=wide))]
        Path(args.two_launch_json).write_text(json.dumps([entry], indent=1))
        print(f"the two-launch form's one-row entry at S{wide} written to {args.two_launch_json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
