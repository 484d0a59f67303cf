"""Milestone 0 check: greedy generation, parity with HF transformers on the same weights
(identical greedy tokens, argmax agreement, max |logit difference|), and tokens per second.

    python scripts/m0_check.py [--model M] [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from flashlet import LLM, SamplingParams
from flashlet.config import torch_dtype

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three laws of thermodynamics are"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="folder, hub id or .gguf (default: embedded)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    dtype = torch_dtype(args.dtype)

    llm = LLM(args.model, device=args.device, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=dtype).to(args.device)
    hf.generation_config.eos_token_id = None  # both sides run exactly max_new_tokens, no EOS rule
    logits_seen = []
    stop_recording = llm.engine.observe_steps(lambda meta, logits: logits_seen.append(logits.clone()))

    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    same, agree, total, max_diff = 0, 0, 0, 0.0
    for prompt in PROMPTS:
        logits_seen.clear()
        ours = llm.generate([prompt], params)[0]
        ids = llm.tokenizer(prompt, return_tensors="pt").input_ids.to(args.device)
        full = torch.cat([ids[0], torch.tensor(ours.token_ids[:-1], device=args.device)])
        with torch.no_grad():
            ref_logits = hf(full[None]).logits[0, ids.shape[1] - 1:].float()  # teacher-forced
        mine = torch.cat(logits_seen).to(ref_logits.device)
        ref = hf.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
        same += ref == ours.token_ids
        agree += (mine.argmax(-1) == ref_logits.argmax(-1)).sum().item()
        total += mine.shape[0]
        max_diff = max(max_diff, (mine - ref_logits).abs().max().item())
        print(f"{prompt!r} -> {ours.text!r}  [{'identical' if ref == ours.token_ids else 'DIFFERS'}]")

    stop_recording()
    batch = PROMPTS * 4
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    t0 = time.perf_counter()
    llm.generate(PROMPTS[:1], params)
    single = args.max_new_tokens / (time.perf_counter() - t0)

    print(f"\nprompts with identical greedy tokens: {same}/{len(PROMPTS)}")
    print(f"argmax agreement (teacher-forced): {100 * agree / total:.2f}% of {total} positions")
    print(f"max |logit difference|: {max_diff:.3e}")
    print(f"throughput: {tokens / elapsed:.1f} tok/s (batch {len(batch)}), "
          f"{single:.1f} tok/s (batch 1) on {args.device} {args.dtype}")
    return 0 if same == len(PROMPTS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
