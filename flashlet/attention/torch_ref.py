"""The dense PyTorch reference backend: gathers each sequence's pages and runs SDPA.

Slow and obvious on purpose: it is the oracle every other backend is tested against
(`batched_decode=False`: every step through the per-sequence loop). By default pure-decode
steps take a batched path instead (a padded page table, one masked attention for the whole
batch), checked against the loop: it can be captured in a CUDA graph, the GPU baseline for the
other backends, and on the CPU it spares a Python loop over the sequences. An fp8 pool's
gathered pages are dequantized (times the layer's k_scale / v_scale, in fp32) to q's dtype.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flashlet.attention.base import AttentionBackend, AttentionMetadata
from flashlet.kvcache.kv_pool import dequantize


def causal_mask_aligned_to_end(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool mask: query row i sees keys 0 .. kv_len - q_len + i."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    return cols <= rows


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_pool, num_q_heads, scale=None, max_batch_size: int = 256,
                 max_pages_per_seq: int | None = None, batched_decode: bool = True, **_):
        super().__init__(kv_pool, num_q_heads, scale)
        device = kv_pool.k_cache.device
        self.supports_cuda_graph = batched_decode  # graphs are captured on CUDA only
        self._padded = None  # (batch, pages per row) while a batched decode step is planned
        if self.supports_cuda_graph:
            max_pages = max_pages_per_seq or kv_pool.num_pages
            self._page_table = torch.zeros(max_batch_size, max_pages, dtype=torch.int64,
                                           device=device)
            self._kv_lens = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
            pin = device.type == "cuda"
            self._table_host = torch.zeros(max_batch_size, max_pages, dtype=torch.int64,
                                           pin_memory=pin)
            self._kv_lens_host = torch.zeros(max_batch_size, dtype=torch.int64, pin_memory=pin)

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        self._padded = None
        if self.supports_cuda_graph and meta.is_pure_decode and meta.num_seqs <= len(self._kv_lens):
            self._plan_batched_decode(meta)
            return
        # Host-side page lists per sequence, computed once per step and reused by every layer.
        host = meta.host
        counts = np.diff(host.paged_kv_indptr.numpy()).tolist()
        pages = host.paged_kv_indices.to(torch.int64).split(counts)
        self._pages = [own.to(meta.positions.device) for own in pages]
        self._qo, self._kv_lens_list = host.qo_indptr.tolist(), host.kv_lens.tolist()
        self._masks = {}

    def plan_graph(self, meta: AttentionMetadata, batch_size: int) -> None:
        super().plan(meta)
        self._plan_batched_decode(meta)

    def graph_key(self, meta: AttentionMetadata) -> tuple:
        return (self._padded[1],)

    def _plan_batched_decode(self, meta: AttentionMetadata) -> None:
        """Fill the padded page table; its width is rounded up to a power of two so that few
        graphs cover all context lengths."""
        host, n = meta.host, meta.num_seqs
        counts = np.diff(host.paged_kv_indptr.numpy())  # [n] pages of each sequence
        width = min(1 << (int(counts.max()) - 1).bit_length(), self._page_table.shape[1])
        # Staged in pinned host memory, so the copies below do not wait for the GPU.
        table = self._table_host[:n, :width]
        table_np = table.numpy()
        table_np[:] = self.kv_pool.scratch_page
        table_np[np.arange(width) < counts[:, None]] = host.paged_kv_indices.numpy()  # row-major
        self._page_table[:n, :width].copy_(table, non_blocking=True)
        kv_lens = self._kv_lens_host[:n]
        kv_lens.numpy()[:] = host.kv_lens.numpy()
        self._kv_lens[:n].copy_(kv_lens, non_blocking=True)
        self._padded = (n, width)

    def _attend_batched_decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        batch, width = self._padded
        ps, hkv, d = self.kv_pool.page_size, self.num_kv_heads, self.head_dim
        table = self._page_table[:batch, :width]
        k_scale, v_scale = self.kv_pool.scales(layer)
        k = self.kv_pool.k_cache[layer][table].view(batch, width * ps, hkv, d)  # [B, L, Hkv, D]
        v = self.kv_pool.v_cache[layer][table].view(batch, width * ps, hkv, d)
        k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        qg = q.view(batch, hkv, -1, d)  # [B, Hkv, G, D]
        scores = torch.einsum("bhgd,blhd->bhgl", qg.float(), k.float()) * self.scale
        visible = torch.arange(width * ps, device=q.device) < self._kv_lens[:batch, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(batch, -1, d)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self._padded is not None:
            return self._attend_batched_decode(layer, q)
        meta = self.meta
        out = torch.empty_like(q)
        k_pages, v_pages = self.kv_pool.k_cache[layer], self.kv_pool.v_cache[layer]
        k_scale, v_scale = self.kv_pool.scales(layer)
        group = self.num_q_heads // self.num_kv_heads
        qo = self._qo
        for b in range(meta.num_seqs):
            kv_len = self._kv_lens_list[b]
            q_len = qo[b + 1] - qo[b]
            # k, v: [kv_len, kv_heads, head_dim] gathered from this sequence's pages
            k = k_pages[self._pages[b]].flatten(0, 1)[:kv_len]
            v = v_pages[self._pages[b]].flatten(0, 1)[:kv_len]
            k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
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
