"""Model hyper-parameters, read from a Hugging Face `config.json` (Qwen2 and Llama families)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "qwen2" or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of the SwiGLU feed-forward
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (fewer than query heads: grouped-query attention)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool  # Qwen2: biases on the q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool  # the LM head reuses the token embedding matrix
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @property
    def group_size(self) -> int:
        """How many query heads share one key/value head."""
        return self.num_heads // self.num_kv_heads


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` (and the EOS ids of `generation_config.json`, when there is one)."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    generation_file = model_dir / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
    return config_from_dict(raw, extra_eos=generation.get("eos_token_id"))


def config_from_dict(raw: dict, extra_eos: int | list[int] | None = None) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {supported})")
    check_supported_features(raw)
    num_heads = raw["num_attention_heads"]
    is_qwen2 = model_type == "qwen2"
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta(raw),
        qkv_bias=True if is_qwen2 else raw.get("attention_bias", False),
        o_proj_bias=False if is_qwen2 else raw.get("attention_bias", False),
        mlp_bias=False if is_qwen2 else raw.get("mlp_bias", False),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        eos_token_ids=merge_ids(raw.get("eos_token_id"), extra_eos),
    )


def rope_theta(raw: dict) -> float:
    """transformers 5 nests it in `rope_parameters`; older configs have a top-level `rope_theta`."""
    nested = raw.get("rope_parameters") or {}
    return float(nested.get("rope_theta") or raw.get("rope_theta") or 10000.0)


def check_supported_features(raw: dict) -> None:
    """Refuse what this small engine does not implement, rather than computing something else."""
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"unsupported RoPE scaling {rope_type!r}: only plain RoPE is implemented")
    if raw.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not implemented")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {raw['hidden_act']!r}: only SwiGLU (silu)")


def merge_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else value or []:
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
