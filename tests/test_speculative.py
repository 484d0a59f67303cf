"""Speculative decoding (flashlet/spec/speculative.py): the config, the n-gram proposer, verification
inside continuous batching (greedy output identical to no speculation, sampled output
distributed as without it), and everything around it (preemption, aborts, stops, max_tokens,
n > 1, logprobs, pages)."""

import json
import random

import numpy as np
import pytest
import torch

from flashlet import Engine, EngineConfig, LLM, SamplingParams
from flashlet.core.request import PLACEHOLDER, Request
from flashlet.spec.speculative import NgramProposer, SpeculativeConfig, verify, verify_greedy

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
    bad = [({**NGRAM, "lookahead": 2}, "lookahead"),
           ({"method": "ngram"}, "num_speculative_tokens"),
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
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(device="cpu", speculative_config=NGRAM, tensor_parallel_size=2)


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


def test_ngram_lookup_equals_a_plain_scan_on_random_tokens():
    """The lookup (candidate ends of the newest token, extended a token at a time) against a
    scan of every earlier window, longest n first, most recent first."""

    def scan(tokens, k, lo, hi):
        t, length = tokens.tolist(), len(tokens)
        for n in range(min(hi, length - 1), lo - 1, -1):
            for start in range(length - n - 1, -1, -1):
                if t[start : start + n] == t[length - n :]:
                    return t[start + n : start + n + k]
        return []

    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, rng.integers(2, 8), size=rng.integers(0, 40))
        lo = int(rng.integers(1, 4))
        hi, k = int(rng.integers(lo, 6)), int(rng.integers(1, 6))
        assert NgramProposer(lo, hi).lookup(tokens, k) == scan(tokens, k, lo, hi)


def test_ngram_proposals_of_a_growing_request_equal_the_lookup_of_its_tokens():
    """The proposer keeps each request's tokens as they grow, and answers from where each
    n-gram last ended (or, for a range of sizes too wide to index or a request grown past
    MAX_INDEXED_TOKENS, by `lookup`'s scan): the same as `lookup` over all of them, at every
    length. Released (finished, aborted,
    preempted), a request's id starts afresh: nothing stale."""
    rng = np.random.default_rng(1)
    for trial in range(60):
        lo, most = int(rng.integers(1, 4)), NgramProposer.MAX_INDEXED_SIZES
        wide = most if trial % 5 == 4 else 0  # not indexed
        hi = lo + most - 1 if trial % 5 == 3 else int(rng.integers(lo, 5)) + wide  # 3: widest
        proposer = NgramProposer(lo, hi)
        assert bool(proposer._sizes) == (not wide)
        if trial % 3 == 2:  # requests grow past the indexed length: they drop the index and scan
            proposer.MAX_INDEXED_TOKENS = int(rng.integers(4, 40))
        limit = proposer.MAX_INDEXED_TOKENS
        vocab = int(rng.integers(2, 9))
        for _ in range(2):  # the same id twice, with other tokens after a release
            req = Request(trial, rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist(),
                          SamplingParams())
            for _ in range(15):
                k = int(rng.integers(1, 6))
                tokens = np.array(req.prompt_token_ids + req.output_token_ids)
                assert proposer.propose([req], k) == [proposer.lookup(tokens, k)]
                # indexed: only n-grams of the sizes looked up; past the limit, no index at all
                history = proposer._tokens[trial]
                assert {len(key) for key in history._ends} <= set(proposer._sizes)
                assert history.indexed == (not wide and len(history.tokens) <= limit)
                assert history.indexed or not history._ends
                grow = int(rng.integers(1, 5)) if trial % 2 else 1  # odd trials: several a step
                req.output_token_ids += rng.integers(0, vocab, size=grow).tolist()
            proposer.release(req)
            assert not proposer._tokens


