"""Runs the model for one step: plan the attention backend, forward, LM head on sampled rows."""

from __future__ import annotations

import torch

from flashlet.attention import create_backend
from flashlet.attention.base import AttentionMetadata


class ModelRunner:
    def __init__(self, model, kv_pool, config, device):
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.backend = create_backend(config.backend, kv_pool, model.config.num_heads)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> logits [num_sampled, vocab] fp32 for meta.logits_indices."""
        self.backend.plan(meta)
        hidden = self.model(input_ids, meta.positions, self.backend)
        return self.model.compute_logits(hidden[meta.logits_indices])
