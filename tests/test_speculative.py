"""Speculative decoding (flashlet/speculative.py): the config, the n-gram proposer, verification
inside continuous batching (greedy output identical to no speculation, sampled output
distributed as without it), and everything around it (preemption, aborts, stops, max_tokens,
n > 1, logprobs, pages)."""

import json
import random

import numpy as np
import pytest
import torch

from flashlet import Engine, EngineConfig, LLM, SamplingParams
from flashlet.request import Request
from flashlet.speculative import NgramProposer, SpeculativeConfig, verify

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def run_all(engine, done=None):
    """Step until idle, checking integrity after every step; finished outputs by id."""
    done = {} if done is None else done
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return done


def repetitive_prompts(num: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup finds proposals."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(2, vocab) for _ in range(rng.randint(3, 8))]
        prompts.append(phrase * rng.randint(2, 4) + phrase[: rng.randint(0, len(phrase))])
    return prompts


def generate(model, prompts, params, spec=None, **config):
    engine = Engine(EngineConfig(model=str(model), page_size=4, speculative_config=spec, **config))
    ids = [engine.add_request(p, params[i] if isinstance(params, list) else params)
           for i, p in enumerate(prompts)]
    done = run_all(engine)
    return [done[i] for i in ids], engine


# ---- the config ------------------------------------------------------------------------------
def test_config_parses_vllm_json_and_names_bad_keys():
    spec = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 3)
    draft = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2})
    assert draft.method == "draft" and draft.model == "/m"
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    bad = [({**NGRAM, "lookahead": 2}, "lookahead"), ({"method": "ngram"}, "num_speculative_tokens"),
           ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_max"),
           ({**NGRAM, "method": "eagle"}, "method"), ("{not json", "JSON"),
           ({"num_speculative_tokens": 2}, "method")]
    for value, named in bad:
        with pytest.raises(ValueError, match=named):
            SpeculativeConfig.parse(value)


def test_engine_config_takes_json_and_the_batch_size_flag():
    config = EngineConfig(device="cpu", speculative_config=json.dumps(NGRAM),
                          speculative_disable_by_batch_size=3)
    assert config.speculative_config.disable_by_batch_size == 3
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineConfig(device="cpu", speculative_disable_by_batch_size=3)


def test_server_flags_parse():
    from flashlet.server.cli import build_parser

    args = build_parser().parse_args(["--speculative-config", json.dumps(NGRAM),
                                      "--speculative-disable-by-batch-size", "8"])
    config = EngineConfig.from_cli(args)
    assert config.speculative_config.num_speculative_tokens == 4
    assert config.speculative_config.disable_by_batch_size == 8


# ---- the proposer ----------------------------------------------------------------------------
def test_ngram_proposes_after_the_most_recent_longest_match():
    proposer = NgramProposer(1, 3)
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # "6 7" (the longest suffix that recurs: "3 6 7" does not) last occurred before "2 3".
    assert proposer.lookup(tokens, 3) == [2, 3, 6]
    assert proposer.lookup(np.array([1, 2, 3, 4]), 3) == []
    assert proposer.lookup(np.array([4, 4]), 3) == [4]  # a match needs a token after it
    req = Request(0, [9, 1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose([req], 2) == [[3, 1]]
    req.output_token_ids += [3, 1]  # the cached array grows with the request
    assert proposer.propose([req], 2) == [[2, 3]]
    proposer.release(req)
    assert not proposer._tokens


# ---- greedy: identical output ------------------------------------------------------------------
def test_greedy_output_is_identical_and_proposals_are_accepted(tiny_model):
    prompts = repetitive_prompts(6)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain, _ = generate(tiny_model, prompts, params)
    spec, engine = generate(tiny_model, prompts, params, spec=NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0  # not vacuous: proposals were kept
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] >= 0
    assert stats["spec_mean_accepted_length"] > 1
    assert stats["kv_pages_used"] == stats["kv_pages_cached"]  # rejected tokens' pages freed
