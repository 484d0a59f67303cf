"""Prompt logprobs (SamplingParams.prompt_logprobs) on a tiny random model, held to transformers
fp32 on the same weights: in one step, under chunked prefill, with the prompt in the prefix
cache, after a preemption; requests that do not ask get none and lose no cache hit."""

import pytest
import torch

from flashlet import LLM, SamplingParams
from flashlet.config import EngineConfig
from flashlet.core.engine import Engine

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(45)]  # 45 tokens: several pages and chunks


@pytest.fixture(scope="module")
def hf_logprobs(tiny_qwen2):
    """transformers' fp32 log-softmax at every position of PROMPT: [P, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def engine_of(model_dir, **config) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **config))


def run(engine: Engine, params: SamplingParams, prompt=PROMPT):
    rid = engine.add_request(list(prompt), params)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    engine.check_integrity()
    return outputs


def check_against_hf(entries, hf_logprobs, k):
    assert len(entries) == len(PROMPT) and entries[0] is None
    for t, entry in enumerate(entries[1:], start=1):
        expected = hf_logprobs[t - 1]
        assert entry.token_id == PROMPT[t]
        assert entry.logprob == pytest.approx(expected[PROMPT[t]].item(), abs=1e-4)
        assert entry.rank == int((expected > expected[PROMPT[t]]).sum()) + 1
        values, ids = expected.topk(k)
        assert [i for i, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_equal_transformers_fp32(tiny_qwen2, hf_logprobs):
    outputs = run(engine_of(tiny_qwen2), SamplingParams(max_new_tokens=3, prompt_logprobs=2,
                                                        ignore_eos=True))
    first, final = outputs[0], outputs[-1]
    check_against_hf(final.prompt_logprobs, hf_logprobs, 2)
    assert first.prompt_logprobs == final.prompt_logprobs  # with the first token too
    assert all(o.prompt_logprobs is None for o in outputs[1:-1])


def test_chunked_prefill_scores_every_chunk(tiny_qwen2, hf_logprobs):
    engine = engine_of(tiny_qwen2, max_num_batched_tokens=8, max_num_seqs=4)
    # A second request shares the steps, so the scored rows sit after another row's.
    other = engine.add_request(PROMPT[:20], SamplingParams(max_new_tokens=4, ignore_eos=True))
    outputs = run(engine, SamplingParams(max_new_tokens=2, prompt_logprobs=0, ignore_eos=True))
    check_against_hf(outputs[-1].prompt_logprobs, hf_logprobs, 0)
    assert other not in engine.scheduler.requests


def test_cached_prefix_is_recomputed_for_a_scoring_request(tiny_qwen2, hf_logprobs):
    engine = engine_of(tiny_qwen2)
    run(engine, SamplingParams(max_new_tokens=1))  # the prompt's pages into the prefix cache
    scored = run(engine, SamplingParams(max_new_tokens=1, prompt_logprobs=1))[-1]
    assert scored.num_cached_tokens == 0
    check_against_hf(scored.prompt_logprobs, hf_logprobs, 1)
    plain = run(engine, SamplingParams(max_new_tokens=1))[-1]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert engine.kv_pool.allocator.num_used == engine.scheduler.cache.num_pages  # no leak


def test_a_preempted_scoring_request_scores_each_token_once(tiny_qwen2, hf_logprobs):
    # 6 pages of 16 tokens: the two requests cannot both hold their prompt and output.
    engine = engine_of(tiny_qwen2, max_num_pages=6, max_num_batched_tokens=16, max_num_seqs=4,
                       enable_prefix_cache=False)
    engine.add_request(PROMPT[:40], SamplingParams(max_new_tokens=40, ignore_eos=True))
    outputs = run(engine, SamplingParams(max_new_tokens=20, prompt_logprobs=1, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    check_against_hf(outputs[-1].prompt_logprobs, hf_logprobs, 1)
    assert engine.kv_pool.allocator.num_used == 0


def test_llm_generate_returns_prompt_logprobs_only_when_asked(tiny_qwen2, hf_logprobs):
    llm = LLM(str(tiny_qwen2))
    asked = llm.generate([PROMPT], SamplingParams(max_new_tokens=2, prompt_logprobs=0))[0]
    plain = llm.generate([PROMPT], SamplingParams(max_new_tokens=2))[0]
    check_against_hf(asked.prompt_logprobs, hf_logprobs, 0)
    assert plain.prompt_logprobs is None
    assert asked.token_ids == plain.token_ids  # scoring the prompt changes no output token


def test_samples_of_a_prompt_share_its_prompt_logprobs(tiny_qwen2, hf_logprobs):
    """The first sample scores the prompt; the others find its pages in the prefix cache."""
    llm = LLM(str(tiny_qwen2))
    outs = llm.generate([PROMPT], SamplingParams(max_new_tokens=3, temperature=1.0, seed=2,
                                                 n=2, best_of=3, prompt_logprobs=1))
    assert len(outs) == 2
    for out in outs:
        check_against_hf(out.prompt_logprobs, hf_logprobs, 1)
    assert llm.engine.kv_pool.allocator.num_used == llm.engine.scheduler.cache.num_pages


def test_one_token_prompt_has_only_the_null_entry(tiny_qwen2):
    out = run(engine_of(tiny_qwen2), SamplingParams(max_new_tokens=1, prompt_logprobs=3),
              prompt=[5])[-1]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_is_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_tensor_parallel_engine_refuses_prompt_logprobs(tiny_qwen2):
    """Its workers run rank 0's steps without the scored rows' LM head: refused, by name."""
    engine = engine_of(tiny_qwen2)
    engine.tp = object()  # what check_request looks at; nothing runs
    try:
        with pytest.raises(ValueError, match="prompt_logprobs.*tensor parallelism"):
            engine.check_request(5, SamplingParams(prompt_logprobs=0))
    finally:
        engine.tp = None
