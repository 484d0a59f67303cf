"""A paged KV cache. Keys and values live in fixed-size pages drawn from one shared pool, and a
page table maps each slot's logical pages (positions 0..page_size-1, then page_size.., ...) to
physical pages. A request takes a page when its sequence grows into one and gives all of them
back when it finishes, so memory follows the actual sequence lengths, not max_seq_len per slot."""

from __future__ import annotations

import torch

from .config import ModelConfig

NULL_PAGE = 0  # never handed out: empty page-table entries point here, and so do empty slots


class PagedKVCache:
    """Per layer, k and v of shape [num_pages, page_size, num_kv_heads, head_dim]; the token at
    position p of the request in slot s lives in page page_table[s, p // page_size], row
    p % page_size."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_seq_len: int,
        page_size: int,
        num_pages: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.page_size = page_size
        max_pages_per_slot = -(-max_seq_len // page_size)
        shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        table_shape = (num_slots, max_pages_per_slot)
        self.page_table = torch.full(table_shape, NULL_PAGE, dtype=torch.int32, device=device)
        self.num_usable_pages = num_pages - 1  # all but the null page
        self.free_pages: list[int] = list(range(1, num_pages))  # the free list of physical pages
        self.pages_of_slot: list[list[int]] = [[] for _ in range(num_slots)]  # host-side copy

    def attach(self, model: torch.nn.Module) -> None:
        """Hand each attention layer its own pages (k[i], v[i]) and the shared page table."""
        for layer_index, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.k[layer_index]
            layer.self_attn.v_cache = self.v[layer_index]
            layer.self_attn.page_table = self.page_table

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_to_grow(self, slot: int, num_tokens: int) -> int:
        """Pages the slot still has to take to hold num_tokens tokens."""
        return max(0, self.pages_needed(num_tokens) - len(self.pages_of_slot[slot]))

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Give the slot pages for its first num_tokens positions, from the free list."""
        pages = self.pages_of_slot[slot]
        for _ in range(self.pages_to_grow(slot, num_tokens)):
            if not self.free_pages:
                raise RuntimeError("out of KV cache pages (raise num_pages)")
            page = self.free_pages.pop()
            self.page_table[slot, len(pages)] = page  # in place: a CUDA graph sees the update
            pages.append(page)

    def release(self, slot: int) -> None:
        """Give the slot's pages back to the free list."""
        self.free_pages.extend(reversed(self.pages_of_slot[slot]))
        self.pages_of_slot[slot] = []
        self.page_table[slot] = NULL_PAGE
