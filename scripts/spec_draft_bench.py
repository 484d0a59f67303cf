"""The draft proposer's cost per verify step: one propose() call (a catch-up forward of the
target's new token(s), then k - 1 batched greedy decode forwards), per k and batch size.

    python scripts/spec_draft_bench.py --target qwen2.5-7b --draft qwen2.5-0.5b --target-step
    python scripts/spec_draft_bench.py --k 4 --batch 1 --target-step    # a tiny pair, on the CPU

Each request starts from a prompt of --context tokens; every round the target "accepts"
--accepted of the proposals and appends a token of its own (the steady state of speculative
decoding), so the catch-up feeds one or two tokens. The first --warmup rounds (graph captures,
kernel compiles) are not timed. `tiny` builds a tiny random model pair (tests/conftest.py's
shapes). The draft's weights are random: acceptance does not matter to its cost.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_pair() -> tuple[str, str]:
    """config.json paths of a tiny target (2 layers) and draft (1 layer), one vocabulary."""
    import json

    folder = Path(tempfile.mkdtemp())
    shape = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                 rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=True)
    paths = []
    for name, layers in (("target", 2), ("draft", 1)):
        path = folder / f"{name}.json"
        path.write_text(json.dumps({**shape, "num_hidden_layers": layers}))
        paths.append(str(path))
    return paths[0], paths[1]


def measure(proposer, batch: int, k: int, args) -> list[float]:
    from flashlet.core.request import Request
    from flashlet.core.sampling import SamplingParams

    rng, vocab = random.Random(0), proposer.model.config.vocab_size
    reqs = [Request(i, [rng.randrange(2, vocab) for _ in range(args.context)], SamplingParams())
            for i in range(batch)]
    times = []
    for round_ in range(args.warmup + args.rounds):
        started = time.perf_counter()
        drafted = proposer.propose(reqs, k)  # ends in a host read of the proposals: synced
        if round_ >= args.warmup:
            times.append(time.perf_counter() - started)
        for req, tokens in zip(reqs, drafted):
            accepted = min(args.accepted, len(tokens))
            req.output_token_ids += tokens[:accepted] + [rng.randrange(2, vocab)]
            proposer.on_accepted(req, accepted)
    for req in reqs:
        proposer.release(req)
    return times


def target_step_ms(config, context: int, tokens: int = 64) -> float:
    """The target's own decode step, one stream, in ms: what a draft's propose() is set against."""
    from flashlet import Engine, SamplingParams

    engine = Engine(config)
    vocab = engine.model_config.vocab_size
    engine.add_request([2 + i % (vocab - 2) for i in range(context)],
                       SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    engine.step()  # the prefill (and, overlapped, the first decode launched)
    started, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tiny", help="the target's preset or config.json")
    parser.add_argument("--draft", default="tiny", help="the draft's preset, config.json or folder")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--accepted", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--target-step", action="store_true",
                        help="also time the target's one-stream decode step (loads the target)")
    args = parser.parse_args()

    import torch

    from flashlet import EngineConfig
    from flashlet.spec.draft import DraftProposer
    from flashlet.spec.api import SpeculativeConfig

    target, draft = (tiny_pair() if "tiny" in (args.target, args.draft)
                     else (args.target, args.draft))
    config = EngineConfig(config=target, dtype=args.dtype, backend=args.backend,
                          max_num_seqs=max(args.batch), max_model_len=args.context + 1024,
                          max_num_pages=max(args.batch) * (args.context + 1024) // 16)
    proposer = DraftProposer(config, SpeculativeConfig("draft", max(args.k), model=draft))
    proposer.warm_up()
    print(f"draft {args.draft} for target {args.target}, {proposer.device}, "
          f"{config.resolved_dtype()}, backend {proposer.runner.backend.name}, "
          f"torch {torch.__version__}")
    print("| batch | k | propose ms p50 | p90 | ms per draft forward |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        for k in args.k:
            times = sorted(measure(proposer, batch, k, args))
            p50, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
            print(f"| {batch} | {k} | {p50 * 1e3:.2f} | {p90 * 1e3:.2f} | {p50 / k * 1e3:.2f} |")
    if args.target_step:
        del proposer
        print(f"target {args.target}: one-stream decode step "
              f"{target_step_ms(config, args.context):.2f} ms")


if __name__ == "__main__":
    main()
