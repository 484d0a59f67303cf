"""One stream through `LLM.generate` in a fresh process, three timed runs, then each captured
batch-1 CUDA graph replayed alone (its device time with no host work): for comparing two trees
in interleaved processes, where the machine's own modes move one reading by ~7%.

    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py now
    PYTHONPATH=../old-tree:$CUTE python3 lab/one_stream_pair.py base      # alternate the two
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py fp8 --config qwen2.5-7b --quantization fp8
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py kv-fp8 --kv-cache-dtype fp8
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py 1k --config qwen3-0.6b --prompt-len 1000
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py two-launch --prompt-len 30000 --fused-off attn
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py swap --prompt-len 30000 --page-swap
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py per-op --config qwen2.5-7b --no-fused-decode

Each run times `generate` of 257 new tokens minus that of 1, after a cached prompt (32 tokens
unless --prompt-len says): 256 decode steps. Prints one JSON line: tok/s of each run (and its two
calls' ms), the start-up seconds and where they went (the engine's start report), the graphs'
us, and issue 29's yardstick: the byte limit (the weights' bytes plus the KV bytes of the steps'
mean context, at the H200's measured 4.24 TB/s copy bandwidth) and the best run's share of it.
`--table` reads such lines on stdin and prints them as a table.
"""

import argparse
import json
import os
import sys
import time

import torch

import flashlet.llm
from flashlet import LLM, SamplingParams
from flashlet.kvcache.radix_cache import RadixCache
from flashlet.runner.fused_decode import FusedParts

COPY_BYTES_PER_S = 4.24e12  # the H200's measured device-to-device copy bandwidth (BENCHMARKS.md)


def keep_the_trees_pages() -> None:
    """The prefix cache as before e13e412: its walks adopt no caller's pages, so where the tree
    holds a continuation already the caller takes the tree's pages (and frees its own), whoever
    else holds them."""
    walk = RadixCache._walk
    RadixCache._walk = lambda self, node, tokens, lock=False, adopt=None: walk(self, node, tokens, lock)


