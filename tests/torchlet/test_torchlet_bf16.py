"""In bf16 every rung gives v00's greedy tokens, up to near-ties.

bf16 rounds differently in different kernels, batch shapes and accumulation orders, so two
correct engines may take different greedy paths. The rule (check_greedy_tokens_near in
torchlet_testing): for each prompt the new tokens are identical, or, at the first position where
they differ, each side's token is in the other side's top 5 after the same prefix. Checked on the
tiny random Qwen2 and Llama models and on the demo model; `pytest -s` prints how many prompts
matched exactly and how many passed by the top-5 rule.

On a CPU the CUDA-graph rung skips, and so do the Triton rungs while Triton's interpreter gets
bf16 arithmetic wrong; on a GPU every rung runs.
"""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torchlet_testing import (
    DEVICE,
    TOP_K,
    TRITON_VERSIONS,
    check_greedy_tokens_near,
    first_difference,
    in_top_k,
    llm_class,
    make_llm,
    next_token_logits,
    skip_unless_runnable,
    token_ids,
    triton_interpreter_multiplies_bf16,
)

import torchlet

MAX_NEW_TOKENS = 8
LATER_VERSIONS = torchlet.VERSIONS[1:]
KINDS = ["qwen2", "llama"]
BF16 = "bfloat16"


def skip_unless_runnable_in_bf16(version: str) -> None:
    skip_unless_runnable(version)
    if version in TRITON_VERSIONS and DEVICE == "cpu" and not triton_interpreter_multiplies_bf16():
        pytest.skip(
            "Triton's CPU interpreter computes bf16 arithmetic on the raw bit patterns; "
            "the Triton rungs are checked in bf16 on a GPU"
        )


