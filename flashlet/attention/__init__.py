"""Attention backends behind one plan()/run() interface; each is imported only when chosen."""

from __future__ import annotations

from flashlet.attention.base import AttentionBackend, AttentionMetadata


def create_backend(name: str, kv_pool, num_q_heads: int, **kwargs) -> AttentionBackend:
    """Build the backend `name` over `kv_pool`; a clear error if it cannot run on this device."""
    device = kv_pool.k_cache.device
    if name == "torch":
        from flashlet.attention.torch_ref import TorchBackend

        return TorchBackend(kv_pool, num_q_heads, **kwargs)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer backend needs a CUDA device; use --backend torch on CPU")
        try:
            from flashlet.attention.flashinfer_backend import FlashInferBackend
        except ImportError as e:
            raise ValueError(f"the flashinfer backend needs the flashinfer package ({e})") from e
        return FlashInferBackend(kv_pool, num_q_heads, **kwargs)
    if name == "triton":
        from flashlet.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool, num_q_heads, **kwargs)
    raise ValueError(f"unknown attention backend {name!r} (choose from torch, flashinfer, triton)")


__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend"]