def test_a_verify_row_samples_its_last_k_plus_one_tokens():
    from flashlet.runner.batch import InputBatch

    batch = InputBatch(3, 2, 8)
    for i in range(3):
        batch.add(i, [i])
    # Row 0 verifies 2 proposals, row 1 is a prefill chunk that does not sample, row 2 one.
    layout = batch.layout(np.arange(3), [2, 0, 1], [5, 6, 7, 8, 9, 10, 11], [3, 2, 2],
                          [True, False, True], [2, 0, 1])
    assert layout.arrays["logits_indices"].tolist() == [0, 1, 2, 5, 6]
    assert layout.arrays["positions"].tolist() == [2, 3, 4, 0, 1, 1, 2]
    # every row a decode or verify row, each sampling all its tokens: every row's logits
    layout = batch.layout(np.arange(3), [2, 0, 1], [5, 6, 7, 8, 9, 10], [3, 1, 2],
                          [True, True, True], [2, 0, 1])
    assert layout.arrays["logits_indices"].tolist() == [0, 1, 2, 3, 4, 5]
    layout = batch.layout(np.arange(3), [2, 0, 1], [5, 6, 7, 8, 9, 10], [3, 1, 2],
                          [True, True, True], [1, 0, 1])  # row 0's first token is no proposal
    assert layout.arrays["logits_indices"].tolist() == [1, 2, 3, 4, 5]


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


def test_greedy_output_is_identical_with_an_fp8_kv_cache(tiny_qwen2):
    prompts = repetitive_prompts(4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain, _ = generate(tiny_qwen2, prompts, params, kv_cache_dtype="fp8")
    spec, engine = generate(tiny_qwen2, prompts, params, spec=NGRAM, kv_cache_dtype="fp8")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats()["spec_num_accepted_tokens"] > 0


def test_one_stream_takes_fewer_steps(tiny_qwen2):
    prompt = repetitive_prompts(1, seed=3)[0]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    (plain,), plain_engine = generate(tiny_qwen2, [prompt], params)
    (spec,), engine = generate(tiny_qwen2, [prompt], params, spec=NGRAM)
    assert spec.token_ids == plain.token_ids
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert engine.stats()["num_steps"] < plain_engine.stats()["num_steps"]


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_under_a_small_pool_keeps_outputs(tiny_qwen2, overlap):
    prompts = repetitive_prompts(8, seed=1)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain, _ = generate(tiny_qwen2, prompts, params, max_num_pages=64)
    spec, engine = generate(tiny_qwen2, prompts, params, spec=NGRAM, max_num_pages=22,
                            overlap=overlap)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert not engine.spec._proposed and not engine.spec.proposer._tokens  # all let go
    engine.reset_prefix_cache()
    assert engine.stats()["kv_pages_used"] == 0


def test_abort_mid_run_releases_everything(tiny_qwen2):
    prompts = repetitive_prompts(4, seed=2)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain, _ = generate(tiny_qwen2, prompts, params)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, speculative_config=NGRAM))
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(4):
        for out in engine.step():
            done.setdefault(out.request_id, []).append(out)
    assert engine.abort(ids[1])
    engine.check_integrity()
    finished = run_all(engine)
    assert finished[ids[1]].finish_reason == "abort"
    for i in (0, 2, 3):
        assert finished[ids[i]].token_ids == plain[i].token_ids
    assert not engine.spec._proposed and not engine.spec.proposer._tokens  # all let go
    engine.reset_prefix_cache()
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_max_tokens_is_never_overshot(tiny_qwen2, max_tokens):
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    plain, _ = generate(tiny_qwen2, prompts, params)
    spec, _ = generate(tiny_qwen2, prompts, params, spec=NGRAM)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids and len(a.token_ids) == max_tokens
        assert a.finish_reason == "length"


