"""FP8 (e4m3) weights: the per-output-channel holder, its one matmul, and the hub's FP8 formats.

Every linear weight (fused QKV, O, fused gate-up, down) becomes a `QuantizedWeight`: `qweight`
[N, K] float8_e4m3fn and `scale` [N] fp32, with W ~= qweight * scale[:, None]. Embeddings,
norms and the LM head stay in the model dtype. `--quantization fp8` quantizes a bf16/fp16/fp32
checkpoint at load (each row rounded to nearest under the best of SCALE_CANDIDATES scales:
`quantize_weight_rows`); FP8 checkpoints (`quant_method` "fp8" with per-tensor, per-channel or block
scales, and compressed-tensors' float8 weights) convert to the same representation at load:
per-tensor and per-channel scales exactly, block scales by dequantizing in fp32 and
requantizing each row. `python -m flashlet.quantize` writes a per-channel checkpoint whose codes
GPTQ chose (`flashlet/models/gptq.py`) instead of rounding each weight to its nearest code.

`linear(x, w, bias)` is the one entry point the model's matmuls reach (`TorchOps.linear`). What
runs where, and why (lab/fp8_fidelity.py emulates each variant on the CPU against fp32):

- Weight-only everywhere by default: activations stay in the model dtype, each fp8 weight is
  widened exactly and the products summed in fp32, the row scale applied once. Off CUDA (and as
  the reference) `dequant_linear` does this in fp32 PyTorch; on CUDA, up to
  TRITON_GEMM_MAX_ROWS rows (decode, short prefill chunks) the Triton kernel
  `flashlet/kernels/fp8_gemv.py` streams the fp8 weight once per row tile; above,
  `weight_only_linear` widens the weight to the activation dtype in one Triton pass
  (`dequantize_rows`: 3 bytes a weight) for one cuBLAS GEMM.
- Per-token fp8 activations (`torch._scaled_mm`, sm_89+, bf16) only where a weight's
  `fp8_activations` is set. Quantizing activations as well as weights is what cost fidelity
  beyond the weights' own rounding: on SmolLM2-135M it moved perplexity over bf16's from +2.6%
  (weight-only) to +3.8%, past the 3% bar, and on a random qwen2.5-0.5b it cost another 10 points
  of argmax agreement.
- The LM head and embeddings stay in the model dtype: an fp8 LM head (one scale a row) cost
  SmolLM2-135M another 5.4 points of argmax agreement against fp32 (fp8 decoder weights with an
  fp8 head 87.7%, with the bf16 head 93.1%; all bf16 98.5%) and moved its perplexity from +3.0%
  over bf16 (lab's emulation; scripts/fidelity.py measured +2.5%) to +4.1%,
  past the 3% bar (`lab/fp8_fidelity.py --smollm2`, 389 positions; alone, on a bf16 decoder:
  92.3%, +1.1%). One scale per output row, not per 128 x 128 block: blocks measured no
  better (the error is e4m3's 3 mantissa bits, which no choice of scale removes).

On random-weight presets no fp8 variant comes within 3 points of bf16's argmax agreement: their
logits are nearly flat (fp32 top-2 gaps median 0.08), and the weights' rounding alone moves them
by about that much (RMS 0.1, 9 x bf16's), so every projection alone costs points. A trained
model's top-2 gaps are ten times wider; its perplexity (scripts/fidelity.py --perplexity) is
the measure that tells what fp8 weights lose there.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # an all-zero row gets this, not 0 (dividing by it stays finite)
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
QUANTIZATION_METHODS = ("fp8",)
# Row scales tried when a float weight is quantized (`quantize_weight_rows`), the best kept.
SCALE_CANDIDATES = 8
# Rows up to which CUDA runs the Triton weight-only kernel (`flashlet/kernels/fp8_gemv.py`,
# which streams the fp8 weight once per row tile); above it, a cuBLAS GEMM on the widened
# weight (one Triton pass, `dequantize_rows`). Measured by scripts/fp8_gemm_bench.py on the
# H200 (c2407b5): at 128 rows the widening wins on four of five shapes (the 7B QKV 22.6 us
# against 30.2, down 103 against 102, the 0.5B gate+up 14.2 against 26.5 and down 11.6 against
# 17.9; the 7B gate+up loses, 185 against 148), at 256 rows and above on all; at 64 rows the
# Triton tiles win (gate+up 82 us against ~180). Above DECODE_ROWS a weight that opts in to fp8
# activations (`fp8_activations`) takes `torch._scaled_mm` instead.
TRITON_GEMM_MAX_ROWS = 64
DECODE_ROWS = 16


class QuantizedWeight(nn.Module):
    """A linear weight in fp8 with one fp32 scale per output row. It stands where the
    nn.Linear's weight Parameter stood (`linear.weight`), so `ops.linear(x, layer.o_proj.weight)`
    reaches `linear` below."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if qweight.dtype != FP8 or scale.dtype != torch.float32 or scale.shape != qweight.shape[:1]:
            raise ValueError(f"QuantizedWeight needs fp8 [N, K] and fp32 [N], got "
                             f"{qweight.dtype} {tuple(qweight.shape)}, {scale.dtype} {tuple(scale.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        # Per-token fp8 activations (torch._scaled_mm) above DECODE_ROWS rows: faster
        # prefill, but they cost fidelity (quantization's docstring), so off unless asked.
        self.fp8_activations = False

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.qweight.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: qweight * scale, multiplied in fp32 and rounded once."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not cast the fp8 codes or their fp32 scales: keep only the move.
        for name in ("qweight", "scale"):
            old = self._buffers[name]
            new = fn(old)
            self._buffers[name] = new if new.dtype == old.dtype else old.to(new.device)
        return self


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (qweight [N, K] fp8, scale [N] fp32), per output row:
    scale = amax|row| / 448, so each row's largest entry maps to fp8's largest."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    qweight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return qweight, scale


def scale_fractions(candidates: int) -> list[float]:
    """The searched scales, as the fraction f of fp8's 448 that a row's amax maps to: 1 (amax /
    448, round-to-nearest's scale) and `candidates - 1` more, evenly down to just above 1/2.
    e4m3's grid is nearly the same in every binade, so f and 2f round alike: these f shift
    the grid under the row's values through one whole binade, and none clips."""
    return [1 - j / (2 * candidates) for j in range(candidates)]


def quantize_weight_rows(weight: torch.Tensor, candidates: int = SCALE_CANDIDATES
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's fp8 codes and row scales: round to nearest under each of
    `scale_fractions(candidates)`, each row keeping the scale whose dequantized row is closest
    to its float one (squared error). candidates=1 is `quantize_rows`. Where a row's values fall
    in e4m3's grid decides its rounding error; moving the grid by a fraction of a step lets each
    row take its best alignment, at no cost after load: on SmolLM2-135M, 8 candidates took the
    argmax-agreement loss against bf16 from -5.71 to -4.86 points and the perplexity from x1.0183
    to x1.0083 (`lab/fp8_rtn_search.py`, BENCHMARKS.md)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    best = None
    for f in scale_fractions(candidates):
        scale = (amax / (FP8_MAX * f)).clamp(min=MIN_SCALE)
        codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        loss = (codes.float().mul_(scale[:, None]).sub_(w)).square_().sum(dim=1)
        best = keep_better_rows(best, codes, scale, loss)
    return best[0], best[1]


def keep_better_rows(best, codes: torch.Tensor, scale: torch.Tensor, loss: torch.Tensor):
    """(codes [N, K] fp8, scale [N], loss [N]) taking each row from the new candidate where its
    loss is lower than `best`'s (None: the candidate whole); a tie keeps the earlier one."""
    if best is None:
        return codes, scale, loss
    better = loss < best[2]
    kept = torch.where(better[:, None], codes.view(torch.uint8), best[0].view(torch.uint8))
    return kept.view(FP8), torch.where(better, scale, best[1]), torch.where(better, loss, best[2])


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(*quantize_weight_rows(weight))


def empty_weight(shape: tuple[int, int], device) -> QuantizedWeight:
    """An uninitialised holder of `shape`, filled row by row by the loader."""
    return QuantizedWeight(torch.empty(shape, dtype=FP8, device=device),
                           torch.empty(shape[0], dtype=torch.float32, device=device))


def quantize_model(model) -> None:
    """Swap every decoder layer's linear weights for fp8 ones in place, freeing each float copy
    as it goes (the LM head, embeddings and norms stay as they are)."""
    with torch.no_grad():
        for layer in model.layers:
            for proj in QUANTIZED_PROJECTIONS:
                linear = getattr(layer, proj)
                if isinstance(linear.weight, QuantizedWeight):
                    continue
                swap_weight(linear, quantize_weight(linear.weight))


def prepare_quantized_model(model) -> None:
    """Give every decoder linear an empty fp8 holder (on the model's device) for the loader."""
    for layer in model.layers:
        for proj in QUANTIZED_PROJECTIONS:
            linear = getattr(layer, proj)
            swap_weight(linear, empty_weight(tuple(linear.weight.shape), linear.weight.device))


def swap_weight(linear: nn.Linear, weight: QuantizedWeight) -> None:
    """Put `weight` where the Linear's float Parameter was (which is dropped)."""
    del linear.weight  # nn.Module refuses a module assigned over a Parameter's name
    linear.weight = weight


def is_quantized(model) -> bool:
    return isinstance(model.layers[0].qkv_proj.weight, QuantizedWeight)


# ---- the matmul -------------------------------------------------------------------------------

def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) -> [T, N] in x's dtype, by `matmul_path`'s choice."""
    path = matmul_path(x, w)
    if path == "dequant":
        return dequant_linear(x, w, bias)
    if path == "scaled_mm":
        return scaled_mm_linear(x, w, bias)
    if path == "triton":
        from flashlet.kernels.fp8_gemv import fp8_gemm

        return fp8_gemm(x, w.qweight, w.scale, bias)
    return weight_only_linear(x, w, bias)


def matmul_path(x: torch.Tensor, w: QuantizedWeight) -> str:
    """Which matmul `linear` runs for these rows: "dequant" (off CUDA, or fp32: the reference),
    "scaled_mm" (fp8 activations, opted in, above DECODE_ROWS), "triton" (the weight-only fp8
    GEMM, up to TRITON_GEMM_MAX_ROWS) or "widen" (the widened weight, one cuBLAS GEMM)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return "dequant"
    rows = x.shape[0]
    if rows > DECODE_ROWS and w.fp8_activations and scaled_mm_fits(x, w):
        return "scaled_mm"
    if rows <= TRITON_GEMM_MAX_ROWS and has_fp8_gemm(x.device.index):
        return "triton"
    return "widen"


def linear_add_(x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor) -> torch.Tensor:
    """out += x [T, K] @ W.T, in place: where `linear` takes the Triton GEMM, in its epilogue
    (summed in fp32, rounded once: no add kernel); elsewhere `linear`, then the add."""
    if matmul_path(x, w) == "triton" and out.dtype == x.dtype:
        from flashlet.kernels.fp8_gemv import fp8_gemm

        return fp8_gemm(x, w.qweight, w.scale, accumulate_into=out)
    return out.add_(linear(x, w))


def weight_only_linear(x, w: QuantizedWeight, bias=None) -> torch.Tensor:
    """Many rows on CUDA: the weight widened to x's dtype for this call (code times scale in
    fp32, rounded once, as `dequantize`; far below fp8's own error) by one Triton pass
    (`dequantize_rows`), then one cuBLAS GEMM, whose FLOPs then outweigh the widening's bytes."""
    if x.is_cuda and has_fp8_gemm(x.device.index):
        from flashlet.kernels.fp8_gemv import dequantize_rows

        widened = dequantize_rows(w.qweight, w.scale, x.dtype)
    else:
        widened = w.dequantize(x.dtype)
    return F.linear(x, widened, bias)


def dequant_linear(x, w: QuantizedWeight, bias=None) -> torch.Tensor:
    """The reference (and the CPU path): the weight dequantized in fp32 and multiplied in fp32
    (as _scaled_mm's epilogue applies the scales), rounded once to x's dtype: a bf16 copy of
    the weight would add its own rounding on top of fp8's."""
    out = F.linear(x.float(), w.dequantize(torch.float32))
    return (out + bias if bias is not None else out).to(x.dtype)


def scaled_mm_fits(x: torch.Tensor, w: QuantizedWeight) -> bool:
    """torch._scaled_mm with row-wise scales: sm_89+, a bf16 output (the only one row-wise
    scaling is sure to take across PyTorch versions), K and N multiples of 16, some rows."""
    n, k = w.shape
    return (x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0
            and x.shape[0] > 0 and has_fp8_gemm(x.device.index))


@functools.lru_cache(maxsize=None)
def has_fp8_gemm(device_index: int | None) -> bool:
    """FP8 tensor cores and Triton's e4m3 type: sm_89 (Ada) and up. Cached: every linear asks."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_linear(x, w: QuantizedWeight, bias=None) -> torch.Tensor:
    """FP8 x FP8 GEMM: x quantized per token (row-wise scales), W per output channel; both
    scales applied in the GEMM's fp32 epilogue. Rows are padded to a multiple of 16."""
    rows = x.shape[0]
    xq, x_scale = quantize_rows(x)
    pad = -rows % 16
    if pad:
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
        x_scale = F.pad(x_scale, (0, pad), value=1.0)
    out = torch._scaled_mm(xq, w.qweight.t(), scale_a=x_scale[:, None],
                           scale_b=w.scale[None, :], out_dtype=x.dtype)
    out = out[:rows]
    return out + bias if bias is not None else out


# ---- FP8 checkpoints on the hub ---------------------------------------------------------------

# What a checkpoint of `QuantizedWeight`s is written with (`weights.save_fp8_checkpoint`):
# compressed-tensors' per-channel float8 weights, which `checkpoint_format` reads back exactly
# and which other engines (vLLM) read as weight-only fp8; activations stay unquantized.
PER_CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True,
                    "dynamic": False}}}}


