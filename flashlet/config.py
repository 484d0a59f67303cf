"""EngineConfig: every engine default in one frozen dataclass; command-line flags are built from it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass, fields

import torch

from flashlet.spec.api import SpeculativeConfig

BACKENDS = ("auto", "torch", "flashinfer", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; both fp8 ones are e4m3
CHOICES = {"backend": BACKENDS, "scheduling_policy": SCHEDULING_POLICIES,
           "kv_cache_dtype": KV_CACHE_DTYPES}  # flags with a closed set


# A server's bound on a step that carries decodes, by "on CUDA": at the 0.5B shape on the H200
# a prefill token costs ~2.5 us against a ~1.3 ms step of 64 decodes, so a 512-token step keeps
# the gaps within ~3x of a decode step (p99 / p50 1.7x while eight 8,000-token prompts
# arrive); on the CPU a step's prompt tokens cost far more.
SERVING_DECODE_STEP_TOKENS = {True: 512, False: 64}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # folder, hub id, .gguf file; None = the embedded default model
    config: str | None = None  # a config.json path or preset name: random weights at that shape
    backend: str = "auto"  # attention backend: auto | torch | flashinfer | triton
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str | None = None  # float32 | bfloat16 | float16; default: bf16 on cuda, fp32 on cpu
    quantization: str | None = None  # fp8: the decoder's linear weights in float8 e4m3 with per-output-channel scales, quantized at load (FP8 checkpoints load as fp8 without it); default: the checkpoint's
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3: K/V stored in float8 e4m3 with a per-layer scale each (vLLM's flag): twice the tokens in the same memory
    page_size: int = 16  # tokens per KV page
    max_num_pages: int | None = None  # KV pool size; default from kv_memory_gb / GPU memory
    kv_memory_gb: float = 1.0  # KV pool budget on the CPU when max_num_pages is not given
    gpu_memory_utilization: float = 0.6  # fraction of free GPU memory the KV pool may take
    max_num_seqs: int = 256  # running requests at once
    # On CUDA 8192: prefill chunks that fill the GPU (fewer, faster steps end to end:
    # BENCHMARKS.md); the steps that carry decodes are bounded apart (max_decode_step_tokens). On
    # the CPU a step's attention costs chunk x context, and 256 keeps one step to seconds.
    max_num_batched_tokens: int | None = None  # token budget of one step (prefill chunks + decodes); default 8192 on CUDA, 256 on the CPU (at least max_num_seqs)
    # Stall-free batching (Sarathi-Serve; vLLM and SGLang bound the steps that carry decodes too):
    # a step with decodes in it stops at this many tokens, so a long prompt's chunks lengthen
    # each token gap by a bounded amount while the prompt still progresses every step. That is
    # a server's trade (for_serving: 512 on CUDA, 64 on the CPU); an offline batch (LLM, the
    # bench) wants its prompts through fast and leaves such steps whole by default: on the
    # H200 at the 0.5B shape a bound of 512 cost decode-sat 46% and offline 12% (BENCHMARKS.md).
    max_decode_step_tokens: int | None = None  # token budget of a step that carries decodes, or 4 prompt tokens a decode where that is more (prefill-only steps use max_num_batched_tokens); default: max_num_batched_tokens (no bound) in-process, 512 on CUDA and 64 on the CPU in the server
    scheduling_policy: str = "fcfs"  # fcfs | priority: waiting requests by arrival, or by their `priority` (lower first, then arrival; vLLM's)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True  # reuse the KV pages of shared prompt prefixes (radix cache)
    cuda_graph: bool = True  # capture pure-decode steps in CUDA graphs (CUDA only)
    mixed_graphs: bool = True  # with cuda_graph, triton backend, no tensor parallelism: steps with prefill chunks replay CUDA graphs too, padded to a token bucket
    fused_ops: bool = True  # Triton kernels for RMSNorm(+residual), SiLU-mul, RoPE (CUDA only)
    # The fused path: None = auto, True / False = forced on / off. Engine.config then
    # holds what the engine chose (True / False); the log says why auto left it off.
    fused_decode: bool | None = None  # decode steps of 1-16 rows (sequences, or a verify step's query tokens; fused_decode.SERVED_ROWS) on the CuTe DSL fused path (one stream: about twice per-op's tok/s); default auto: on with CUDA sm_90+, bf16 (whatever --backend: it attends with triton), one GPU, CUDA graphs, a shape it serves and the CuTe DSL (pip install nvidia-cutlass-dsl==4.8.1; 4.3.5 to 4.8.1 work), else off; --no-fused-decode turns it off
    fused_decode_fp8_mma: bool | None = None  # with fp8 weights on the fused path: their GEMVs on the tensor cores (e4m3 widened to bf16 by integer ops; every width a multiple of 64; then up to 16 rows a fused step, not 4; 8 at the shapes of FP8_MMA_SHAPES, fused_decode.SERVED_ROWS_FP8_LARGE); default auto: on at the shapes where it measured faster (fused_decode.FP8_MMA_SHAPES: Qwen2.5-7B's; slower at 0.5B's and Llama-3.1-8B's); --no-fused-decode-fp8-mma keeps the CUDA-core form
    overlap: bool = True  # launch step N before reading step N-1's tokens (host work overlaps GPU)
    weights_seed: int = 0  # seeds the random weights of --config (sampling has its own)
    warmup_at_start: bool = True  # CUDA: compile every kernel variant, capture every graph first
    tensor_parallel_size: int = 1  # GPUs (ranks) one model is split over; 1 = no collectives
    # Structured output (flashlet/text/structured.py): each limit refuses a response format (a 400
    # naming it) before or while its grammar compiles, so that no request can stall the others.
    structured_output_timeout_s: float = 10.0  # time limit of one grammar compile, in a worker process killed past it; 0 = compile in the engine's process, unbounded
    structured_output_max_bytes: int = 262144  # a response format's size as JSON
    structured_output_max_depth: int = 64  # nesting depth of a JSON schema's subschemas
    structured_output_max_enum: int = 8192  # enum and const values in one schema, in all
    structured_output_max_enum_chars: int = 131072  # characters of those values (as JSON)
    structured_output_max_pattern_size: int = 4096  # a regex pattern's size with its repetitions expanded (a{1000} counts 1000)
    # Speculative decoding (flashlet/spec/speculative.py): a JSON string or dict, parsed here.
    speculative_config: SpeculativeConfig | None = None  # speculative decoding as vLLM configures it (JSON): '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}' or '{"model": PATH, "num_speculative_tokens": 4}'; default: off
    speculative_disable_by_batch_size: int | None = None  # speculate only while at most this many requests run (overrides the speculative config's disable_by_batch_size); default: always

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r} (choose from {', '.join(BACKENDS)})")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_pages is not None and self.max_num_pages < 1:
            raise ValueError(f"max_num_pages must be >= 1, got {self.max_num_pages}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (None: the model's own), got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        self._resolve_token_budgets()
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r} "
                             f"(choose from {', '.join(SCHEDULING_POLICIES)})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs so every decode fits in a step"
            )
        if self.dtype is not None:
            torch_dtype(self.dtype)
        if self.structured_output_timeout_s < 0:
            raise ValueError("structured_output_timeout_s must be >= 0 (0: no time limit), got "
                             f"{self.structured_output_timeout_s}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r} "
                             f"(choose from {', '.join(KV_CACHE_DTYPES)})")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"unknown quantization {self.quantization!r} (choose from fp8)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.fused_decode_fp8_mma and self.fused_decode is False:
            raise ValueError("fused_decode_fp8_mma applies to the fused decode path, which fused_decode=False turns off")
        if self.fused_decode and self.tensor_parallel_size > 1:
            raise ValueError("fused_decode runs one GPU only: it needs tensor_parallel_size 1")
        self._resolve_speculative()

    def _resolve_speculative(self) -> None:
        """Parse the speculative config (JSON or a dict) and fold the batch-size flag into it."""
        spec = SpeculativeConfig.parse(self.speculative_config)
        limit = self.speculative_disable_by_batch_size
        if limit is not None:
            if spec is None:
                raise ValueError("speculative_disable_by_batch_size needs a speculative_config")
            spec = spec.replace(disable_by_batch_size=limit)
        if spec is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: speculative decoding runs on one GPU only "
                             "(tensor_parallel_size 1)")
        object.__setattr__(self, "speculative_config", spec)

    def _resolve_token_budgets(self) -> None:
        """Fill in the device's token budgets where none was given (frozen: set through object)."""
        try:
            on_cuda = self.resolved_device().type == "cuda"
        except RuntimeError as e:  # torch's error for a device string it cannot parse
            raise ValueError(f"device {self.device!r} is not a device: "
                             f"{str(e).splitlines()[0]}") from None
        if self.max_num_batched_tokens is None:
            default = 8192 if on_cuda else max(256, self.max_num_seqs)
            object.__setattr__(self, "max_num_batched_tokens", default)
        if self.max_decode_step_tokens is None:
            object.__setattr__(self, "max_decode_step_tokens", self.max_num_batched_tokens)
        if self.max_decode_step_tokens < 1:
            raise ValueError(f"max_decode_step_tokens must be >= 1, got {self.max_decode_step_tokens}")

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return torch_dtype(self.dtype)
        return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32

    def resolved_kv_cache_dtype(self) -> torch.dtype:
        """What the KV pool stores: the model's dtype, or float8 e4m3."""
        if self.kv_cache_dtype == "auto":
            return self.resolved_dtype()
        return torch.float8_e4m3fn

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def for_serving(self, decode_step_tokens_given: bool) -> "EngineConfig":
        """The server's config: steps that carry decodes bounded (stall-free batching) unless
        the bound was given, so its streams' token gaps stay near a decode step while long
        prompts arrive."""
        if decode_step_tokens_given:
            return self
        bound = SERVING_DECODE_STEP_TOKENS[self.resolved_device().type == "cuda"]
        return self.replace(max_decode_step_tokens=min(bound, self.max_num_batched_tokens))

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
                                choices=CHOICES.get(f.name))

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
