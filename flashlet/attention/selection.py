"""What runs each kind of step: `--backend auto` and the fused decode path, chosen in one place.

A step is one of three kinds, and each may run a different path over the same paged pool (every
backend reads the pool's NHD layout, `KVPool`):
    decode (1-16 rows) the fused decode path (CuTe GEMVs + the triton one-launch attention,
                       `flashlet/runner/fused_decode.py`), where the platform and the model allow
                       it; so do speculative verify steps of at most 16 query tokens (the rows
                       where it was measured faster: `fused_decode.SERVED_ROWS`; 4 with fp8
                       weights on the CUDA cores, `SERVED_ROWS_FP8`; 8 with them on the tensor
                       cores at the 7B's shape, `SERVED_ROWS_FP8_LARGE`; 4 at the 7B's and
                       8B's bf16 shapes, `SERVED_ROWS_BF16_LARGE`)
    decode (17+ rows)  the decode backend, per-op
    prefill/mixed      the step backend, per-op
`--backend auto` picks the step backend and the decode backend apart, from the measured table
(`tuning.BACKEND_PREFERENCE`, per head_dim, GQA group and step kind: on Qwen3's shape FlashInfer
lost the large decode steps by 11% and only tied at prefill). A backend named by `--backend`
serves both. The fused path brings its own attention (a `TritonBackend` over the pool), so
installing FlashInfer changes what serves prefill and larger decode steps, never whether small
decode steps are fused.

`choose_paths` is a pure function of the platform (device capability, installed packages) and
the model's shape (head_dim, GQA group, dtype, tensor parallelism, CUDA graphs): it returns
each step kind's path with its reason, which the runner logs as one line at start. The model's
own shape limits on the fused path (`fused_decode.refusals`) are checked after it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashlet.kernels import tuning

# The measured preferences, one place. Figures: BENCHMARKS.md.
# - decode (1 row): the fused path, wherever its conditions hold. It beat per-op on every
#   preset it serves (measured behind the triton backend; behind another it runs the same
#   kernels), replayed in CUDA graphs with PDL (sm_90+): eagerly each CuTe launch costs host
#   time never measured against per-op.
FUSED_MIN_CAPABILITY = (9, 0)
FUSED_DTYPES = (torch.bfloat16,)
# - decode (17+ rows) and prefill/mixed: per (head_dim, group, kind) from
#   `tuning.preferred_backend` (the engine's offline and decode-sat figures with each; where
#   unmeasured, FlashInfer's FA2 at head_dim >= 128, our Triton kernels, tuned at 64, below).
FUSED_DECODE_PATH = "fused (CuTe GEMVs + triton one-launch attention)"


@dataclass(frozen=True)
class Platform:
    """What the choice reads of the machine. capability None: not a CUDA device."""

    device_type: str
    capability: tuple[int, int] | None
    installed: frozenset[str]  # optional backends found here ("flashinfer")
    # Why an installed backend fails to import (None: it imports), asked only of one auto would
    # pick: importing FlashInfer takes seconds, and one built against another CuTe DSL or torch
    # than the one installed raises at import (0.6.18 with nvidia-cutlass-dsl 4.3.5 did).
    import_error: Callable[[str], str | None] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, device: torch.device) -> "Platform":
        """This machine: the device's capability and the optional backends that import."""
        cuda = device.type == "cuda"
        installed = frozenset(n for n in ("flashinfer",) if importlib.util.find_spec(n) is not None)
        capability = tuple(torch.cuda.get_device_capability(device)) if cuda else None
        return cls(device.type, capability, installed, import_error)


@functools.cache
def import_error(name: str) -> str | None:
    """Why `import name` fails here ("ExceptionType: message"), or None where it imports."""
    try:
        importlib.import_module(name)
    except Exception as e:  # a broken install raises anything: AttributeError, OSError, ...
        return f"{type(e).__name__}: {e}"
    return None


@dataclass(frozen=True)
class StepPaths:
    """Each step kind's path and why."""

    backend: str            # the step backend: prefill/mixed steps
    backend_why: str
    fused_decline: str | None  # why small decode steps are not fused (None: fused, if the model allows)
    decode_backend: str     # pure-decode steps the fused path does not serve
    decode_why: str

    def log_line(self, fused_rows: int, fused_why: str | None = None) -> str:
        """'decode (1-16 rows): ...; decode (17+ rows): ...; prefill/mixed: ...' for the start
        log. fused_rows: the most rows the fused path serves (0: it is off)."""
        rows = max(fused_rows, 1)
        small = "1 row" if rows == 1 else f"1-{rows} rows"
        if fused_rows:  # (a verify step has two tokens at least)
            fused = FUSED_DECODE_PATH + (f", and verify steps of <= {rows} tokens" if rows > 1 else "")
        else:
            fused = f"{self.decode_backend} (per-op: {fused_why or self.fused_decline})"
        differs = self.decode_backend != self.backend or self.decode_why != self.backend_why
        large = self.decode_backend + (f" ({self.decode_why})" if differs else "")
        return (f"decode ({small}): {fused}; decode ({rows + 1}+ rows): {large}; "
                f"prefill/mixed: {self.backend} ({self.backend_why})")


def choose_paths(requested: str, platform: Platform, head_dim: int, group: int, dtype: torch.dtype,
                 tensor_parallel: bool, cuda_graphs: bool) -> StepPaths:
    """The step and decode backends (`requested`, or auto's picks) and why one-row decode would
    not be fused on this platform (None: nothing against it here)."""
    backend, why = step_backend(requested, platform, head_dim, group, "prefill")
    decode, decode_why = step_backend(requested, platform, head_dim, group, "decode")
    return StepPaths(backend, why, fused_decline(platform, dtype, tensor_parallel, cuda_graphs),
                     decode, decode_why)


def step_backend(requested: str, platform: Platform, head_dim: int, group: int,
                 kind: str = "prefill") -> tuple[str, str]:
    """(backend, why) for one step kind (`tuning.STEP_KINDS`): "prefill" (every step with a
    chunk) or "decode" (pure-decode steps the fused path does not serve)."""
    if requested != "auto":
        return requested, "asked for by name"
    if platform.capability is None:
        return "torch", f"auto on {platform.device_type}: the torch backend"
    name, why = tuning.preferred_backend(head_dim, group, "flashinfer" in platform.installed, kind)
    failure = platform.import_error(name) if platform.import_error and name != "triton" else None
    if failure:
        return "triton", f"{why}, but it is installed and does not import ({failure[:300]}): triton"
    return name, why


def fused_decline(platform: Platform, dtype: torch.dtype, tensor_parallel: bool,
                  cuda_graphs: bool) -> str | None:
    """Why the fused path stays off on this platform (the first condition that fails), or None.
    The step backend is not a condition: the fused path attends with its own triton kernel.
    The model's shape and the CuTe DSL are checked after this (`fused_decode.auto_declines`)."""
    if platform.capability is None:
        return f"the device is {platform.device_type}, not CUDA"
    if platform.capability < FUSED_MIN_CAPABILITY:
        major, minor = platform.capability
        return f"the GPU is sm_{major}{minor}; its PDL launches need sm_90 or newer"
    if dtype not in FUSED_DTYPES:
        return f"the dtype is {str(dtype).removeprefix('torch.')}; its kernels are bf16 only"
    if tensor_parallel:
        return "tensor parallelism is on; it runs one GPU only"
    if not cuda_graphs:
        return "CUDA graphs are off; it was measured faster replayed in them"
    return None
