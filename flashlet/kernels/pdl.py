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
"""

from __future__ import annotations

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


def pdl_supported(device: torch.device) -> bool:
    """CUDA devices of compute capability 9.0 (Hopper) and up."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
