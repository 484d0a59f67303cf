"""`python -m flashlet [PROMPT ...]`: generate with the engine and report tokens per second.

With no --model it runs the embedded default model (SmolLM2-135M-Instruct). Every flag is
checked before the model loads: bad usage is one line on stderr and exit code 2."""

from __future__ import annotations

import time

from flashlet.config import CliParser, EngineConfig, check_backend_runs_here
from flashlet.core.sampling import SamplingParams

DEMO_PROMPTS = ["The capital of France is", "The three primary colors are", "def add(a, b):"]


def build_parser() -> CliParser:
    parser = CliParser(prog="python -m flashlet", description=__doc__)
    parser.add_argument("prompts", nargs="*", help="prompts (default: a few demo prompts)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=32,
                          help="tokens to generate per prompt (default: %(default)s)")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="0 = greedy (default: %(default)s)")
    sampling.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    sampling.add_argument("--seed", type=int, default=None,
                          help="sampling seed: a fixed one reproduces sampled output "
                               "(--weights-seed seeds random weights)")
    parser.add_argument("--chat", action="store_true",
                        help="apply the chat template (each prompt is one user message, "
                             "encoded as text)")
    engine = parser.add_argument_group("engine")
    EngineConfig.add_cli_args(engine)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # everything checked before the model loads
        config = EngineConfig.from_cli(args)
        check_backend_runs_here(config)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    from flashlet.llm import LLM  # after the checks: importing the engine takes a while

    t0 = time.perf_counter()
    try:
        llm = LLM(**{k: v for k, v in config.__dict__.items()})
    except (OSError, ValueError) as e:  # no such model, unreadable or unsupported files
        parser.exit(1, f"{parser.prog}: error: could not load the model: {e}\n")
    load_s = time.perf_counter() - t0
    engine = llm.engine
    fused = " + fused decode" if engine.config.fused_decode else ""  # one stream (auto: where it applies)
    print(f"model: {engine.model_dir or config.config} | backend {engine.backend_name}{fused} | "
          f"{engine.device} {str(engine.dtype).removeprefix('torch.')} | "
          f"KV pool {engine.stats()['kv_pages_total']} pages x {config.page_size} tokens | "
          f"loaded in {load_s:.1f} s")
    prompts = args.prompts or DEMO_PROMPTS
    try:
        if args.chat:
            prompts = [llm.apply_chat_template([{"role": "user", "content": p}])
                       for p in prompts]
        for p in prompts:  # e.g. longer than the context, or text for a model without a tokenizer
            llm.engine.check_request(len(llm.engine.encode(p)), params)
    except ValueError as e:
        parser.error(str(e))
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
