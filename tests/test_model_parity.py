"""Our forward pass against Hugging Face transformers on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashlet import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], list(range(20, 60)), [200] * 5 + [9, 8, 7]]


def record_logits(llm):
    """Keep every step's sampled-row logits (in step order); returns (them, stop keeping)."""
    seen = []
    stop = llm.engine.observe_steps(lambda meta, logits: seen.append(logits.clone()))
    return seen, stop


def hf_greedy(model_dir, prompt, n):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # exactly n tokens, as ignore_eos does on our side
    ids = torch.tensor([prompt])
    out = hf.generate(ids, max_new_tokens=n, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


def test_logits_and_greedy_tokens_match_transformers(tiny_model):
    llm = LLM(str(tiny_model))
    for prompt in PROMPTS[:2]:
        seen, stop = record_logits(llm)
        out = llm.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
        stop()
        ref_tokens, ref_logits = hf_greedy(tiny_model, prompt, 32)
        ours = torch.cat(seen)
        assert out.token_ids == ref_tokens
        assert ours.shape == ref_logits.shape
        assert (ours - ref_logits).abs().max().item() < 1e-4


def test_greedy_tokens_are_the_argmax_of_the_fp32_logits(tiny_model):
    """Model.greedy_tokens (the per-op greedy decode graph's end) takes the argmax of the LM
    head's bf16 logits: the same token as compute_logits' fp32 copy, ties included (a row of
    equal hidden states, and a head with two equal rows)."""
    from flashlet import Engine, EngineConfig

    model = Engine(EngineConfig(model=str(tiny_model), device="cpu", dtype="bfloat16")).model
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, model.config.hidden_size, generator=generator).to(torch.bfloat16)
    hidden[3] = hidden[2]
    with torch.inference_mode():
        head = model.lm_head_weight
        saved = head[[5, 7]].clone()
        head[5] = head[7] = hidden[0] * 4  # row 0's largest logit, at two ids: the first wins
        try:
            tokens, logits = model.greedy_tokens(hidden), model.compute_logits(hidden)
        finally:
            head[[5, 7]] = saved
    assert logits.dtype == torch.float32 and tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[0] == 5 and logits[0, 5] == logits[0, 7] and tokens[3] == tokens[2]


def test_ragged_batch_equals_each_prompt_alone(tiny_model):
    llm = LLM(str(tiny_model))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    together = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        alone = LLM(str(tiny_model), enable_prefix_cache=False).generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids


@pytest.mark.slow
def test_demo_model_matches_transformers_token_for_token(demo_llm, demo_model_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outs = demo_llm.generate(prompts, SamplingParams(max_new_tokens=20))
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        ids = demo_llm.tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
        n = min(len(ref), len(out.token_ids))
        assert out.token_ids[:n] == ref[:n] and n > 0
    assert "Paris" in outs[0].text
