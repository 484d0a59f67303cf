"""Helpers shared by the torchlet tests: tiny random models, loading a rung by name, skips."""

from __future__ import annotations

import contextlib
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


def skip_unless_runnable(version: str) -> None:
    """CUDA-graph rungs skip without CUDA; Triton rungs need CUDA or the interpreter."""
    if version in CUDA_ONLY_VERSIONS and not torch.cuda.is_available():
        pytest.skip(f"needs CUDA: {CUDA_ONLY_VERSIONS[version]}")
    if version in TRITON_VERSIONS and not triton_can_run():
        pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before triton was first imported")


def make_llm(version: str, model_dir, **options):
    """The rung's engine in fp32 on the test device; options it does not take are dropped."""
    import inspect

    cls = llm_class(version)
    accepted = inspect.signature(cls.__init__).parameters
    kept = {name: value for name, value in options.items() if name in accepted}
    return cls(str(model_dir), device=DEVICE, dtype="float32", **kept)


def token_ids(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]
