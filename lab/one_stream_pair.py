"""One stream through `LLM.generate` in a fresh process, three timed runs, then each captured
batch-1 CUDA graph replayed alone (its device time with no host work): for comparing two trees
in interleaved processes, where the machine's own modes move one reading by ~7%.

    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py now
    PYTHONPATH=../old-tree:$CUTE python3 lab/one_stream_pair.py base      # alternate the two
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py fp8 --config qwen2.5-7b --quantization fp8
    PYTHONPATH=.:$CUTE python3 lab/one_stream_pair.py kv-fp8 --kv-cache-dtype fp8

Each run times `generate` of 257 new tokens minus that of 1, after a cached 32-token prompt:
256 decode steps. Prints one JSON line: tok/s of each run, the start-up seconds, the graphs' us.
"""

import argparse
import json
import time

import torch

from flashlet import LLM, SamplingParams


def timed_run(llm, prompt) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_new_tokens=257, ignore_eos=True))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 256 / ((t2 - t1) - (t1 - t0))


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("label", nargs="?", default="now")
    p.add_argument("--config", default="qwen2.5-0.5b", help="a preset (random weights)")
    p.add_argument("--quantization", default=None, choices=("fp8",))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = p.parse_args()
    started = time.perf_counter()
    llm = LLM(config=args.config, dtype="bfloat16", max_num_pages=8192, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    result = {"label": args.label, "config": args.config, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype,
              "fused": llm.engine.runner.fused is not None,
              "start_s": round(time.perf_counter() - started, 1)}
    vocab = llm.engine.model_config.vocab_size
    prompt = [(i * 7919 + 43) % vocab for i in range(32)]
    llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))  # prompt cached
    result["tok_s"] = [round(timed_run(llm, prompt), 1) for _ in range(3)]
    result["graph_us"] = {str(key[:3]): round(graph_us(entry[0]), 1)
                          for key, entry in llm.engine.runner.graphs.items() if key[0] == 1}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
