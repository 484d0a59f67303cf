"""GPU: the draft proposer on CUDA (its decode steps replayed from the runner's CUDA graphs, fed
the previous step's tokens on the device) proposes what a plain engine on the draft model
generates greedily, round after round of partial acceptance, and frees every page.

fp32, so the proposer's steps (a short catch-up chunk over cached K/V, then graphed decodes)
and the reference engine's (a whole prefill, then decodes) differ by summation order only."""

import random

import pytest
import torch

from flashlet import LLM, EngineConfig, SamplingParams
from flashlet.core.request import Request
from flashlet.spec.draft import DraftProposer
from flashlet.spec.api import SpeculativeConfig
from tests.conftest import save_near_copy, save_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


HEAD_DIM_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2)


def backend_or_skip(name):
    if name == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    return name


@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_gpu_proposals_follow_the_drafts_greedy_run_through_rollbacks(tmp_path, backend):
    backend = backend_or_skip(backend)
    # head_dim 64, which every backend's kernels take; one vocabulary of 256 tokens.
    target = save_tiny_model("qwen2", tmp_path / "target", **HEAD_DIM_64)
    draft = save_tiny_model("llama", tmp_path / "draft", seed=3, num_hidden_layers=1,
                            **HEAD_DIM_64)
    config = dict(backend=backend, dtype="float32", device="cuda", page_size=16,
                  max_num_seqs=4, max_num_batched_tokens=64, warmup_at_start=False)
    proposer = DraftProposer(EngineConfig(model=str(target), max_num_pages=64, **config),
                             SpeculativeConfig("draft", 4, model=str(draft)))
    proposer.warm_up()
    captured = len(proposer.runner.graphs)
    assert captured, "the draft's decode steps replay CUDA graphs"
    reference = LLM(str(draft), enable_prefix_cache=False, max_num_pages=64, **config)
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    rng = random.Random(0)
    reqs = [Request(i, [rng.randrange(2, 256) for _ in range(n)], SamplingParams())
            for i, n in enumerate((3, 40, 100))]
    for _ in range(6):
        drafted = proposer.propose(reqs, 4)
        for req, tokens in zip(reqs, drafted):
            context = req.prompt_token_ids + req.output_token_ids
            assert tokens == reference.generate([context], greedy)[0].token_ids
            accepted = rng.randrange(0, 5)
            req.output_token_ids += tokens[:accepted] + [rng.randrange(2, 256)]
            proposer.on_accepted(req, accepted)
        proposer.check_integrity()
    if backend != "torch":  # its graphs also key on a page-table width (flashlet/core/warmup.py)
        assert len(proposer.runner.graphs) == captured, "a graph was captured after warm-up"
    for req in reqs:
        proposer.release(req)
    assert proposer.num_free_pages == proposer.kv_pool.num_pages


near_copy = save_near_copy  # the model with slightly perturbed weights


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_engine_greedy_output_is_identical_with_a_draft(tmp_path, backend):
    pytest.importorskip("flashlet.spec.speculative",
                        reason="needs the engine side of speculative decoding (speculative.py)")
    backend = backend_or_skip(backend)
    from flashlet import Engine

    target = save_tiny_model("qwen2", tmp_path / "target", **HEAD_DIM_64)
    draft = near_copy(target, tmp_path / "draft")
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    outputs, engines = [], []
    for spec in (None, {"model": str(draft), "num_speculative_tokens": 4}):
        engine = Engine(EngineConfig(model=str(target), backend=backend, dtype="float32",
                                     device="cuda", page_size=16, max_num_pages=128,
                                     max_num_seqs=8, speculative_config=spec))
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        outputs.append([done[i].token_ids for i in ids])
        engines.append(engine)
    assert outputs[1] == outputs[0]
    assert engines[1].stats()["spec_num_accepted_tokens"] > 0
    proposer = engines[1].spec.proposer
    assert proposer.num_free_pages == proposer.kv_pool.num_pages


def test_gpu_the_drafts_steps_replay_the_fused_greedy_graphs(tmp_path):
    """bf16 on sm_90+ with the CuTe DSL: the draft (here the target itself) decodes on the fused
    path, each one-token step replaying a greedy-token graph captured at warm-up, and (one
    model proposing for itself) nearly every proposal is accepted."""
    from flashlet import Engine
    from flashlet.kernels.cute_gemv import cute_available

    if torch.cuda.get_device_capability()[0] < 9 or not cute_available()[0]:
        pytest.skip("the fused decode path needs sm_90+ and the CuTe DSL")
    target = save_tiny_model("qwen2", tmp_path / "target", **HEAD_DIM_64)
    spec = {"model": str(target), "num_speculative_tokens": 3}
    engine = Engine(EngineConfig(model=str(target), backend="triton", dtype="bfloat16",
                                 device="cuda", page_size=16, max_num_pages=128, max_num_seqs=1,
                                 speculative_config=spec))
    proposer = engine.spec.proposer
    assert proposer.runner.fused is not None, "auto left the draft per-op"
    captured, fused_steps = len(proposer.runner.graphs), [0]
    greedy_tokens = proposer.runner.greedy_tokens

    def counted(*args):
        tokens = greedy_tokens(*args)
        fused_steps[0] += tokens is not None
        return tokens

    proposer.runner.greedy_tokens = counted
    rng = random.Random(5)
    engine.add_request([rng.randrange(2, 256) for _ in range(30)],
                       SamplingParams(max_new_tokens=64, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert fused_steps[0] >= 2 * stats["spec_num_drafts"], stats  # k - 1 decodes a propose
    assert len(proposer.runner.graphs) == captured, "a graph was captured after warm-up"
    assert stats["spec_acceptance_rate"] > 0.7, stats  # bf16: a near tie may round apart
    assert proposer.num_free_pages == proposer.kv_pool.num_pages
