"""EngineConfig: every engine default in one frozen dataclass; command-line flags are built from it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass, fields

import torch

BACKENDS = ("auto", "torch", "flashinfer", "triton")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # folder, hub id, .gguf file; None = the embedded default model
    config: str | None = None  # a config.json path or preset name: random weights at that shape
    backend: str = "auto"  # attention backend: auto | torch | flashinfer | triton
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str | None = None  # float32 | bfloat16 | float16; default: bf16 on cuda, fp32 on cpu
    quantization: str | None = None  # fp8: the decoder's linear weights in float8 e4m3 with per-output-channel scales, quantized at load (FP8 checkpoints load as fp8 without it); default: the checkpoint's
    page_size: int = 16  # tokens per KV page
    max_num_pages: int | None = None  # KV pool size; default from kv_memory_gb / GPU memory
    kv_memory_gb: float = 1.0  # KV pool budget on the CPU when max_num_pages is not given
    gpu_memory_utilization: float = 0.6  # fraction of free GPU memory the KV pool may take
    max_num_seqs: int = 256  # running requests at once
    # 8192, not 2048: prefill chunks that fill the GPU, and a quarter as many steps where decodes
    # ride along with a chunk (H200, Qwen2.5-0.5B: offline first run +30%, decode-sat end to end
    # 0.78 -> 0.96 of steady), at the price of longer steps for the running decodes while a long
    # prompt is prefilled.
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True  # reuse the KV pages of shared prompt prefixes (radix cache)
    cuda_graph: bool = True  # capture pure-decode steps in CUDA graphs (CUDA only)
    mixed_graphs: bool = True  # with cuda_graph, triton backend, no tensor parallelism: steps with prefill chunks replay CUDA graphs too, padded to a token bucket
    fused_ops: bool = True  # Triton kernels for RMSNorm(+residual), SiLU-mul, RoPE (CUDA only)
    gemv: bool = False  # with fused_ops: one-row matmuls on our Triton GEMV (slower than cuBLAS)
    # The fused path (issue 16): None = auto, True / False = forced on / off. Engine.config then
    # holds what the engine chose (True / False); the log says why auto left it off.
    fused_decode: bool | None = None  # one-sequence decode steps on the CuTe DSL fused path (H200, Qwen2.5-0.5B: 2.3x per-op's tok/s); default auto: on with CUDA sm_90+, bf16, the triton backend, one GPU, CUDA graphs, a shape it serves and the CuTe DSL (pip install nvidia-cutlass-dsl==4.3.5), else off; --no-fused-decode turns it off
    fused_decode_pdl: bool | None = None  # with the fused path: its kernels launch with Programmatic Dependent Launch; default: on where the GPU has it (sm_90+)
    fused_decode_rope: bool | None = None  # with the fused path: RoPE + K/V write in the QKV GEMV's epilogue (H200: +2.5-8%); default: on where the model allows it (not Qwen3's per-head q/k norm)
    fused_decode_attn: bool | None = None  # with the fused path: one attention launch a layer (PDL with _pdl); default: on the triton backend
    overlap: bool = True  # launch step N before reading step N-1's tokens (host work overlaps GPU)
    weights_seed: int = 0  # seeds the random weights of --config (sampling has its own)
    warmup_at_start: bool = True  # CUDA: compile every kernel variant, capture every graph first
    tensor_parallel_size: int = 1  # GPUs (ranks) one model is split over; 1 = no collectives

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r} (choose from {', '.join(BACKENDS)})")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_pages is not None and self.max_num_pages < 1:
            raise ValueError(f"max_num_pages must be >= 1, got {self.max_num_pages}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs so every decode fits in a step"
            )
        if self.dtype is not None:
            torch_dtype(self.dtype)
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"unknown quantization {self.quantization!r} (choose from fp8)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for sub in ("fused_decode_pdl", "fused_decode_rope", "fused_decode_attn"):
            if getattr(self, sub) and self.fused_decode is False:
                raise ValueError(f"{sub} applies to the fused decode path, which fused_decode=False "
                                 f"turns off")
        if self.fused_decode_attn and self.backend not in ("triton", "auto"):
            raise ValueError(f"fused_decode_attn is the triton backend's one-launch decode; backend is {self.backend!r}")
        if self.fused_decode and self.tensor_parallel_size > 1:
            raise ValueError("fused_decode runs one GPU only: it needs tensor_parallel_size 1")

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return torch_dtype(self.dtype)
        return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    # ---- command line, generated from the fields above ----------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field; its help is the field's comment above."""
        helps = field_comments(cls)
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help = helps.get(f.name, "").replace("%", "%%")
            if f.type in ("bool", bool, "bool | None"):  # None: decided by the engine (auto)
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=help)
                continue
            if "default" not in help:
                help += " (default: %(default)s)"
            parser.add_argument(flag, type=_cli_type(f), default=f.default, help=help,
                                choices=BACKENDS if f.name == "backend" else None)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def check_backend_runs_here(config: EngineConfig) -> None:
    """Raise ValueError, before any model loads, when the backend cannot run on this machine:
    flashinfer needs CUDA; auto is torch off CUDA; triton needs CUDA unless TRITON_INTERPRET=1
    asks for the (slow) interpreter."""
    if config.backend in ("torch", "auto") or config.resolved_device().type == "cuda":
        return
    if config.backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    where = "no CUDA GPU is available" if not torch.cuda.is_available() else \
        f"the device is {config.resolved_device()}"
    hint = " (or set TRITON_INTERPRET=1 for Triton's slow CPU interpreter)" \
        if config.backend == "triton" else ""
    raise ValueError(f"--backend {config.backend} needs a CUDA GPU but {where}: "
                     f"use --backend torch{hint}")


def field_comments(cls) -> dict[str, str]:
    """Each dataclass field's trailing `# comment` in the source: one place for the docs of a
    setting, read by the flags' help."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source (e.g. a frozen build): flags without help
        return {}
    pattern = re.compile(r"^    (\w+): [^#\n]*#\s*(.+)$", re.M)
    return {name: text.strip() for name, text in pattern.findall(source)}


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors (`prog: error: ...`, exit code 2), no usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _cli_type(f):
    text = str(f.type)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from float32, bfloat16, float16)")
    return DTYPES[name]
