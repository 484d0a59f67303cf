"""One decoder for every family we run: Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3 (dense).

One loop covers them all: embedding, then per layer RMSNorm, fused QKV projection, (Qwen3: a
per-head RMSNorm on q and k), RoPE, paged grouped-query attention through the step's attention
backend, output projection, residual, RMSNorm, SwiGLU MLP (fused gate/up), residual; final norm
and the LM head (tied to the embedding where the config says so).

The families differ only in ModelConfig fields, read from config.json by `ModelConfig.from_hf`:
    qkv_bias       Qwen2 always; Llama/Qwen3 with attention_bias (which also biases o_proj)
    o_bias         attention_bias on Llama and Qwen3
    qk_norm        Qwen3: RMSNorm over head_dim on q and k before RoPE
    head_dim       given by the config (Qwen3, Mistral-Nemo) or hidden_size / num_heads
    rope_scaling   default | linear | dynamic | yarn | llama3 (`flashlet.models.rope` builds the table)
    sliding_window Mistral (and Qwen with use_sliding_window): honoured by capping the context
                   at the window, where sliding-window attention equals full attention
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from flashlet.distributed.parallel import LocalShape, local_shape
from flashlet.models import rope
from flashlet.models.ops import QKNorm, TorchOps
from flashlet.models.quantization import checkpoint_format

# model_type -> the architecture its config.json names.
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx",
                   "olmoe", "phimoe", "granitemoe", "jamba", "llama4")


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
    o_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    sliding_window: int | None = None  # set only where some layer really slides

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict; raises ValueError naming what we cannot run."""
        model_type = _check_supported(cfg)
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False)) and model_type != "mistral"
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=rope.rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or attention_bias,
            eos_token_ids=eos,
            o_bias=attention_bias and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            rope_scaling=rope.rope_parameters(cfg),
            sliding_window=active_sliding_window(cfg, model_type),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))

    @property
    def max_context_len(self) -> int:
        """The longest sequence we run exactly: the (scaled) RoPE's context, capped at the
        sliding window (within it, sliding-window attention is full attention)."""
        length = rope.context_length(self.rope_scaling, self.max_position_embeddings)
        return min(length, self.sliding_window) if self.sliding_window else length

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        layer = qkv + self.num_heads * d * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            layer += (self.num_heads + 2 * self.num_kv_heads) * d
        layer += h * self.o_bias + 2 * d * self.qk_norm
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


def _check_supported(cfg: dict) -> str:
    """The config's model_type if we run it exactly; else ValueError naming what is missing."""
    model_type = cfg.get("model_type")
    if model_type in MOE_MODEL_TYPES or any(k in cfg for k in ("num_experts", "num_local_experts")):
        raise ValueError(f"model_type {model_type!r} is a mixture-of-experts model: MoE layers "
                         f"are not implemented (dense {', '.join(SUPPORTED_MODEL_TYPES)} only)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    checkpoint_format(cfg.get("quantization_config"))  # refuses, by name, a method we do not read
    archs = cfg.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
    if not all(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"unsupported architecture {archs[0]!r}: only the *ForCausalLM head is implemented")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only SwiGLU with silu is implemented")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias: true (MLP projections with a bias are not implemented)")
    return model_type


