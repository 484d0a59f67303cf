"""Which device and dtype an engine runs on."""

from __future__ import annotations

import torch

DTYPES_BY_NAME = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class NeedsCudaError(RuntimeError):
    """Raised by a version that only runs on a CUDA GPU (it captures CUDA graphs)."""


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The given device, else the GPU when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The given dtype (a torch.dtype or a name like "bf16"), else bf16 on GPU and fp32 on CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES_BY_NAME)})")
    return DTYPES_BY_NAME[name]


def require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise NeedsCudaError(f"needs CUDA: {what} (asked to run on {device})")
