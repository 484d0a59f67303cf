"""Helpers shared by the torchlet tests: tiny random models, loading a rung by name, skips."""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY_VERSIONS = {"v07_cuda_graph": "v07 records the decode step as a CUDA graph"}
TRITON_VERSIONS = ("v09_triton_basics", "v10_triton_paged_gqa")

TINY_CONFIGS = {
    # odd sizes on purpose: 3 query heads per K/V head, head_dim 12, hidden 48, tied embeddings
    "qwen2": dict(
        vocab_size=320,
        hidden_size=48,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=True,
        eos_token_id=1,
    ),
    # one K/V head for four query heads (multi-query), untied LM head
    "llama": dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=136,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        tie_word_embeddings=False,
        eos_token_id=1,
    ),
}


def save_tiny_model(kind: str, folder, seed: int = 0):
    """A tiny random model saved as a HF folder. Weights larger than the default init, random
    biases and norm weights: greedy choices depend on the context and every tensor matters."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIGS[kind]))
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIGS[kind]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0, 0.3)
            else:
                param.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def single_cpu_thread():
    """Tiny models gain nothing from threads, and on a busy CPU the hand-offs between threads
    dominate: run torch on one thread (CPU only), then restore the setting."""
    if torch.cuda.is_available():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def llm_class(version: str):
    return importlib.import_module(f"torchlet.{version}.llm").LLM


def triton_can_run() -> bool:
    """A GPU, or Triton's interpreter selected before triton was first imported."""
    if torch.cuda.is_available():
        return True
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


@functools.cache
def triton_interpreter_multiplies_bf16() -> bool:
    """Whether Triton's CPU interpreter multiplies two bf16 tensors correctly. Triton 3.9's keeps
    bf16 as uint16 and runs arithmetic on the bit patterns (products come out wildly wrong), so
    bf16 Triton kernels can only be checked on a GPU there; a fixed interpreter passes this."""
    import triton
    import triton.language as tl

    @triton.jit
    def multiply(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(a_ptr + offsets) * tl.load(b_ptr + offsets))

    a = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.bfloat16)
    b = torch.tensor([1.5, 0.25, -4.0, 2.0], dtype=torch.bfloat16)
    out = torch.empty_like(a)
    multiply[(1,)](a, b, out, BLOCK=4)
    return torch.equal(out, a * b)


def skip_unless_runnable(version: str) -> None:
    """CUDA-graph rungs skip without CUDA; Triton rungs need CUDA or the interpreter."""
    if version in CUDA_ONLY_VERSIONS and not torch.cuda.is_available():
        pytest.skip(f"needs CUDA: {CUDA_ONLY_VERSIONS[version]}")
    if version in TRITON_VERSIONS and not triton_can_run():
        pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before triton was first imported")


def make_llm(version: str, model_dir, dtype: str = "float32", **options):
    """The rung's engine on the test device (fp32 unless told); options it does not take are
    dropped."""
    import inspect

    cls = llm_class(version)
    accepted = inspect.signature(cls.__init__).parameters
    kept = {name: value for name, value in options.items() if name in accepted}
    return cls(str(model_dir), device=DEVICE, dtype=dtype, **kept)


def token_ids(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


# --- bf16: greedy tokens may part ways, but only between near-ties ------------------------------

TOP_K = 5


def in_top_k(token: int, logits: torch.Tensor, k: int = TOP_K) -> bool:
    """Whether fewer than k tokens score strictly higher than `token`: ties count in its favour,
    so the answer does not depend on how a top-k routine orders equal (bf16-rounded) logits."""
    return int((logits > logits[token]).sum()) < k


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def next_token_logits(llm, prefix: list[int]) -> torch.Tensor:
    """The logits [vocab_size] from which `llm` picks the token after `prefix` (token ids).

    Works for every rung without touching its code: the rung's own generate(max_new_tokens=1)
    runs while an instance-level wrapper around `llm.model.logits` (every rung's LM-head method,
    called exactly once for a one-token generation: v00's next_token, or the later rungs'
    prefill) records what it returns. The recorded row's argmax must be the token generated."""
    model = llm.model
    calls = []
    unwrapped = model.logits

    def recording_logits(hidden):
        logits = unwrapped(hidden)
        calls.append(logits.detach().float().clone())
        return logits

    model.logits = recording_logits  # shadows the class's method on this instance only
    try:
        [completion] = llm.generate([prefix], max_new_tokens=1, ignore_eos=True)
    finally:
        del model.logits
    assert len(calls) == 1 and calls[0].shape[0] == 1, "expected one [1, vocab] logits call"
    logits = calls[0][0]
    assert completion.token_ids == [int(logits.argmax())], "recorded logits are not the ones used"
    return logits


def check_greedy_tokens_near(reference_llm, llm, prompt, reference_tokens, tokens, k=TOP_K):
    """The bf16 rule: two engines' greedy tokens for `prompt` are identical, or, at the first
    position where they differ, each side's token is in the other side's top k there (the logits
    of each engine after the same prefix: the prompt and the tokens both generated before).
    Each side's logits there come from a one-prompt run of its own generate over that prefix
    (next_token_logits), not from the batched step that produced the differing token.
    Returns "identical" or f"top-{k}"; raises AssertionError otherwise."""
    position = first_difference(reference_tokens, tokens)
    if position is None:
        return "identical"
    assert position < min(len(reference_tokens), len(tokens)), "one side stopped early"
    prefix = list(prompt) + list(tokens[:position])
    reference_token, token = reference_tokens[position], tokens[position]
    reference_logits = next_token_logits(reference_llm, prefix)
    logits = next_token_logits(llm, prefix)
    where = f"prompt {list(prompt)}, first difference at new token {position}"
    assert in_top_k(reference_token, logits, k), (
        f"{where}: the reference's token {reference_token} is not in the engine's top {k} "
        f"{logits.topk(k).indices.tolist()}"
    )
    assert in_top_k(token, reference_logits, k), (
        f"{where}: the engine's token {token} is not in the reference's top {k} "
        f"{reference_logits.topk(k).indices.tolist()}"
    )
    return f"top-{k}"
