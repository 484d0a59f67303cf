"""Single-stream decode with and without the fused decode path, one table.

    python scripts/fused_decode_bench.py [--config qwen2.5-0.5b] [--json OUT]

Two paths: per-op (`--no-fused-decode`) and the default (no flag: the fused path where it
applies, each of its parts on where it applies; the figures say what ran).
Two figures a path, each in a fresh process (triton attention backend, bf16, random weights at
the preset's shape, CUDA graphs; no FlashInfer needed):
  harness  `python -m flashlet.bench --workload single` (256 tokens after a 32-token prompt):
           decode tok/s between the first and the last token
  generate `LLM.generate` of one 32-token prompt, 256 new tokens, greedy, the first call after
           the engine starts (its warm-up has compiled and captured everything): 256 / seconds,
           and a second call's figure beside it
and whether the two paths' generated tokens agree (they may part at a near tie: the fused path
rounds differently; tests/gpu/test_gpu_fused_decode.py checks it teacher-forced). Where a fused
path parts from per-op at token i, both have decoded the same tokens 0..i-1, so per-op's top-2
logit gap at step i says whether it is a near tie: the per-op child records every step's gap in
a third, untimed call (an observer), and the table prints it beside the tie limit
(0.05 + 1% of the top logit: a few bf16 ulps at these magnitudes).

    python scripts/fused_decode_bench.py --streams 1 4 16 [--paths default] [--new-tokens 128]

instead times N streams through `LLM.generate` (issue 29's closed loop, through the public
API): one call of N distinct 32-token prompts, 128 new tokens each (greedy, ignore_eos), so
every stream decodes for the whole call as a closed loop's clients do; each N's first call and
a second with fresh prompts, in one fresh process per path. Per-stream tok/s is 128 / seconds
of the call (its prefill included); the table gives it against N = 1's. A third call of fresh
prompts asks for one token (its prefill alone): N x 127 / (second - third) seconds is the
decode rate, the LLM.generate twin of decode-sat's end-to-end figure, e.g.

    python scripts/fused_decode_bench.py --streams 128 --paths default --prompt-len 2000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_LEN, NEW_TOKENS = 32, 256
NEAR_TIE_ABS, NEAR_TIE_REL = 0.05, 0.01  # a display rule: 0.05 + 1% of the top logit (a few bf16 ulps)


PATHS = {"per-op": ["--no-fused-decode"], "default": []}  # path -> its engine flags


def fused_settings(flags: list[str]) -> dict:
    """The EngineConfig fields the path's flags set (none: the engine's default), and the KV
    cache's dtype where `--kv-cache-dtype` is among them."""
    settings = {"fused_decode": False} if "--no-fused-decode" in flags else {}
    if "--kv-cache-dtype" in flags:
        settings["kv_cache_dtype"] = flags[flags.index("--kv-cache-dtype") + 1]
    return settings


def harness(config: str, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "single.json"
        cmd = [sys.executable, "-m", "flashlet.bench", "--config", config, "--dtype", "bfloat16",
               "--backend", "triton", "--workload", "single", "--max-num-pages", "8192", "--quiet",
               "--out", str(out)] + flags
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stdout + proc.stderr)[-3000:]}
        record = json.loads(out.read_text())
        res, engine = record["backends"]["triton"], record["engines"]["triton"]
        return {"decode_tok_s": res.get("decode_tok_s"), "ms_per_token": res.get("ms_per_token"),
                "fraction_of_bandwidth_limit": res.get("fraction_of_bandwidth_limit"),
                "ran": {"fused_decode": engine.get("fused_decode")}, "error": res.get("error")}


def started_llm(config: str, flags: list[str], max_num_pages: int):
    """(the path's LLM at the preset's shape: triton backend, bf16; its start-up seconds)."""
    from flashlet import LLM

    t0 = time.perf_counter()
    llm = LLM(config=config, backend="triton", dtype="bfloat16", max_num_pages=max_num_pages,
              **fused_settings(flags))
    return llm, time.perf_counter() - t0


