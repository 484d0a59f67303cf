"""The paged KV pool: one K and one V tensor per model, split into fixed-size pages, and the
free-list allocator that hands pages out.

Layout `[layers, pages, page_size, kv_heads, head_dim]` is FlashInfer's NHD: flattening
`pages * page_size` gives one row per token slot, so writing a step's new K/V is one
`index_copy_` at the step's slot mapping. The pool is the one place K/V are written: `write`
stores rows as given, `write_rope` rotates q and k first (RoPE) and stores k and v, as one fused
Triton kernel (`flashlet/kernels/rope_kv_write.py`) on CUDA or as PyTorch ops elsewhere.

An FP8 pool (`kv_cache_dtype="fp8"`) stores K and V in float8 e4m3 with one fp32 scale per
layer for K and one for V (vLLM's and FlashInfer's `k_scale` / `v_scale`): stored = x / scale,
saturated to e4m3's +-448, and every reader multiplies by the scale in fp32 (`dequantize`).
The scales are 1.0, as vLLM's are without calibrated ones: post-RoPE K and V of the models we
serve stay well inside +-448 (a rare outlier saturates rather than turning into NaN), and a
per-tensor scale gains little, since e4m3's relative precision is the same at any magnitude
above 2^-6 (on SmolLM2-135M, 4,134 positions, per-layer absmax scales lost 3.75 points of
argmax agreement with fp32 against 2.85 at 1.0; K's rounding costs 2.5 of them, V's 0.85:
`lab/fp8_kv_fidelity.py`). They are plain floats, baked into CUDA graphs at capture: set them before
the engine's warm-up, never after.
"""

from __future__ import annotations

import torch

from flashlet.models.ops import QKNorm, TorchOps
from flashlet.models.quantization import FP8, FP8_MAX

FP8_DTYPES = (FP8,)  # the cache dtypes stored scaled (stores saturate at +-FP8_MAX)


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in fp32, saturated to the fp8 range, then rounded to `dtype` (e4m3)."""
    x = x.float()
    if scale != 1.0:
        x = x * (1.0 / scale)  # as the Triton write does: one rounding of the same product
    return x.clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows x as `dtype`: an fp8 x times its scale in fp32; any other x only cast."""
    if x.dtype not in FP8_DTYPES:
        return x.to(dtype)
    x = x.float()
    return (x * scale if scale != 1.0 else x).to(dtype)


def check_fp8_cache_device(device: torch.device) -> None:
    """An fp8 cache on CUDA needs sm_89+ (Ada, Hopper): the Triton kernels that write and read
    it convert e4m3 in hardware; elsewhere a ValueError naming the GPU."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or newer "
                         f"(Ada, Hopper); this one is sm_{major}{minor}: use kv_cache_dtype auto")


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
        cache_dtype: torch.dtype | None = None,
    ):
        """dtype: the model's, in which K/V are written and read. cache_dtype: what the pool
        stores (default: dtype; float8_e4m3fn: fp8 with per-layer scales). fused_rope:
        `write_rope` as the Triton kernel (default: on CUDA); else PyTorch ops."""
        cache_dtype = cache_dtype or dtype
        if cache_dtype not in (dtype, *FP8_DTYPES):
            raise ValueError(f"the KV cache stores the model's dtype ({dtype}) or fp8 "
                             f"(float8_e4m3fn), not {cache_dtype}")
        if cache_dtype in FP8_DTYPES:
            check_fp8_cache_device(torch.device(device))
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        # One page more than the allocator hands out: a scratch page that padding rows of a
        # CUDA-graph batch write to and read from, so they never touch a live page.
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
        self.model_dtype = dtype
        self.is_fp8 = cache_dtype in FP8_DTYPES
        # Per layer, fp32: the value a stored 1.0 stands for (1.0 unless fp8: see the module doc).
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
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

    @property
    def num_tokens(self) -> int:
        """Token slots the allocator hands out (the scratch page not counted)."""
        return self.num_pages * self.page_size

    @property
    def dtype(self) -> torch.dtype:
        """What the pool stores (the model's dtype, or fp8)."""
        return self.k_cache.dtype

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        """K and V bytes of one page over all layers, at the cache dtype's element size."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of a layer: what the kernels multiply stored K / V by."""
        return self.k_scales[layer], self.v_scales[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        """Store new K/V rows: k, v [num_tokens, kv_heads, head_dim] at flat slots [num_tokens]."""
        flat = (-1,) + tuple(self.k_cache.shape[3:])
        k_rows, v_rows = self.k_cache[layer].view(flat), self.v_cache[layer].view(flat)
        if self.is_fp8:
            k = quantize_fp8(k, self.k_scales[layer], self.dtype)
            v = quantize_fp8(v, self.v_scales[layer], self.dtype)
            # As bytes: PyTorch's CPU index_copy_ has no float8 kernel.
            k_rows, v_rows, k, v = (t.view(torch.uint8) for t in (k_rows, v_rows, k, v))
        k_rows.index_copy_(0, slot_mapping, k)
        v_rows.index_copy_(0, slot_mapping, v)

    def write_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, qk_norm: QKNorm | None = None) -> torch.Tensor:
        """RoPE on q [T, Hq, D] and k [T, Hkv, D] at positions [T] (cos_sin_cache [max_pos, D]:
        cos | sin), then the rotated k and v stored at flat slots [T]. Returns the rotated q
        (the rotated k lives only in the pool). qk_norm: Qwen3's per-head norms first (in the
        same kernel on CUDA)."""
        if self._rope_kernel is not None:
            q, _ = self._rope_kernel(q, k, v, positions, cos_sin_cache, self.k_cache[layer],
                                     self.v_cache[layer], slot_mapping, return_k=False,
                                     kv_scales=self.scales(layer), qk_norm=qk_norm)
            return q
        if qk_norm is not None:
            q, k = qk_norm.apply(q, k)
        q, k = TorchOps.rope(q, k, positions, cos_sin_cache)
        self.write(layer, k, v, slot_mapping)
        return q
