"""A simple KV cache: the keys and values of every token seen so far, for every layer, so that a
decode step computes them only for the new token."""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    """Per layer, k and v of shape [num_rows, max_seq_len, num_kv_heads, head_dim].

    A request owns one row: the key and value of its token at position p live at [row, p]. Only
    the key/value heads are stored (grouped-query attention): group_size times less memory than
    one entry per query head.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_rows: int,
        max_seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        shape = (config.num_layers, num_rows, max_seq_len, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def attach(self, model: torch.nn.Module) -> None:
        """Hand each attention layer its own slice: layer i reads and writes k[i] and v[i]."""
        for layer_index, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.k[layer_index]
            layer.self_attn.v_cache = self.v[layer_index]
