"""The per-token building blocks of a Llama/Qwen2 decoder: RMSNorm, rotary position embeddings
(RoPE) and the SwiGLU feed-forward, in plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """Scale each token's vector to unit root-mean-square, then by a learned weight."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size]; the statistics are taken in fp32
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * (x32 * inv_rms).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """The rotation angles of every (token, frequency) pair, as cos and sin."""
    # positions: [num_tokens] -> cos, sin: [num_tokens, head_dim // 2], fp32
    even_dims = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (even_dims / head_dim))  # [head_dim // 2]
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + head_dim/2]) of every head by its token's angles."""
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim // 2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)


class SwiGLU(nn.Module):
    """The feed-forward: down(silu(gate(x)) * up(x)). Named `mlp` in the checkpoints."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> gate, up: [num_tokens, intermediate_size]
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)
