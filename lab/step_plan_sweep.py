"""One fused GEMV's plans ranked inside the engine's one-row step, not alone.

`scripts/gemv_sweep.py` times each plan in a chain of the same GEMV; the step runs it between
other kernels under PDL, where a plan's grid also decides when the kernel after it finds room on
the SMs. Session 66 (FUSED_NOTES.md) read the gap: Qwen2.5-1.5B's QKV + RoPE winner was 1.05x
alone and +13.6% through `LLM.generate`; TinyLlama's was 1.27x alone and -2.7% in the step. Here
each of the sweep's variants for one GEMV becomes that GEMV's `TUNED_PLANS` entry in a running
engine in turn: the one-row GEMVs are built again, the batch-1 graphs dropped and captured anew,
then the step is timed as `lab/one_stream_pair.py` times it (the graph replayed alone, and one
run of 256 tokens through `LLM.generate` after the cached prompt). --rows M does the same for the
M-row GEMV in M-row steps (M prompts of the same length, tok/s a stream): the closed loop's
4- and 16-stream steps, whose M-row plans were swept alone too (`gpu_run.sh gemv-rows`).
`--gemv attention` ranks the one-launch attention's configs the same way: the tree's (its
`tuning.ONE_LAUNCH_TABLE` entry for the rows bucket, or the derived config) and its neighbours,
one knob moved at a time (splits, smallest split, warps, block, stages, page ids ahead), each
becoming the bucket's table entry in turn; the table entries were swept alone too
(`scripts/decode_attn_bench.py --one-launch`).

    python3 lab/step_plan_sweep.py --config qwen2.5-1.5b --gemv qkv --prompt-len 1000
    python3 lab/step_plan_sweep.py --config tinyllama-1.1b --gemv qkv --variants loop late_g
    python3 lab/step_plan_sweep.py --config qwen2.5-0.5b --gemv gate_up --rows 4
    python3 lab/step_plan_sweep.py --config qwen2.5-0.5b --gemv attention

Prints a row a variant (the tree's plan first, fastest last) and the best one's entry in
TUNED_PLANS' form; --json keeps the rows. One process, one preset: the other GEMVs keep their
plans, so a winner here is a candidate for its A/B (`lab/one_stream_pair.py` in fresh processes,
`gpu_run.sh gemv-preset-ab` with the entry as a FLASHLET_GEMV_PLANS file), not yet an entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "scripts")]

import gemv_sweep  # noqa: E402  (scripts/)
from one_stream_pair import graphs_us, prompts_for, timed_run  # noqa: E402  (lab/)

from flashlet import LLM, SamplingParams  # noqa: E402
from flashlet.kernels import cute_gemv, tuning  # noqa: E402
from flashlet.kernels.decode_attention import one_launch_counters  # noqa: E402

# --gemv -> the one-row Gemvs field (gemv_sweep's shape name: sweep_name)
FIELDS = {"qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down", "lm_head": "lm_argmax"}


def sweep_name(gemv: str, plan) -> str:
    """gemv_sweep's name for the shape: the QKV's is "qkv_rope" where the engine builds it with
    the RoPE epilogue."""
    if gemv == "qkv":
        return "qkv_rope" if plan.rope is not None else "qkv"
    return gemv


def drop_graphs(runner, rows: int) -> None:
    """The batch-`rows` graphs forgotten (the next such step captures its own), with the steady
    replay's hold on the last one: between calls, with no request running."""
    keys = [key for key in runner.graphs if key[0] == rows]
    for key in keys:
        del runner.graphs[key]
        runner._moving_graphs.discard(key)
    runner._moved_on = runner._last_moved = None


def with_entry(llm, gemv: str, key: tuple, knobs: dict | None, rows: int = 1):
    """TUNED_PLANS[key] = knobs (None: no entry), the `rows`-row GEMV built again from it and the
    batch-`rows` graphs dropped -> its plan."""
    if knobs is None:
        cute_gemv.TUNED_PLANS.pop(key, None)
    else:
        cute_gemv.TUNED_PLANS[key] = dict(knobs)
    runner = llm.engine.runner
    fused = runner.fused
    rebuilt = getattr(fused._build_gemvs(rows, runner.device), FIELDS[gemv])
    fused.gemvs[rows] = dataclasses.replace(fused.gemvs[rows], **{FIELDS[gemv]: rebuilt})
    drop_graphs(runner, rows)
    return rebuilt.plan


def attention_key(backend, rows: int) -> tuple:
    """ONE_LAUNCH_TABLE's key for a step of `rows` rows on this backend."""
    return (backend.head_dim, backend.group, tuning.bucket(rows, tuning.ONE_LAUNCH_ROW_BUCKETS))


