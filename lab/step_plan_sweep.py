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

    python3 lab/step_plan_sweep.py --config qwen2.5-1.5b --gemv qkv --prompt-len 1000
    python3 lab/step_plan_sweep.py --config tinyllama-1.1b --gemv qkv --variants loop late_g
    python3 lab/step_plan_sweep.py --config qwen2.5-0.5b --gemv gate_up --rows 4

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
from one_stream_pair import graphs_us, timed_run  # noqa: E402  (lab/)

from flashlet import LLM, SamplingParams  # noqa: E402
from flashlet.kernels import cute_gemv  # noqa: E402

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


def prompts_for(rows: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """`rows` prompts of prompt_len tokens, no two alike (their pages are their own)."""
    return [[(i * 7919 + 43 + r * 104729) % vocab for i in range(prompt_len)] for r in range(rows)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen2.5-1.5b", help="a preset (random weights)")
    p.add_argument("--gemv", default="qkv", choices=sorted(FIELDS))
    p.add_argument("--prompt-len", type=int, default=1000, help="tokens of the cached prompt")
    p.add_argument("--rows", type=int, default=1, help="the M-row GEMV, timed in M-row steps (a row count the path serves)")
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
    rows, seen = [], set()
    for label, knobs in candidates:
        if time.perf_counter() - started > args.budget_s:
            print(f"budget: {len(candidates) - len(rows)} variants not run", flush=True)
            break
        try:
            built = with_entry(llm, args.gemv, key, knobs, args.rows)
        except ValueError as e:  # knobs the engine's own shape refuses (its RoPE pool, say)
            print(f"{label}: not a plan here ({e})", flush=True)
            continue
        if built in seen:
            continue  # the same plan as one timed already (the heuristic's, or the tree's entry)
        seen.add(built)
        llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # compile, capture
        graph = graphs_us(llm.engine.runner, args.rows)
        tok_s, _, _ = timed_run(llm, prompts)
        row = {"label": label, "knobs": knobs, "plan": built.describe(), "graph_us": graph, "tok_s": round(tok_s, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with_entry(llm, args.gemv, key, tree_entry, args.rows)  # as the tree has it

    base = rows[0]["tok_s"]
    print(f"\n{'variant':<28} {'plan':<22} {'tok/s':>8} {'vs tree':>8}  graph us ({args.rows} rows; tok/s a stream)")
    for row in [rows[0]] + sorted(rows[1:], key=lambda r: r["tok_s"]):
        print(f"{row['label']:<28} {row['plan']:<22} {row['tok_s']:>8.1f} {row['tok_s'] / base:>7.3f}x  "
              f"{' '.join(f'{v:.1f}' for v in row['graph_us'].values())}")
    best = max(rows, key=lambda r: r["tok_s"])
    print(f"best: {best['label']} ({best['tok_s'] / base:.3f}x the tree's plan); as an entry:\n"
          f"    {key}: {best['knobs'] or {}},  # {args.config} {args.gemv}, in the step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "gemv": args.gemv, "key": list(key), "step_rows": args.rows,
                       "prompt_len": args.prompt_len, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