def test_stop_ids_end_the_output_at_the_first_accepted_stop(tiny_qwen2):
    prompts = repetitive_prompts(4, seed=5)
    free, _ = generate(tiny_qwen2, prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    # Stop on a token each output produces part-way through (several in one verify step's run).
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True,
                             stop_token_ids=[out.token_ids[len(out.token_ids) // 2]])
              for out in free]
    plain, _ = generate(tiny_qwen2, prompts, params)
    spec, engine = generate(tiny_qwen2, prompts, params, spec=NGRAM)
    for a, b, p in zip(spec, plain, params):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert a.finish_reason == "stop" and a.token_ids[-1] == p.stop_token_ids[0]
    assert engine.stats()["spec_num_accepted_tokens"] > 0


def test_eos_in_proposals_and_min_tokens(tiny_qwen2):
    """EOS is a token the outputs produce part-way and their prompts hold, so lookup proposes
    it: a stop is checked on each accepted token, and positions short of min_tokens may not
    accept it (nor draw it)."""
    prompts = repetitive_prompts(6, seed=14)
    free, _ = generate(tiny_qwen2, prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    eos = free[0].token_ids[4]

    def run(params, spec):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, speculative_config=spec))
        engine.eos_token_ids = {eos}
        ids = [engine.add_request(p + [eos], params) for p in prompts]
        done = run_all(engine)
        return [(done[i].token_ids, done[i].finish_reason) for i in ids], engine

    stops = []
    for params in (SamplingParams(max_new_tokens=24),
                   SamplingParams(max_new_tokens=24, min_tokens=8),
                   SamplingParams(max_new_tokens=24, min_tokens=8, repetition_penalty=1.2)):
        plain, _ = run(params, None)
        spec, engine = run(params, NGRAM)
        assert spec == plain
        assert all(len(tokens) >= params.min_tokens for tokens, _ in spec)
        assert engine.stats()["spec_num_accepted_tokens"] > 0
        stops.append(sum(reason == "stop" for _, reason in spec))
    assert stops[0] and stops[1]  # EOS did end outputs, with min_tokens too


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logit_bias_holds_in_verify_steps(tiny_qwen2, temperature):
    """Verify rows add each request's logit_bias as the sampler does: greedy output with a bias
    equals it without speculation, and a banned token never appears, sampled or not."""
    prompts = repetitive_prompts(3, seed=7)
    banned = {t: -100.0 for t in set(prompts[0][:4])}  # tokens n-gram lookup proposes
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=temperature, seed=5,
                            logit_bias={**banned, 9: 3.0})
    spec, engine = generate(tiny_qwen2, prompts, params, spec=NGRAM)
    assert engine.stats()["spec_num_drafts"] > 0
    assert not set(banned) & {t for o in spec for t in o.token_ids}
    if temperature == 0:
        plain, _ = generate(tiny_qwen2, prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_logprobs_of_every_accepted_token(tiny_qwen2):
    prompts = repetitive_prompts(3, seed=6)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=3)
    plain, _ = generate(tiny_qwen2, prompts, params)
    spec, engine = generate(tiny_qwen2, prompts, params, spec=NGRAM)
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert [lp.token_id for lp in a.logprobs] == a.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.slow
def test_n_samples_and_stop_strings_through_llm(demo_model_dir, demo_llm):
    prompt = ("Repeat this list exactly: apples, pears, plums, figs, dates, limes. "
              "Repeat: apples, pears, plums, figs, dates, limes. Repeat:")
    base = SamplingParams(max_new_tokens=24, n=2)
    plain = demo_llm.generate([prompt], base)  # the session's plain engine: one build less
    llm = LLM(str(demo_model_dir), speculative_config=NGRAM)
    spec = llm.generate([prompt], base)
    assert [o.text for o in spec] == [o.text for o in plain]
    stopped = llm.generate([prompt], SamplingParams(max_new_tokens=24, stop=["figs"]))
    reference = demo_llm.generate([prompt], SamplingParams(max_new_tokens=24, stop=["figs"]))
    assert stopped[0].text == reference[0].text and "figs" not in stopped[0].text
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    llm.engine.check_integrity()


def test_disable_by_batch_size_switches_off_and_back_on(tiny_qwen2):
    prompts = repetitive_prompts(5, seed=7)
    params = [SamplingParams(max_new_tokens=8 if i else 40, ignore_eos=True)
              for i in range(len(prompts))]
    plain, _ = generate(tiny_qwen2, prompts, params)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4,
                                 speculative_config={**NGRAM, "disable_by_batch_size": 2}))
    ids = [engine.add_request(p, params[i]) for i, p in enumerate(prompts)]
    drafts_while_many, done = [], {}
    while engine.has_unfinished():
        many = len(engine.scheduler.running) > 2
        before = engine.spec.stats.num_drafts
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if many:
            drafts_while_many.append(engine.spec.stats.num_drafts - before)
        engine.check_integrity()
    assert drafts_while_many and not any(drafts_while_many)  # off above the size
    assert engine.spec.stats.num_drafts > 0  # on again once the short ones left
    assert [done[i].token_ids for i in ids] == [o.token_ids for o in plain]


def test_seeded_sampling_reproduces_with_speculation(tiny_qwen2):
    prompts = repetitive_prompts(3, seed=8)
    params = SamplingParams(max_new_tokens=16, temperature=0.7, seed=11, ignore_eos=True)
    first, engine = generate(tiny_qwen2, prompts, params, spec=NGRAM)
    second, _ = generate(tiny_qwen2, prompts, params, spec=NGRAM)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert engine.stats()["spec_num_drafts"] > 0


