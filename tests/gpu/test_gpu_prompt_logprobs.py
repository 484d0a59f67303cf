"""GPU: prompt logprobs on each attention backend (triton with its mixed-step CUDA graphs,
flashinfer where installed) equal the torch backend's, under chunked prefill beside another
request's decodes; random weights at the Qwen2.5-0.5B shape. Triton in fp32 (the backends then
differ by summation order only: tight), FlashInfer in bf16 (it has no fp32 path: within bf16's
rounding on average, bounded at worst)."""

import importlib.util

import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [(37 * i + 11) % 5000 + 7 for i in range(300)]
# (backend, dtype, mean |difference| bound, max |difference| bound)
CASES = [("triton", "float32", 5e-4, 2e-3)] + (
    [("flashinfer", "bfloat16", 0.03, 0.3)] if importlib.util.find_spec("flashinfer") else [])


def prompt_logprobs(backend: str, dtype: str) -> list:
    engine = Engine(EngineConfig(config="qwen2.5-0.5b", backend=backend, dtype=dtype,
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


@pytest.mark.parametrize("backend,dtype,mean_bound,max_bound", CASES,
                         ids=[c[0] for c in CASES])
def test_prompt_logprobs_equal_the_torch_backends(backend, dtype, mean_bound, max_bound):
    reference = prompt_logprobs("torch", dtype)
    got = prompt_logprobs(backend, dtype)
    assert len(got) == len(reference) == len(PROMPT) and got[0] is None
    assert [e.token_id for e in got[1:]] == PROMPT[1:]
    diffs = torch.tensor([abs(ours.logprob - ref.logprob)
                          for ours, ref in zip(got[1:], reference[1:])])
    assert diffs.mean() < mean_bound and diffs.max() < max_bound, (diffs.mean(), diffs.max())