class CheckpointFormat:
    """How an FP8 checkpoint stores a linear weight: `<name>` in fp8 beside `<name>_<scale_suffix>`
    (fp32: one value, one per row, or one per `block` [rows, cols] tile), W = q * scale."""

    def __init__(self, method: str, scale_suffix: str, block: tuple[int, int] | None = None):
        self.method, self.scale_suffix, self.block = method, scale_suffix, block

    def scale_name(self, weight_name: str) -> str:
        return weight_name + self.scale_suffix.removeprefix("weight")  # weight -> weight_scale

    def scale_shape_error(self, weight_shape: tuple, scale_shape: tuple) -> str | None:
        """Why a scale of `scale_shape` cannot scale a weight of `weight_shape` (None: it can)."""
        n, k = weight_shape
        numel = math.prod(scale_shape)
        if numel == 1 or (numel == n and self.block is None):
            return None
        if self.block is None:
            return (f"a scale of shape {tuple(scale_shape)} for a [{n}, {k}] weight is neither "
                    f"per-tensor nor per-channel, and the config gives no block size")
        bn, bk = self.block
        if tuple(scale_shape) != (-(-n // bn), -(-k // bk)):
            return (f"block scales of shape {tuple(scale_shape)} do not tile a [{n}, {k}] weight "
                    f"in {bn} x {bk} blocks")
        return None

    def to_rows(self, qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A stored (fp8 weight, scale) -> (qweight [N, K] fp8, scale [N] fp32) per row: exact for
        one scale or one per row; block scales are dequantized in fp32 and requantized per row."""
        error = self.scale_shape_error(tuple(qweight.shape), tuple(scale.shape))
        if error:
            raise ValueError(error)
        n, k = qweight.shape
        scale = scale.float()
        if scale.numel() == 1:
            return qweight, scale.reshape(1).expand(n).contiguous()
        if self.block is None:
            return qweight, scale.reshape(n).contiguous()
        bn, bk = self.block
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return quantize_weight_rows(qweight.float() * full)


def checkpoint_format(quant: dict | str | None) -> CheckpointFormat | None:
    """A config.json's `quantization_config` -> how its weights are stored (None: not quantized);
    ValueError naming the method or setting for anything we do not read."""
    if not quant:
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
    if method == "fp8":
        return _fp8_format(quant)
    if method == "compressed-tensors":
        return _compressed_tensors_format(quant)
    raise ValueError(f"quantized checkpoint (quantization_config, quant_method {method!r}): only "
                     f"FP8 checkpoints (quant_method 'fp8' or 'compressed-tensors' with float8 "
                     f"weights) are read; use the unquantized model")


def _fp8_format(quant: dict) -> CheckpointFormat:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quant_method 'fp8' with fmt {fmt!r}: only e4m3 weights are read")
    block = quant.get("weight_block_size")
    if block is None:
        return CheckpointFormat("fp8", "weight_scale")
    if len(block) != 2:
        raise ValueError(f"quant_method 'fp8': weight_block_size {block!r} is not [rows, cols]")
    return CheckpointFormat("fp8", "weight_scale_inv", (int(block[0]), int(block[1])))


def _compressed_tensors_format(quant: dict) -> CheckpointFormat:
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("quant_method 'compressed-tensors' without config_groups")
    formats = {_compressed_group_format(g) for g in groups}
    if len(formats) > 1:
        raise ValueError(f"quant_method 'compressed-tensors' with differing weight schemes {sorted(formats)}")
    strategy, block = formats.pop()
    return CheckpointFormat("compressed-tensors", "weight_scale", block)


def _compressed_group_format(group: dict) -> tuple[str, tuple[int, int] | None]:
    weights = group.get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind != "float" or bits != 8:
        raise ValueError(f"quant_method 'compressed-tensors' with {kind} {bits}-bit weights: only "
                         f"float 8-bit weights are read")
    if strategy in ("tensor", "channel"):
        return strategy, None
    if strategy == "block" and len(weights.get("block_structure") or ()) == 2:
        return strategy, tuple(int(b) for b in weights["block_structure"])
    raise ValueError(f"quant_method 'compressed-tensors' with weight strategy {strategy!r}: only "
                     f"tensor, channel and block are read")
