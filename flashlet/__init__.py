"""flashlet: a pocket-sized LLM inference engine for Qwen2.5- and Llama-class models."""

import importlib

# Imported on first use (PEP 562), not on `import flashlet`: these import torch (seconds), so a
# load-generator process (`flashlet.bench.sse`) pays nothing for them, and `python -m
# flashlet.server` sets its signal handlers before anything slow runs.
_EXPORTS = {"LLM": "flashlet.llm", "SamplingParams": "flashlet.core.sampling",
            "Engine": "flashlet.core.engine", "EngineConfig": "flashlet.config",
            "RequestOutput": "flashlet.core.request", "FinishReason": "flashlet.core.request"}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashlet' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
