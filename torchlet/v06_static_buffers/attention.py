"""Grouped-query attention (GQA) with a KV cache. Prefill: each prompt attends causally to its own
tokens (ragged batch, `req_indptr`). Decode: each slot's new token attends to its cached keys;
batch row s is slot s is cache row s. Both write the new keys and values into the cache first."""

from __future__ import annotations

import torch
from torch import nn

from .batch import Batch, DecodeBatch
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
        # [num_rows, max_seq_len, num_kv_heads, head_dim] each, handed over by KVCache.attach
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        # x: [num_tokens, hidden_size]: whole prompts (prefill) or one token per request (decode)
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.k_cache[batch.slots, batch.positions] = k
        self.v_cache[batch.slots, batch.positions] = v
        if isinstance(batch, DecodeBatch):
            out = decode_gqa(q, self.k_cache, self.v_cache, batch, self.scale)
        else:
            out = ragged_causal_gqa(q, k, v, batch.req_indptr, self.scale)  # like q
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


def ragged_causal_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, req_indptr: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention inside each request; requests never see each other's tokens."""
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    out = torch.empty_like(q)
    bounds = req_indptr.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[start:end] = causal_gqa(q[start:end], k[start:end], v[start:end], scale)
    return out


def causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Within one request: each token attends to itself and the tokens before it.

    Grouped-query attention in phases: the query heads that share a key/value head are grouped,
    so K and V are read once per group instead of being copied for every query head.
    """
    num_tokens, num_heads, head_dim = q.shape
    q = group_query_heads(q, num_kv_heads=k.shape[1])  # [num_tokens, kv_heads, group, head_dim]
    scores = gqa_scores(q, k, scale)  # [kv_heads, group, num_queries, num_keys]
    scores = scores.masked_fill(~causal_mask(num_tokens, q.device), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)  # each query's weights over the keys
    out = gqa_weighted_values(probs, v)  # [num_tokens, kv_heads, group, head_dim]
    return out.reshape(num_tokens, num_heads, head_dim)  # merge the groups back into heads


def group_query_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Query head h uses key/value head h // group_size: split the head axis that way."""
    # q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_kv_heads, group_size, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    return q.view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)


def gqa_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Dot product of every query with every key of its key/value head (fp32 scores)."""
    # q: [num_queries, kv_heads, group, head_dim]; k: [num_keys, kv_heads, head_dim]
    return torch.einsum("qhgd,khd->hgqk", q, k).float() * scale


def causal_mask(num_tokens: int, device: torch.device) -> torch.Tensor:
    """True where query i may see key j, that is j <= i."""
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()


def gqa_weighted_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each query's output: the values of its key/value head, weighted by its probabilities."""
    # probs: [kv_heads, group, num_queries, num_keys]; v: [num_keys, kv_heads, head_dim]
    return torch.einsum("hgqk,khd->qhgd", probs, v)  # [num_queries, kv_heads, group, head_dim]


def decode_gqa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    """Each slot's one new query attends to all of its cached keys (its own included).

    Static shapes: every slot scores all max_seq_len cache positions and masks those past its
    length, instead of slicing to the longest sequence (which needs its length on the host).
    """
    # q: [num_slots, num_heads, head_dim]; k_cache, v_cache: [num_slots, max_seq_len, kv_heads, dim]
    num_slots, num_heads, head_dim = q.shape
    max_seq_len = k_cache.shape[1]
    q = group_query_heads(q, num_kv_heads=k_cache.shape[2])  # [num_slots, kv_heads, group, dim]
    scores = torch.einsum("bhgd,bkhd->bhgk", q, k_cache).float() * scale  # [b, kv, group, keys]
    scores = scores.masked_fill(~cached_mask(batch.seq_lens, max_seq_len), float("-inf"))
    probs = scores.softmax(dim=-1).to(v_cache.dtype)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, v_cache)  # [num_slots, kv_heads, group, dim]
    return out.reshape(num_slots, num_heads, head_dim)


def cached_mask(seq_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """True where key j holds a token of the request (j < its sequence length)."""
    # seq_lens: [num_slots] -> [num_slots, 1, 1, num_keys], broadcast over heads
    key_positions = torch.arange(num_keys, device=seq_lens.device)
    return (key_positions[None, :] < seq_lens[:, None])[:, None, None, :]
