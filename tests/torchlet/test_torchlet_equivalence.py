"""Every rung generates exactly v00's greedy tokens, and v00 generates exactly what transformers'
own greedy `generate` does: on tiny random Qwen2 and Llama models (fp32) and on the demo model."""

from collections import Counter

import pytest
import torch
from torchlet_testing import (
    DEVICE,
    TRITON_VERSIONS,
    llm_class,
    make_llm,
    skip_unless_runnable,
    token_ids,
)

import torchlet

MAX_NEW_TOKENS = 8
LATER_VERSIONS = torchlet.VERSIONS[1:]
KINDS = ["qwen2", "llama"]
# Small engines: 2 slots for 5 prompts (admission while decoding), 4-token pages (page crossings)
SMALL_ENGINE = dict(max_batch_size=2, page_size=4, max_seq_len=64)


def v00_completions(model_dir, prompts, eos_token_ids=None):
    llm = make_llm("v00_full_recompute", model_dir)
    if eos_token_ids is not None:
        llm.eos_token_ids = eos_token_ids
    return llm.generate(prompts, max_new_tokens=MAX_NEW_TOKENS)


def staggered_eos(outputs: list[list[int]]) -> int:
    """A token that, used as EOS, stops the requests at as many different steps as possible."""
    stop_steps: dict[int, set[int]] = {}  # token -> steps at which it would stop some request
    for output in outputs:
        for step, token in enumerate(output[:-1]):  # not the last: a genuinely early stop
            if token not in output[:step]:
                stop_steps.setdefault(token, set()).add(step)
    return max(sorted(stop_steps), key=lambda token: len(stop_steps[token]))


@pytest.fixture(scope="module")
def reference(tiny_model_dirs, tiny_prompts):
    """v00's tokens per tiny model: plain, and with an EOS that stops requests at different
    steps."""
    result = {}
    for kind, model_dir in tiny_model_dirs.items():
        plain = token_ids(v00_completions(model_dir, tiny_prompts))
        eos = staggered_eos(plain)
        stopped = v00_completions(model_dir, tiny_prompts, eos_token_ids={eos})
        result[kind] = {"plain": plain, "eos": eos, "stopped": stopped}
    return result


@pytest.mark.parametrize("kind", KINDS)
def test_v00_matches_transformers_greedy_generate(kind, tiny_model_dirs, tiny_prompts):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[kind]
    ours = v00_completions(model_dir, tiny_prompts)
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for prompt, completion in zip(tiny_prompts, ours):
        input_ids = torch.tensor([prompt])
        expected = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert completion.token_ids == expected


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_models_are_not_degenerate(kind, reference):
    """The equivalence tests only mean something if greedy outputs depend on the prompt."""
    outputs = reference[kind]["plain"]
    assert len({tuple(output) for output in outputs}) == len(outputs)
    assert len(set().union(*outputs)) >= 10
    finish_steps = Counter(len(c.token_ids) for c in reference[kind]["stopped"])
    assert len(finish_steps) >= 2, "the EOS run should retire requests at different steps"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("version", LATER_VERSIONS)
def test_same_tokens_as_v00(version, kind, tiny_model_dirs, tiny_prompts, reference):
    skip_unless_runnable(version)
    llm = make_llm(version, tiny_model_dirs[kind], max_batch_size=len(tiny_prompts))
    completions = llm.generate(tiny_prompts, max_new_tokens=MAX_NEW_TOKENS)
    assert token_ids(completions) == reference[kind]["plain"]
    assert all(c.text is None for c in completions)  # no tokenizer in the tiny folders


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("version", LATER_VERSIONS)
def test_same_tokens_as_v00_with_early_stops_in_a_small_engine(
    version, kind, tiny_model_dirs, tiny_prompts, reference
):
    """EOS retires requests at different steps; with 2 slots the others are admitted meanwhile;
    4-token pages make sequences cross page boundaries."""
    skip_unless_runnable(version)
    llm = make_llm(version, tiny_model_dirs[kind], **SMALL_ENGINE)
    llm.eos_token_ids = {reference[kind]["eos"]}
    completions = llm.generate(tiny_prompts, max_new_tokens=MAX_NEW_TOKENS)
    expected = reference[kind]["stopped"]
    assert token_ids(completions) == token_ids(expected)
    assert [c.finish_reason for c in completions] == [c.finish_reason for c in expected]


@pytest.mark.parametrize("version", torchlet.VERSIONS)
def test_ignore_eos_generates_max_new_tokens(version, tiny_model_dirs, tiny_prompts, reference):
    skip_unless_runnable(version)
    if version in TRITON_VERSIONS and DEVICE == "cpu":
        pytest.skip("covered by the other Triton tests; the CPU interpreter is slow")
    llm = make_llm(version, tiny_model_dirs["qwen2"], **SMALL_ENGINE)
    llm.eos_token_ids = {reference["qwen2"]["eos"]}
    completions = llm.generate(tiny_prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    assert token_ids(completions) == reference["qwen2"]["plain"]
    assert {c.finish_reason for c in completions} == {"length"}


# --- the embedded demo model (SmolLM2-135M-Instruct, 30 layers), a few tokens --------------------

DEMO_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
DEMO_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def demo_reference(demo_model_path):
    llm = llm_class("v00_full_recompute")(demo_model_path, device=DEVICE, dtype="float32")
    return llm.generate(DEMO_PROMPTS, max_new_tokens=DEMO_NEW_TOKENS)


def test_demo_model_v00_generates_text(demo_reference):
    assert [len(c.token_ids) for c in demo_reference] == [DEMO_NEW_TOKENS] * len(DEMO_PROMPTS)
    assert all(c.text and c.text.strip() for c in demo_reference)
    assert "Paris" in demo_reference[0].text


@pytest.mark.parametrize("version", LATER_VERSIONS)
def test_demo_model_same_tokens_as_v00(version, demo_model_path, demo_reference):
    skip_unless_runnable(version)
    if version in TRITON_VERSIONS and DEVICE == "cpu":
        pytest.skip(
            "Triton's CPU interpreter is too slow for the 30-layer demo model; "
            "the Triton rungs are checked on the tiny models"
        )
    llm = make_llm(version, demo_model_path)
    completions = llm.generate(DEMO_PROMPTS, max_new_tokens=DEMO_NEW_TOKENS)
    assert token_ids(completions) == token_ids(demo_reference)
    assert [c.text for c in completions] == [c.text for c in demo_reference]
