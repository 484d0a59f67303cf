"""Attention backends behind one plan()/run() interface; flashinfer and triton are imported only
when chosen (optional packages), the torch reference always."""

from __future__ import annotations

import logging

from flashlet.attention.base import AttentionBackend, AttentionMetadata
from flashlet.attention.torch_ref import TorchBackend
from flashlet.attention.selection import Platform, step_backend

log = logging.getLogger("flashlet")


def resolve_backend(name: str, device, head_dim: int, group: int) -> tuple[str, str]:
    """(the backend `name` stands for, why). "auto": torch off CUDA; on CUDA the faster of
    triton and flashinfer for this shape (`flashlet.attention.selection.step_backend`)."""
    return step_backend(name, Platform.of(device), head_dim, group)


def create_backend(name: str, kv_pool, num_q_heads: int, **kwargs) -> AttentionBackend:
    """Build the backend `name` over `kv_pool`; a clear error if it cannot run on this device."""
    device = kv_pool.k_cache.device
    if name == "auto":
        name, why = resolve_backend(name, device, kv_pool.head_dim, num_q_heads // kv_pool.num_kv_heads)
        log.info("backend auto: %s (%s)", name, why)
    if name == "torch":
        return TorchBackend(kv_pool, num_q_heads, **kwargs)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer backend needs a CUDA device; use --backend torch on CPU")
        try:
            from flashlet.attention.flashinfer_backend import FlashInferBackend
        except Exception as e:  # absent (ImportError) or broken (anything its import raises)
            raise ValueError(f"the flashinfer backend needs the flashinfer package, and importing it "
                             f"failed: {type(e).__name__}: {e}") from e
        return FlashInferBackend(kv_pool, num_q_heads, **kwargs)
    if name == "triton":
        from flashlet.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool, num_q_heads, **kwargs)
    raise ValueError(f"unknown attention backend {name!r} (choose from auto, torch, flashinfer, triton)")


__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend", "resolve_backend"]
