"""The decoder: token embedding, a stack of transformer blocks, a final norm and the LM head.
Module names follow the Hugging Face checkpoints, so weights load by name."""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .batch import Batch
from .config import ModelConfig
from .layers import RMSNorm, SwiGLU, rope_cos_sin


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        # x: [num_tokens, hidden_size]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        # input_ids: [num_tokens] -> hidden: [num_tokens, hidden_size]
        cos, sin = rope_cos_sin(batch.positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.model(input_ids, batch)  # [num_tokens, hidden_size]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden_size] -> logits: [n, vocab_size], fp32 for the argmax
        return self.lm_head(hidden).float()
