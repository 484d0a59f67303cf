"""Embedding requests (SamplingParams.pooling, flashlet/runner/pooling.py) against transformers'
final hidden states on the same tiny random weights, fp32 on the CPU: last-token and mean
pooling, prompts cut into prefill chunks, batched with a generating request, a cached prefix."""

from __future__ import annotations

import pytest
import torch

from flashlet import LLM, SamplingParams
from tests.conftest import save_tiny_model

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(100, 130)), [9]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-pool"))


def reference(folder, prompt: list[int], mode: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    return torch.nn.functional.normalize(hidden[-1] if mode == "last" else hidden.mean(0), dim=0)


def run(engine, requests) -> dict:
    """Add (prompt, params) requests, step to the end; the final outputs by request id."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[i] for i in ids]


@pytest.mark.parametrize("enable_prefix_cache", [False, True])
def test_pooled_states_equal_transformers(folder, enable_prefix_cache):
    # 16-token steps: the long prompts are computed in several chunks, side by side.
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_cache=enable_prefix_cache)
    requests = [(p, SamplingParams(max_new_tokens=1, pooling=m))
                for p in PROMPTS for m in ("last", "mean")]
    requests.append((PROMPTS[0], SamplingParams(max_new_tokens=8)))  # a generation beside them
    outs = run(llm.engine, requests)
    if enable_prefix_cache:  # again: the prompts' pages are cached now
        outs = run(llm.engine, requests)
    for (prompt, params), out in zip(requests, outs):
        if params.pooling is None:
            assert out.embedding is None and len(out.token_ids) == 8
            continue
        got = torch.tensor(out.embedding)
        assert got.shape == (64,) and out.finish_reason == "length"
        torch.testing.assert_close(got, reference(folder, prompt, params.pooling),
                                   atol=1e-4, rtol=0)
    llm.engine.check_integrity()
    assert not llm.engine.pooler.modes  # nothing left behind


def test_llm_embed(folder):
    llm = LLM(str(folder), dtype="float32")
    vectors = llm.embed(PROMPTS[:2], pooling="mean")
    for prompt, vector in zip(PROMPTS, vectors):
        torch.testing.assert_close(torch.tensor(vector), reference(folder, prompt, "mean"),
                                   atol=1e-4, rtol=0)


def test_aborted_embedding_request_leaves_nothing(folder):
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=1, pooling="mean"))
    engine.step()  # its first chunk
    engine.abort(rid)
    outs = [o for o in engine.step() if o.request_id == rid]
    assert outs[0].finish_reason == "abort" and outs[0].embedding is None
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert not engine.pooler.modes and not engine.pooler._sums
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max").validate()
