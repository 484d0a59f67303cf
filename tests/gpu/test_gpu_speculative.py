"""GPU checks of speculative decoding with the n-gram proposer: greedy output identical to no
speculation on each backend (verify steps in mixed-step graphs on triton, eager elsewhere),
sampled requests through the sampling kernel's neighbours (seeded runs reproduce, logprobs come
with every accepted token), and pages all returned."""

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from tests.conftest import run_to_completion, save_tiny_model
from tests.test_speculative import NGRAM, repetitive_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64: every backend's kernels take it.
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2-d64"), hidden_size=256,
                           intermediate_size=512)


def run(model_dir, prompts, params, spec=None, **config):
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", page_size=16,
                                 max_num_pages=512, max_num_seqs=16, speculative_config=spec,
                                 **config))
    return run_to_completion(engine, prompts, params), engine


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "torch"])
def test_greedy_output_identical_with_ngram(model_dir, backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    prompts = repetitive_prompts(6)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    # fp32: the verify step's attention (a prefill kernel) and the decode kernel round alike.
    plain, _ = run(model_dir, prompts, params, backend=backend, dtype="float32")
    spec, engine = run(model_dir, prompts, params, NGRAM, backend=backend, dtype="float32")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    engine.reset_prefix_cache()
    assert engine.stats()["kv_pages_used"] == 0


def test_one_stream_bf16_mostly_agrees_and_accepts(model_dir):
    """bf16 with the defaults (graphs, the fused path where it applies): near-ties may round
    the other way in a verify step, so the outputs agree on a long prefix, not to the end."""
    prompt = repetitive_prompts(1, seed=3)[0]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    (plain,), _ = run(model_dir, [prompt], params)
    (spec,), engine = run(model_dir, [prompt], params, NGRAM)
    same = next((i for i, (a, b) in enumerate(zip(spec.token_ids, plain.token_ids)) if a != b),
                len(plain.token_ids))
    assert same >= 16
    assert engine.stats()["spec_mean_accepted_length"] > 1


def test_sampled_requests_reproduce_with_seeds_and_carry_logprobs(model_dir):
    prompts = repetitive_prompts(4, seed=2)
    params = SamplingParams(max_new_tokens=32, temperature=0.5, top_p=0.9, seed=5, logprobs=2,
                            repetition_penalty=1.1, ignore_eos=True)
    first, engine = run(model_dir, prompts, params, NGRAM)
    second, _ = run(model_dir, prompts, params, NGRAM)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    for out in first:
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert engine.stats()["spec_num_drafts"] > 0


def test_one_stream_speculating_captures_every_graph_at_start(model_dir):
    """bf16, one stream, k = 3 (verify steps of 4 tokens: fused where the path runs): every
    graph a speculating step replays (the greedy-token graphs of the verify sizes too) is
    captured at start, none while serving."""
    spec = {**NGRAM, "num_speculative_tokens": 3}
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", page_size=16,
                                 max_num_pages=512, max_num_seqs=1, speculative_config=spec))
    graphs = set(engine.runner.graphs)
    run_to_completion(engine, repetitive_prompts(2, seed=4),
                      SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert set(engine.runner.graphs) == graphs, set(engine.runner.graphs) - graphs
