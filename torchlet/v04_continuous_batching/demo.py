"""`python -m torchlet.<version>.llm`: a few chat questions through this version's engine."""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

from .device import NeedsCudaError
from .prompts import chat_prompt

VERSION = Path(__file__).parent.name
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three prime numbers.",
    "Explain gravity to a child in one sentence.",
]
# Fewer than len(QUESTIONS): engines that admit requests as others retire (v04+) show it.
DEMO_MAX_BATCH_SIZE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=f"torchlet {VERSION} demo")
    parser.add_argument("--model", help="HF folder or hub id (default: the embedded model)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16")
    parser.add_argument("--max-new-tokens", type=int, help="default: 32 (4 for Triton on CPU)")
    return parser.parse_args(argv)


def main(llm_class, argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = demo_options(llm_class)
    try:
        llm = llm_class(args.model, device=args.device, dtype=args.dtype, **options)
    except NeedsCudaError as e:
        print(f"{VERSION}: {e}", file=sys.stderr)
        sys.exit(1)
    prompts = [chat_prompt(llm.tokenizer, question) for question in QUESTIONS]
    max_new_tokens = args.max_new_tokens or (4 if triton_interpreted(llm) else 32)
    start = time.perf_counter()
    completions = llm.generate(prompts, max_new_tokens=max_new_tokens)
    elapsed = time.perf_counter() - start
    print(f"torchlet {VERSION} on {llm.device} ({llm.dtype}) {options or ''}")
    if triton_interpreted(llm):
        print("(Triton kernels in Triton's CPU interpreter: correct but slow, hence short answers)")
    for question, completion in zip(QUESTIONS, completions):
        print(f"\n> {question}\n{completion.text.strip()}  [{completion.finish_reason}]")
    num_tokens = sum(len(c.token_ids) for c in completions)
    print(f"\n{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)")
    print_step_log(getattr(llm, "step_log", None))


def demo_options(llm_class) -> dict:
    """A max batch size smaller than the number of prompts, for engines that have one."""
    if "max_batch_size" in inspect.signature(llm_class.__init__).parameters:
        return {"max_batch_size": DEMO_MAX_BATCH_SIZE}
    return {}


def triton_interpreted(llm) -> bool:
    """This rung has Triton kernels (v09+) and no GPU to run them on."""
    return llm.device.type != "cuda" and any(Path(__file__).parent.glob("triton_*.py"))


def print_step_log(step_log: list | None) -> None:
    """One line per engine step: prefill or decode, and the requests it ran."""
    if not step_log:
        return
    print("\nsteps (request ids per step):")
    for step, (kind, request_ids) in enumerate(step_log):
        print(f"  {step:3d} {kind:8s} {request_ids}")
