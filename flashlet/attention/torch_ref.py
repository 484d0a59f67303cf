"""The dense PyTorch reference backend: gathers each sequence's pages and runs SDPA.

Slow and obvious on purpose: it is the oracle every other backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashlet.attention.base import AttentionBackend, AttentionMetadata


def causal_mask_aligned_to_end(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool mask: query row i sees keys 0 .. kv_len - q_len + i."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    return cols <= rows


class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        # Host-side page lists per sequence, computed once per step and reused by every layer.
        indices = meta.paged_kv_indices.to("cpu", torch.int64)
        ptr = meta.paged_kv_indptr_host
        self._pages = [indices[ptr[b] : ptr[b + 1]].to(meta.positions.device) for b in range(meta.num_seqs)]
        self._masks = {}

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        out = torch.empty_like(q)
        k_pages, v_pages = self.kv_pool.k_cache[layer], self.kv_pool.v_cache[layer]
        group = self.num_q_heads // self.num_kv_heads
        qo = meta.qo_indptr_host
        for b in range(meta.num_seqs):
            kv_len = meta.kv_lens_host[b]
            q_len = qo[b + 1] - qo[b]
            # k, v: [kv_len, kv_heads, head_dim] gathered from this sequence's pages
            k = k_pages[self._pages[b]].flatten(0, 1)[:kv_len]
            v = v_pages[self._pages[b]].flatten(0, 1)[:kv_len]
            k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, kv_len, D]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1)
            qb = q[qo[b] : qo[b + 1]].transpose(0, 1)  # [Hq, q_len, D]
            mask = self._mask(q_len, kv_len, q.device)
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=self.scale)
            out[qo[b] : qo[b + 1]] = o.transpose(0, 1)
        return out

    def _mask(self, q_len: int, kv_len: int, device) -> torch.Tensor:
        key = (q_len, kv_len)
        if key not in self._masks:
            self._masks[key] = causal_mask_aligned_to_end(q_len, kv_len, device)
        return self._masks[key]