def with_attention_entry(llm, key: tuple, cfg, rows: int) -> tuple:
    """ONE_LAUNCH_TABLE[key] = cfg (None: no entry), the batch-`rows` graphs dropped -> (config,
    splits) as a step of `rows` rows launches it (with rope_in: its form for that). ValueError
    (the entry undone) where it needs more split scratch or merge counters than the backend
    allocated at start for its tree's table."""
    backend = llm.engine.runner.fused_attention
    before = tuning.ONE_LAUNCH_TABLE.get(key)

    def put(entry):
        if entry is None:
            tuning.ONE_LAUNCH_TABLE.pop(key, None)
        else:
            tuning.ONE_LAUNCH_TABLE[key] = entry

    put(cfg)
    launched, splits = backend.one_launch_config(rows)
    counters = one_launch_counters(rows, backend.num_kv_heads, splits, launched.merge_group)
    if (splits > 1 and rows * splits > backend._mid_o.shape[0]) or counters > backend._merge_counts.numel():
        put(before)
        raise ValueError(f"{splits} splits x {rows} rows need more scratch than the backend allocated")
    drop_graphs(llm.engine.runner, rows)
    if llm.engine.runner.fused.rope_in_attention:  # Qwen3's rows made in the kernel: the form it launches
        launched = backend.rope_in_form(launched)
    return launched, splits


def describe_attention(launched, splits: int) -> str:
    c = launched
    return (f"bn{c.block_n} w{c.num_warps} st{c.num_stages} S{splits} min{c.min_split_tokens}"
            + (f" kv{c.kv_pack}" if c.kv_pack > 1 else "") + (" pages" if c.prefetch_pages else "")
            + (f" mg{c.merge_group}" if c.merge_group else ""))