def generate_in_this_process(config: str, flags: list[str]) -> dict:
    import torch

    from flashlet import SamplingParams

    llm, start_s = started_llm(config, flags, max_num_pages=4096)
    prompt = [(i * 7919 + 11) % llm.engine.model_config.vocab_size for i in range(PROMPT_LEN)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    fused = llm.engine.runner.fused
    parts = vars(fused.parts) if fused is not None else {}
    figures = {"start_s": start_s, "ran": {"fused_decode": fused is not None, **parts}}
    for name in ("first", "second"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        seconds = time.perf_counter() - t0
        assert len(out.token_ids) == NEW_TOKENS
        figures[f"{name}_tok_s"] = NEW_TOKENS / seconds
    figures["tokens"] = list(out.token_ids)
    if llm.engine.runner.fused is None:  # per-op: every step's top-2 logits, untimed (observers sync)
        steps = []
        llm.engine.observe_steps(lambda meta, logits: steps.append(logits[0].float().topk(2).values.tolist()))
        again = llm.generate([prompt], params)[0]
        figures["top2"] = steps if list(again.token_ids) == figures["tokens"] else None
    return figures


def streams_in_this_process(config: str, flags: list[str], streams: list[int], new_tokens: int,
                            prompt_len: int = PROMPT_LEN) -> dict:
    """Per stream tok/s of one `LLM.generate` call of N prompts, for each N: a first call and
    a second with fresh prompts (none shares a prefix with another: no cache hits), then a third
    of one new token a stream (the prefill alone), which the decode rate is taken against."""
    import torch

    from flashlet import SamplingParams

    tokens = max(streams) * (prompt_len + new_tokens + 16)  # each call's KV, with a page of slack a row
    llm, start_s = started_llm(config, flags, max_num_pages=max(8192, -(-tokens // 16)))
    figures = {"start_s": start_s, "ran": {"fused_decode": llm.engine.runner.fused is not None},
               "prompt_len": prompt_len}
    vocab = llm.engine.model_config.vocab_size
    rows, seed = {}, 0
    for n in streams:
        row, seconds = {}, {}
        for call, count in (("first", new_tokens), ("second", new_tokens), ("prefill", 1)):
            prompts = []
            for _ in range(n):
                seed += 1
                prompts.append([(seed * 1_000_003 + i * 7919) % vocab for i in range(prompt_len)])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=count, ignore_eos=True))
            seconds[call] = time.perf_counter() - t0
            assert all(len(o.token_ids) == count for o in outs)
        row["first_per_stream_tok_s"] = new_tokens / seconds["first"]
        row["second_per_stream_tok_s"] = new_tokens / seconds["second"]
        decode_s = seconds["second"] - seconds["prefill"]
        row["decode_tok_s"] = n * (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else None
        rows[str(n)] = row
    figures["streams"] = rows
    return figures


def streams_table(results: dict, streams: list[int], new_tokens: int) -> list[str]:
    prompt_len = next((r.get("prompt_len") for r in results.values() if r.get("prompt_len")), PROMPT_LEN)
    lines = [f"N streams through LLM.generate ({prompt_len}-token prompts, {new_tokens} new tokens each, "
             "one call): per-stream tok/s, 1st / 2nd call, the 2nd against N = 1's; decode: "
             f"N x {new_tokens - 1} tokens / (2nd call - a 1-token call's seconds)",
             f"{'path':10} {'N':>4} {'1st':>9} {'2nd':>9} {'total':>9} {'per stream / N=1':>17} "
             f"{'decode tok/s':>13}"]
    for name, res in results.items():
        rows = res.get("streams") or {}
        base = rows.get("1", {}).get("second_per_stream_tok_s")
        for n in streams:
            r = rows.get(str(n))
            if r is None:
                continue
            second = r["second_per_stream_tok_s"]
            ratio = f"{second / base:17.2f}" if base else "-".rjust(17)
            decode = r.get("decode_tok_s")
            decode = f"{decode:13.1f}" if decode else "-".rjust(13)
            lines.append(f"{name:10} {n:4d} {r['first_per_stream_tok_s']:9.1f} {second:9.1f} "
                         f"{second * n:9.1f} {ratio} {decode}")
    return lines


def generate(config: str, flags: list[str], child: str = "--generate-child") -> dict:
    """`generate_in_this_process` (or, with child="--streams-child", `streams_in_this_process`)
    in a fresh interpreter (nothing compiled or cached before)."""
    cmd = [sys.executable, __file__, "--config", config, child, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(lines[-1])


def near_tie_note(top2, parted: int) -> str:
    """Per-op's top-2 gap at the step where a fused path parted from it (same prefix before)."""
    if parted >= NEW_TOKENS or not top2 or parted >= len(top2):
        return ""
    first, second = top2[parted]
    gap, limit = first - second, NEAR_TIE_ABS + NEAR_TIE_REL * abs(first)
    return (f" (per-op's top-2 gap there {gap:.4f}, top {first:.3f}: "
            f"{'a near tie' if gap <= limit else 'NOT a near tie'}, limit {limit:.4f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen2.5-0.5b")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--streams", nargs="+", type=int, default=None, metavar="N",
                    help="time N streams through LLM.generate instead (issue 29's closed loop)")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens a stream with --streams")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="prompt tokens a stream with --streams")
    ap.add_argument("--kv-cache-dtype", default=None, help="the KV cache's dtype with --streams (default: the model's)")
    ap.add_argument("--generate-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--streams-child", action="store_true", help=argparse.SUPPRESS)
    args, child_flags = ap.parse_known_args()
    if args.kv_cache_dtype:
        child_flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.streams and (min(args.streams) < 1 or args.new_tokens < 1 or args.prompt_len < 1):
        ap.error("--streams, --new-tokens and --prompt-len take positive counts")
    if args.kv_cache_dtype and not (args.streams or args.streams_child):
        ap.error("--kv-cache-dtype applies to --streams (the single-stream table compares paths at the model's dtype)")
    if args.generate_child:
        print(json.dumps(generate_in_this_process(args.config, child_flags)))
        return 0
    if args.streams_child:
        print(json.dumps(streams_in_this_process(args.config, child_flags, args.streams, args.new_tokens,
                                                 args.prompt_len)))
        return 0
    if args.streams:
        return streams_main(args)
    results = {}
    for name in args.paths:
        flags = PATHS[name]
        results[name] = {"harness": harness(args.config, flags), "generate": generate(args.config, flags)}
    print(f"single stream, {args.config}, bf16, triton backend, CUDA graphs "
          f"({PROMPT_LEN}-token prompt, {NEW_TOKENS} new tokens)")
    print(f"{'path':14} {'harness tok/s':>14} {'ms/token':>9} {'of limit':>9} "
          f"{'generate tok/s (1st)':>21} {'(2nd)':>8} {'start s':>8}")
    ok = True
    for name, res in results.items():
        h, g = res["harness"], res["generate"]
        for what, part in (("harness", h), ("generate", g)):
            if part.get("error"):
                ok = False
                print(f"{name} {what} failed:\n{part['error']}")

        def f(x, spec):
            return format(x, spec) if isinstance(x, (int, float)) else "-".rjust(int(spec.split(".")[0]))

        print(f"{name:14} {f(h.get('decode_tok_s'), '14.1f')} {f(h.get('ms_per_token'), '9.3f')} "
              f"{f(h.get('fraction_of_bandwidth_limit'), '9.3f')} {f(g.get('first_tok_s'), '21.1f')} "
              f"{f(g.get('second_tok_s'), '8.1f')} {f(g.get('start_s'), '8.1f')}")
    if "default" in results:  # what the engine's auto picked here
        ran = results["default"]["generate"].get("ran") or results["default"]["harness"].get("ran") or {}
        print("default ran: " + (", ".join(f for f, on in ran.items() if on) or "per-op"))
    base = results.get("per-op", {}).get("generate", {}).get("tokens")
    for name, res in results.items():
        tokens = res["generate"].get("tokens")
        if base and tokens and name != "per-op":
            agree = next((i for i, (a, b) in enumerate(zip(base, tokens)) if a != b), len(base))
            res["tokens_agree_with_per_op_for"] = agree
            print(f"{name}: generated tokens agree with per-op for the first {agree} of {NEW_TOKENS}"
                  + near_tie_note(results["per-op"]["generate"].get("top2"), agree))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


def streams_main(args) -> int:
    streams = sorted(set(args.streams) | {1})  # N = 1 is every ratio's base
    child = ["--streams", *map(str, streams), "--new-tokens", str(args.new_tokens),
             "--prompt-len", str(args.prompt_len)]
    if args.kv_cache_dtype:
        child += ["--kv-cache-dtype", args.kv_cache_dtype]
    results = {name: generate(args.config, PATHS[name] + child, "--streams-child") for name in args.paths}
    ok = True
    for name, res in results.items():
        if res.get("error"):
            ok = False
            print(f"{name} failed:\n{res['error']}")
    print(f"{args.config}, bf16, triton backend, CUDA graphs")
    print("\n".join(streams_table(results, streams, args.new_tokens)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
