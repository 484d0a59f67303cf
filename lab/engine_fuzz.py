"""Random request traffic through the engine on the CPU (hypothesis), with the page accounting
checked after every round: the prefix cache and aborts, which the unit tests cover one case at
a time.

    PYTHONPATH=. python lab/engine_fuzz.py prefix --examples 150
    PYTHONPATH=. python lab/engine_fuzz.py abort --examples 200

prefix: multi-turn prompts (earlier prompts with their answers, cut anywhere, plus new tokens)
over a small pool (48 pages of 4 tokens, 32-token steps, so chunks, evictions and recomputed
last pages all happen) against an engine without the prefix cache: the same greedy tokens, the
tree's integrity after each round, no request left, every page held only by the cache, and
none at all after a reset. abort: adds, steps and aborts in random order, the integrity checked
after each; once drained, nothing running or waiting and no page held but by the cache.
Both run a tiny random Qwen2 (vocab 512) written into a temporary folder, or `--model DIR`.
Prints "ok" or raises with hypothesis's smallest failing example.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashlet import LLM, SamplingParams  # noqa: E402


def tiny_model() -> str:
    from tests.conftest import save_tiny_model

    return str(save_tiny_model("qwen2", Path(tempfile.mkdtemp(prefix="engine-fuzz-")), vocab_size=512))


BASES = [[random.Random(i).randrange(5, 400) for _ in range(60)] for i in range(3)]


def assert_idle(engine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats


def fuzz_prefix(model: str, examples: int) -> None:
    cached = LLM(model, page_size=4, max_num_pages=48, max_num_seqs=4, max_num_batched_tokens=32)
    plain = LLM(model, page_size=4, max_num_pages=256, max_num_seqs=8, max_num_batched_tokens=64,
                enable_prefix_cache=False)

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        history = []
        for _ in range(data.draw(st.integers(1, 4))):
            prompts = []
            for _ in range(data.draw(st.integers(1, 4))):
                if history and data.draw(st.booleans()):
                    base = data.draw(st.sampled_from(history))
                else:
                    b = data.draw(st.sampled_from(BASES))
                    base = b[: data.draw(st.integers(1, len(b)))]
                prompts.append(list(base) + data.draw(st.lists(st.integers(5, 400), max_size=9)))
            params = SamplingParams(max_new_tokens=data.draw(st.integers(1, 6)), ignore_eos=True)
            got = cached.generate([{"prompt_token_ids": p} for p in prompts], params)
            want = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
            for p, g, w in zip(prompts, got, want):
                assert g.token_ids == w.token_ids, (len(p), g.token_ids, w.token_ids)
                history.append(p + list(g.token_ids))
            assert_idle(cached.engine)
        if data.draw(st.booleans()):
            cached.engine.reset_prefix_cache()
            assert cached.engine.stats()["kv_pages_used"] == 0

    check()


def fuzz_abort(model: str, examples: int) -> None:
    engine = LLM(model, page_size=4, max_num_pages=40, max_num_seqs=4, max_num_batched_tokens=24).engine

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        live = []
        ops = st.lists(st.sampled_from(["add", "add", "step", "step", "step", "abort"]), min_size=1, max_size=30)
        for op in data.draw(ops):
            if op == "add":
                b = data.draw(st.sampled_from(BASES))
                prompt = b[: data.draw(st.integers(1, len(b)))] + data.draw(st.lists(st.integers(5, 400), max_size=6))
                params = SamplingParams(max_new_tokens=data.draw(st.integers(1, 8)), ignore_eos=True)
                live.append(engine.add_request(prompt, params))
            elif op == "step" and engine.has_unfinished():
                engine.step()
            elif op == "abort" and live:
                engine.abort(data.draw(st.sampled_from(live)))
            engine.check_integrity()
        while engine.has_unfinished():
            engine.step()
        assert_idle(engine)

    check()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["prefix", "abort"])
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--model", default=None, help="a model folder (default: a tiny random Qwen2)")
    args = p.parse_args()
    model = args.model or tiny_model()
    (fuzz_prefix if args.mode == "prefix" else fuzz_abort)(model, args.examples)
    print("ok")


if __name__ == "__main__":
    main()