def attention_variants(cfg, splits: int) -> list[tuple[str, object]]:
    """The tree's config's neighbours, one knob moved at a time (each a ONE_LAUNCH_TABLE entry
    with its split cap given): fewer and more splits, half, twice and four times the smallest
    split (a short row in one or two splits: no merge, or a short one), half and twice the
    warps, half the block; then the block and the smallest split a half and a quarter (warps to
    match, splits the more); a stage less and more, page ids ahead toggled."""
    base = dataclasses.replace(cfg, num_splits=splits, long_from_tokens=0, long_split_tokens=0)
    out = [(f"S{s}", dataclasses.replace(base, num_splits=s))
           for s in (splits // 4, splits // 2, splits * 2) if 1 <= s <= 128]
    out += [(f"min{m}", dataclasses.replace(base, min_split_tokens=m))
            for m in (cfg.min_split_tokens // 2, cfg.min_split_tokens * 2, cfg.min_split_tokens * 4)
            if m >= cfg.block_n]
    out += [(f"w{w}", dataclasses.replace(base, num_warps=w)) for w in (cfg.num_warps // 2, cfg.num_warps * 2)
            if 1 <= w <= 8]
    if cfg.block_n >= 32:
        out += [(f"bn{cfg.block_n // 2}", dataclasses.replace(base, block_n=cfg.block_n // 2))]
    for f in (2, 4):  # smaller blocks and splits, more of them (more programs at work on a short row)
        bn = cfg.block_n // f
        if bn >= 16:
            m = max(bn, cfg.min_split_tokens // f)
            w = max(1, min(cfg.num_warps, 16 * bn // 256))  # a [16, bn] score tile, 8+ values a thread
            s = min(128, splits * f)
            out += [(f"bn{bn} min{m} w{w} S{s}", dataclasses.replace(base, block_n=bn, min_split_tokens=m, num_warps=w,
                                                                     num_splits=s))]
    out += [(f"st{st}", dataclasses.replace(base, num_stages=st)) for st in (cfg.num_stages - 1, cfg.num_stages + 1)
            if 1 <= st <= 4]
    out += [("pages" if not cfg.prefetch_pages else "no pages",
             dataclasses.replace(base, prefetch_pages=not cfg.prefetch_pages))]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen2.5-1.5b", help="a preset (random weights)")
    p.add_argument("--gemv", default="qkv", choices=sorted(FIELDS) + ["attention"],
                   help="a fused GEMV, or the one-launch attention (its table entry's configs)")
    p.add_argument("--prompt-len", type=int, default=1000, help="tokens of the cached prompt")
    p.add_argument("--rows", type=int, default=1,
                   help="steps of M rows (M streams; a row count the path serves): the M-row GEMV, "
                        "the attention's rows bucket")
    p.add_argument("--variants", nargs="*", default=[],
                   help="only the sweep's variants whose label holds one of these (and the default)")
    p.add_argument("--budget-s", type=float, default=300, help="stop starting variants after this long")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    started = time.perf_counter()
    llm = LLM(config=args.config, dtype="bfloat16", max_num_pages=8192)
    fused = llm.engine.runner.fused
    if fused is None:
        raise SystemExit(f"{args.config}: the engine runs per-op here (no fused path to sweep)")
    if args.rows not in fused.row_counts:
        raise SystemExit(f"{args.config}: the fused path serves {fused.row_counts} rows, not {args.rows}")
    if args.gemv == "attention":
        return sweep_attention(llm, args, started)
    plan = getattr(fused.gemvs_for(args.rows), FIELDS[args.gemv]).plan
    if plan.fp8 or (plan.mma and args.rows == 1):
        raise SystemExit("the one-row tensor-core and fp8 plans are not swept here (their own knobs)")
    key = cute_gemv._tuned_key(plan.n_rows, plan.k, plan.epilogue, plan.norm, plan.pdl, args.rows)
    tree_entry = cute_gemv.TUNED_PLANS.get(key)
    gemv_sweep.SHAPES = gemv_sweep.shapes_for(args.config)
    gemv_sweep.VARIANTS_MATCHING[:] = args.variants
    name = sweep_name(args.gemv, plan)
    vocab = llm.engine.model_config.vocab_size
    prompts = prompts_for(args.rows, args.prompt_len, vocab)
    llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # the prompts cached
    print(f"{args.config} {args.gemv} ({name}) key {key}: the tree's entry {tree_entry}", flush=True)

    swept = gemv_sweep.variants(name, plan.pdl, rows=args.rows, mma=plan.mma)
    candidates = [("tree", tree_entry)] + [(label, knobs) for label, knobs in swept]
    rows = time_candidates(llm, args, started, prompts, candidates,
                           lambda knobs: with_entry(llm, args.gemv, key, knobs, args.rows),
                           lambda built: built.describe())
    with_entry(llm, args.gemv, key, tree_entry, args.rows)  # as the tree has it
    report(args, key, rows)


def time_candidates(llm, args, started: float, prompts, candidates, apply, describe) -> list[dict]:
    """Each (label, entry) of `candidates` applied (`apply(entry)` -> what it builds; ValueError:
    not one here) and timed in the step, one row each, until the budget runs out; a candidate that
    builds what an earlier one built is not timed twice."""
    rows, seen = [], set()
    for n, (label, knobs) in enumerate(candidates):
        if time.perf_counter() - started > args.budget_s:
            print(f"budget: {len(candidates) - n} variants not run", flush=True)
            break
        try:
            built = apply(knobs)
        except ValueError as e:  # knobs the engine's own shape refuses (its RoPE pool, say)
            print(f"{label}: not a plan here ({e})", flush=True)
            continue
        if built in seen:
            continue  # the same plan as one timed already (the heuristic's, or the tree's entry)
        seen.add(built)
        llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # compile, capture
        graph = graphs_us(llm.engine.runner, args.rows)
        tok_s, _, _ = timed_run(llm, prompts)
        entry = dataclasses.asdict(knobs) if dataclasses.is_dataclass(knobs) else knobs
        row = {"label": label, "knobs": entry, "plan": describe(built), "graph_us": graph, "tok_s": round(tok_s, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep_attention(llm, args, started: float) -> None:
    """--gemv attention: the one-launch attention's configs for the rows bucket, ranked in the step."""
    backend = llm.engine.runner.fused_attention
    if not getattr(llm.engine.runner.fused, "one_launch_attention", False) or not hasattr(backend, "one_launch_config"):
        raise SystemExit(f"{args.config}: the fused path's attention is not the one-launch kernel here")
    key = attention_key(backend, args.rows)
    tree_entry = tuning.ONE_LAUNCH_TABLE.get(key)
    cfg, splits = backend.one_launch_config(args.rows)
    prompts = prompts_for(args.rows, args.prompt_len, llm.engine.model_config.vocab_size)
    llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # the prompts cached
    print(f"{args.config} attention key {key}: the tree's {'entry' if tree_entry else 'derived config'} "
          f"{describe_attention(cfg, splits)}", flush=True)
    candidates = [("tree", tree_entry)] + [(label, c) for label, c in attention_variants(cfg, splits)
                                           if not args.variants or any(v in label for v in args.variants)]
    rows = time_candidates(llm, args, started, prompts, candidates,
                           lambda entry: with_attention_entry(llm, key, entry, args.rows),
                           lambda built: describe_attention(*built))
    with_attention_entry(llm, key, tree_entry, args.rows)  # as the tree has it
    report(args, key, rows)


def report(args, key: tuple, rows: list[dict]) -> None:
    """The rows, the tree's first and the rest fastest last, the best as an entry; --json keeps them."""
    base = rows[0]["tok_s"]
    print(f"\n{'variant':<28} {'plan':<22} {'tok/s':>8} {'vs tree':>8}  graph us ({args.rows} rows; tok/s a stream)")
    for row in [rows[0]] + sorted(rows[1:], key=lambda r: r["tok_s"]):
        print(f"{row['label']:<28} {row['plan']:<22} {row['tok_s']:>8.1f} {row['tok_s'] / base:>7.3f}x  "
              f"{' '.join(f'{v:.1f}' for v in row['graph_us'].values())}")
    best = max(rows, key=lambda r: r["tok_s"])
    entry = best["knobs"] or {}
    if args.gemv == "attention" and entry:  # a ONE_LAUNCH_TABLE entry
        entry = f"OneLaunchConfig({', '.join(f'{k}={v!r}' for k, v in entry.items())})"
    print(f"best: {best['label']} ({best['tok_s'] / base:.3f}x the tree's plan); as an entry:\n"
          f"    {key}: {entry},  # {args.config} {args.gemv}, in the step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "gemv": args.gemv, "key": list(key), "step_rows": args.rows,
                       "prompt_len": args.prompt_len, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
