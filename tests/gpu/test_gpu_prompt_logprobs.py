"""GPU: prompt logprobs on each attention backend (triton with its mixed-step CUDA graphs,
flashinfer where installed) equal the torch backend's, under chunked prefill beside another
request's decodes. fp32 weights (random, at the Qwen2.5-0.5B shape), so the backends differ by
summation order only."""

import importlib.util

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [(37 * i + 11) % 5000 + 7 for i in range(300)]
BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


def prompt_logprobs(backend: str) -> list:
    engine = Engine(EngineConfig(config="qwen2.5-0.5b", backend=backend, dtype="float32",
                                 max_num_pages=256, max_num_seqs=4, max_num_batched_tokens=128,
                                 max_model_len=1024, warmup_at_start=False))
    engine.add_request(PROMPT[:40], SamplingParams(max_new_tokens=30, ignore_eos=True))
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=2, prompt_logprobs=3,
                                                    ignore_eos=True))
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    engine.check_integrity()
    return final.prompt_logprobs


@pytest.fixture(scope="module")
def reference():
    return prompt_logprobs("torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_equal_the_torch_backends(backend, reference):
    got = prompt_logprobs(backend)
    assert len(got) == len(reference) == len(PROMPT) and got[0] is None
    for ours, ref in zip(got[1:], reference[1:]):
        assert ours.token_id == ref.token_id
        assert ours.logprob == pytest.approx(ref.logprob, abs=2e-3)
        assert [v for _, v in ours.top] == pytest.approx([v for _, v in ref.top], abs=2e-3)
