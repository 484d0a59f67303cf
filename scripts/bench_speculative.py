"""Speculative decoding on input-grounded tasks: one stream's tok/s with n-gram prompt lookup
against the same engine without it, the acceptance rate, and a check that the greedy outputs
are the same.

    python scripts/bench_speculative.py                      # SmolLM2-135M, k = 4, the CPU
    python scripts/bench_speculative.py --k 2 4 8 --device cuda --model PATH

Each task is a chat prompt whose answer copies much of its input (repeat or lightly rewrite a
paragraph, edit a function), where prompt lookup proposes long runs. Every measurement is a
fresh generate call after one warm-up call of the same engine; the figure is the best of
--repeats (the least disturbed by other load on the machine).
"""

from __future__ import annotations

import argparse
import time

from flashlet import LLM, SamplingParams

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
             "can of oil and a cloth. He cleaned the great lens until it shone, trimmed the "
             "wick, and lit the lamp, and its beam swept across the dark water all night long. "
             "Ships far out at sea saw the light and knew where the rocks were.")

FUNCTION = '''def mean_and_spread(values):
    total = 0
    for value in values:
        total += value
    mean = total / len(values)
    spread = 0
    for value in values:
        spread += (value - mean) ** 2
    return mean, (spread / len(values)) ** 0.5
'''

TASKS = {
    "repeat a paragraph": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}",
    "rewrite a paragraph": f"Rewrite this paragraph in the present tense:\n\n{PARAGRAPH}",
    "edit a function": ("Rename the variable `values` to `samples` in this function and "
                        f"return the whole function:\n\n```python\n{FUNCTION}```"),
}


def run(llm: LLM, prompt: list[dict], params: SamplingParams, repeats: int) -> tuple[float, list]:
    """Best tok/s of `repeats` timed calls (after one warm-up) -> (tok/s, the output's tokens)."""
    llm.chat([prompt], params)
    best, tokens = 0.0, []
    for _ in range(repeats):
        started = time.perf_counter()
        out = llm.chat([prompt], params)[0]
        best = max(best, len(out.token_ids) / (time.perf_counter() - started))
        tokens = out.token_ids
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--device", default=None)
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.max_tokens)
    plain = LLM(args.model, device=args.device)
    baseline = {name: run(plain, [{"role": "user", "content": text}], params, args.repeats)
                for name, text in TASKS.items()}
    plain.close()
    print("| task | k | tokens | tok/s without | tok/s with | speed-up | acceptance | "
          "mean accepted length | same output |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in args.k:
        spec = {"method": "ngram", "num_speculative_tokens": k}
        for name, text in TASKS.items():
            llm = LLM(args.model, device=args.device, speculative_config=spec)
            speed, tokens = run(llm, [{"role": "user", "content": text}], params, args.repeats)
            stats = llm.engine.stats()
            base_speed, base_tokens = baseline[name]
            print(f"| {name} | {k} | {len(tokens)} | {base_speed:.1f} | {speed:.1f} | "
                  f"{speed / base_speed:.2f}x | {stats['spec_acceptance_rate']:.2f} | "
                  f"{stats['spec_mean_accepted_length']:.2f} | {tokens == base_tokens} |")
            llm.close()


if __name__ == "__main__":
    main()
