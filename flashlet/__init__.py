"""flashlet: a pocket-sized LLM inference engine for Qwen2.5- and Llama-class models."""

from flashlet.config import EngineConfig
from flashlet.engine import Engine
from flashlet.llm import LLM
from flashlet.request import FinishReason, RequestOutput
from flashlet.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "RequestOutput", "FinishReason"]
__version__ = "0.1.0"
