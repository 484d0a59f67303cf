"""The draft proposer inside the engine's speculative decoding (flashlet/spec/speculative.py): greedy
output identical to decoding without speculation on each model family, through preemption and
aborts, with proposals accepted, and every draft page free once the requests are gone."""

import random

import pytest

from flashlet import Engine, EngineConfig, SamplingParams
from tests.conftest import run_to_completion, save_near_copy, save_tiny_model

pytest.importorskip("flashlet.spec.speculative",
                    reason="needs the engine side of speculative decoding (speculative.py)")


@pytest.fixture(scope="module")
def near_copies(tmp_path_factory):
    """near_copy(target folder): the target with slightly perturbed weights, a draft that agrees
    with it for a few tokens at a time (accepts and rejects both happen)."""
    made = {}

    def near_copy(folder):
        if folder not in made:
            made[folder] = save_near_copy(folder, tmp_path_factory.mktemp("near-copy"))
        return made[folder]

    return near_copy


def draft_spec(draft, k=4):
    return {"model": str(draft), "num_speculative_tokens": k}


def prompts_of(num, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(rng.randint(3, 30))] for _ in range(num)]


def run(target, prompts, params, spec=None, **config):
    engine = Engine(EngineConfig(model=str(target), page_size=4, speculative_config=spec,
                                 **config))
    return [out.token_ids for out in run_to_completion(engine, prompts, params)], engine


def assert_draft_pages_free(engine):
    proposer = engine.spec.proposer
    proposer.check_integrity()
    assert proposer.num_free_pages == proposer.kv_pool.num_pages


def test_greedy_output_is_identical_with_a_draft_model(tiny_model, near_copies):
    prompts = prompts_of(5)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain, _ = run(tiny_model, prompts, params)
    spec, engine = run(tiny_model, prompts, params, spec=draft_spec(near_copies(tiny_model)))
    assert spec == plain
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] > 0
    assert stats["num_steps"] < run(tiny_model, prompts, params)[1].stats()["num_steps"]
    assert_draft_pages_free(engine)


def test_a_draft_of_another_family_and_shape_keeps_the_output(tiny_qwen2, tmp_path):
    draft = save_tiny_model("llama", tmp_path / "draft", seed=3, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=1)
    prompts = prompts_of(4, seed=1)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain, _ = run(tiny_qwen2, prompts, params)
    spec, engine = run(tiny_qwen2, prompts, params, spec=draft_spec(draft, k=3))
    assert spec == plain
    assert engine.stats()["spec_num_drafts"] > 0
    assert_draft_pages_free(engine)


def test_preemption_under_a_small_pool_keeps_the_output(tiny_qwen2, near_copies):
    prompts = prompts_of(8, seed=2)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain, _ = run(tiny_qwen2, prompts, params, max_num_pages=64)
    spec, engine = run(tiny_qwen2, prompts, params, spec=draft_spec(near_copies(tiny_qwen2)),
                       max_num_pages=24)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert spec == plain
    assert_draft_pages_free(engine)


def test_an_abort_frees_the_requests_draft_pages(tiny_qwen2, near_copies):
    prompts = prompts_of(3, seed=3)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain, _ = run(tiny_qwen2, prompts, params)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4,
                                 speculative_config=draft_spec(near_copies(tiny_qwen2))))
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.spec.proposer.num_free_pages < engine.spec.proposer.kv_pool.num_pages
    assert engine.abort(ids[1])
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[ids[1]].finish_reason == "abort"
    assert [done[ids[i]].token_ids for i in (0, 2)] == [plain[0], plain[2]]
    assert_draft_pages_free(engine)
