"""The decoder forward pass for Qwen2 (Qwen2.5) and Llama (SmolLM2) models.

One loop covers both: embedding, then per layer RMSNorm, fused QKV projection (Qwen2 has a bias),
RoPE, paged grouped-query attention through the step's attention backend, output projection,
residual, RMSNorm, SwiGLU MLP (fused gate/up), residual; final norm and the LM head (tied to
the embedding in both families' small models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from flashlet.ops import TorchOps
from flashlet.parallel import LocalShape, local_shape

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict; raises ValueError on what we cannot run."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}: only plain RoPE is implemented")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            eos_token_ids=eos,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        layer = qkv + self.num_heads * d * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            layer += (self.num_heads + 2 * self.num_kv_heads) * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, local: LocalShape, tp=None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        # `local`: this rank's heads and MLP slice under tensor parallelism, else the model's.
        self.q_size, self.kv_size = local.num_heads * d, local.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, d
        self.eps = cfg.rms_norm_eps
        self.tp = tp
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attn_norm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * local.intermediate_size, bias=False)
        self.down_proj = nn.Linear(local.intermediate_size, h, bias=False)

    def forward(self, x, residual, positions, cos_sin, layer_idx, attn, ops):
        # x, residual: [T, hidden]
        x, residual = ops.add_rms_norm(x, residual, self.input_norm, self.eps)
        qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = attn.run_rope(layer_idx, q, k, v, positions, cos_sin, ops)  # RoPE, K/V write, attend
        x = ops.linear(o.reshape(-1, self.q_size), self.o_proj.weight)
        if self.tp is not None:  # row-parallel O: sum the ranks' partial outputs
            x = self.tp.all_reduce(x)
        x, residual = ops.add_rms_norm(x, residual, self.post_attn_norm, self.eps)
        x = ops.silu_and_mul(ops.linear(x, self.gate_up_proj.weight))
        x = ops.linear(x, self.down_proj.weight)
        if self.tp is not None:  # row-parallel down
            x = self.tp.all_reduce(x)
        return x, residual


class CausalLM(nn.Module):
    """Qwen2/Llama decoder. `forward` returns final hidden states; `compute_logits` the LM head."""

    def __init__(self, cfg: ModelConfig, ops=TorchOps, tp=None):
        super().__init__()
        self.config = cfg
        self.ops = ops
        # Tensor parallelism (flashlet.parallel.TensorParallel): this rank's slice; None = all.
        self.tp = tp
        self.local = tp.shape(cfg) if tp is not None else local_shape(cfg)
        self.embed_tokens = nn.Embedding(self.local.vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.local, tp) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(self.local.vocab_rows, cfg.hidden_size))
        self.register_buffer("cos_sin_cache", rope_cache(cfg), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (K/V written through `attn`)."""
        if self.tp is None:
            x, residual = self.embed_tokens(input_ids), None
        else:  # vocab-parallel: each rank looks up its own id range
            x, residual = self.tp.embed(self.embed_tokens.weight, input_ids,
                                        self.local.vocab_start), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.cos_sin_cache, i, attn, self.ops)
        x, _ = self.ops.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32."""
        logits = self.ops.linear(hidden, self.lm_head_weight)
        if self.tp is not None:  # vocab-parallel: gather every rank's columns
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float()


def rope_cache(cfg: ModelConfig) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of the half-dim frequencies, then sin."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def hf_to_flashlet_names(cfg: ModelConfig):
    """Yield (our parameter name, [HF tensor names concatenated along dim 0])."""
    yield "embed_tokens.weight", ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = [hf + f"self_attn.{p}_proj" for p in "qkv"]
        yield ours + "input_norm", [hf + "input_layernorm.weight"]
        yield ours + "qkv_proj.weight", [a + ".weight" for a in attn]
        if cfg.qkv_bias:
            yield ours + "qkv_proj.bias", [a + ".bias" for a in attn]
        yield ours + "o_proj.weight", [hf + "self_attn.o_proj.weight"]
        yield ours + "post_attn_norm", [hf + "post_attention_layernorm.weight"]
        yield ours + "gate_up_proj.weight", [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        yield ours + "down_proj.weight", [hf + "mlp.down_proj.weight"]
    yield "norm", ["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "lm_head", ["lm_head.weight"]