def prompts_for(rows: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """`rows` prompts of prompt_len tokens, no two alike (their pages are their own)."""
    return [[(i * 7919 + 43 + r * 104729) % vocab for i in range(prompt_len)] for r in range(rows)]


def timed_run(llm, prompts: list[list[int]]) -> tuple[float, float, float]:
    """(a stream's tok/s over the 256 decode steps, the 1-token call's seconds, the 257-token
    call's): the prompts decoded together, one stream each."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_new_tokens=257, ignore_eos=True))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 256 / ((t2 - t1) - (t1 - t0)), t1 - t0, t2 - t1


def graph_us(graph, replays: int = 300) -> float:
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def weight_bytes(model) -> int:
    """Bytes of every weight a decode step reads: the parameters and the quantized weights'
    buffers (each tensor once: tied embeddings count once), not the RoPE table."""
    tensors = {t.data_ptr(): t for t in model.parameters()}
    tensors.update({t.data_ptr(): t for name, t in model.named_buffers() if not name.endswith("cos_sin_cache")})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def byte_limit(llm, context: int) -> float:
    """tok/s at which one stream reads its weights and `context` tokens of KV at copy bandwidth."""
    pool = llm.engine.kv_pool
    kv_per_token = pool.bytes_per_page(pool.num_layers, 1, pool.num_kv_heads, pool.head_dim, pool.dtype)
    return COPY_BYTES_PER_S / (weight_bytes(llm.engine.model) + context * kv_per_token)


def print_table(lines) -> None:
    """The JSON lines of earlier runs as a table: a row each, the best of its three runs, then
    all three (a repeat slower than the first shows there)."""
    print(f"{'label':<14} {'config':<16} {'prompt':>6} {'fused':>5} {'tok/s':>8} {'limit':>8} {'share':>6}  runs")
    for line in lines:
        r = json.loads(line)
        runs = " / ".join(f"{t:.1f}" for t in r['tok_s'])
        print(f"{r['label']:<14} {r['config']:<16} {r.get('prompt_len', 32):>6} {str(r['fused']):>5} "
              f"{max(r['tok_s']):>8.1f} {r.get('limit_tok_s', float('nan')):>8.1f} {r.get('share', float('nan')):>6.3f}  {runs}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("label", nargs="?", default="now")
    p.add_argument("--table", action="store_true", help="print the JSON lines on stdin as a table")
    p.add_argument("--config", default="qwen2.5-0.5b", help="a preset (random weights)")
    p.add_argument("--quantization", default=None, choices=("fp8",))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of the cached prompt")
    p.add_argument("--fused-off", nargs="+", default=[], choices=("pdl", "rope", "attn"),
                   help="turn these parts of the fused decode path off (the rest as the engine chooses); "
                        "attn: the step backend's own decode attention (two launches) in the fused step")
    p.add_argument("--no-fused-decode", action="store_true",
                   help="the per-op path for every step (fused_decode=False): an A/B's per-op side")
    p.add_argument("--page-swap", action="store_true",
                   help="the prefix cache as before e13e412: a repeat's filled page that the tree holds "
                        "swapped into the request's table (the tree keeps its own): an A/B's old side")
    args = p.parse_args()
    if args.page_swap:
        keep_the_trees_pages()
    if args.table:
        print_table(line for line in sys.stdin if line.startswith("{"))
        return
    if args.fused_off:  # LLM builds its Engine with these parts named off
        parts = FusedParts(**{name: False for name in args.fused_off})
        engine_class = flashlet.llm.Engine
        flashlet.llm.Engine = lambda config: engine_class(config, fused_parts=parts)
    started = time.perf_counter()
    llm = LLM(config=args.config, dtype="bfloat16", max_num_pages=8192, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, **({"fused_decode": False} if args.no_fused_decode else {}))
    result = {"label": args.label, "config": args.config, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "fused_off": args.fused_off,
              "fused": llm.engine.runner.fused is not None,
              "start_s": round(time.perf_counter() - started, 1),
              "start": start_parts(llm.engine)}
    prompts = prompts_for(1, args.prompt_len, llm.engine.model_config.vocab_size)
    llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # prompt cached
    runs = [timed_run(llm, prompts) for _ in range(3)]
    result["tok_s"] = [round(tok_s, 1) for tok_s, _, _ in runs]
    # each run's two calls, ms: which of them moves where a repeat reads slower than the first run
    result["calls_ms"] = [[round(one * 1e3, 2), round(all_ * 1e3, 2)] for _, one, all_ in runs]
    result["prompt_len"] = args.prompt_len
    result["limit_tok_s"] = round(byte_limit(llm, args.prompt_len + 128), 1)  # the steps' mean context
    result["share"] = round(max(result["tok_s"]) / result["limit_tok_s"], 3)
    result["graph_us"] = graphs_us(llm.engine.runner)
    print(json.dumps(result))


def start_parts(engine) -> dict:
    """Where start_s went, from the engine's start report: its load / warm-up / capture seconds,
    the graphs captured and the CuTe GEMVs readied (compiled, or loaded from the disk cache), so
    an A/B's processes say what a start spends without a call of their own."""
    report = getattr(engine, "start_report", None) or {}
    keys = ("load_s", "warmup_s", "capture_s", "graphs", "mixed_graphs", "mixed_capture_s", "triton_compiles",
            "cute_gemvs", "cute_compile_s", "cute_from_disk", "cute_precompile")
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in report.items() if k in keys}


def graphs_us(runner, rows: int = 1) -> dict[str, float]:
    """Each captured batch-`rows` graph replayed alone, us (not one that moves its inputs on: its
    replays would run past the rows' pages), by the first three parts of its key."""
    return {str(key[:3]): round(graph_us(entry[0]), 1)
            for key, entry in runner.graphs.items() if key[0] == rows and key not in runner._moving_graphs}


def run_patched(args: list[str]) -> None:
    """For a lab tool that patches the engine in its own process first: `pair ARGS` runs this
    script's main on ARGS, `profile ARGS` scripts/profile_step.py's, anything else the bench
    harness's (`python -m flashlet.bench ARGS`)."""
    if args[:1] == ["pair"]:
        sys.argv = ["one_stream_pair.py", *args[1:]]
        main()
    elif args[:1] == ["profile"]:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
        from profile_step import main as profile_main

        profile_main(args[1:])
    else:
        from flashlet.bench.cli import main as bench_main

        sys.exit(bench_main(args))


if __name__ == "__main__":
    main()
