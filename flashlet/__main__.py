"""`python -m flashlet [PROMPT ...]`: generate with the engine and report tokens per second.

With no --model it runs the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import argparse
import time

from flashlet.config import EngineConfig
from flashlet.llm import LLM
from flashlet.sampling import SamplingParams

DEMO_PROMPTS = ["The capital of France is", "The three primary colors are", "def add(a, b):"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashlet", description=__doc__)
    parser.add_argument("prompts", nargs="*", help="prompts (default: a few demo prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    config = EngineConfig.from_cli(args)
    t0 = time.perf_counter()
    llm = LLM(**{k: v for k, v in config.__dict__.items()})
    load_s = time.perf_counter() - t0
    engine = llm.engine
    print(f"model: {engine.model_dir or config.config} | backend {config.backend} | "
          f"{engine.device} {str(engine.dtype).removeprefix('torch.')} | "
          f"KV pool {engine.stats()['kv_pages_total']} pages x {config.page_size} tokens | "
          f"loaded in {load_s:.1f} s")
    prompts = args.prompts or DEMO_PROMPTS
    if args.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=2))  # warm-up
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(args.prompts or DEMO_PROMPTS, outputs):
        print(f"\n>>> {prompt}\n{out.text!r}  [{out.finish_reason}, {len(out.token_ids)} tokens]")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"\n{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tok/s "
          f"(batch of {len(prompts)}, {engine.device})")


if __name__ == "__main__":
    main()
