"""Programmatic Dependent Launch (PDL) for the Triton kernels: the two device instructions and
whether the device has them.

A kernel launched with PDL (`launch_pdl=True` at the launch, sm_90+) may start while the kernel
before it in the stream still runs, once every program of that kernel has executed
`griddepcontrol.launch_dependents` (or exited). `griddepcontrol.wait` then blocks until that
kernel has completed and its memory is visible; what a kernel reads before it must not be
written by the kernels still running. Both instructions are no-ops without PDL.

Written here as inline assembly rather than taken from `tl.extra.cuda`: Triton's own
`gdc_launch_dependents` was once declared pure (an unused result), which lets the compiler drop
it as dead code; these are marked side-effecting in every Triton version.

The per-op path's own kernels (RMSNorm, SiLU-mul, RoPE + K/V write, the fp8 GEMM) take part
where `per_op_enabled` says so: each signals first thing and waits before it reads anything a
kernel of the step writes, so the next one launches (and the fp8 GEMM warms its first weight
blocks in L2, `prefetch_l2`) while it runs. $FLASHLET_PDL=0 turns that off, for an A/B in a
fresh process; the fused path's PDL is its own (`FusedParts.pdl`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def launch_dependents():
    """Let the next kernel in the stream launch (its programs run up to their `wait`)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def wait():
    """Block until the previous kernel in the stream has completed and flushed its memory."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (one instruction each; nothing is returned, no
    register waits on it): memory no kernel of the step writes, fetched before `wait`."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def pdl_supported(device: torch.device) -> bool:
    """CUDA devices of compute capability 9.0 (Hopper) and up."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


PER_OP_PDL = os.environ.get("FLASHLET_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _supported_index(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def per_op_enabled(device: torch.device) -> bool:
    """Whether the per-op kernels launch with PDL on `device`: CUDA sm_90+, unless
    $FLASHLET_PDL=0. Cached per device (every launch asks)."""
    if not PER_OP_PDL or device.type != "cuda":
        return False
    return _supported_index(device.index if device.index is not None else torch.cuda.current_device())