# ---- sampled: the same distribution ------------------------------------------------------------
def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at df degrees of freedom for a normal quantile z (3.09: 0.999),
    by the Wilson-Hilferty approximation (scipy is not a dependency)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * c**0.5) ** 3


def homogeneity_statistic(a: list, b: list) -> tuple[float, int]:
    """Pearson's two-sample chi-square over the outcomes; outcomes expected fewer than 5 times
    are pooled into one. -> (statistic, degrees of freedom)."""
    outcomes = sorted(set(a) | set(b), key=repr)
    ca = {o: a.count(o) for o in outcomes}
    cb = {o: b.count(o) for o in outcomes}
    na, nb = len(a), len(b)
    big = [o for o in outcomes if (ca[o] + cb[o]) * min(na, nb) / (na + nb) >= 5]
    rows = [(ca[o], cb[o]) for o in big]
    rest = (na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows))
    if sum(rest):
        rows.append(rest)
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


def test_sampled_distribution_equals_the_one_without_speculation(tiny_qwen2):
    # The prompt ends in a loop the tiny model keeps to (63 63 ...): lookup proposes 63, and
    # at temperature 0.4 the model keeps it often and rejects it often. Tokens 2 to 4 of each
    # draw come from verify steps.
    prompt = [7, 21, 9, 30, 41, 71, 169, 149, 239, 45, 33, 63, 63, 63, 63, 63]
    params = SamplingParams(max_new_tokens=5, temperature=0.4, top_p=0.9, top_k=40,
                            repetition_penalty=1.1, presence_penalty=0.1, ignore_eos=True)
    draws = 1200

    def sample(spec):
        outs, engine = generate(tiny_qwen2, [prompt] * draws, params, spec=spec)
        return [tuple(o.token_ids) for o in outs], engine

    plain, _ = sample(None)
    spec, engine = sample(NGRAM)
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] > 150  # many draws went through acceptance
    assert stats["spec_num_draft_tokens"] - stats["spec_num_accepted_tokens"] > 150  # rejection
    outcomes = [lambda t: t[1], lambda t: t[2], lambda t: t[1:3], lambda t: t[3]]
    for outcome in outcomes:
        stat, df = homogeneity_statistic(list(map(outcome, spec)), list(map(outcome, plain)))
        assert df >= 3
        assert stat < chi_square_critical(df), (stat, df)


def test_verify_without_a_model_keeps_the_target_distribution():
    """verify() on fixed logits: a proposal is kept with probability p(x), and the token
    after a rejection comes from p without x, so each row's first token is distributed as p."""
    torch.manual_seed(0)
    vocab, draws = 6, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3]]).repeat(2 * draws, 1)
    reqs = [Request(i, [1, 2], SamplingParams(temperature=1.0, max_new_tokens=8))
            for i in range(draws)]
    proposals = {req: [1] for req in reqs}  # the model gives token 1 p = 0.17
    results = verify(logits, reqs, proposals, frozenset())
    first = [r.tokens[0] for r in results]
    probs = torch.softmax(logits[0], -1).tolist()
    expected = [p * draws for p in probs]
    stat = sum((first.count(t) - e) ** 2 / e for t, e in enumerate(expected))
    assert stat < chi_square_critical(vocab - 1)
    accepted = sum(r.num_accepted for r in results)
    assert abs(accepted / draws - probs[1]) < 4 * (probs[1] * (1 - probs[1]) / draws) ** 0.5
    assert all(len(r.tokens) == 1 + r.num_accepted for r in results)


def test_a_rejected_proposal_is_never_the_token_drawn_instead():
    logits = torch.tensor([[0.0, 3.0, 0.0]] * 2)
    reqs = [Request(0, [1], SamplingParams(temperature=1.0, max_new_tokens=8))]
    for _ in range(50):
        (result,) = verify(logits, reqs, {reqs[0]: [1]}, frozenset())
        if result.num_accepted == 0:
            assert result.tokens != [1]
    greedy = [Request(0, [1], SamplingParams(max_new_tokens=8))]
    (result,) = verify(logits, greedy, {greedy[0]: [0]}, frozenset())
    assert result == (([1], None, 0))


