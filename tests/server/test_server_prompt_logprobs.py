"""Prompt logprobs through the server (issue 33) on the demo model: lm-eval's exact
loglikelihood request (echo + logprobs + max_tokens 1) held to transformers fp32 on the same
weights, max_tokens 0 (score only), vLLM's prompt_logprobs on both endpoints, streamed echo,
and generated logprob tokens that concatenate to the text (no <|im_end|>)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from server_helpers import MODEL_NAME, parse_sse

pytestmark = pytest.mark.slow

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = [" Paris", " Berlin"]


@pytest.fixture(scope="module")
def tokenizer(engine_loop):
    return engine_loop.tokenizer


@pytest.fixture(scope="module")
def hf_model(demo_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """transformers fp32: log p(ids[t] | ids[:t]) for t >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_loglikelihood_request_matches_transformers(server, tokenizer, hf_model, idle):
    prompts = [tokenizer.encode(CONTEXT + c) for c in CHOICES]
    for max_tokens in (1, 0):  # lm-eval's shape, and the legacy score-only one
        body = post(server, "/v1/completions", {
            "model": MODEL_NAME, "prompt": prompts, "echo": True, "logprobs": 1,
            "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
        assert body["usage"]["completion_tokens"] == 0 if max_tokens == 0 else 2
        for choice, ids in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            expected = hf_prompt_logprobs(hf_model, ids)
            assert lp["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-4)
            assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
            # lm-eval's is_greedy test: the token's logprob against the best alternative.
            for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
                assert value <= max(top.values()) + 1e-6
            assert "".join(lp["tokens"]) == choice["text"]
            assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
            if max_tokens == 0:
                assert choice["text"] == tokenizer.decode(ids)
                assert choice["finish_reason"] == "length"


def test_vllm_prompt_logprobs_on_both_endpoints(server, tokenizer, hf_model, idle):
    ids = tokenizer.encode(CONTEXT + CHOICES[0])
    body = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": ids,
                                            "max_tokens": 2, "temperature": 0,
                                            "prompt_logprobs": 2})
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    expected = hf_prompt_logprobs(hf_model, ids)
    for t, entry in enumerate(scored[1:], start=1):
        assert str(ids[t]) in entry and 2 <= len(entry) <= 3
        assert entry[str(ids[t])]["logprob"] == pytest.approx(expected[t - 1], abs=1e-4)
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2]
    chat = post(server, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "temperature": 0, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 5
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # k = 0: the token itself
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=300, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0, "stream": True}) as r:
        chunks = [c for c in parse_sse(r.iter_lines()) if isinstance(c, dict)]
    streamed = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
    assert streamed == [chat["prompt_logprobs"]]


def test_streamed_echo_carries_the_prompt_logprobs(server, tokenizer, idle):
    body = {"model": MODEL_NAME, "prompt": CONTEXT, "echo": True, "logprobs": 1,
            "max_tokens": 3, "temperature": 0}
    whole = post(server, "/v1/completions", body)["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:
        chunks = [c for c in parse_sse(r.iter_lines()) if isinstance(c, dict) and c["choices"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    streamed = [v for c in chunks if c["choices"][0]["logprobs"]
                for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert text == whole["text"]
    assert streamed == pytest.approx(whole["logprobs"]["token_logprobs"])


def test_generated_logprob_tokens_are_the_text(server, idle):
    """A reply that ends on <|im_end|>: the chat logprobs leave it out, as the text does. (The
    two requests run side by side: their decode steps are shared.)"""
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(post, server, "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": [{"role": "user", "content":
                                               "What is the capital of France?"}],
            "max_tokens": 40, "temperature": 0, "logprobs": True})
        plain = pool.submit(post, server, "/v1/completions", {
            "model": MODEL_NAME,
            "prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            "max_tokens": 40, "temperature": 0, "logprobs": 0})
        choice, completion = chat.result()["choices"][0], plain.result()["choices"][0]
    assert choice["finish_reason"] == "stop"
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    assert "".join(tokens) == choice["message"]["content"] and "<|im_end|>" not in tokens
    assert "".join(completion["logprobs"]["tokens"]) == completion["text"]