def greedy_tokens(llm, prompts, max_new_tokens=MAX_NEW_TOKENS) -> list[list[int]]:
    # ignore_eos: both sides generate max_new_tokens, an EOS is just another token here
    return token_ids(llm.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def outcomes():
    """Counts of prompts by outcome ("identical" or "top-5"), printed at the end (pytest -s)."""
    counts = Counter()
    yield counts
    print(f"\nbf16 vs v00, prompts by outcome: {dict(counts)}")


def check_against_v00(v00, llm, prompts, v00_tokens, outcomes, label):
    tokens = greedy_tokens(llm, prompts, max_new_tokens=len(v00_tokens[0]))
    results = [
        check_greedy_tokens_near(v00, llm, prompt, expected, got)
        for prompt, expected, got in zip(prompts, v00_tokens, tokens)
    ]
    outcomes.update(results)
    print(f"\n{label}: {dict(Counter(results))}")


# --- the tiny random models ------------------------------------------------------------------


@pytest.fixture(scope="module")
def v00_bf16(tiny_model_dirs, tiny_prompts):
    """{kind: (v00 engine in bf16, its tokens for the tiny prompts)}"""
    result = {}
    for kind, model_dir in tiny_model_dirs.items():
        llm = make_llm("v00_full_recompute", model_dir, dtype=BF16)
        result[kind] = (llm, greedy_tokens(llm, tiny_prompts))
    return result


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("version", LATER_VERSIONS)
def test_bf16_tokens_near_v00(version, kind, tiny_model_dirs, tiny_prompts, v00_bf16, outcomes):
    skip_unless_runnable_in_bf16(version)
    v00, v00_tokens = v00_bf16[kind]
    llm = make_llm(version, tiny_model_dirs[kind], dtype=BF16, max_batch_size=len(tiny_prompts))
    check_against_v00(v00, llm, tiny_prompts, v00_tokens, outcomes, f"{version} {kind}")


# --- the embedded demo model (SmolLM2-135M-Instruct) -----------------------------------------

DEMO_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
DEMO_NEW_TOKENS = MAX_NEW_TOKENS if DEVICE == "cuda" else 4  # 30 layers: slow-ish on a CPU


@pytest.fixture(scope="module")
def demo_v00_bf16(demo_model_path):
    """(v00 engine in bf16, the demo prompts as token ids, v00's tokens for them)"""
    llm = llm_class("v00_full_recompute")(demo_model_path, device=DEVICE, dtype=BF16)
    prompts = [llm.tokenizer(text)["input_ids"] for text in DEMO_PROMPTS]
    return llm, prompts, greedy_tokens(llm, prompts, DEMO_NEW_TOKENS)


@pytest.mark.parametrize("version", LATER_VERSIONS)
def test_demo_model_bf16_tokens_near_v00(version, demo_model_path, demo_v00_bf16, outcomes):
    skip_unless_runnable_in_bf16(version)
    v00, prompts, v00_tokens = demo_v00_bf16
    llm = make_llm(version, demo_model_path, dtype=BF16)
    check_against_v00(v00, llm, prompts, v00_tokens, outcomes, f"{version} demo")


# --- the logits capture works on every rung ----------------------------------------------------


@pytest.mark.parametrize("version", LATER_VERSIONS)
def test_next_token_logits_are_the_rungs_logits(version, tiny_model_dirs, tiny_prompts):
    """In fp32 every rung's recorded logits are v00's (so the recording reads the right row of
    the right call), and the model is left unwrapped afterwards."""
    skip_unless_runnable(version)
    model_dir = tiny_model_dirs["qwen2"]
    v00 = make_llm("v00_full_recompute", model_dir)
    llm = make_llm(version, model_dir)
    for prefix in tiny_prompts[:3]:
        expected = next_token_logits(v00, prefix)
        torch.testing.assert_close(next_token_logits(llm, prefix), expected, rtol=1e-4, atol=1e-4)
    assert "logits" not in vars(llm.model)


# --- the rule itself, on fabricated logits: it passes near-ties and catches the rest ------------


class ScriptedModel:
    def __init__(self, logits: list[float]):
        self.fixed = torch.tensor(logits)

    def logits(self, hidden):
        return self.fixed[None]  # [1, vocab_size]


class ScriptedLLM:
    """A stand-in engine whose next-token logits are fixed, whatever the prefix; its generate
    goes through model.logits like a rung's, so next_token_logits records them."""

    def __init__(self, logits: list[float]):
        self.model = ScriptedModel(logits)

    def generate(self, prompts, max_new_tokens, ignore_eos=False):
        assert len(prompts) == 1 and max_new_tokens == 1
        return [SimpleNamespace(token_ids=[int(self.model.logits(None).argmax())])]


def test_in_top_k_counts_the_strictly_higher_scores():
    logits = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0])
    assert TOP_K == 5
    assert in_top_k(4, logits) and not in_top_k(5, logits)
    assert in_top_k(5, torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]))  # a six-way tie


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_bf16_rule_passes_identical_tokens_and_near_ties():
    reference = ScriptedLLM([0, 10, 9, 8, 7, 6, 5, 1])  # picks 1; 2 is its runner-up
    engine = ScriptedLLM([0, 9, 10, 1, 2, 3, 4, 5])  # picks 2; 1 is its runner-up
    assert check_greedy_tokens_near(reference, engine, [3], [4, 1], [4, 1]) == "identical"
    assert check_greedy_tokens_near(reference, engine, [3], [4, 1], [4, 2]) == f"top-{TOP_K}"


def test_bf16_rule_fails_when_a_token_is_outside_the_others_top_k():
    reference = ScriptedLLM([0, 10, 9, 8, 7, 6, 5, 1])  # picks 1; 7 ranks seventh
    engine = ScriptedLLM([0, 9, 1, 2, 3, 4, 5, 10])  # picks 7; 1 is its runner-up
    with pytest.raises(AssertionError, match="engine's token 7 is not in the reference's top 5"):
        check_greedy_tokens_near(reference, engine, [3], [4, 1], [4, 7])
    with pytest.raises(AssertionError, match="reference's token 7 is not in the engine's top 5"):
        check_greedy_tokens_near(engine, reference, [3], [4, 7], [4, 1])