def test_greedy_verify_from_argmax_tokens_is_verify_from_logits():
    """verify_greedy (each row's argmax token, the fused path's LM head epilogue) decides as
    verify does on the logits: rows without proposals, all accepted, a rejection at each place."""
    torch.manual_seed(1)
    vocab = 12
    # min_tokens (with no stop token to ban) takes verify's general path without changing a row
    reqs = [Request(i, [1, 2, 3], SamplingParams(max_new_tokens=8, min_tokens=1)) for i in range(5)]
    logits = torch.randn(1 + 4 + 4 + 2 + 4, vocab)  # each request's 1 + k rows
    chosen = logits.argmax(-1).tolist()
    proposals = {reqs[1]: chosen[1:4],                              # all three accepted
                 reqs[2]: [chosen[5], (chosen[6] + 1) % vocab, 0],  # rejected at the second
                 reqs[3]: [(chosen[9] + 1) % vocab],                # rejected at the first
                 reqs[4]: chosen[11:14]}
    want = verify(logits, reqs, proposals, frozenset())
    got = verify_greedy(logits.argmax(-1), reqs, proposals)
    assert got == want
    for req in reqs:  # plain greedy: verify takes the argmax path itself
        req.params = SamplingParams(max_new_tokens=8)
    assert verify(logits, reqs, proposals, frozenset()) == want
    assert [r.num_accepted for r in got] == [0, 3, 1, 0, 3]


def test_prompt_logprobs_and_embeddings_share_verify_steps(tiny_qwen2):
    """Requests that score their prompt or pool it arrive while others speculate: their rows
    sit beside verify rows (forward_hidden), and every result equals the run without."""
    prompts = repetitive_prompts(3, seed=10)
    decoding = SamplingParams(max_new_tokens=24, ignore_eos=True)
    others = [(repetitive_prompts(1, seed=11)[0], SamplingParams(max_new_tokens=4, ignore_eos=True,
                                                                  prompt_logprobs=2)),
              (repetitive_prompts(1, seed=12)[0], SamplingParams(max_new_tokens=1, pooling="mean"))]

    def run(spec):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, speculative_config=spec))
        ids = [engine.add_request(p, decoding) for p in prompts]
        done = {}
        for _ in range(3):  # the decodes are under way (and speculating) first
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        ids += [engine.add_request(p, params) for p, params in others]
        run_all(engine, done)
        return [done[i] for i in ids], engine

    plain, _ = run(None)
    spec, engine = run(NGRAM)
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
    scored_a, scored_b = spec[3].prompt_logprobs[1:], plain[3].prompt_logprobs[1:]
    assert [x.logprob for x in scored_a] == pytest.approx([x.logprob for x in scored_b], abs=1e-4)
    assert spec[4].embedding == pytest.approx(plain[4].embedding, abs=1e-5)


