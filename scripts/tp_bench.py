"""Tensor parallelism on the GPU: TP = 1 against TP = N at a real model shape (random weights).

    python scripts/tp_bench.py run --config qwen2.5-7b --tp 2 --out tp2.json
    python scripts/tp_bench.py report tp1.json tp2.json ...

`run` builds one engine and measures, in this order: greedy tokens of a few random prompts
(with the top-2 logit gap at every position, to tell a near-tie from a bug), single-stream
ms/token, decode-sat tok/s (64 sequences, 300-token prompts), and the collectives' GPU time per
decode step (torch.profiler on rank 0 over captured decode steps: NCCL kernels, all-reduce and
all-gather). `report` pairs the runs of each shape and prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashlet.bench import workloads  # noqa: E402
from flashlet.config import EngineConfig  # noqa: E402
from flashlet.core.engine import Engine  # noqa: E402
from flashlet.core.sampling import SamplingParams  # noqa: E402

NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 64, 32
DECODE_BATCH, DECODE_PROMPT_LEN, DECODE_STEPS = 64, 300, 128
PROFILE_STEPS = 20


def run(a) -> dict:
    # fused_decode=False: TP = 1 on the per-op path that TP = N runs (the fused one-stream path
    # is one GPU's and would make the single-stream figures compare two different paths)
    ecfg = EngineConfig(config=a.config, dtype=a.dtype, backend=a.backend,
                        tensor_parallel_size=a.tp, max_num_seqs=a.decode_batch,
                        max_num_pages=a.max_num_pages, max_num_batched_tokens=2048,
                        cuda_graph=a.cuda_graph, fused_decode=False)
    t0 = time.monotonic()
    engine = Engine(ecfg)
    result = {"config": a.config, "tp": a.tp, "backend": a.backend,
              "load_s": time.monotonic() - t0, "decode_batch": a.decode_batch,
              "decode_prompt_len": a.decode_prompt_len}
    result.update(greedy(engine))
    args = argparse.Namespace(single_prompt_len=32, single_tokens=a.single_tokens, warmup=True,
                              seed=0, bandwidth_mib=256, decode_batch=a.decode_batch,
                              decode_prompt_len=a.decode_prompt_len, decode_tokens=a.decode_steps,
                              max_num_batched_tokens=ecfg.max_num_batched_tokens)
    single = workloads.single(engine, args)
    result["single_ms_per_token"] = single["ms_per_token"]
    result["single_collectives_ms"] = profile_collectives(engine, batch=1)
    sat = workloads.decode_sat(engine, args)
    result["decode_sat_tok_s"] = sat["decode_tok_s"]
    result["decode_sat_ms_per_step"] = sat["ms_per_step"]
    result["decode_collectives_ms"] = profile_collectives(engine, batch=a.decode_batch)
    engine.shutdown()
    return result


def greedy(engine) -> dict:
    """Greedy tokens of fixed random prompts, and the top-2 logit gap behind each token."""
    gen = torch.Generator().manual_seed(1234)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
               for _ in range(NUM_PROMPTS)]
    # logprobs=2: the two most likely tokens' log-probabilities from the raw logits, whose
    # difference is the top-2 logit gap behind each greedy token.
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens, gaps = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
                gaps[out.request_id] = [lp.top[0][1] - lp.top[1][1] for lp in out.logprobs]
    return {"tokens": [tokens[i] for i in ids], "gaps": [gaps[i] for i in ids]}


def profile_collectives(engine, batch: int) -> dict:
    """GPU time of NCCL kernels per decode step on rank 0, over PROFILE_STEPS steps of
    `batch` sequences (captured graphs included)."""
    if engine.tp is None:
        return {"all_reduce_ms": 0.0, "all_gather_ms": 0.0, "step_ms": None}
    from torch.profiler import ProfilerActivity, profile

    ids = [engine.add_request([1 + i, 2, 3, 4],
                              SamplingParams(max_new_tokens=PROFILE_STEPS + 8, ignore_eos=True))
           for i in range(batch)]
    sync = workloads.synchronizer(engine.device)
    for _ in range(4):  # prefill, reach pure decode
        engine.step()
    sync()
    on_gpu = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        t0 = time.monotonic()
        for _ in range(PROFILE_STEPS):
            engine.step()
        sync()
        wall = time.monotonic() - t0
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    reduce_us = gather_us = 0.0
    for ev in prof.key_averages():
        name = ev.key.lower().replace("_", "")
        if "nccl" not in name or "kernel" not in name:  # GPU kernels only, not host-side ops
            continue
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if "allreduce" in name:
            reduce_us += us
        elif "allgather" in name:
            gather_us += us
    return {"all_reduce_ms": reduce_us / PROFILE_STEPS / 1e3,
            "all_gather_ms": gather_us / PROFILE_STEPS / 1e3,
            "step_ms": wall / PROFILE_STEPS * 1e3}


def report(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    by_shape: dict[str, dict[int, dict]] = {}
    for r in runs:
        by_shape.setdefault(r["config"], {})[r["tp"]] = r
    b, p = runs[0]["decode_batch"], runs[0]["decode_prompt_len"]
    print(f"| shape | TP | single ms/token | decode-sat {b}x{p} tok/s | all-reduce ms/step "
          f"(B=1 / B={b}) | all-gather ms/step (B=1 / B={b}) | profiled step ms (B=1 / B={b}) "
          f"| greedy vs TP=1 |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, by_tp in by_shape.items():
        base = by_tp.get(1)
        for tp, r in sorted(by_tp.items()):
            s, d = r["single_collectives_ms"], r["decode_collectives_ms"]
            agree = "reference" if tp == 1 or base is None else compare(base, r)
            steps = (f"{s['step_ms']:.2f} / {d['step_ms']:.2f}" if s["step_ms"] is not None
                     else "-")
            print(f"| {shape} | {tp} | {r['single_ms_per_token']:.2f} | "
                  f"{r['decode_sat_tok_s']:.0f} | {s['all_reduce_ms']:.3f} / "
                  f"{d['all_reduce_ms']:.3f} | {s['all_gather_ms']:.3f} / "
                  f"{d['all_gather_ms']:.3f} | {steps} | {agree} |")
            if tp > 1 and d["all_reduce_ms"] == 0:
                print("\n(no NCCL kernel in the profile: the profiler did not trace the kernels "
                      "inside CUDA graphs; rerun with --no-cuda-graph for eager figures)")
    for shape, by_tp in by_shape.items():
        base = by_tp.get(1)
        for tp, r in sorted(by_tp.items()):
            if tp != 1 and base is not None:
                print(f"\n{shape} TP={tp} vs TP=1, per prompt where the tokens first differ:")
                for line in divergences(base, r):
                    print("  " + line)


def compare(base: dict, other: dict) -> str:
    same = sum(a == b for a, b in zip(base["tokens"], other["tokens"]))
    return f"{same}/{len(base['tokens'])} prompts identical"


def divergences(base: dict, other: dict) -> list[str]:
    """For each prompt whose tokens differ: the first position and both runs' top-2 gaps there
    (a small gap on both sides is a near-tie that bf16 rounding may flip)."""
    lines = []
    for i, (a, b) in enumerate(zip(base["tokens"], other["tokens"])):
        if a == b:
            lines.append(f"prompt {i}: identical ({len(a)} tokens)")
            continue
        k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        g1, g2 = base["gaps"][i][k], other["gaps"][i][k]
        lines.append(f"prompt {i}: first differs at token {k} ({a[k]} vs {b[k]}); top-2 gap "
                     f"there TP=1 {g1:.4f}, TP=N {g2:.4f}; smallest TP=1 gap before it "
                     f"{min(base['gaps'][i][:k + 1]):.4f}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", required=True)
    r.add_argument("--tp", type=int, required=True)
    r.add_argument("--backend", default="triton")
    r.add_argument("--max-num-pages", type=int, default=2048)
    r.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--single-tokens", type=int, default=256)
    r.add_argument("--decode-batch", type=int, default=DECODE_BATCH)
    r.add_argument("--decode-prompt-len", type=int, default=DECODE_PROMPT_LEN)
    r.add_argument("--decode-steps", type=int, default=DECODE_STEPS)
    r.add_argument("--out", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("files", nargs="+")
    a = p.parse_args()
    if a.cmd == "run":
        result = run(a)
        Path(a.out).write_text(json.dumps(result))
        print(json.dumps({k: v for k, v in result.items() if k not in ("tokens", "gaps")}))
    else:
        report(a.files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