def active_sliding_window(cfg: dict, model_type: str) -> int | None:
    """The attention window if some layer uses one: Mistral's `sliding_window` when set; Qwen's
    only with use_sliding_window (its configs carry the field switched off), and only if a layer
    at or past `max_window_layers` exists, as Transformers builds its layer_types."""
    window = cfg.get("sliding_window")
    if not window or model_type not in ("mistral", "qwen2", "qwen3"):
        return None
    if model_type == "mistral":
        return window
    if not cfg.get("use_sliding_window"):
        return None
    first = cfg.get("max_window_layers", 28)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return window if "sliding_attention" in layer_types else None


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
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(d))
            self.k_norm = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
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
        # (Qwen3: per-head q/k norms,) RoPE, K/V into the pool, attend
        o = attn.run_rope(layer_idx, q, k, v, positions, cos_sin, self.qk_norm())
        if self.tp is None:
            x = ops.linear(o.reshape(-1, self.q_size), self.o_proj.weight, self.o_proj.bias)
        else:  # row-parallel O: sum the ranks' partial outputs, then the bias once
            x = self.tp.all_reduce(ops.linear(o.reshape(-1, self.q_size), self.o_proj.weight))
            if self.o_proj.bias is not None:
                x = x + self.o_proj.bias
        x, residual = ops.add_rms_norm(x, residual, self.post_attn_norm, self.eps)
        x = ops.silu_and_mul(ops.linear(x, self.gate_up_proj.weight))
        x = ops.linear(x, self.down_proj.weight)
        if self.tp is not None:  # row-parallel down
            x = self.tp.all_reduce(x)
        return x, residual

    def qk_norm(self) -> QKNorm | None:
        """Qwen3's per-head RMSNorm of q and k, which the pool's RoPE kernel applies first."""
        return QKNorm(self.q_norm, self.k_norm, self.eps) if hasattr(self, "q_norm") else None


class CausalLM(nn.Module):
    """The decoder. `forward` returns final hidden states; `compute_logits` the LM head."""

    def __init__(self, cfg: ModelConfig, ops=TorchOps, tp=None):
        super().__init__()
        self.config = cfg
        self.ops = ops
        # Tensor parallelism (flashlet.distributed.parallel.TensorParallel): this rank's slice; None = all.
        self.tp = tp
        self.local = tp.shape(cfg) if tp is not None else local_shape(cfg)
        rows, hidden = self.local.vocab_rows, cfg.hidden_size
        # On the meta device (a checkpoint's shapes, filled after to_empty) nothing is drawn or
        # computed: a draw or arithmetic there runs PyTorch's Python reference ops, the first of
        # which imports torch._dynamo (~3 s of every process that loads a checkpoint on a CPU).
        on_meta = torch.get_default_device().type == "meta"
        self.embed_tokens = (nn.Embedding(rows, hidden, _weight=torch.empty(rows, hidden))
                             if on_meta else nn.Embedding(rows, hidden))
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.local, tp)
                                    for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(self.local.vocab_rows, cfg.hidden_size))
        table = torch.empty(cfg.max_context_len, cfg.head_dim) if on_meta else rope_cache(cfg)
        self.register_buffer("cos_sin_cache", table, persistent=False)

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

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> each row's argmax token [N] int64: `compute_logits(...)
        .argmax(-1)` without the fp32 copy (widening bf16 / fp16 to fp32 is exact, so the
        argmax, the first index of the maximum, is the same). One device only."""
        if self.tp is not None:
            raise ValueError("greedy_tokens runs on one device (tensor parallel: compute_logits)")
        return self.ops.linear(hidden, self.lm_head_weight).argmax(dim=-1)


def rope_cache(cfg: ModelConfig) -> torch.Tensor:
    """[max_context_len, head_dim] fp32: cos | sin of each position (`flashlet.models.rope`)."""
    return rope.cos_sin_cache(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                              cfg.max_position_embeddings, cfg.max_context_len)


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
        if cfg.qk_norm:
            yield ours + "q_norm", [hf + "self_attn.q_norm.weight"]
            yield ours + "k_norm", [hf + "self_attn.k_norm.weight"]
        yield ours + "o_proj.weight", [hf + "self_attn.o_proj.weight"]
        if cfg.o_bias:
            yield ours + "o_proj.bias", [hf + "self_attn.o_proj.bias"]
        yield ours + "post_attn_norm", [hf + "post_attention_layernorm.weight"]
        yield ours + "gate_up_proj.weight", [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        yield ours + "down_proj.weight", [hf + "mlp.down_proj.weight"]
    yield "norm", ["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "lm_head", ["lm_head.weight"]