@pytest.mark.slow
def test_structured_output_speculates_within_its_grammar(demo_model_dir, demo_llm):
    """A request with a response_format speculates beside an unconstrained one: its verify
    rows are masked as its grammar stands after the proposals before them, and it advances
    over the accepted tokens only. Both outputs equal the run without speculation."""
    repeat = f"Repeat this paragraph exactly: {PARAGRAPH}"
    json_prompt = ('Return this object as JSON, unchanged: {"name": "Tom", "age": 3, '
                   '"colour": "grey", "toys": ["ball", "mouse", "string"]}')
    params = [SamplingParams(max_new_tokens=40),
              SamplingParams(max_new_tokens=40, response_format={"type": "json_object"})]

    def run(llm):
        engine = llm.engine
        ids = [engine.add_request(repeat, params[0])]
        done = {}
        for _ in range(6):  # alone at first
            for out in engine.step():
                done[out.request_id] = out
        ids.append(engine.add_request(json_prompt, params[1]))
        run_all(engine, done)
        return [done[i] for i in ids], llm

    plain, _ = run(demo_llm)  # the session's plain engine
    # (its grammar compiled in this process: no compile worker to start, which imports torch)
    spec, llm = run(LLM(str(demo_model_dir), speculative_config=NGRAM, structured_output_timeout_s=0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[1].finish_reason in ("stop", "length") and spec[1].error is None
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    llm.engine.check_integrity()


def test_grammar_masks_verify_rows_and_rolls_back():
    """mask_grammars on a grammar that allows only one token after another: the row after
    an accepted proposal is masked as the grammar stands then, and the matcher ends where
    it started."""
    from flashlet.spec.speculative import _Rows, mask_grammars

    class Matcher:  # allows token t + 1 after token t, from 5
        def __init__(self):
            self.last, self.history = 4, []

        def fill_next_token_bitmask(self, bitmask, row):
            allowed = self.last + 1
            bitmask[row] = 0
            bitmask[row, allowed // 32] = torch.tensor(1 << (allowed % 32), dtype=torch.int32)

        def accept_token(self, token):
            if token != self.last + 1:
                return False
            self.history.append(self.last)
            self.last = token
            return True

        def is_terminated(self):
            return False

        def rollback(self, n):
            for _ in range(n):
                self.last = self.history.pop()

    req = Request(0, [1], SamplingParams(max_new_tokens=8))
    req.grammar = Matcher()
    logits = torch.zeros(4, 64)
    errors = {}
    mask_grammars(logits, [req], _Rows([0], [[5, 9, 7]]), errors)
    assert not errors and req.grammar.last == 4  # rolled back
    allowed = [(row > float("-inf")).nonzero().flatten().tolist() for row in logits]
    assert allowed[:2] == [[5], [6]]  # 5 accepted; 9 refused in its own row
    assert allowed[2:] == [list(range(64))] * 2  # never read: 9 is rejected at row 1
    (result,) = verify(torch.zeros(4, 64), [req], {req: [5, 9, 7]}, frozenset())
    assert result.tokens == [5, 6] and result.num_accepted == 1


# ---- the real model ---------------------------------------------------------------------------
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
             "can of oil and a cloth. He cleaned the great lens until it shone, trimmed the wick, "
             "and lit the lamp, and its beam swept across the dark water all night long.")


@pytest.mark.slow
def test_smollm_greedy_output_matches_on_an_input_grounded_prompt(demo_model_dir, demo_llm):
    conversation = [{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}"}]
    params = SamplingParams(max_new_tokens=64)
    plain = demo_llm.chat([conversation], params)[0]
    llm = LLM(str(demo_model_dir), speculative_config=NGRAM)
    spec = llm.chat([conversation], params)[0]
    assert spec.token_ids == plain.token_ids
    stats = llm.engine.stats()
    assert stats["spec_acceptance_rate"] > 0.3  # the paragraph is copied: lookup pays
    assert stats["spec_mean_accepted_length"] > 2
    llm.engine.check_integrity()


def test_metrics_export_speculation_counters(tiny_qwen2):
    from prometheus_client import CollectorRegistry, generate_latest

    from flashlet.server.engine_core import core_stats
    from flashlet.server.metrics import EngineCollector

    _, engine = generate(tiny_qwen2, repetitive_prompts(2, seed=9),
                         SamplingParams(max_new_tokens=12, ignore_eos=True), spec=NGRAM)
    stats = core_stats(engine)

    class Loop:
        is_ready = True

        def core_stats(self):
            return [stats]

    registry = CollectorRegistry()
    registry.register(EngineCollector(Loop()))
    text = generate_latest(registry).decode()
    for name, key in (("num_draft_tokens", "spec_num_draft_tokens"),
                      ("num_accepted_tokens", "spec_num_accepted_tokens"),
                      ("num_drafts", "spec_num_drafts")):
        assert stats[key] > 0
        assert f'flashlet_spec_decode_{name}_total{{core="0"}} {float(stats[key])}' in text


def test_proposals_never_preempt_another_request():
    """With no free page for a row's proposals, it verifies none rather than push another
    request out (the page its own token needs it still gets, as any decode)."""
    from flashlet.kvcache.kv_pool import PageAllocator
    from flashlet.core.scheduler import Scheduler
    from flashlet.spec.speculative import Verified

    sched = Scheduler(PageAllocator(3), 4, max_num_seqs=4, max_num_batched_tokens=16,
                      enable_prefix_cache=False)
    older, newer = Request(0, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=8)), \
        Request(1, [5, 6], SamplingParams(max_new_tokens=8))
    for req in (older, newer):
        sched.add(req)
    out = sched.schedule()  # both prompts: older takes 2 pages, newer 1; none is free
    sched.on_launch(out)
    sched.update(out, [7, 7])
    assert sched.allocator.num_free == 0
    # older's next token fits its second page; its proposals would need a third
    out = sched.schedule({older: [8, 9, 5, 6], newer: [5]})
    assert out.proposals == {newer: [5]} and not out.preempted
    assert [n for _, n in out.scheduled] == [1, 2]
    sched.on_launch(out)
    sched.update(out, [Verified([3], None, 0), Verified([5, 4], None, 1)])
    sched.check_integrity()


class ProposesEvery:
    """A proposer that finds nothing (as prompt lookup finding no match) but on every
    `every`-th call, where it proposes n-gram lookup's guesses (every=0: never)."""

    def __init__(self, every: int):
        self.ngram, self.every, self.calls = NgramProposer(1, 3), every, 0

    def propose(self, requests, k):
        self.calls += 1
        if self.every and self.calls % self.every == 0:
            return self.ngram.propose(requests, k)
        return [[] for _ in requests]

    def on_accepted(self, request, num_accepted):
        pass

    def release(self, request):
        self.ngram.release(request)


def outputs_per_call(engine, prompts, params) -> list[list[tuple[int, list[int]]]]:
    """Each step() call's outputs, (request id, new tokens), checking integrity after each."""
    for p in prompts:
        engine.add_request(p, params)
    calls = []
    while engine.has_unfinished():
        calls.append([(o.request_id, list(o.new_token_ids)) for o in engine.step()])
        engine.check_integrity()
    return calls


def test_a_speculating_step_without_proposals_overlaps_as_a_plain_one(tiny_qwen2):
    """Where the proposer finds nothing for any row, the step stays in flight while the caller
    takes the previous one's outputs, as without speculation: each step() call returns the
    same outputs as a plain overlapped engine's."""
    prompts = repetitive_prompts(2, seed=4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = outputs_per_call(Engine(EngineConfig(model=str(tiny_qwen2), page_size=4)),
                             prompts, params)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, speculative_config=NGRAM))
    engine.spec.proposer = ProposesEvery(0)
    assert outputs_per_call(engine, prompts, params) == plain
    assert engine.spec.stats.num_drafts == 0


def test_steps_with_and_without_proposals_in_turn_keep_the_greedy_output(tiny_qwen2):
    """Verify steps between overlapped steps without proposals: the step in flight is read
    before the next proposal, and the output is the plain engine's."""
    prompts = repetitive_prompts(3, seed=5)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain, _ = generate(tiny_qwen2, prompts, params)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, speculative_config=NGRAM))
    engine.spec.proposer = ProposesEvery(2)
    ids = [engine.add_request(p, params) for p in prompts]
    done = run_all(engine)
    assert [done[i].token_ids for i in ids] == [o.token_ids for o in plain]
    assert engine.spec.stats.num_accepted_tokens > 0
    engine.reset_prefix_cache()
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_greedy_verify_step_is_read_by_the_next_call(tiny_qwen2, temperature):
    """A verify step of plain greedy requests stays in flight after step() returns (its rows'
    argmax tokens on their way to the host, verified when the next call reads them), while
    the caller takes the previous outputs; one with sampled rows is verified at once."""
    prompt = repetitive_prompts(1, seed=3)[0]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=temperature, seed=1)
    (plain,), _ = generate(tiny_qwen2, [prompt], params)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, speculative_config=NGRAM))
    rid = engine.add_request(prompt, params)
    tokens, verify_in_flight = [], 0
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
        verify_in_flight += engine._in_flight is not None and engine._in_flight.verifying
        engine.check_integrity()
    assert engine.spec.stats.num_drafts > 0
    assert (verify_in_flight > 0) == (temperature == 0.0)
    if temperature == 0.0:
        assert tokens == plain.token_ids and engine.spec.stats.num_accepted_tokens > 0


