"""GPU checks of the batched sampler: the same distribution, greedy tokens and logprobs on
CUDA as the per-row references on the CPU (tests/test_sampler.py), with the logprobs copied
through pinned memory and penalties counted on the device across overlapped steps."""

import pytest
import torch

from flashlet.sampler import Sampler
from flashlet.sampling import SamplingParams
from tests.test_sampler import VOCAB, ref_penalties, ref_probs, request, total_variation

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_draws_greedy_and_logprobs_match_the_references():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    sampled = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, logprobs=2,
                             presence_penalty=0.5, repetition_penalty=1.2)
    greedy = SamplingParams(logprobs=2, frequency_penalty=0.7)
    n = 20000
    reqs = [request(i, sampled if i % 2 else greedy, output=[]) for i in range(n)]
    sampler = Sampler(torch.device("cuda"), {1})
    out = sampler.sample(logits.cuda().expand(n, VOCAB).contiguous(), reqs)
    torch.cuda.synchronize()
    tokens = out.tokens.cpu().tolist()
    want = ref_probs(ref_penalties(logits, [3, 4, 5], [], sampled), sampled)
    assert total_variation(tokens[1::2], want) < 0.03
    assert set(tokens[0::2]) == {int(ref_penalties(logits, [3, 4, 5], [], greedy).argmax())}
    raw = torch.log_softmax(logits, -1)
    for row in (0, 1, n - 1):
        lp = out.logprobs.get(row)
        assert lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(raw[tokens[row]].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == raw.topk(2).indices.tolist()


def test_engine_on_cuda_with_penalties_and_logprobs_overlapped(tiny_qwen2):
    from flashlet import LLM

    params = SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                            logprobs=1)
    outs = {}
    for overlap in (False, True):
        llm = LLM(str(tiny_qwen2), device="cuda", overlap=overlap)
        outs[overlap] = llm.generate([[5, 6, 7], [9, 9]], params)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids  # counts updated on the device, in time for overlap
        assert len(b.logprobs) == len(b.token_ids)
