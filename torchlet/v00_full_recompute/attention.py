"""Causal grouped-query attention (GQA) over one whole sequence."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import apply_rope


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size], the tokens of one sequence
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_gqa(q, k, v, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


def causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Each token attends to itself and the tokens before it."""
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    group_size = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group_size, dim=1)  # [num_tokens, num_heads, head_dim]
    v = v.repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k).float() * scale  # [num_heads, q, k]
    num_tokens = q.shape[0]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [num_tokens, num_heads, head_dim]
