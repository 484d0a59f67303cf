"""The paged KV pool: one K and one V tensor per model, split into fixed-size pages, and the
free-list allocator that hands pages out.

Layout `[layers, pages, page_size, kv_heads, head_dim]` is FlashInfer's NHD: flattening
`pages * page_size` gives one row per token slot, so writing a step's new K/V is one
`index_copy_` at the step's slot mapping. The pool is the one place K/V are written: `write`
stores rows as given, `write_rope` rotates q and k first (RoPE) and stores k and v, as one fused
Triton kernel (`flashlet/kernels/rope_kv_write.py`) on CUDA or as PyTorch ops elsewhere.
"""

from __future__ import annotations

import torch

from flashlet.models.ops import TorchOps


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request for pages."""


class PageAllocator:
    """A free list of page ids. Allocation is O(n) in pages asked for; double frees are caught."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps traces readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is outside the pool (0..{self.num_pages - 1})")
            if self._is_free[p]:
                raise ValueError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def free_pages(self) -> set[int]:
        return set(self._free)


class KVPool:
    """K and V caches shaped [layers, pages, page_size, kv_heads, head_dim], plus their allocator."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fused_rope: bool | None = None,
    ):
        """fused_rope: `write_rope` as the Triton kernel (default: on CUDA); else PyTorch ops."""
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        # One page more than the allocator hands out: a scratch page that padding rows of a
        # CUDA-graph batch write to and read from, so they never touch a live page.
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.allocator = PageAllocator(num_pages)
        self.scratch_page = num_pages
        if fused_rope is None:
            fused_rope = self.k_cache.device.type == "cuda"
        self._rope_kernel = None
        if fused_rope:
            from flashlet.kernels.rope_kv_write import rope_kv_write  # imports Triton: only here

            self._rope_kernel = rope_kv_write

    @property
    def num_bytes(self) -> int:
        """K and V together, the scratch page included."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        """Store new K/V rows: k, v [num_tokens, kv_heads, head_dim] at flat slots [num_tokens]."""
        flat = (-1,) + tuple(self.k_cache.shape[3:])
        self.k_cache[layer].view(flat).index_copy_(0, slot_mapping, k)
        self.v_cache[layer].view(flat).index_copy_(0, slot_mapping, v)

    def write_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
        """RoPE on q [T, Hq, D] and k [T, Hkv, D] at positions [T] (cos_sin_cache [max_pos, D]:
        cos | sin), then the rotated k and v stored at flat slots [T]. Returns the rotated q
        (the rotated k lives only in the pool)."""
        if self._rope_kernel is not None:
            q, _ = self._rope_kernel(q, k, v, positions, cos_sin_cache, self.k_cache[layer],
                                     self.v_cache[layer], slot_mapping, return_k=False)
            return q
        q, k = TorchOps.rope(q, k, positions, cos_sin_cache)
        self.write(layer, k, v, slot_mapping)
        return q