def test_one_sequence_engine_stages_every_verify_row(tiny_qwen2):
    """max_num_seqs 1: a verify step's 1 + k argmax tokens still fit the staging buffers."""
    prompt = repetitive_prompts(1, seed=3)[0]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    (plain,), _ = generate(tiny_qwen2, [prompt], params, max_num_seqs=1)
    (spec,), engine = generate(tiny_qwen2, [prompt], params, spec=NGRAM, max_num_seqs=1)
    assert spec.token_ids == plain.token_ids
    assert engine.spec.stats.num_draft_tokens > engine.spec.stats.num_drafts  # rows past 1


def verify_update(rng, batch_rows: int, page_size: int):
    """A BatchUpdate of a step of decode and verify rows (random starts, 0-3 proposals each),
    adding every row with a page table that covers its tokens."""
    from flashlet.core.scheduler import BatchUpdate, NewRow

    update = BatchUpdate(query_lens=[], spec_lens=[], sample=[])
    for i in range(batch_rows):
        start, k = rng.randrange(0, 40), rng.randrange(0, 4)
        pages = [rng.randrange(1, 500) for _ in range(-(-(start + 1 + k) // page_size))]
        update.added.append(NewRow(i, pages, SamplingParams(), 5))
        update.request_ids.append(i)
        update.starts.append(start)
        update.token_ids += [rng.randrange(2, 256) for _ in range(1 + k)]
        update.query_lens.append(1 + k)
        update.spec_lens.append(k)
        update.sample.append(True)
    return update


def test_a_verify_step_laid_out_as_decode_rows_at_once_is_the_converted_ragged_one():
    """InputBatch.apply(verify_decode_rows=N) builds a verify step's decode rows directly: the
    same arrays as fused_decode.verify_as_decode_rows of its ragged layout, the same sampled
    rows noted; past N tokens (or with a row that samples less) the ragged layout."""
    from flashlet.runner import fused_decode
    from flashlet.runner.batch import InputBatch

    rng, ps = random.Random(7), 4
    for trial in range(30):
        update = verify_update(rng, rng.randrange(1, 4), ps)
        if trial % 3 == 0:  # a token still to be fed from the step before (not an engine's)
            update.token_ids[rng.randrange(len(update.token_ids))] = PLACEHOLDER
        direct, ragged = InputBatch(4, 16, ps), InputBatch(4, 16, ps)
        layout = direct.apply(update, verify_decode_rows=16)
        want = fused_decode.verify_as_decode_rows(ragged.apply(update), ps, 16)
        assert layout.verify_as_decode_rows and layout.is_pure_decode
        if want is None:  # every row a plain decode: a decode step either way
            want = ragged.layout(ragged._rows_of(update.request_ids), update.starts, update.token_ids)
        for name, values in want.arrays.items():
            assert np.array_equal(layout.arrays[name], values), (trial, name)
        assert direct.sampling_rows == ragged.sampling_rows
        assert np.array_equal(direct.sampled_output_index, ragged.sampled_output_index)
    update = verify_update(random.Random(1), 3, ps)
    assert not InputBatch(4, 16, ps).apply(update, verify_decode_rows=2).verify_as_decode_rows
    update.sample[0] = False
    assert not InputBatch(4, 16, ps).apply(update, verify_decode_rows=16).verify_as_decode_rows
    short = verify_update(random.Random(2), 2, ps)  # a row's table a page short of its tokens
    short.added[1] = short.added[1]._replace(page_ids=short.added[1].page_ids[:-1])
    with pytest.raises(ValueError, match="fewer pages"):
        InputBatch(4, 16, ps).apply(short, verify_decode_rows=16)


def test_a_fused_verify_step_is_laid_out_once(tiny_qwen2, monkeypatch):
    """On the fused path (reference GEMVs on the CPU) a verify step's decode rows come from the
    batch at once: no ragged layout of it is built and none converted (the host's work between
    a verify step's tokens and the next launch is not overlapped)."""
    from tests.test_fused_decode import ReferenceGemv
    from flashlet.runner import fused_decode
    from flashlet.runner.batch import InputBatch

    monkeypatch.setattr(fused_decode, "CuteGemv", ReferenceGemv)
    monkeypatch.setattr(fused_decode, "cute_available", lambda: (True, ""))
    monkeypatch.setattr(fused_decode, "check_fused_decode", lambda *a, **kw: None)
    ragged, converted, real_layout = [], [], InputBatch.layout
    real_convert = fused_decode.verify_as_decode_rows

    def layout(batch, rows, starts, token_ids, query_lens=None, sample=None, spec_lens=None):
        ragged.append(spec_lens is not None)
        return real_layout(batch, rows, starts, token_ids, query_lens, sample, spec_lens)

    def convert(*args):
        decode = real_convert(*args)
        converted.append(decode is not None)
        return decode

    monkeypatch.setattr(InputBatch, "layout", layout)
    monkeypatch.setattr(fused_decode, "verify_as_decode_rows", convert)
    spec = {**NGRAM, "num_speculative_tokens": 3}
    prompt = repetitive_prompts(1, seed=3)[0]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    (out,), engine = generate(tiny_qwen2, [prompt], params, spec=spec, max_num_seqs=1,
                              fused_decode=True)
    assert engine.runner.fused is not None and engine.spec.stats.num_drafts > 0
    assert not any(ragged) and not any(converted)
