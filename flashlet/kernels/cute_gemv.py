"""A decode step's linear layer in CuTe DSL for 1 to 16 rows: y[M, N] = x[M, K] @ W[N, K]^T,
with fused epilogues; the weights, which are the cost, are read once for all M rows.

Work. W [N, K] bf16 row-major (nn.Linear's layout), x [M, K] bf16; products summed in fp32,
rounded once to bf16. Epilogues, each folded into the same kernel (shapes per row; the bias is
the layer's, one for all rows; the residual, positions and slots are each row's):
  none       y = W x                                   [N]
  bias       y = W x + b                               [N]   (the QKV projection)
  residual   y = W x + r                               [N]   (O and down: the residual add)
  silu_mul   y = silu(g) * u, g|u = W x split in half  [N/2] (the fused gate+up projection)
  argmax     token = argmax(W x)                       int32 (greedy sampling off the LM head)
  rope_kv, bias_rope_kv                                [N]   (the QKV projection of the fused
             decode path: y = W x (+ b), then RoPE on the q and k heads at the step's position
             and the k and v heads stored into the paged pool at its slot; see `RopeKV`)

Bytes: N * K * 2 of weights (everything else is noise); FLOPs 2 * M * N * K. At batch 1 only
the bytes matter, so the design is about keeping enough loads in flight. With M rows (`rows`,
compiled in) each lane multiplies its weight chunks by every row's x and the group's sums are
reduce-scattered so each lane finishes its own rows (`_dot_rows`, `reduce_scatter`;
FUSED_NOTES.md, "Stage 4: M rows"), or the tensor cores sum them (below); M = 1 compiles to the
one-row kernel described below.

Design. A group of L lanes (L = 32, 16, 8 ... the largest power of two dividing K / 8) owns
a row; each lane holds C = K / (8 L) 16-byte chunks of that row, so a row is read as C
coalesced runs of L * 16 bytes. Every lane first issues the loads for all R rows its group
owns (R * C independent 16-byte loads, all in flight at once: nothing waits before the last
one is issued), then reads x (L1-resident after the first warp), converts, multiplies, and the
L lanes reduce with butterfly shuffles. Lane 0 of the group applies the epilogue and stores.
For the small projections the whole matrix is in flight in one wave (no split-K is needed:
at K = 4864 a warp per row already gives each lane 19 loads in flight, and 896 one-warp CTAs
cover the 132 SMs about seven times). By default each CTA owns one tile of rows; a plan may
instead launch a resident grid that loops over the tiles (`ctas_per_sm`, any epilogue; staged
with `stages=2`, each CTA's next tile is copied while this one is summed), and the knobs that
shape the plan can be set per call or per shape in TUNED_PLANS (see plan_gemv and
scripts/gemv_sweep.py). With argmax the grid always loops: a
resident grid of three CTAs per SM loops over the LM head's tiles keeping a running (value,
index) per group, reduces it through shared memory, writes one partial per CTA, and the last
CTA to finish (a counter it resets) reduces the partials, so one launch yields the token.
With `pdl=True` the kernel issues its weight loads before `griddepcontrol.wait`, so under
Programmatic Dependent Launch they overlap the previous kernel's tail: the form the fused
decode path will use (see FUSED_NOTES.md). The residual epilogue may write in place (out is
the residual): each output is read and written by the same lane group.

Tensor cores (`mma`, the default for 2-16 bf16 rows where it plans; FUSED_NOTES.md, "Stage
5"): the M rows' sums come from mma.sync m16n8k16 (bf16 in, fp32 sums) with W as the A operand
and x^T as B, each lane's natural 16-byte loads its fragments (K permuted alike in both), so the
products cost about one row's: a CTA owns 16 weight rows and its warps split K (`_plan_mma`,
`_mma_kernel`); a long K also splits over CTAs (`splits`), and a CTA may take G tiles at once
(`tile_group`: their weight loads all in flight, x's fragments, at 16 rows as many bytes as a
tile's weights, read from L2 once for the G). One row, fp8 and the staged variant
keep the CUDA-core form by default (`mma=False` asks for it); fp8 has a tensor-core form too,
opt-in (below).

FP8 weights (`fp8=True`; quantization.QuantizedWeight's layout: W ~= q * scale[:, None], q [N, K]
e4m3, scale [N] fp32): weight-only, as the per-op fp8 kernel. A 16-byte load holds 16 weights
(8 in bf16), so K is chunked by 16 (lanes_for(K, 16): K = 896 gives 8 lanes of 7 chunks, 4864
16 lanes of 19); each chunk is widened by the hardware's e4m3x2 -> f16x2 conversion (exact) and
then to fp32, and its two halves meet x's two 16-byte loads (x stays bf16, 8 a load). The sums
go through `_dot_rows` at one row too (a lane covers twice a bf16 lane's K: the one-row form held
too many registers and spilled), and each weight row's sum is multiplied by its scale once,
before any epilogue. The bytes fall to N * K (+ 4 N of scales); the bf16 kernels' code is the
same (their PTX is byte-identical with or without this path, a test pins it). With mma=True (1
to 16 rows, opt-in until measured; FUSED_NOTES.md, "Issue 31: fp8 on the tensor cores") fp8
weights go through the tensor-core form instead: a K step is 64, lane t's 16-byte load of a row
holds its 16 codes, widened to bf16 by three integer instructions a pair (`widen_e4m3_word`:
exact, each value times 2^-120, which the epilogue multiplies back with the row's scale), and
four m16n8k16 products a step take them with x's two 16-byte chunks of the same K.

The CuTe DSL (`nvidia-cutlass-dsl`, 4.3.5 to 4.8.1; CUTE_DSL_PIN is the recommended one, which
also meets FlashInfer's floor of 4.6.2) is imported on first use, so the rest of flashlet never
needs it; `CuteUnavailable` says how to install it when it is missing. A compiled launcher is
kept on disk and loaded by later processes (`cute_disk_cache`). The code is the same on
each version; the PTX is not (instruction selection, a load's type spelled otherwise), the SASS's
loads and products are (FUSED_NOTES.md, "CuTe DSL versions").
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import time

try:
    import torch
except ImportError:  # a cute_precompile worker, which keeps torch out (half its start): its
    torch = None     # traces use stand-ins only (CuteGemv.stand_in)

from flashlet.kernels import cute_disk_cache, cute_precompile, tuning

EPILOGUES = ("none", "bias", "residual", "silu_mul", "argmax", "rope_kv", "bias_rope_kv")
ROPE_EPILOGUES = ("rope_kv", "bias_rope_kv")
VEC = 8  # bf16 elements in one 16-byte load
FP8_VEC = 16  # fp8 (e4m3) weights in one 16-byte load: a chunk of K is 16 elements, x's two loads
FP8_VECTOR_SUMS = 4  # fp8: up to this many sums a lane (M x rows in flight) keep 8-wide accumulators (more spilled)
MAX_ROWS = 16  # decode rows one launch computes (the fused path's small batches, verify steps)
MMA_K = 32  # the mma form's K step: a lane's 16-byte load a row, two m16n8k16 products
MMA_ROWS = 16  # weight rows a tensor-core tile covers (the mma's M; the decode rows are its N)
MMA_MAX_STEPS = 8  # K steps a warp loads at once: 16 weight loads a lane in flight
MMA_MAX_WARPS = 32  # a CTA's warps splitting K (1024 threads)
MMA_ARGMAX_CTAS_PER_SM = 8  # the tensor-core argmax's looping grid (a CTA walks ~9 LM-head tiles)
MMA_K_FP8 = 64  # fp8's K step: a lane's 16-byte load a row holds 16 e4m3, four m16n8k16 products
# fp8 on the tensor cores widens e4m3 to bf16 with integer ops (`widen_e4m3_word`, exact): each
# 32-bit word of four codes becomes two bf16 pairs whose values are the codes' times 2^-120; the
# epilogue multiplies each sum by E4M3_BF16_SCALE before the row's scale.
E4M3_PRMT = (0x9180, 0xB3A2)  # prmt selectors: codes 0, 1 (2, 3) as sign-extended 16-bit halves
E4M3_SHIFT = 4                # the 7 exponent + mantissa bits to bf16's bits 4-10 (sign: bits 11-15)
E4M3_MASK = 0x87F087F0        # keep each half's bit 15 (sign) and bits 4-10
E4M3_BF16_SCALE = 2.0 ** 120  # bf16 exponent e against e4m3's bias 7: 2^(e - 127) / 2^(e - 7)
CUTE_DSL_PIN = "nvidia-cutlass-dsl==4.8.1"  # the newest checked (4.3.5 to 4.8.1 work); FlashInfer needs >= 4.6.2
INSTALL_HINT = (
    f"the CuTe DSL is not importable: pip install {CUTE_DSL_PIN} (4.3.5 to 4.8.1 work; it needs "
    "cuda-bindings too). With pip's --target DIR, which skips the wheel's .pth file, put "
    "DIR/nvidia_cutlass_dsl/dsl_packages (4.3.5: DIR/nvidia_cutlass_dsl/python_packages) and DIR "
    "on PYTHONPATH"
)


class CuteUnavailable(RuntimeError):
    """The CuTe DSL (nvidia-cutlass-dsl) cannot be imported."""


def dsl_version() -> str:
    """The importable CuTe DSL's version ("" when none is)."""
    for dist in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base"):  # (4.6 on: the meta wheel's libraries)
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return ""


def cute_available() -> tuple[bool, str]:
    """(True, "") when `cutlass.cute` imports, else (False, the reason)."""
    try:
        _dsl()
    except CuteUnavailable as e:
        return False, str(e)
    return True, ""


@functools.cache
def _dsl():
    """Import the DSL once; the kernel functions below are decorated here, not at import."""
    try:
        import cuda.bindings.driver as cuda_driver
        import cutlass
        import cutlass.cute as cute
        import cutlass.utils.distributed  # noqa: F401  (atomicAdd for the argmax epilogue)
        from cutlass._mlir import ir
        from cutlass._mlir.dialects import llvm, vector  # inline PTX (`_opaque_zero`, `_mma_bf16`)
        from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor
    except Exception as e:  # ImportError, or a broken native library underneath
        raise CuteUnavailable(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
    g = globals()
    g.update(cutlass=cutlass, cute=cute, llvm=llvm, ir=ir, vector=vector)
    # Compile-time parameters are marked here: the annotations need `cutlass`, imported late.
    for fn, names in _CONSTEXPR_PARAMS.items():
        fn.__annotations__ = {name: cutlass.Constexpr for name in names}
    for fn in (_gemv_launch, _gemv_launch_fp8, _mma_launch, _mma_launch_fp8):
        # Typed, as an exported launcher's C signature needs every runtime argument typed
        # (cute_disk_cache's export_to_c; tensors are typed by their values).
        fn.__annotations__["stream"] = cuda_driver.CUstream
    g["_gemv_kernel_compiled"] = cute.kernel(_gemv_kernel)
    g["_mma_kernel_compiled"] = cute.kernel(_mma_kernel)
    for helper in (_argmax_pick, _argmax_warp, _argmax_cta, _argmax_finish, _argmax_finish_rows,
                   _argmax_last_cta_rows, _mma_load_weights, _mma_x_fragments, _mma_rstd, _mma_sq_to_smem,
                   _mma_store_sq, _lane_rows_rstd, _summed_rstd, _mma_tile, _mma_epilogue, _mma_argmax_finish, _mma_finish_split,
                   _rope_kv_store, _stage_tile, _dot_rows, _fp8_partials, _merge_split_count, _merge_counts, _merge_x):
        g[helper.__name__] = cute.jit(helper)
    return dict(cutlass=cutlass, cute=cute, from_dlpack=from_dlpack, cuda=cuda_driver,
                launcher=cute.jit(_gemv_launch), launcher_fp8=cute.jit(_gemv_launch_fp8),
                launcher_mma=cute.jit(_mma_launch), launcher_mma_fp8=cute.jit(_mma_launch_fp8),
                make_fake=make_fake_compact_tensor)


# ---------------------------------------------------------------------------------------------
# The plan: how rows and chunks map onto lanes, warps and CTAs (plain Python, testable on CPU).

@dataclasses.dataclass(frozen=True)
class GemvPlan:
    n_rows: int          # rows of W
    k: int               # columns of W
    n_out: int           # outputs (n_rows, or n_rows / 2 for silu_mul)
    epilogue: str
    lanes: int           # L: lanes that share one row
    chunks: int          # C: 16-byte chunks per lane per row
    outs_per_group: int  # outputs a lane group owns in one tile (rows in flight: x2 for silu_mul)
    warps: int           # warps per CTA
    grid: int            # CTAs launched
    pdl: bool = False
    staged: bool = False  # weights go through shared memory by cp.async (see plan_gemv)
    norm: bool = False    # RMSNorm prologue: y = W (x * rstd(x) * g) (see plan_gemv)
    eps: float = 1e-6     # the RMSNorm's epsilon (with norm)
    rope: RopeShape | None = None  # the rope epilogues' head layout, table and pool sizes
    stages: int = 1       # staged only: 2 = the next tile's copies fly while this one is used
    late_g: bool = False  # norm + pdl: the norm's weight is read after the wait, with x
    min_ctas: int = 0     # > 0: ptxas must fit this many CTAs an SM (a register cap)
    rows: int = 1         # M: decode rows computed per launch, each weight read once for all
    fp8: bool = False     # W is fp8 (e4m3) with one fp32 scale a row, applied to each sum
    mma: bool = False     # tensor cores (M >= 2): `chunks` K steps of 32 a warp, `warps` split K
    splits: int = 1       # mma: CTAs sharing a tile's K (their sums meet in a workspace)
    tile_group: int = 1   # mma: weight tiles a CTA loads at once and sums against one load of x
    merge: tuple = ()     # x merged from the attention's split partials (`merge_in`); () reads x

    @property
    def vec(self) -> int:
        """Elements of K in one 16-byte weight chunk: 8 bf16, 16 fp8."""
        return FP8_VEC if self.fp8 else VEC

    @property
    def k_step(self) -> int:
        """The tensor-core form's K step: 32 bf16 (two products), 64 fp8 (four)."""
        return mma_k_step(self.fp8)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weight is called with: e4m3 codes with fp8, else bf16."""
        return torch.float8_e4m3fn if self.fp8 else torch.bfloat16

    @property
    def groups_per_cta(self) -> int:
        return self.warps * (32 // self.lanes)

    @property
    def outs_per_tile(self) -> int:
        if self.mma:  # a CTA's 16 weight rows: 16 outputs, or 8 gate|up or rotate-half pairs
            return MMA_ROWS // self.rows_per_out
        return self.groups_per_cta * self.outs_per_group

    @property
    def num_tiles(self) -> int:
        return math.ceil(self.n_out / self.outs_per_tile)

    # The rope epilogues' head layout as plain ints for the kernel (unused without rope).
    head_dim = property(lambda self: self.rope.head_dim if self.rope else 2)
    q_heads = property(lambda self: self.rope.num_q_heads if self.rope else 0)
    kv_heads = property(lambda self: self.rope.num_kv_heads if self.rope else 0)

    @property
    def rows_per_out(self) -> int:
        """Rows of W behind one output slot: a SiLU-mul's gate and up, a RoPE pair's two halves."""
        return 2 if self.epilogue == "silu_mul" or self.epilogue in ROPE_EPILOGUES else 1

    @property
    def loads_in_flight_per_lane(self) -> int:
        if self.mma:  # rows g and g + 8 of the tile, one 16-byte load each per K step
            return 2 * self.chunks
        return self.outs_per_group * self.chunks * self.rows_per_out

    @property
    def loops(self) -> bool:
        """A resident grid: fewer CTAs than tiles, each CTA walks tiles bidx, bidx + grid, ..."""
        return self.grid * self.tile_group < self.num_tiles * self.splits

    def describe(self) -> str:
        """A short tag for tables: warps, rows in flight, grid, and the options that are on."""
        tag = f"w{self.warps} R{self.outs_per_group} g{self.grid}"
        tag += f" st{self.stages}" if self.staged else ""
        tag += " lateg" if self.late_g else ""
        tag += f" min{self.min_ctas}" if self.min_ctas else ""
        tag += f" M{self.rows}" if self.rows > 1 else ""
        tag += " fp8" if self.fp8 else ""
        tag += f" mma{self.chunks}" if self.mma else ""
        tag += f" s{self.splits}" if self.splits > 1 else ""
        tag += f" tg{self.tile_group}" if self.tile_group > 1 else ""
        tag += f" merge{self.merge[4]}" if self.merge else ""
        tag += " bf16parts" if self.merge and self.merge[5] == "bf16" else ""
        return tag


@dataclasses.dataclass(frozen=True)
class RopeShape:
    """What the rope epilogues compile in: the QKV output is Hq + 2 Hkv heads of head_dim,
    q heads first, then k, then v; the fp32 cos | sin table has table_rows rows of head_dim;
    one layer's pool (k_cache[layer], v_cache[layer]) holds cache_slots slots of [Hkv, head_dim]."""
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    table_rows: int
    cache_slots: int

    def __post_init__(self):
        # The kernel indexes the table and one layer's pool with 32-bit offsets.
        if max(self.table_rows * self.head_dim, self.cache_slots * self.num_kv_heads * self.head_dim) >= 2**31:
            raise ValueError(f"the rope epilogue indexes with 32 bits: table or pool too large ({self})")

    @property
    def rows(self) -> int:
        return (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim


PARTIAL_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # merge_in(partials=): mid_o's dtype (torch's name)


def partial_dtype(rule: tuple):
    """The torch dtype of a `merge_in` rule's partial outputs (mid_o)."""
    return getattr(torch, PARTIAL_DTYPES[rule[5]])


def merge_in(splits: int, split_tokens: int, block_n: int, head_dim: int, group: int = 4,
             partials: str = "fp32") -> tuple:
    """A GEMV's `merge` (plan_gemv): its x is the one-launch attention's output, left by the
    attention as split partials (`decode_attention_one_launch(partials_out=True)`) and merged in
    the GEMV's prologue, each CTA merging all of x into shared memory. The attention's split rule
    (the grid's splits, the smallest split's tokens, its key block) gives each row's split count
    from its KV length; `group` splits load at once (one L2 round trip a group); `partials` is
    the partial outputs' dtype ("fp32", or "bf16": half the bytes each CTA loads; the
    log-sum-exps stay fp32)."""
    for name, v in (("splits", splits), ("split_tokens", split_tokens), ("block_n", block_n),
                    ("head_dim", head_dim), ("group", group)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"merge_in: {name} must be a positive int, got {v!r}")
    if head_dim % VEC:
        raise ValueError(f"merge_in: head_dim must be a multiple of {VEC} (a chunk of x in one head), got {head_dim}")
    if partials not in PARTIAL_DTYPES:
        raise ValueError(f"merge_in: partials must be one of {tuple(PARTIAL_DTYPES)}, got {partials!r}")
    return (splits, split_tokens, block_n, head_dim, group, partials)


def same_split_rule(a: tuple, b: tuple) -> bool:
    """Whether two `merge_in` tuples count and store the splits alike (all but the group of
    splits a round, which is the consuming GEMV's own)."""
    return tuple(a)[:4] + tuple(a)[5:] == tuple(b)[:4] + tuple(b)[5:]


@dataclasses.dataclass
class SplitPartials:
    """A merge GEMV's x (`merge_in`): the attention's split partials of M rows, mid_o [>= M x splits,
    Hq, D] fp32 (bf16 where the rule says so) and mid_lse [>= M x splits, Hq] fp32 (base-2
    log-sum-exps; row b's in slots b x splits + s), its kv_lens [>= M] int32 (each row's KV length:
    its split count), and `rule`, the `merge_in` tuple of the attention's split rule, which the
    GEMV's plan must share (all but its group of splits a round, the GEMV's own)."""
    mid_o: torch.Tensor
    mid_lse: torch.Tensor
    kv_lens: torch.Tensor
    rule: tuple


def split_count(kv_len: int, rule: tuple) -> int:
    """The splits the one-launch attention gives a row of kv_len tokens under `rule` (merge_in's
    tuple): its `_split_range`, which the merge GEMV's prologue repeats on the device."""
    splits, split_tokens, block_n = rule[:3]
    n = max(min(-(-kv_len // split_tokens), splits), 1)
    split_len = max(-(-(-(-kv_len // n)) // block_n) * block_n, block_n)
    return max(-(-kv_len // split_len), 1)


def merge_partials_reference(parts: SplitPartials, rows: int = 1) -> torch.Tensor:
    """The slow obvious merge of `rows` decode rows' split partials -> x [rows, Hq * D] fp32: row
    b's slots b * splits .. b * splits + split_count(kv_len_b) - 1 only (what lies past them is never
    read), each head weighted by 2^(lse - max lse)."""
    splits, head_dim = parts.rule[0], parts.rule[3]
    heads = parts.mid_o.shape[-2]
    lse_all = parts.mid_lse.reshape(-1, heads).float()
    o_all = parts.mid_o.reshape(-1, heads, head_dim).float()
    out = []
    for b in range(rows):
        n = split_count(int(parts.kv_lens.view(-1)[b]), parts.rule)
        lse, o = lse_all[b * splits: b * splits + n], o_all[b * splits: b * splits + n]
        w = torch.exp2(lse - lse.max(dim=0).values)
        out.append(((w[:, :, None] * o).sum(0) / w.sum(0)[:, None]).reshape(-1))
    return torch.stack(out)


def lanes_for(k: int, vec: int = VEC) -> int:
    """The largest power of two up to 32 dividing K / vec (vec: elements a 16-byte chunk holds,
    8 bf16 or 16 fp8): lanes that share one row."""
    chunks = k // vec
    lanes = 32
    while chunks % lanes:
        lanes //= 2
    return lanes


# Tuned plans for the shapes measured on a GPU, filled from the plan sweep
# (`python scripts/gemv_sweep.py --pdl on`; `--only lm_head` for the LM head), which prints entries in this
# form. Key: (n_rows, k, epilogue, norm, pdl), as the fused decode path builds its GEMVs, with
# the decode rows M appended where M > 1 (a plan measured at one row does not bind the others).
# Value: plan_gemv's knobs for that GEMV, any of
#   warps            warps per CTA (1, 2, 4, 8)
#   outs_per_group   outputs a lane group owns per tile (rows in flight: x2 for silu_mul / rope)
#   ctas_per_sm      a resident grid of ctas_per_sm x SMs CTAs looping over the tiles
#                    (0: one tile per CTA)
#   staged, stages   weights through shared memory by cp.async; stages=2 double-buffers a
#                    looping grid's tiles
#   late_g           read the norm's weight after the PDL wait (fewer registers held across it)
#   min_ctas_per_sm  ptxas register cap: this many CTAs must fit an SM
#   splits           the tensor-core form (M > 1): CTAs sharing a tile's K
#   tile_group       the tensor-core form: weight tiles a CTA computes together, their loads in
#                    flight at once, x's fragments loaded once for all of them
# An argument given to plan_gemv wins over the table; a knob the table leaves out keeps the
# built-in heuristic below. A shape with no entry (every shape, until measured) is planned by
# the heuristic alone. Entries hold for the GPU they were measured on (H200, 132 SMs: the
# grid scales with the SM count, the best choice might not).
TUNED_PLANS: dict[tuple, dict] = {
    # Qwen2.5-0.5B's fused path with PDL (each plan's time against the default plan's:
    # BENCHMARKS.md's history, the GEMV plan sweep).
    (9728, 896, "silu_mul", True, True): {"staged": True, "stages": 2, "ctas_per_sm": 4},  # gate_up
    (896, 4864, "residual", False, True): {"warps": 4},  # down
    (1152, 896, "bias", True, True): {"ctas_per_sm": 4, "warps": 2},  # qkv
    (896, 896, "residual", False, True): {"staged": True, "stages": 2, "ctas_per_sm": 4},  # o
    (1152, 896, "bias_rope_kv", True, True): {"warps": 8},  # qkv + RoPE
    # The tied LM head with its argmax: a looping grid of 2 CTAs an SM.
    (151936, 896, "argmax", True, True): {"ctas_per_sm": 2},
    # The other fused presets' one-row plans, swept on an H200 (gpu_run.sh gemv-preset, 2026-12-05):
    # one stream after 1,000 tokens through LLM.generate +8-15% against the heuristic's plans
    # (BENCHMARKS.md's history). The O projection at K = 2048 won with 8 warps at all three
    # presets that have it. The plain QKV entries of Llama-3.2-1B, TinyLlama and Qwen2.5-1.5B
    # serve steps without the RoPE epilogue (an fp8 KV pool); with it, see below.
    (4096, 1024, "none", True, True): {"min_ctas_per_sm": 8},  # qwen3-0.6b qkv
    (1024, 2048, "residual", False, True): {"warps": 8},  # qwen3-0.6b o
    (6144, 1024, "silu_mul", True, True): {"staged": True},  # qwen3-0.6b gate_up
    (1024, 3072, "residual", False, True): {"min_ctas_per_sm": 12},  # qwen3-0.6b down
    (151936, 1024, "argmax", True, True): {"ctas_per_sm": 2},  # qwen3-0.6b lm_head
    (4096, 2048, "none", True, True): {"staged": True, "stages": 2, "ctas_per_sm": 4},  # qwen3-1.7b qkv
    (2048, 2048, "residual", False, True): {"warps": 8},  # o at hidden 2048
    (12288, 2048, "silu_mul", True, True): {"staged": True, "stages": 2, "ctas_per_sm": 8},  # qwen3-1.7b gate_up
    (2048, 6144, "residual", False, True): {"ctas_per_sm": 4},  # qwen3-1.7b down
    (151936, 2048, "argmax", True, True): {"ctas_per_sm": 4, "warps": 2},  # qwen3-1.7b lm_head
    (3072, 2048, "none", True, True): {"staged": True, "stages": 2, "ctas_per_sm": 4},  # llama-3.2-1b qkv
    (16384, 2048, "silu_mul", True, True): {"staged": True, "stages": 2, "ctas_per_sm": 8},  # llama-3.2-1b gate_up
    (2048, 8192, "residual", False, True): {"warps": 8},  # llama-3.2-1b down
    (128256, 2048, "argmax", True, True): {"ctas_per_sm": 4, "warps": 2},  # llama-3.2-1b lm_head
    (2560, 2048, "none", True, True): {"late_g": True, "warps": 1},  # tinyllama-1.1b qkv
    (11264, 2048, "silu_mul", True, True): {"staged": True, "stages": 2, "ctas_per_sm": 8},  # tinyllama-1.1b gate_up
    (2048, 5632, "residual", False, True): {"ctas_per_sm": 4},  # tinyllama-1.1b down
    (32000, 2048, "argmax", True, True): {"ctas_per_sm": 4, "warps": 2},  # tinyllama-1.1b lm_head
    (2048, 1536, "bias", True, True): {"outs_per_group": 3},  # qwen2.5-1.5b qkv
    (1536, 1536, "residual", False, True): {"warps": 8},  # qwen2.5-1.5b o
    (17920, 1536, "silu_mul", True, True): {"staged": True, "stages": 2, "ctas_per_sm": 4},  # qwen2.5-1.5b gate_up
    (1536, 8960, "residual", False, True): {"warps": 8},  # qwen2.5-1.5b down
    (151936, 1536, "argmax", True, True): {"late_g": True, "min_ctas_per_sm": 3},  # qwen2.5-1.5b lm_head
    # Qwen2.5-1.5B's QKV with its RoPE epilogue (the one-row steps' form), swept on an H100
    # (gpu_run.sh gemv-preset with GEMV_SHAPES=qkv_rope, session 66): 1.05x alone, but one stream
    # after 1,000 tokens through LLM.generate +13.6% / +13.8% (two interleaved pairs), the
    # attention after it no longer waiting on 1,024 one-warp CTAs (read under the image's Triton
    # 3.6, where the attention holds more registers; under the pin not yet). Llama-3.2-1B's winner (1.20x
    # alone) read +0.7% and TinyLlama's (1.27x) -2.7% in the same A/B: neither is an entry.
    (2048, 1536, "bias_rope_kv", True, True): {"warps": 2, "outs_per_group": 2},  # qwen2.5-1.5b qkv + RoPE
    # Qwen2.5-0.5B's 2-, 4- and 16-row plans (the tensor-core form, but for the 2-row down's CUDA
    # cores), swept on an H100 (gpu_run.sh gemv-rows, 2026-12-05 for 4 rows, 2026-12-06 for 2 and
    # 16). The closed loop at c = 2 / 16 +16% / +11-14%, c = 4 -0.7 to +3.0%; N streams through
    # LLM.generate +19% / +7-8% / +22% at 2 / 4 / 16 (BENCHMARKS.md's history, session 53). The
    # 8-row winners lost 3-5% in the engine (c = 8), so 8 rows keep the heuristic's plans.
    (1152, 896, "bias_rope_kv", True, True, 2): {"min_ctas_per_sm": 2},  # qkv + RoPE
    (896, 896, "residual", False, True, 2): {"min_ctas_per_sm": 3},  # o
    (9728, 896, "silu_mul", True, True, 2): {"ctas_per_sm": 3},  # gate_up
    (896, 4864, "residual", False, True, 2): {"ctas_per_sm": 4, "warps": 2},  # down
    (1152, 896, "bias_rope_kv", True, True, 4): {"min_ctas_per_sm": 4},
    (896, 896, "residual", False, True, 4): {"min_ctas_per_sm": 3},
    (9728, 896, "silu_mul", True, True, 4): {"ctas_per_sm": 3},
    (896, 4864, "residual", False, True, 4): {"splits": 2},
    (1152, 896, "bias_rope_kv", True, True, 16): {"min_ctas_per_sm": 2},
    (896, 896, "residual", False, True, 16): {"min_ctas_per_sm": 2},
    (9728, 896, "silu_mul", True, True, 16): {"ctas_per_sm": 2},
    (896, 4864, "residual", False, True, 16): {"splits": 2},
    # Qwen3-0.6B's 4-row plans and Llama-3.2-1B's 16-row plans (the tensor-core form), swept on
    # an H100 (gpu_run.sh gemv-rows, 2026-12-06, session 54), each A/B'd in the engine with its
    # 2-, 4- and 16-row winners together. Qwen3: the closed loop at c = 4 +4.0% / +3.9% (two
    # interleaved pairs), 4 streams through LLM.generate +3.4%; its 2- and 16-row winners moved
    # their steps 2% or less (c = 16 +0.7%, N = 2 / 16 +1.7% / +2.2%), so they stay out. Llama:
    # c = 16 +11.1% / +10.5%, N = 16 +8.4%; its 2- and 4-row winners lost through LLM.generate
    # (N = 2 -5.5%, N = 4 -2.5%) and stay out (FUSED_NOTES.md, "Session 54").
    (4096, 1024, "none", True, True, 4): {"min_ctas_per_sm": 3},  # qwen3-0.6b qkv (1.15x alone)
    (1024, 2048, "residual", False, True, 4): {"min_ctas_per_sm": 2},  # qwen3-0.6b o (1.08x)
    (1024, 3072, "residual", False, True, 4): {"min_ctas_per_sm": 1},  # qwen3-0.6b down (1.16x)
    (3072, 2048, "rope_kv", True, True, 16): {"min_ctas_per_sm": 2},  # llama-3.2-1b qkv + RoPE (1.27x)
    # (O at 2,048 x 2,048 is Qwen3-1.7B's and TinyLlama's too: the entry steers their 16-row O,
    # the same kernel at the same shape, not timed in their engines)
    (2048, 2048, "residual", False, True, 16): {"warps": 16},  # llama-3.2-1b o (1.07x)
    (16384, 2048, "silu_mul", True, True, 16): {"ctas_per_sm": 1},  # llama-3.2-1b gate_up (1.21x)
    (2048, 8192, "residual", False, True, 16): {"splits": 4},  # llama-3.2-1b down (1.19x)
    # Qwen2.5-1.5B's 2-, 4- and 16-row plans (the tensor-core form, but for the 2-row QKV's CUDA
    # cores; H100, gpu_run.sh gemv-rows, session 54). The closed loop at c = 4 / 16 +6.1-6.3% /
    # +6.4-7.0% (two interleaved pairs), c = 1 level; N streams through LLM.generate +5.2% /
    # +6.9% / +7.2% at 2 / 4 / 16.
    (2048, 1536, "bias_rope_kv", True, True, 2): {"warps": 4},  # qkv + RoPE (1.08x alone)
    (1536, 1536, "residual", False, True, 2): {"min_ctas_per_sm": 3},  # o (1.15x)
    (17920, 1536, "silu_mul", True, True, 2): {"ctas_per_sm": 2},  # gate_up (1.06x)
    (1536, 8960, "residual", False, True, 2): {"splits": 8},  # down (1.10x)
    (2048, 1536, "bias_rope_kv", True, True, 4): {"min_ctas_per_sm": 2},  # (1.06x)
    (1536, 1536, "residual", False, True, 4): {"warps": 16},  # (1.14x)
    (17920, 1536, "silu_mul", True, True, 4): {"ctas_per_sm": 2},  # (1.07x)
    (1536, 8960, "residual", False, True, 4): {"splits": 8},  # (1.11x)
    (2048, 1536, "bias_rope_kv", True, True, 16): {"warps": 8},  # (1.01x)
    (1536, 1536, "residual", False, True, 16): {"min_ctas_per_sm": 2},  # (1.10x)
    (17920, 1536, "silu_mul", True, True, 16): {"ctas_per_sm": 1},  # (1.14x)
    (1536, 8960, "residual", False, True, 16): {"splits": 8},  # (1.12x)
}
# The tensor-core form's own knobs, each with what it does (the CUDA-core form refuses them).
MMA_ONLY_KNOBS = {"splits": "K over CTAs", "tile_group": "weight tiles a CTA sharing x"}
TUNABLE = ("warps", "outs_per_group", "ctas_per_sm", "staged", "stages", "late_g", "min_ctas_per_sm", "splits",
           "tile_group")


def _tuned_key(n_rows: int, k: int, epilogue: str, norm: bool, pdl: bool, rows: int,
               fp8: bool = False, mma: bool = False) -> tuple:
    """TUNED_PLANS' key: (N, K, epilogue, norm, pdl), then M where M > 1, then "fp8" (half the
    bytes a row: a bf16 plan does not bind it) and "mma" for a tensor-core plan asked for where
    the default form is the CUDA cores' (fp8, and bf16 at one row: a form of its own, whose knobs
    mean other things)."""
    key = (n_rows, k, epilogue, bool(norm), bool(pdl))
    key = key if rows == 1 else (*key, rows)
    key = (*key, "fp8") if fp8 else key
    return (*key, "mma") if mma and (fp8 or rows == 1) else key


def load_tuned_plans(path: str) -> int:
    """Add the entries of a JSON file written by `scripts/gemv_sweep.py --plans-out` (a list of
    {"key": [N, K, epilogue, norm, pdl], "knobs": {...}}, the key with M, then "fp8" and "mma"
    where they apply, as in TUNED_PLANS) to TUNED_PLANS: plans measured on this machine, over
    the built-in table. Returns how many were added."""
    entries = tuning.read_sweep_file(path, "plan file", "gemv_sweep.py --plans-out")
    for entry in entries:
        try:
            n, k, epilogue, norm, pdl, *rest = entry["key"]
            knobs = dict(entry["knobs"])
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: the entry {entry!r} is not a {{\"key\": [N, K, epilogue, "
                             f"norm, pdl, ...], \"knobs\": {{...}}}} plan: {e!r}") from None
        mma = rest[-1:] == ["mma"]
        rest = rest[:-1] if mma else rest
        fp8 = rest[-1:] == ["fp8"]
        rows = rest[:-1] if fp8 else rest
        unknown = set(knobs) - set(TUNABLE)
        if (unknown or epilogue not in EPILOGUES or len(rows) > 1 or not all(isinstance(r, int) for r in rows)
                or (mma and not fp8 and rows)):  # bf16's M-row plans are the tensor-core form, unmarked
            raise ValueError(f"{path}: entry {entry['key']} has unknown knobs {unknown}, epilogue or key length")
        key = _tuned_key(int(n), int(k), epilogue, norm, pdl, int(rows[0]) if rows else 1, fp8, mma)
        TUNED_PLANS[key] = dict(knobs)
    return len(entries)


tuning.load_from_env("FLASHLET_GEMV_PLANS", load_tuned_plans)  # plans tuned on this machine


def plan_gemv(n_rows: int, k: int, epilogue: str = "none", *, num_sms: int = 132,
              pdl: bool = False, max_loads: int = 16, staged: bool | None = None,
              norm: bool = False, eps: float = 1e-6, rope: RopeShape | None = None,
              warps: int | None = None, outs_per_group: int | None = None,
              ctas_per_sm: int | None = None, stages: int | None = None,
              late_g: bool | None = None, min_ctas_per_sm: int | None = None,
              tuned: bool = True, rows: int = 1, fp8: bool = False, mma: bool | None = None,
              splits: int | None = None, tile_group: int | None = None, merge: tuple = ()) -> GemvPlan:
    """Pick lanes per row, rows in flight per lane group, warps per CTA and the grid.

    The knobs (warps, outs_per_group, ctas_per_sm, staged, stages, late_g, min_ctas_per_sm)
    left at None come from TUNED_PLANS when it holds this GEMV (tuned=True), else from the
    heuristic: R as many rows as fit `max_loads` 16-byte loads a lane while two tiles an SM
    remain, four warps a CTA (fewer when that leaves under four CTAs an SM), one tile per CTA
    (argmax: a resident grid of three CTAs an SM). An explicit knob wins.

    staged=True copies the weights into shared memory with cp.async (16 bytes a copy) instead
    of loading them into registers: ptxas cannot defer those copies, so every one is in flight
    at once whatever the register count (the alternative the benchmark measures). stages=2
    (staged only) gives each thread two buffers: a looping CTA issues the copies of its next
    tile before it waits for this one's, so its bytes stay in flight across tiles.

    ctas_per_sm=c launches min(tiles, c x num_sms) CTAs that loop over the tiles (what the
    argmax epilogue always does); 0 launches one CTA per tile. min_ctas_per_sm=m asks ptxas to
    fit m CTAs an SM (`.minnctapersm`: registers capped at 64K / (m x threads)).

    norm=True folds the RMSNorm before the projection into the kernel: every lane group
    already reads the whole of x (its L lanes x C chunks cover K), so it also sums x^2 over
    its chunks, reduces that with the same shuffles as the dot product, and scales its sums
    by rstd = 1 / sqrt(mean(x^2) + eps); the norm's weight g multiplies x chunk by chunk.
    Since W (x * rstd * g) = rstd * (W (x * g)), no normalised x is ever stored. g is a weight,
    so with PDL it is loaded before the wait, unless late_g=True (after it, with x: C x 4
    registers a lane fewer held across the wait, one L2 round trip more after it).

    The rope epilogues (rope=RopeShape(...)) pair rows like silu_mul pairs gate and up: output
    slot p stands for the head h = p // (D/2) and the dim i = p % (D/2), and its group computes
    both rows of the rotate-half pair, h D + i and h D + i + D/2, so the rotation needs no
    exchange between groups. There are N / 2 slots; each writes two outputs.

    rows=M (1 to MAX_ROWS) computes M decode rows per launch: every lane's weight chunks are
    read once and multiplied by each row's x in turn (FUSED_NOTES.md, "Stage 4: M rows").
    TUNED_PLANS entries for M > 1 carry M as a sixth key element; M = 1 keeps the five.

    fp8=True plans an fp8 (e4m3) weight with one fp32 scale a row (weight-only: x stays bf16):
    a 16-byte chunk holds 16 weights, so K is chunked by 16 (lanes_for(K, 16)) and each chunk
    meets two of x's 16-byte loads; the sums are scaled once, before the epilogue. Its
    TUNED_PLANS keys end in "fp8" (a bf16 plan was measured for twice the bytes: the fp8
    shapes are planned by the heuristic until a sweep measures them), its tensor-core form's in
    "fp8", "mma".

    mma=True sums on the tensor cores (`_plan_mma`; FUSED_NOTES.md, "Stage 5"): the default for
    rows >= 2 bf16 where it applies (K a multiple of 32, no CUDA-core-only knob given), and one
    bf16 row only where asked; mma=False keeps the CUDA-core M-row form. Its knobs of its own:
    splits (K over CTAs) and tile_group (tiles a CTA sharing one load of x; `_plan_mma`). With
    fp8=True the tensor-core form (1 to 16 rows, K a multiple of 64; FUSED_NOTES.md, "Issue 31: fp8 on the
    tensor cores") is opt-in: only mma=True plans it, until a GPU measures it.

    merge (`merge_in`): x is attention output left as split partials, merged by each CTA in its
    prologue (bf16 weights, no norm, K a whole number of heads; one row on the CUDA cores, M rows
    in either form); the other knobs plan as for x itself."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}; expected one of {EPILOGUES}")
    if merge:
        if len(merge) != 6:
            raise ValueError(f"merge must be merge_in(...)'s tuple, got {merge!r}")
        why = ("fp8 weights" if fp8 else "one row on the tensor cores" if mma and rows == 1
               else "norm" if norm else "rope" if rope is not None else "argmax" if epilogue == "argmax"
               else f"K = {k} not a whole number of heads of {merge[3]}" if k % merge[3] else None)
        if why:
            raise ValueError(f"merge (x from the attention's split partials) is planned for bf16 weights without "
                             f"a norm, one row on the CUDA cores: not with {why}")
        if rows == 1:
            mma = False
    knobs = dict(warps=warps, outs_per_group=outs_per_group, ctas_per_sm=ctas_per_sm, staged=staged,
                 stages=stages, late_g=late_g, min_ctas_per_sm=min_ctas_per_sm, splits=splits,
                 tile_group=tile_group)
    if not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in [1, {MAX_ROWS}] (decode rows per launch), got {rows!r}")
    key = _tuned_key(n_rows, k, epilogue, norm, pdl, rows, fp8, mma=bool(mma))
    table = TUNED_PLANS.get(key, {}) if tuned else {}
    unknown = set(table) - set(TUNABLE)
    if unknown:
        raise ValueError(f"TUNED_PLANS entry for {key} has unknown knobs {unknown}")
    if staged is False:  # the caller chose registers: the table's staging depth does not apply
        table = {name: v for name, v in table.items() if name != "stages"}
    if table and mma is not None and rows > 1 and not fp8:
        # bf16's M-row entries are keyed as the default form plans them: one measured in the
        # other form than the caller asks for does not steer this plan
        measured = plan_gemv(n_rows, k, epilogue, num_sms=num_sms, pdl=pdl, max_loads=max_loads, norm=norm,
                             eps=eps, rope=rope, tuned=False, rows=rows, **table)
        table = table if measured.mma == bool(mma) else {}
    knobs = {name: table.get(name) if value is None else value for name, value in knobs.items()}
    staged = bool(knobs["staged"])
    stages = knobs["stages"] or 1
    late_g = bool(knobs["late_g"])
    min_ctas = knobs["min_ctas_per_sm"] or 0
    if staged and epilogue == "argmax":
        raise ValueError("the staged (shared-memory) variant has no argmax epilogue")
    vec = FP8_VEC if fp8 else VEC
    if k % vec or k <= 0:
        raise ValueError(f"K must be a positive multiple of {vec} (16-byte loads of "
                         f"{'fp8' if fp8 else 'bf16'} weights), got {k}")
    if epilogue == "silu_mul" and n_rows % 2:
        raise ValueError(f"silu_mul needs an even number of rows (gate | up), got {n_rows}")
    if (epilogue in ROPE_EPILOGUES) != (rope is not None):
        raise ValueError(f"epilogue {epilogue!r} {'needs' if rope is None else 'takes no'} a RopeShape")
    if rope is not None:
        if rope.head_dim % 2 or rope.rows != n_rows:
            raise ValueError(f"the rope epilogue needs an even head_dim and (Hq + 2 Hkv) * head_dim = {n_rows} "
                             f"rows, got {rope}")
        if staged:
            raise ValueError("the staged (shared-memory) variant has no rope epilogue")
    if stages not in (1, 2) or (stages == 2 and not staged):
        raise ValueError(f"stages must be 1, or 2 with staged=True; got stages={stages}, staged={staged}")
    if late_g and not norm:
        raise ValueError("late_g moves the norm's weight load: it needs norm=True")
    n_out = n_rows // 2 if epilogue == "silu_mul" or rope is not None else n_rows
    refusal = _mma_refusal(k, rows, fp8, knobs, asked=bool(mma))
    if mma and refusal:
        raise ValueError(f"mma=True: {refusal}")
    mma_only = [name for name in MMA_ONLY_KNOBS if knobs[name] not in (None, 1)]  # given, past their default
    if mma or (mma is None and not refusal):
        try:
            return dataclasses.replace(_plan_mma(n_rows, k, epilogue, n_out, rows, knobs, num_sms=num_sms, pdl=pdl,
                                                 norm=norm, eps=eps, rope=rope, fp8=fp8), merge=tuple(merge))
        except ValueError:
            if mma or mma_only:
                raise  # by default a shape the tensor-core form cannot plan keeps the CUDA-core form,
                       # unless a knob only that form has was given: its reason is the one to give
    if mma_only:
        name = mma_only[0]
        raise ValueError(f"{name} ({MMA_ONLY_KNOBS[name]}) is the tensor-core form's knob: it needs mma")
    for name in ("warps", "outs_per_group"):
        if knobs[name] is not None and (not isinstance(knobs[name], int) or knobs[name] < 1):
            raise ValueError(f"{name} must be a positive int, got {knobs[name]!r}")
    if knobs["warps"] is not None and knobs["warps"] not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {knobs['warps']}")
    if knobs["ctas_per_sm"] is not None and not 0 <= knobs["ctas_per_sm"] <= 32:
        raise ValueError(f"ctas_per_sm must be in [0, 32] (0: one tile per CTA), got {knobs['ctas_per_sm']}")
    lanes = lanes_for(k, vec)
    if epilogue == "argmax" and rows > lanes:
        # Lane m of each group keeps row m's running best across the tiles (one pair a lane).
        raise ValueError(f"argmax with rows={rows} needs at least as many lanes a row, and K = {k} "
                         f"gives {lanes} (the largest power of two dividing K / {vec})")
    chunks = k // (vec * lanes)
    rows_per_out = 2 if epilogue == "silu_mul" or rope is not None else 1

    def tiles(warps: int, outs_per_group: int) -> int:
        return math.ceil(n_out / (warps * (32 // lanes) * outs_per_group))

    outs_per_group = knobs["outs_per_group"]
    if outs_per_group is None:
        # Rows in flight per group: as many as fit `max_loads` 16-byte loads per lane
        # (registers), but no more than leaves two tiles per SM. ptxas does not keep them all in
        # flight: in the sm_90a SASS a one-row lane issues nearly all its loads before the first
        # FMA, but with two or three rows it issues 10-17 and interleaves the rest
        # (FUSED_NOTES.md); the sweep measures which wins.
        outs_per_group = max(1, max_loads // (chunks * rows_per_out))
        while outs_per_group > 1 and tiles(4, outs_per_group) < 2 * num_sms:
            outs_per_group //= 2
    warps = knobs["warps"]
    if warps is None:
        # Smaller CTAs where the rows are few: an SM that gets one CTA more than another waits
        # for it, so aim for four or more CTAs per SM.
        warps = 4
        while warps > 1 and tiles(warps, outs_per_group) < 4 * num_sms:
            warps //= 2
    # With M rows every CTA reads all M rows of x from L2 (155 KB at M = 16, K = 4864). Where
    # one tile a CTA would make that more than twice the weights' bytes (down from M = 3: one
    # output row a CTA), fewer, larger CTAs (up to four warps, while every SM still gets one)
    # in a resident grid keep x in L1 across their tiles. (In bytes: tiles x M x K x 2 of x
    # against N x K x 2 of bf16 weights, or N x K of fp8 ones: fp8 turns x-heavy sooner.)
    weight_bytes = 1 if fp8 else 2
    x_heavy = rows > 1 and tiles(warps, outs_per_group) * rows > n_rows * weight_bytes
    if x_heavy and knobs["warps"] is None:
        warps = 4
        while warps > 1 and tiles(warps, outs_per_group) < num_sms:
            warps //= 2

    def staged_bytes(warps: int) -> int:
        return stages * warps * 32 * outs_per_group * rows_per_out * chunks * 16

    while staged and knobs["warps"] is None and warps > 1 and staged_bytes(warps) > 48 << 10:
        warps //= 2  # stay within the 48 KB of shared memory a CTA gets without opting in
    if staged and staged_bytes(warps) > 48 << 10:
        raise ValueError(f"K = {k} needs {staged_bytes(warps)} bytes of shared memory staged with "
                         f"{warps} warps and {stages} stage(s), over the 48 KB a CTA gets; "
                         "use fewer warps, rows or stages, or the register variant")
    if min_ctas and staged:
        # The DSL sets a register-capped kernel's shared-memory carveout from the launch's
        # static shared memory (0: the staged buffers are sized at trace time), which could
        # leave the staged variant too little shared memory for the CTAs the cap is for.
        raise ValueError("min_ctas_per_sm (a register cap) is not combined with staged=True")
    if min_ctas and min_ctas * warps * 32 > 2048:
        raise ValueError(f"min_ctas_per_sm={min_ctas} CTAs of {warps} warps exceed an SM's 64 warps")
    grid = tiles(warps, outs_per_group)  # one tile per CTA; the hardware balances the waves
    # A resident grid that loops over tiles. argmax always loops (few partials for the last
    # CTA to reduce): three CTAs of four warps fit an SM at the ~155 registers ptxas gives it.
    ctas_per_sm = knobs["ctas_per_sm"]
    if ctas_per_sm is None and (x_heavy or (rows > 1 and epilogue == "argmax")):
        ctas_per_sm = 2  # (the M-row argmax at ~170-210 registers: three CTAs an SM do not fit)
    if ctas_per_sm is None and epilogue == "argmax":
        ctas_per_sm = 3
    if ctas_per_sm:
        grid = min(grid, ctas_per_sm * num_sms)
    return GemvPlan(n_rows, k, n_out, epilogue, lanes, chunks, outs_per_group, warps, grid, pdl,
                    staged, norm, float(eps), rope, stages, late_g and pdl, min_ctas, rows, fp8,
                    merge=tuple(merge))


def mma_k_step(fp8: bool) -> int:
    """The tensor-core form's K step: 32 bf16 (two products), 64 fp8 (four)."""
    return MMA_K_FP8 if fp8 else MMA_K


def _mma_refusal(k: int, rows: int, fp8: bool, knobs: dict, asked: bool = False) -> str:
    """Why the tensor-core form cannot plan this GEMV ("" where it can); asked: mma=True."""
    if fp8 and not asked:
        return "fp8 on the tensor cores is opt-in (mma=True) until measured on a GPU"
    if rows < 2 and not fp8 and not asked:
        # Asked for (mma=True), one bf16 row plans the same kernel with one real column of its
        # 8-row tile: for measurement at shapes whose one-row CUDA-core GEMV collapses (hidden
        # 3,584: MAX_NORM_CHUNKS), not yet measured on a GPU.
        return "the tensor-core form is for rows >= 2 unless asked (one row keeps the CUDA-core kernel)"
    step = mma_k_step(fp8)
    if k % step:
        return f"K must be a multiple of {step}, got {k}"
    cuda_core_only = [name for name in ("outs_per_group", "staged", "stages", "late_g")
                      if knobs[name] and not (name == "stages" and knobs[name] == 1)]
    if cuda_core_only:
        return f"the tensor-core form has no {', '.join(cuda_core_only)} knob"
    return ""


def _plan_mma(n_rows: int, k: int, epilogue: str, n_out: int, rows: int, knobs: dict, *, num_sms: int,
              pdl: bool, norm: bool, eps: float, rope: RopeShape | None, fp8: bool = False) -> GemvPlan:
    """The tensor-core plan: a CTA owns a tile of 16 weight rows and its warps split K, each
    taking `chunks` consecutive K steps of 32 (all its loads in flight at once, at most
    MMA_MAX_STEPS); warps = K steps / chunks, more where the tiles are too few to give every SM
    two warps' loads. By default one tile a CTA (measured faster than a resident grid of two CTAs
    an SM looping over the tiles: FUSED_NOTES.md, "Stage 5"); the argmax loops (its last CTA
    reduces one partial a CTA) with eight CTAs an SM. Where a CTA's warps would not fit
    an SM's registers (a long K: down at K = 4864), `splits` CTAs share a tile's K (one tile a
    CTA, every SM busy); they add their fp32 sums through a workspace and the last to finish
    applies the epilogue (not the argmax, whose reduction spans tiles; the norm splits only where
    one CTA cannot hold K, each CTA then storing its K's sums of x^2 for the last one's rstd).
    `tile_group` G > 1 gives a CTA G consecutive tiles (of a split's K where splits > 1): all
    their weight loads are issued before the PDL wait and x's fragments, which cost as many bytes
    as a tile's weights at 16 rows, are read from L2 once for the G tiles (G must divide the
    tiles; not with a looping grid or the argmax). `warps`, `splits`, `tile_group`,
    `ctas_per_sm` and `min_ctas_per_sm` override. fp8: K steps of 64 (a 16-byte load holds 16
    e4m3), each with twice a bf16 step's x registers."""
    steps = k // mma_k_step(fp8)
    x_regs = 8 if fp8 else 4  # a K step's B registers an n-tile
    # fp8 past 8 rows: half the K steps a warp (at 7 a lane held 255 registers and spilled: the
    # LM head's looping argmax at M = 16; at 4, 200 and no stack)
    max_steps = MMA_MAX_STEPS // 2 if fp8 and rows > 8 else MMA_MAX_STEPS
    rows_per_out = 2 if epilogue == "silu_mul" or rope is not None else 1
    tiles = math.ceil(n_out / (MMA_ROWS // rows_per_out))
    n_tiles = math.ceil(rows / 8)
    warps, splits = knobs["warps"], knobs["splits"]
    if warps is not None and (not isinstance(warps, int) or not 1 <= warps <= MMA_MAX_WARPS):
        raise ValueError(f"warps must be in [1, {MMA_MAX_WARPS}] for the tensor-core form, got {warps}")
    if splits is not None and (not isinstance(splits, int) or not 1 <= splits <= steps):
        raise ValueError(f"splits must be in [1, K / {mma_k_step(fp8)} = {steps}], got {splits!r}")
    if (splits or 1) > 1 and epilogue == "argmax":
        raise ValueError("splits > 1 (K over CTAs) has no argmax epilogue (its reduction spans the tiles)")
    given_warps = warps
    group = 1 if knobs["tile_group"] is None else knobs["tile_group"]
    if not isinstance(group, int) or group < 1 or tiles % group:
        raise ValueError(f"tile_group must be a positive int dividing the {tiles} tiles, got {group!r}")
    if group > 1 and (epilogue == "argmax" or knobs["ctas_per_sm"]):
        raise ValueError("tile_group > 1 is not combined with a looping grid (ctas_per_sm, the argmax)")
    ctas_a_split = tiles // group  # CTAs a split of K

    def warps_for(n_splits: int, most_steps: int = max_steps) -> tuple[int, int]:
        # (warps, K steps a warp, at most most_steps) at n_splits CTAs a tile group
        return _mma_warps(math.ceil(steps / n_splits), ctas_a_split * n_splits, num_sms, given_warps, most_steps)

    # The norm splits K only where one CTA's warps cannot hold it (Qwen2.5-14B's K = 5,120 past 8
    # rows): each CTA then stores its K's sums of squares for the tile's last CTA (`_mma_store_sq`).
    # Its registers are counted as lowered (`_mma_fits`'s lean_x): Llama-3.1-8B's K = 4,096 fits
    # 16 warps of 8 K steps, Qwen2.5-14B's 5,120 20 warps (up to 8 rows).
    lean = norm and epilogue != "argmax"  # (the looping argmax holds its next tile's loads too)
    can_split = epilogue != "argmax" and (not norm or not _mma_fits(*warps_for(1), n_tiles, x_regs, group, lean))
    if splits is None:
        splits = 1
        while can_split and splits < steps and not _mma_fits(*warps_for(splits), n_tiles, x_regs, group, lean):
            splits += 1
        if fp8 and can_split and steps > 2 * MMA_MAX_STEPS and tiles < num_sms:
            splits = max(splits, 2)  # fp8's long K may fit unsplit: split anyway where SMs would idle
        while 1 < splits < steps and ctas_a_split * splits < num_sms:  # splitting anyway: every SM a CTA
            splits += 1
    warps, chunks = warps_for(splits)
    # A CTA's registers hold its weight loads for each of the group's tiles: where they would not
    # fit (fp8 at 2 rows: 2 warps of 8 K steps for 2 tiles), fewer K steps a warp and more warps.
    while given_warps is None and chunks > 1 and not _mma_fits(warps, chunks, n_tiles, x_regs, group, lean):
        more = warps_for(splits, chunks // 2)
        if more[0] > MMA_MAX_WARPS:
            break
        warps, chunks = more
    if chunks > max_steps:
        raise ValueError(f"K = {k} with {warps} warps gives each {chunks} K steps, over {max_steps}")
    if not _mma_fits(warps, chunks, n_tiles, x_regs, group, lean):
        raise ValueError(f"K = {k} needs {warps} warps of {chunks} K steps"
                         f"{f' for {group} tiles' if group > 1 else ''}, over an SM's 64K registers or 255 "
                         "a thread (more CTAs a tile would: splits; or a smaller tile_group)")
    if 2 * warps * n_tiles * 4 * 32 * 4 > 48 << 10:  # the warps' sums, double-buffered
        raise ValueError(f"{warps} warps at {rows} rows need over the 48 KB of shared memory a CTA gets")
    min_ctas = knobs["min_ctas_per_sm"] or 0
    if min_ctas and min_ctas * warps * 32 > 2048:
        raise ValueError(f"min_ctas_per_sm={min_ctas} CTAs of {warps} warps exceed an SM's 64 warps")
    ctas_per_sm = knobs["ctas_per_sm"]
    if ctas_per_sm is not None and not 0 <= ctas_per_sm <= 32:
        raise ValueError(f"ctas_per_sm must be in [0, 32] (0: one tile per CTA), got {ctas_per_sm}")
    if ctas_per_sm and splits > 1:
        raise ValueError("ctas_per_sm (a looping grid) is not combined with splits > 1 (one tile a CTA)")
    if ctas_per_sm is None:
        ctas_per_sm = MMA_ARGMAX_CTAS_PER_SM if epilogue == "argmax" else 0
    grid = (ctas_a_split * splits if splits > 1 or group > 1
            else min(tiles, ctas_per_sm * num_sms) if ctas_per_sm else tiles)
    return GemvPlan(n_rows, k, n_out, epilogue, 32, chunks, 1, warps, grid, pdl, False, norm, float(eps),
                    rope, 1, False, min_ctas, rows, fp8, True, splits, group)


def _mma_warps(steps: int, ctas: int, num_sms: int, warps: int | None,
               max_steps: int = MMA_MAX_STEPS) -> tuple[int, int]:
    """(warps, K steps a warp) for `steps` K steps a CTA: as few warps as hold max_steps
    each, more (fewer steps each) while the CTAs' warps number under two an SM; `warps` given:
    that many at most."""
    if warps is None:
        per_warp = max_steps
        warps = math.ceil(steps / per_warp)
        while per_warp > 2 and ctas * warps < 2 * num_sms and math.ceil(steps / (per_warp // 2)) <= MMA_MAX_WARPS:
            per_warp //= 2
            warps = math.ceil(steps / per_warp)
    chunks = math.ceil(steps / warps)
    return math.ceil(steps / chunks), chunks  # no warp left without a step


def _mma_fits(warps: int, chunks: int, n_tiles: int, x_regs: int = 4, group: int = 1, lean_x: bool = False) -> bool:
    """Whether a CTA's registers fit an SM's 64K: a lane holds its weight loads (4 registers
    each, 2 a K step, for each of the group's tiles), its x fragments (x_regs a step and
    n-tile, kept across tiles: 4 bf16, 8 fp8), two accumulator chains (8 an n-tile) and ~40
    more (fp8: 16 more, a step's widened weights). Past that ptxas caps the registers and
    spills (it did at K = 4864's 19 warps), as it does past 255 a thread (three 16-row tiles of
    8 K steps a warp: 152 bytes of stack). lean_x (the planner's, for a normed bf16 GEMV of one
    n-tile and one tile, up to 8 rows): few of the x fragments are held at once, ptxas issuing
    them among the products, so the weights, the accumulators and 24 (lowered for sm_90a at 8 K
    steps a warp, DSL 4.8.1, Triton's ptxas: 106 registers at 14 warps, where ptxas may take
    146; 100-104 at 16, 128 at 16 warps of 8 rows; at 20 warps, where it may take 102,
    Qwen2.5-14B's QKV (with its RoPE epilogue or its bias alone) and gate+up 96 at 1, 4 and 8
    rows with no stack, 8-16 bytes of stack at 2 rows; this count gives 96, the full one 144).
    Only there, where K split in two costs the norm its own reduction: elsewhere the full count
    keeps the plans that were measured."""
    if lean_x and x_regs == 4 and n_tiles == 1 and group == 1:
        regs = 8 * chunks + 8 + 24
    else:
        regs = 8 * chunks * group + x_regs * chunks * n_tiles + 8 * n_tiles + 40 + (16 if x_regs > 4 else 0)
    return regs <= 255 and regs * warps * 32 <= 65536


# ---------------------------------------------------------------------------------------------
# The kernel. These functions are plain Python until `_dsl()` decorates them; `cute` and
# `cutlass` are module globals filled in by `_dsl()`.

class _Deferred:
    """Stands in for `cute` at import time. The DSL's preprocessor rewrites only functions that
    carry a `.jit` / `.kernel` decorator in their source, so these mark them; `_dsl()` applies
    the real decorators once the DSL is imported."""

    @staticmethod
    def kernel(fn):
        return fn

    @staticmethod
    def jit(fn):
        return fn


_deferred = _Deferred()


@_deferred.kernel
def _gemv_kernel(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                 mMid, mLse, mKvLen, n_out, lanes, chunks, outs_per_group, warps, epilogue, pdl, grid,
                 staged, norm, eps, head_dim, q_heads, kv_heads, stages, late_g, min_ctas, rows, fp8,
                 merge, mS):
    # mW [n_rows, K/8, 8] bf16, or with fp8 [n_rows, K/16, 16] e4m3 and mS [n_rows] fp32 its row
    # scales (None for bf16: no such kernel argument), each weight chunk then meeting two of x's
    # (and g's) chunks; mX [rows * K/8, 8] (decode row m's chunks from m * K/8); mY
    # [rows * n_out] (the tokens [rows] int32 for argmax; all n_rows outputs a row for the rope
    # epilogues); mE: the bias [n_out] ([n_rows] for bias_rope_kv), shared by the rows, or the
    # residual [rows * n_out] (a dummy otherwise); mG: the RMSNorm weight [K/8, 8] (norm; a dummy
    # otherwise); mPart*: [rows * grid] partials (argmax). The rope epilogues: mPos [rows] int64
    # the positions, mCS [table_rows * D] fp32 the cos | sin table, mSlot [rows] int64 the pool
    # slots, mKC / mVC [cache_slots * Hkv * D] bf16 one layer's pool, flat (dummies otherwise).
    # merge (`merge_in`'s tuple; () otherwise): x is not read from mX but merged here from the
    # one-launch attention's split partials, mMid [rows * splits * K/8, 8] fp32 (bf16: merge[5]) and their
    # log-sum-exps mLse [rows * splits * Hq] fp32, each row's split count from mKvLen [rows]
    # int32 (`_merge_counts`, `_merge_x`).
    # With rows > 1 each lane of a group ends with the whole sums of its own decode rows
    # (`reduce_scatter`, `lane_rows`) and finishes them: the epilogue's work is spread over the
    # group's lanes.
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    lane = tidx % 32
    sub = lane % lanes                       # this lane's place within its row's lane group
    group = (tidx // 32) * (32 // lanes) + lane // lanes
    groups_per_cta = warps * (32 // lanes)
    outs_per_tile = groups_per_cta * outs_per_group
    num_tiles = (n_out + outs_per_tile - 1) // outs_per_tile
    rope = epilogue == "rope_kv" or epilogue == "bias_rope_kv"
    rows_per_out = 2 if epilogue == "silu_mul" or rope else 1
    rows_in_flight = outs_per_group * rows_per_out
    half = head_dim // 2
    vec = FP8_VEC if fp8 else VEC            # elements of K in a weight chunk
    xpc = vec // VEC                         # x's (and g's) 16-byte loads a weight chunk meets
    x_chunks = lanes * chunks * xpc          # 16-byte chunks of one decode row of x
    # rows > 1: the decode row of each value a lane keeps (`rows`: another lane finishes it)
    own_rows = [0]
    if cutlass.const_expr(rows > 1):
        own_rows = lane_rows(sub, lanes, rows, _select)
    stored = n_out * rows_per_out if rope else n_out  # outputs a decode row stores
    merging = len(merge) > 0

    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_launch_dependents()

    smem = None  # one allocator for the staged weights and the merged x (each starts at the base)
    if cutlass.const_expr(staged or merging):
        smem = cutlass.utils.SmemAllocator()
    sX = None
    counts = []
    most = 0
    if cutlass.const_expr(merging):
        # Each row's K/8 chunks of x as the CTA merges them, each lane then reading its own
        # (bf16, as the attention would have stored x); each row's split count from its KV
        # length, which no kernel of this step writes: before the wait.
        sX = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((rows * x_chunks, VEC), stride=(VEC, 1)),
                                  byte_alignment=16)
        counts, most = _merge_counts(mKvLen, rows, merge)

    # Without PDL x is ready at launch: load it once, before the weights. Measured in the SASS
    # (sm_90a): with x loaded inside the tile, ptxas interleaves and issues only 10-14 of a
    # lane's 16-byte loads before the first FMA; with x first it issues nearly all (36 of 39 at
    # K = 4864), which is the point of the design.
    x_early = []
    # fp8 sums through `_dot_rows` at one row too: a lane covers twice the K of a bf16 lane, and
    # the one-row form's x, g and widened weights held at once spilled (ptxas, sm_90a). The
    # one-row form below is bf16's alone.
    row_dots = rows > 1 or fp8
    if cutlass.const_expr(not pdl and not row_dots):  # (row_dots: each row's x is read per chunk)
        for j in cutlass.range_constexpr(chunks):
            x_early.append(mX[sub + j * lanes, None].load())
    # fp8 sums with vector accumulators read g chunk by chunk beside x (`_fp8_partials`): all of
    # it held across the wait, twice a bf16 lane's, spilled
    g_per_chunk = fp8 and rows * outs_per_group * rows_per_out <= FP8_VECTOR_SUMS
    g_early = []  # the norm's weight: not written by the previous kernel, so loaded before any wait
    if cutlass.const_expr(norm and not late_g and not g_per_chunk):  # (late_g: after the wait, with x)
        for q in cutlass.range_constexpr(chunks * xpc):
            g_early.append(mG[_x_index(sub, q, lanes, xpc), None].load())
    per_stage = rows_in_flight * chunks
    if cutlass.const_expr(staged):
        # One 16-byte slot per (thread, row chunk, stage); consecutive threads in consecutive
        # slots. Each thread reads back only its own slots, so no barrier is ever needed.
        threads = warps * 32
        w_type = cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16  # 16 bytes a slot either way
        sW = smem.allocate_tensor(
            w_type, cute.make_layout((threads, stages * per_stage, vec),
                                     stride=(vec, threads * vec, 1)), byte_alignment=16)
        g2s = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            w_type, num_bits_per_copy=128)
        if cutlass.const_expr(stages == 2):
            # The pipeline's prologue: this CTA's first tile into buffer 0 (grid <= tiles).
            _stage_tile(mW, sW, g2s, bidx, 0, tidx, sub, group, n_out, lanes, chunks,
                        outs_per_group, groups_per_cta, rows_per_out)
            cute.arch.cp_async_commit_group()
    best_val = cutlass.Float32(-math.inf)
    best_idx = cutlass.Int32(0)
    for tile in range(bidx, num_tiles, gdim):
        # Issue every weight load of this tile before any of them is used.
        stage = 0
        if cutlass.const_expr(stages == 2):
            # Two buffers: this tile's copies are in flight already; issue the next tile's into
            # the other buffer (an empty group at the last tile keeps the wait count uniform).
            stage = ((tile - bidx) // gdim) % 2
            if tile + gdim < num_tiles:
                _stage_tile(mW, sW, g2s, tile + gdim, 1 - stage, tidx, sub, group, n_out, lanes,
                            chunks, outs_per_group, groups_per_cta, rows_per_out)
            cute.arch.cp_async_commit_group()
        outs = []
        w = []
        scales = []  # fp8: each weight row's scale, beside its loads (a weight: before any wait)
        for o in cutlass.range_constexpr(outs_per_group):
            out = tile * outs_per_tile + o * groups_per_cta + group
            outs.append(out)
            safe = cutlass.min(out, n_out - 1)  # tail groups re-read a valid row, store nothing
            for h in cutlass.range_constexpr(rows_per_out):
                row = safe + h * n_out  # silu_mul: gate, then up
                if cutlass.const_expr(rope):  # the rotate-half pair: h D + i, then h D + i + D/2
                    row = (safe // half) * head_dim + safe % half + h * half
                if cutlass.const_expr(fp8):
                    scales.append(cutlass.Float32(mS[row]))
                for j in cutlass.range_constexpr(chunks):
                    src = mW[row, sub + j * lanes, None]
                    if cutlass.const_expr(staged):
                        if cutlass.const_expr(stages == 1):
                            cute.copy(g2s, src, sW[tidx, (o * rows_per_out + h) * chunks + j, None])
                    else:
                        w.append(src.load())
        if cutlass.const_expr(staged and stages == 1):
            cute.arch.cp_async_commit_group()
        xs = []
        gs = g_early
        if cutlass.const_expr(merging):
            if cutlass.const_expr(pdl):
                cute.arch.griddepcontrol_wait()  # the attention's partials (and r) are written
            if cutlass.const_expr(grid < num_tiles):
                if tile == bidx:  # a looping CTA merges once: sX holds x for its later tiles
                    _merge_x(mMid, mLse, sX, counts, most, tidx, warps * 32, x_chunks, rows, merge)
                    cute.arch.sync_threads()
            else:
                _merge_x(mMid, mLse, sX, counts, most, tidx, warps * 32, x_chunks, rows, merge)
                cute.arch.sync_threads()
            if cutlass.const_expr(not row_dots):
                for j in cutlass.range_constexpr(chunks):
                    xs.append(sX[sub + j * lanes, None].load())
        elif cutlass.const_expr(not row_dots):
            for j in cutlass.range_constexpr(chunks):
                if cutlass.const_expr(pdl):
                    if cutlass.const_expr(j == 0):
                        cute.arch.griddepcontrol_wait()  # x (and r) come from the previous kernel
                    xs.append(mX[sub + j * lanes, None].load())
                else:
                    xs.append(x_early[j])
        elif cutlass.const_expr(pdl):
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(norm and late_g and not g_per_chunk):
            gs = []
            for q in cutlass.range_constexpr(chunks * xpc):
                gs.append(mG[_x_index(sub, q, lanes, xpc), None].load())
        cos = []
        sin = []
        biases = []
        slots = []
        if cutlass.const_expr(rope):
            # After the PDL wait (the step's positions and slots are inputs like x), before the
            # FMAs, so their latency hides behind them; every lane of the group loads and uses
            # them (a v head gets cos 1, sin 0), so the compiler cannot sink them into the
            # storing lane's branch after the reduction (measured in the SASS: it did). With
            # rows > 1 each lane loads the position and slot of each row it finishes.
            for r in cutlass.range_constexpr(len(own_rows)):
                row_m = 0
                if cutlass.const_expr(rows > 1):
                    row_m = cutlass.min(own_rows[r], rows - 1)
                pos = cutlass.Int32(mPos[row_m])
                slots.append(cutlass.Int32(mSlot[row_m]))
                for o in cutlass.range_constexpr(outs_per_group):
                    safe = cutlass.min(outs[o], n_out - 1)
                    r1 = (safe // half) * head_dim + safe % half
                    rotate = safe // half < q_heads + kv_heads
                    cos.append(cutlass.Float32(cutlass.select_(rotate, mCS[pos * head_dim + safe % half],
                                                               cutlass.Float32(1.0))))
                    sin.append(cutlass.Float32(cutlass.select_(rotate, mCS[pos * head_dim + half + safe % half],
                                                               cutlass.Float32(0.0))))
                    if cutlass.const_expr(epilogue == "bias_rope_kv" and r == 0):  # one bias for all rows
                        biases.append(mE[r1].to(cutlass.Float32))
                        biases.append(mE[r1 + half].to(cutlass.Float32))
        if cutlass.const_expr(staged):
            # This thread's own copies of this tile (the next tile's group may stay in flight).
            cute.arch.cp_async_wait_group(stages - 1)
            for i in cutlass.range_constexpr(per_stage):
                w.append(sW[tidx, stage * per_stage + i, None].load())
        if cutlass.const_expr(not row_dots):
            acc = []
            for i in cutlass.range_constexpr(rows_in_flight):
                acc.append(cute.full((VEC,), 0.0, cutlass.Float32))
            if cutlass.const_expr(norm):
                # The group's chunks cover all of x: its sum of squares is the whole row's.
                sq = cute.full((VEC,), 0.0, cutlass.Float32)
                for j in cutlass.range_constexpr(chunks):
                    xf = xs[j].to(cutlass.Float32)
                    sq = sq + xf * xf
                ss = cutlass.Float32(sq.reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0))
                ss = cute.arch.warp_reduction_sum(ss, threads_in_group=lanes)
                rstd = cutlass.Float32(cute.math.rsqrt(
                    ss * cutlass.Float32(1.0 / (lanes * chunks * VEC)) + cutlass.Float32(eps), fastmath=True))
            for j in cutlass.range_constexpr(chunks):
                xv = xs[j].to(cutlass.Float32)
                if cutlass.const_expr(norm):
                    xv = xv * gs[j].to(cutlass.Float32)
                for i in cutlass.range_constexpr(rows_in_flight):
                    acc[i] = acc[i] + w[i * chunks + j].to(cutlass.Float32) * xv
            sums = []
            for i in cutlass.range_constexpr(rows_in_flight):
                # reduce() yields a bare MLIR value; with one lane per row (K / 8 odd) no shuffle
                # wraps it, and cute.math.exp (the SiLU) accepts only a Float32: wrap it here.
                s = cutlass.Float32(acc[i].reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0))
                s = cute.arch.warp_reduction_sum(s, threads_in_group=lanes)
                if cutlass.const_expr(norm):
                    s = s * rstd
                sums.append(s)
        else:
            x_base = 0
            if cutlass.const_expr(not pdl):  # (with PDL the wait before x keeps x in the loop)
                x_base = _opaque_zero()
            sums = _dot_rows(sX if merging else mX, mG, w, gs, sub, x_base, lanes, chunks, x_chunks, rows,
                             rows_in_flight, norm, eps, vec)
            if cutlass.const_expr(fp8):  # each weight row's scale, once: W x = scale * (q x)
                sums = [[v * scales[i] for v in sums[i]] for i in range(rows_in_flight)]
        if cutlass.const_expr(not row_dots):
            sums = [[s] for s in sums]  # sums[i][r]: weight row i's sum for the lane's r-th row
        for r in cutlass.range_constexpr(len(own_rows)):
            # The decode row this lane finishes (rows == 1: lane 0 of the group finishes row 0).
            row_m = 0
            finishes = sub == 0
            if cutlass.const_expr(rows > 1):
                finishes = own_rows[r] < rows
                row_m = cutlass.min(own_rows[r], rows - 1)
            for o in cutlass.range_constexpr(outs_per_group):
                out = outs[o]
                y = sums[o * rows_per_out][r]
                if cutlass.const_expr(epilogue == "silu_mul"):
                    up = sums[o * rows_per_out + 1][r]
                    y = y / (cutlass.Float32(1.0) + cute.math.exp(-y, fastmath=True)) * up
                if cutlass.const_expr(epilogue == "bias"):
                    y = y + mE[cutlass.min(out, n_out - 1)].to(cutlass.Float32)
                if cutlass.const_expr(epilogue == "residual"):
                    y = y + mE[row_m * n_out + cutlass.min(out, n_out - 1)].to(cutlass.Float32)
                if cutlass.const_expr(rope):
                    y2 = sums[o * rows_per_out + 1][r]
                    if cutlass.const_expr(epilogue == "bias_rope_kv"):
                        y = y + biases[2 * o]
                        y2 = y2 + biases[2 * o + 1]
                    # Rotate-half in fp32 with the table's fp32 cos / sin, rounded once to bf16
                    # (the numerics of `TorchOps.rope`, less the bf16 rounding of the unrotated
                    # q / k that the two-kernel path stores in between).
                    c = cos[r * outs_per_group + o]
                    sn = sin[r * outs_per_group + o]
                    lo = (y * c - y2 * sn).to(mY.element_type)
                    hi = (y2 * c + y * sn).to(mY.element_type)
                    if finishes:
                        if out < n_out:
                            _rope_kv_store(mY, mKC, mVC, out, lo, hi, slots[r], row_m * stored,
                                           head_dim, q_heads, kv_heads)
                if cutlass.const_expr(epilogue == "argmax"):
                    # Strictly greater: a group meets its rows in increasing order, so ties keep
                    # the first index, as torch.argmax does. (rows > 1: each lane its row's.)
                    if out < n_out:
                        if y > best_val:
                            best_val = y
                            best_idx = out
                if cutlass.const_expr(epilogue != "argmax" and not rope):
                    if finishes:
                        if out < n_out:
                            mY[row_m * n_out + out] = y.to(mY.element_type)

    if cutlass.const_expr(epilogue == "argmax" and rows == 1):
        _argmax_finish(mY, mPartVal, mPartIdx, mCounter, best_val, best_idx, tidx, bidx, gdim,
                       warps, grid)
    if cutlass.const_expr(epilogue == "argmax" and rows > 1):
        _argmax_finish_rows(mY, mPartVal, mPartIdx, mCounter, best_val, best_idx, tidx, bidx, gdim,
                            warps, grid, lanes, rows)


@_deferred.jit
def _merge_split_count(kv_len, merge):
    """The splits the one-launch attention gave a row of kv_len tokens (its `_split_range`,
    the grid's splits and the smallest split's tokens from `merge`)."""
    splits, split_tokens, block_n = merge[0], merge[1], merge[2]
    kv = cutlass.Int32(kv_len)
    n = cutlass.max(cutlass.min((kv + split_tokens - 1) // split_tokens, splits), 1)
    split_len = ((kv + n - 1) // n + block_n - 1) // block_n * block_n
    split_len = cutlass.max(split_len, block_n)
    return cutlass.max((kv + split_len - 1) // split_len, 1)


@_deferred.jit
def _merge_counts(mKvLen, rows, merge):
    """Each decode row's split count (`_merge_split_count` of its KV length), and their largest:
    read before the PDL wait (no kernel of the step writes the KV lengths)."""
    counts = [_merge_split_count(mKvLen[m], merge) for m in range(rows)]
    most = counts[0]
    for m in cutlass.range_constexpr(1, rows):
        most = cutlass.max(most, counts[m])
    return counts, most


@_deferred.jit
def _merge_x(mMid, mLse, sX, counts, most, tidx, threads, x_chunks, rows, merge):
    """x into sX [rows * K/8, 8] from the attention's split partials: for each 8-wide chunk of a decode
    row's x (head h), sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m) over that row's counts[row]
    splits (slots row * splits + s), as the attention's own merge sums them, rounded to bf16 as it
    stores x (bf16 partials widened as they load). The CTA's threads share the rows' chunks (a
    thread past the last merges the last again and stores nothing); `merge`'s group of splits loads
    at once for every chunk a thread has (one L2 round trip while the longest row has at most that
    many), a running max past it."""
    splits, head_dim, group = merge[0], merge[3], merge[4]
    q_heads = x_chunks * VEC // head_dim
    items = rows * x_chunks
    per = (items + threads - 1) // threads
    item = [cutlass.min(tidx + i * threads, items - 1) for i in range(per)]
    row = [item[i] // x_chunks for i in range(per)]
    chunk = [item[i] - row[i] * x_chunks for i in range(per)]
    head = [chunk[i] * VEC // head_dim for i in range(per)]
    count = []  # each item's row's split count
    for i in cutlass.range_constexpr(per):
        n = counts[0]
        for r in cutlass.range_constexpr(1, rows):
            n = cutlass.Int32(_select(row[i] == r, counts[r], n))
        count.append(n)
    m = [cutlass.Float32(-math.inf)] * per
    den = [cutlass.Float32(0.0)] * per
    acc = [cute.full((VEC,), 0.0, cutlass.Float32) for _ in range(per)]
    for s0 in range(0, most, group):
        lses = []
        parts = []
        for j in cutlass.range_constexpr(group):  # every load of the group first
            for i in cutlass.range_constexpr(per):
                s = cutlass.min(s0 + j, count[i] - 1)  # past the row's last split: read it again, weigh it 0
                slot = row[i] * splits + s
                lses.append(cutlass.Float32(mLse[slot * q_heads + head[i]]))
                parts.append(mMid[slot * x_chunks + chunk[i], None].load().to(cutlass.Float32))
        for i in cutlass.range_constexpr(per):
            m_new = m[i]
            for j in cutlass.range_constexpr(group):
                lse = cutlass.Float32(_select(s0 + j < count[i], lses[j * per + i], cutlass.Float32(-math.inf)))
                lses[j * per + i] = lse
                m_new = cutlass.max(m_new, lse)
            m_ref = cutlass.Float32(_select(m_new == cutlass.Float32(-math.inf), cutlass.Float32(0.0), m_new))
            alpha = cute.math.exp2(m[i] - m_ref, fastmath=True)
            a = acc[i] * alpha
            d = den[i] * alpha
            for j in cutlass.range_constexpr(group):
                w = cute.math.exp2(lses[j * per + i] - m_ref, fastmath=True)
                a = a + parts[j * per + i] * w
                d = d + w
            acc[i] = a
            den[i] = d
            m[i] = m_new
    for i in cutlass.range_constexpr(per):
        if tidx + i * threads < items:
            d = cutlass.Float32(_select(den[i] == cutlass.Float32(0.0), cutlass.Float32(1.0), den[i]))
            sX[item[i], None].store((acc[i] / d).to(cutlass.BFloat16))


@_deferred.jit
def _dot_rows(mX, mG, w, gs, sub, x_base, lanes, chunks, x_chunks, rows, rows_in_flight, norm, eps, vec):
    """rows > 1 (fp8: any rows): this group's dot products for every decode row, reduced over its
    lanes (and scaled by each row's rstd with norm), flat [row * rows_in_flight + i]. Each weight
    chunk is converted once and used for every row (fp8: its two halves, `_half`, each against
    one x chunk); each row's x chunk is read (L1) and used for all rows_in_flight weight rows.
    Scalar accumulators: rows * rows_in_flight registers, not x8 (fp8 with few sums: vectors,
    `_fp8_partials`, which reads g from mG itself). x_base: 0, or `_opaque_zero()` to keep the x
    loads in the tile loop."""
    acc = [cutlass.Float32(0.0)] * (rows * rows_in_flight)
    sq = [cutlass.Float32(0.0)] * rows
    xpc = vec // VEC  # fp8: a weight chunk's two halves, each against one x load
    if cutlass.const_expr(xpc > 1 and rows * rows_in_flight <= FP8_VECTOR_SUMS):
        acc, sq = _fp8_partials(mX, mG, w, sub, x_base, lanes, chunks, x_chunks, rows, rows_in_flight, norm)
    else:
        for j in cutlass.range_constexpr(chunks):
            wf = [w[i * chunks + j].to(cutlass.Float32) for i in range(rows_in_flight)]
            for t in cutlass.range_constexpr(xpc):
                q = j * xpc + t
                gv = None
                if cutlass.const_expr(norm):
                    gv = gs[q].to(cutlass.Float32)
                for m in cutlass.range_constexpr(rows):
                    xf = mX[_x_row_index(x_base, m, x_chunks, sub, q, lanes, xpc), None].load().to(cutlass.Float32)
                    if cutlass.const_expr(norm):
                        sq[m] = cutlass.Float32((xf * xf).reduce(cute.ReductionOp.ADD, sq[m], 0))
                        xf = xf * gv
                    for i in cutlass.range_constexpr(rows_in_flight):
                        acc[m * rows_in_flight + i] = cutlass.Float32(
                            (_half(wf[i], t, xpc) * xf).reduce(cute.ReductionOp.ADD, acc[m * rows_in_flight + i], 0))
    # Each (row, weight row) sum is spread over the group's lanes: one reduce-scatter per weight
    # row leaves every lane the full sums of its own rows (`lane_rows`).
    pad = [cutlass.Float32(0.0)] * (rows_padded(rows) - rows)
    rstd = []
    if cutlass.const_expr(norm):
        for ss in reduce_scatter(sq + pad, sub, lanes, _shuffle_bfly, _select):
            rstd.append(cutlass.Float32(cute.math.rsqrt(
                ss * cutlass.Float32(1.0 / (lanes * chunks * vec)) + cutlass.Float32(eps), fastmath=True)))
    sums = []
    for i in cutlass.range_constexpr(rows_in_flight):
        kept = reduce_scatter([acc[m * rows_in_flight + i] for m in range(rows)] + pad, sub, lanes,
                              _shuffle_bfly, _select)
        if cutlass.const_expr(norm):
            kept = [k * r for k, r in zip(kept, rstd)]
        sums.append(kept)
    return sums


@_deferred.jit
def _fp8_partials(mX, mG, w, sub, x_base, lanes, chunks, x_chunks, rows, rows_in_flight, norm):
    """fp8, at most FP8_VECTOR_SUMS sums a lane: `_dot_rows`' per-lane partial sums (and x's
    sums of squares) in 8-wide vector accumulators, reduced once at the end. A scalar sum is one
    dependent FMA chain of 16 C (304 at the down projection's K = 4864): with the few warps an
    fp8 GEMV has a SM, that latency, not the bytes, set its time; 8 chains of 2 C do not. The
    norm's weight is read chunk by chunk here (L1 after the first warp), not held from before
    the PDL wait."""
    accv = [cute.full((VEC,), 0.0, cutlass.Float32) for _ in range(rows * rows_in_flight)]
    sqv = [cute.full((VEC,), 0.0, cutlass.Float32) for _ in range(rows)]
    for j in cutlass.range_constexpr(chunks):
        wf = [w[i * chunks + j].to(cutlass.Float32) for i in range(rows_in_flight)]
        for t in cutlass.range_constexpr(2):
            gv = None
            if cutlass.const_expr(norm):
                gv = mG[_x_index(sub, 2 * j + t, lanes, 2), None].load().to(cutlass.Float32)
            for m in cutlass.range_constexpr(rows):
                xf = mX[_x_row_index(x_base, m, x_chunks, sub, 2 * j + t, lanes, 2), None].load().to(cutlass.Float32)
                if cutlass.const_expr(norm):
                    sqv[m] = sqv[m] + xf * xf
                    xf = xf * gv
                for i in cutlass.range_constexpr(rows_in_flight):
                    accv[m * rows_in_flight + i] = accv[m * rows_in_flight + i] + _half(wf[i], t, 2) * xf
    acc = [cutlass.Float32(a.reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)) for a in accv]
    sq = [cutlass.Float32(v.reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)) for v in sqv]
    return acc, sq


def _x_index(sub, q, lanes: int, xpc: int):
    """The 16-byte chunk of x (or g) a lane reads q-th: bf16 reads chunk sub + q L, meeting its
    weight chunk; fp8's weight chunk c = sub + (q // 2) L spans x's chunks 2c and 2c + 1."""
    if xpc == 1:
        return sub + q * lanes
    return (sub + (q // xpc) * lanes) * xpc + q % xpc


def _x_row_index(x_base, m, x_chunks: int, sub, q, lanes: int, xpc: int):
    """_x_index in decode row m (bf16: the expression as it always was, so its PTX is too)."""
    if xpc == 1:
        return x_base + m * x_chunks + sub + q * lanes
    return x_base + m * x_chunks + _x_index(sub, q, lanes, xpc)


def _half(wf, t: int, xpc: int):
    """bf16: the widened chunk itself; fp8: its t-th 8 elements (column t of the 16 as (8, 2))."""
    return wf if xpc == 1 else wf.reshape((VEC, xpc))[None, t]


def rows_padded(rows: int) -> int:
    """The row count the reduce-scatter works on: the next power of two (rows of zeros added)."""
    return 1 << (rows - 1).bit_length()


def reduce_scatter(vals: list, sub, lanes: int, shuffle, select) -> list:
    """Sum a group's per-lane partial sums of several rows so that each lane ends with whole
    sums of only its own rows (recursive halving). vals: one partial a row, a power of two of
    them; sub: the lane's place in its group of `lanes`; shuffle(v, offset): the partner lane
    sub ^ offset's v; select(c, a, b). Each step the lanes whose bit `offset` is set keep the
    upper half of the rows and send the lower half to their partner, which keeps the lower:
    rows - 1 shuffles in all where full butterflies would take rows x log2(lanes). Once one row
    is left, the lanes that share it finish with a butterfly. Which rows a lane keeps:
    `lane_rows`. Plain Python over the ops it is given, so a CPU test runs it on lane vectors."""
    offset = lanes // 2
    while len(vals) > 1 and offset >= 1:
        half = len(vals) // 2
        upper = (sub // offset) % 2 == 1
        kept = []
        for i in range(half):
            give = select(upper, vals[i], vals[i + half])
            keep = select(upper, vals[i + half], vals[i])
            kept.append(keep + shuffle(give, offset))
        vals = kept
        offset //= 2
    while offset >= 1:
        vals = [v + shuffle(v, offset) for v in vals]
        offset //= 2
    return vals


def lane_rows(sub, lanes: int, rows: int, select) -> list:
    """The decode row of each value `reduce_scatter` leaves a lane, or `rows` (none) where
    another lane holding the same sum finishes it: with at most `lanes` (padded) rows, lane
    sub holds row sub // (lanes / padded), finished by the first lane of those; with more, lane
    sub holds rows sub * k ... sub * k + k - 1 (k = padded / lanes)."""
    padded = rows_padded(rows)
    if padded <= lanes:
        stride = lanes // padded
        return [sub // stride if stride == 1 else select(sub % stride == 0, sub // stride, rows)]
    per_lane = padded // lanes
    return [sub * per_lane + v for v in range(per_lane)]


def _opaque_zero():
    """An Int32 0 the compiler cannot see through (side-effecting inline PTX). Added to the
    x addresses inside the tile loop so that LLVM does not hoist an M-row x out of the loop:
    without a PDL wait in the loop it did (PTX, sm_90a), keeping M x C x 8 fp32 values live
    across it, which at M = 4 sent ptxas to 32 registers and a 1.5 KB stack (the argmax LM
    head ran 13x slower)."""
    return cutlass.Int32(llvm.inline_asm(cutlass.Int32.mlir_type, [], "mov.b32 $0, 0;", "=r",
                                         has_side_effects=True))


def _shuffle_bfly(v, offset):
    return cute.arch.shuffle_sync_bfly(v, offset=offset)


def _select(c, a, b):
    kind = type(a)  # keep the operand's DSL type (Float32 / Int32): later math asks for it
    return kind(cutlass.select_(c, a, kind(b)))


@_deferred.jit
def _stage_tile(mW, sW, g2s, tile, stage, tidx, sub, group, n_out, lanes, chunks, outs_per_group,
                groups_per_cta, rows_per_out):
    """cp.async every weight chunk of `tile` this thread reads into buffer `stage` (stages=2)."""
    per_stage = outs_per_group * rows_per_out * chunks
    for o in cutlass.range_constexpr(outs_per_group):
        safe = cutlass.min(tile * groups_per_cta * outs_per_group + o * groups_per_cta + group, n_out - 1)
        for h in cutlass.range_constexpr(rows_per_out):
            for j in cutlass.range_constexpr(chunks):
                cute.copy(g2s, mW[safe + h * n_out, sub + j * lanes, None],
                          sW[tidx, stage * per_stage + (o * rows_per_out + h) * chunks + j, None])


@_deferred.jit
def _rope_kv_store(mY, mKC, mVC, out, lo, hi, slot, y_base, head_dim, q_heads, kv_heads):
    """One rotate-half pair (rows r = h D + i and r + D/2 of head h), rotated already: both
    values to mY (the decode row's outputs start at y_base), and for a k or v head into the
    pool at the row's slot (none if negative)."""
    half = head_dim // 2
    head = out // half
    r1 = head * head_dim + out % half
    mY[y_base + r1] = lo
    mY[y_base + r1 + half] = hi
    if head >= q_heads:
        if slot >= 0:
            if head < q_heads + kv_heads:
                dst = slot * (kv_heads * head_dim) + (r1 - q_heads * head_dim)
                mKC[dst] = lo
                mKC[dst + half] = hi
            else:
                dst = slot * (kv_heads * head_dim) + (r1 - (q_heads + kv_heads) * head_dim)
                mVC[dst] = lo
                mVC[dst + half] = hi


@_deferred.jit
def _argmax_pick(val, idx, other_val, other_idx):
    """The better of two (value, index) pairs: larger value, then smaller index (torch's rule)."""
    better = other_val > val
    if other_val == val:
        better = other_idx < idx
    if better:
        val = other_val
        idx = other_idx
    return val, idx


@_deferred.jit
def _argmax_warp(val, idx):
    """Every lane ends with its warp's best (value, index)."""
    for offset in cutlass.range_constexpr(5):
        other_val = cute.arch.shuffle_sync_bfly(val, offset=16 >> offset)
        other_idx = cute.arch.shuffle_sync_bfly(idx, offset=16 >> offset)
        val, idx = _argmax_pick(val, idx, other_val, other_idx)
    return val, idx


@_deferred.jit
def _argmax_cta(val, idx, sVal, sIdx, tidx, warps):
    """Thread 0 ends with its CTA's best (value, index); smem holds one pair per warp."""
    val, idx = _argmax_warp(val, idx)
    if tidx % 32 == 0:
        sVal[tidx // 32] = val
        sIdx[tidx // 32] = idx
    cute.arch.sync_threads()
    if tidx == 0:
        for wi in cutlass.range_constexpr(1, warps):
            val, idx = _argmax_pick(val, idx, sVal[wi], sIdx[wi])
    return val, idx


@_deferred.jit
def _argmax_finish(mToken, mPartVal, mPartIdx, mCounter, best_val, best_idx, tidx, bidx, gdim,
                   warps, grid):
    # Each CTA publishes its best pair, then counts itself done; the last one to count reduces
    # the partials (the pattern of CUDA's threadFenceReduction sample) and resets the counter.
    smem = cutlass.utils.SmemAllocator()
    sVal = smem.allocate_tensor(cutlass.Float32, cute.make_layout(warps), byte_alignment=16)
    sIdx = smem.allocate_tensor(cutlass.Int32, cute.make_layout(warps), byte_alignment=16)
    sLast = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), byte_alignment=16)
    val, idx = _argmax_cta(best_val, best_idx, sVal, sIdx, tidx, warps)
    if tidx == 0:
        mPartVal[bidx] = val
        mPartIdx[bidx] = idx
        cute.arch.fence_acq_rel_gpu()
        sLast[0] = cutlass.utils.distributed.atomicAdd(mCounter.iterator, cutlass.Int32(1))
    cute.arch.sync_threads()
    if sLast[0] == gdim - 1:
        cute.arch.fence_acq_rel_gpu()
        val = cutlass.Float32(-math.inf)
        idx = cutlass.Int32(0)
        # All loads first (clamped: a repeated partial cannot change the answer), then compare.
        part_vals = []
        part_idxs = []
        for r in cutlass.range_constexpr((grid + warps * 32 - 1) // (warps * 32)):
            p = cutlass.min(tidx + r * warps * 32, gdim - 1)
            part_vals.append(mPartVal[p])
            part_idxs.append(mPartIdx[p])
        for r in cutlass.range_constexpr(len(part_vals)):
            val, idx = _argmax_pick(val, idx, part_vals[r], part_idxs[r])
        cute.arch.sync_threads()  # sVal / sIdx are reused
        val, idx = _argmax_cta(val, idx, sVal, sIdx, tidx, warps)
        if tidx == 0:
            mToken[0] = idx
            mCounter[0] = cutlass.Int32(0)


@_deferred.jit
def _argmax_finish_rows(mTokens, mPartVal, mPartIdx, mCounter, best_val, best_idx, tidx, bidx,
                        gdim, warps, grid, lanes, rows):
    # rows > 1 (at most `lanes`): every lane holds the best pair of its row (`lane_rows`: lane sub
    # has row sub // stride). The warp's groups are merged lane by lane (butterflies across
    # groups only), the warps through shared memory by thread m (row m), whose pair becomes the
    # CTA's partial [m, bidx]; the last CTA to count itself done reduces each row's partials
    # with one warp a row and resets the counter.
    smem = cutlass.utils.SmemAllocator()
    sVal = smem.allocate_tensor(cutlass.Float32, cute.make_layout(rows * warps), byte_alignment=16)
    sIdx = smem.allocate_tensor(cutlass.Int32, cute.make_layout(rows * warps), byte_alignment=16)
    sLast = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), byte_alignment=16)
    lane = tidx % 32
    warp = tidx // 32
    val = best_val
    idx = best_idx
    for step in cutlass.range_constexpr(5):
        if cutlass.const_expr((16 >> step) >= lanes):
            other_val = cute.arch.shuffle_sync_bfly(val, offset=16 >> step)
            other_idx = cute.arch.shuffle_sync_bfly(idx, offset=16 >> step)
            val, idx = _argmax_pick(val, idx, other_val, other_idx)
    stride = lanes // rows_padded(rows)
    if lane % stride == 0:
        if lane // stride < rows:  # group 0's first lane of each row
            sVal[(lane // stride) * warps + warp] = val
            sIdx[(lane // stride) * warps + warp] = idx
    cute.arch.sync_threads()
    if tidx < rows:
        val = sVal[tidx * warps]
        idx = sIdx[tidx * warps]
        for wi in cutlass.range_constexpr(1, warps):
            val, idx = _argmax_pick(val, idx, sVal[tidx * warps + wi], sIdx[tidx * warps + wi])
        mPartVal[tidx * grid + bidx] = val
        mPartIdx[tidx * grid + bidx] = idx
        cute.arch.fence_acq_rel_gpu()
    _argmax_last_cta_rows(mTokens, mPartVal, mPartIdx, mCounter, sLast, tidx, gdim, warps, grid, rows)


@_deferred.jit
def _argmax_last_cta_rows(mTokens, mPartVal, mPartIdx, mCounter, sLast, tidx, gdim, warps, grid, rows):
    """Every CTA has written its partials [m * grid + bidx] (fenced): the last CTA to count
    itself done reduces each row's partials with one warp a row and resets the counter."""
    lane = tidx % 32
    warp = tidx // 32
    cute.arch.sync_threads()
    if tidx == 0:
        sLast[0] = cutlass.utils.distributed.atomicAdd(mCounter.iterator, cutlass.Int32(1))
    cute.arch.sync_threads()
    if sLast[0] == gdim - 1:
        cute.arch.fence_acq_rel_gpu()
        for rr in cutlass.range_constexpr((rows + warps - 1) // warps):
            m = cutlass.min(warp + rr * warps, rows - 1)  # a repeated row is reduced twice, alike
            val = cutlass.Float32(-math.inf)
            idx = cutlass.Int32(0)
            part_vals = []
            part_idxs = []
            for c in cutlass.range_constexpr((grid + 31) // 32):
                p = cutlass.min(lane + c * 32, gdim - 1)
                part_vals.append(mPartVal[m * grid + p])
                part_idxs.append(mPartIdx[m * grid + p])
            for c in cutlass.range_constexpr(len(part_vals)):
                val, idx = _argmax_pick(val, idx, part_vals[c], part_idxs[c])
            val, idx = _argmax_warp(val, idx)
            if lane == 0:
                mTokens[m] = idx
        if tidx == 0:
            mCounter[0] = cutlass.Int32(0)


@_deferred.jit
def _gemv_launch(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                 mMid, mLse, mKvLen, stream, n_out, lanes, chunks, outs_per_group, warps, epilogue,
                 pdl, grid, staged, norm, eps, head_dim, q_heads, kv_heads, stages, late_g, min_ctas,
                 rows, fp8, merge):
    """bf16 weights (the kernel's mS is None: no scale argument reaches the kernel)."""
    _launch_traced(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                   mMid, mLse, mKvLen, None, stream, n_out, lanes, chunks, outs_per_group, warps,
                   epilogue, pdl, grid, staged, norm, eps, head_dim, q_heads, kv_heads, stages,
                   late_g, min_ctas, rows, fp8, merge)


@_deferred.jit
def _gemv_launch_fp8(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                     mMid, mLse, mKvLen, mS, stream, n_out, lanes, chunks, outs_per_group, warps,
                     epilogue, pdl, grid, staged, norm, eps, head_dim, q_heads, kv_heads, stages,
                     late_g, min_ctas, rows, fp8, merge):
    """fp8 weights with their row scales mS [n_rows] fp32."""
    _launch_traced(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                   mMid, mLse, mKvLen, mS, stream, n_out, lanes, chunks, outs_per_group, warps,
                   epilogue, pdl, grid, staged, norm, eps, head_dim, q_heads, kv_heads, stages,
                   late_g, min_ctas, rows, fp8, merge)


def _launch_traced(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                   mMid, mLse, mKvLen, mS, stream, n_out, lanes, chunks, outs_per_group, warps,
                   epilogue, pdl, grid, staged, norm, eps, head_dim, q_heads, kv_heads, stages,
                   late_g, min_ctas, rows, fp8, merge):
    """The launch both jit entries trace: the bf16 one passes no scale tensor (mS None), the
    fp8 one its row scales."""
    _gemv_kernel_compiled(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC,
                          mVC, mMid, mLse, mKvLen, n_out, lanes, chunks, outs_per_group, warps,
                          epilogue, pdl, grid, staged, norm, eps, head_dim, q_heads, kv_heads,
                          stages, late_g, min_ctas, rows, fp8, merge, mS).launch(
        grid=[grid, 1, 1], block=[warps * 32, 1, 1], stream=stream, use_pdl=pdl,
        min_blocks_per_mp=min_ctas)


# ---------------------------------------------------------------------------------------------
# The tensor-core form (bf16 rows >= 2 or asked, fp8 rows >= 1; FUSED_NOTES.md, "Stage 5: tensor-core M
# rows" and "Issue 31: fp8 on the tensor cores").
#
# y^T [16 weight rows, 8 decode rows] += W [16, K] x^T [K, 8] with mma.sync m16n8k16 (bf16 in,
# fp32 sums): W is the A operand, x^T the B operand (decode rows 8-15: a second product). At
# each K step of 32, lane 4 g + t loads 16 bytes (K 8 t .. 8 t + 7) of weight rows g and g + 8
# and of decode row g's x, and uses them as its fragments of two products with no exchange. In
# the PTX layout a lane's A fragment is (row g | g + 8; k 2t, 2t+1, 2t+8, 2t+9) and its B
# fragment (k 2t, 2t+1, 2t+8, 2t+9; column g): mapping those four logical k to the physical
# 8t .. 8t+3 (the first product) and 8t+4 .. 8t+7 (the second) permutes K the same way in
# both operands, which leaves every dot product as it was. The sums land as (weight row g |
# g + 8; decode rows 2t, 2t + 1): lane 4 g + t finishes those. A tile's rows are chosen so
# that an epilogue's pair meets in one lane: gate row j at g and up row j at g + 8 (silu_mul),
# dims d and d + D/2 of a head (rope).


def _as_i32x4(v):
    """8 bf16 (one 16-byte load) as the four 32-bit registers an mma operand takes (pairs of
    consecutive elements, the lower index in the low half)."""
    vec = llvm.bitcast(ir.VectorType.get([4], cutlass.Int32.mlir_type), v)
    return [cutlass.Int32(vector.extract(vec, dynamic_position=[], static_position=[i])) for i in range(4)]


def mma_operands(wa: list, wb: list, xb: list, half: int) -> tuple[list, list]:
    """The A and B registers of one of a K step's two products (half 0: K 8t .. 8t+3, 1: 8t+4
    .. 8t+7) from a lane's loads as 32-bit pairs: wa / wb weight rows g / g + 8, xb decode row
    g's x. A is {a0a1, a2a3, a4a5, a6a7} = (row g, k 2t..), (g + 8, 2t..), (g, 2t+8..), (g + 8,
    2t+8..) and B {b0b1, b2b3} = (k 2t.., column g), (2t+8.., g), so logical k 2t, 2t+1, 2t+8,
    2t+9 are physical 8t + 4 half + 0..3 in both. Plain Python: a CPU test checks it."""
    return ([wa[2 * half], wb[2 * half], wa[2 * half + 1], wb[2 * half + 1]],
            [xb[2 * half], xb[2 * half + 1]])


def _mma_bf16(a, b, c):
    """d = A B + c for one m16n8k16 bf16 product: a four A registers, b two B registers, c the
    four fp32 accumulators; returns the four new ones."""
    f32 = cutlass.Float32.mlir_type
    res = llvm.inline_asm(
        llvm.StructType.get_literal([f32] * 4), [v.ir_value() for v in (*a, *b, *c)],
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    return [cutlass.Float32(llvm.extractvalue(f32, res, [i])) for i in range(4)]


def prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32 d, a, b, selector` (the default mode) on Python ints: byte i of d is byte
    (selector >> 4 i) & 7 of b:a, or with bit 3 of that nibble set, that byte's sign (0x00 or
    0xff). The CPU model `widen_e4m3_word` is checked with."""
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> 4 * i) & 0xF
        byte = source[nibble & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nibble & 8 else byte) << 8 * i
    return out


def widen_e4m3_word(word: int) -> tuple[int, int]:
    """Four e4m3 codes (a 32-bit word, code 0 in the low byte) as two bf16 pairs (code 0 in the
    low half of the first), exactly the three integer instructions a pair `_widen_e4m3` issues:
    prmt makes each code a sign-extended 16-bit half (sign in bits 7-15, exponent + mantissa in
    bits 0-6); a left shift by 4 puts the 7 exponent and mantissa bits at bf16's bits 4-10 (the
    low 4 exponent bits, the top 3 mantissa bits) and the sign copies at 11-15; the mask keeps
    bit 15 and bits 4-10. A code of exponent e >= 1 and mantissa m is then the bf16 2^(e - 127)
    (1 + m/8) = its e4m3 value 2^(e - 7) (1 + m/8) times 2^-120; an e4m3 subnormal (e = 0) the
    bf16 subnormal 2^-126 m/8 = 2^-6 m/8 times 2^-120: every finite code exactly, zero to zero
    (-0 to -0). The two NaN codes (0x7f, 0xff) come out finite (480 times 2^-120): quantized
    weights never hold them (quantization clamps to +-448)."""
    pairs = []
    for selector in E4M3_PRMT:
        pairs.append(((prmt(word, 0, selector) << E4M3_SHIFT) & 0xFFFFFFFF) & E4M3_MASK)
    return pairs[0], pairs[1]


def _widen_e4m3(word):
    """`widen_e4m3_word` on the GPU: an Int32 of four e4m3 codes -> two Int32 bf16 pairs."""
    i32 = cutlass.Int32.mlir_type
    body = "".join(f"prmt.b32 t, $2, 0, {sel:#x};\nshl.b32 t, t, {E4M3_SHIFT};\nand.b32 ${i}, t, {E4M3_MASK:#x};\n"
                   for i, sel in enumerate(E4M3_PRMT))
    res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [word.ir_value()],
                          "{\n.reg .b32 t;\n" + body + "}", "=r,=r,r")
    return [cutlass.Int32(llvm.extractvalue(i32, res, [i])) for i in range(2)]


def _widen_e4m3_x16(v):
    """16 e4m3 codes (one 16-byte load) as the eight bf16 pairs (2 j, 2 j + 1) an mma operand
    takes, each value times 2^-120 (`widen_e4m3_word`)."""
    return [pair for word in _as_i32x4(v) for pair in _widen_e4m3(word)]


def _mma_rows(tile, g, n_out, epilogue, head_dim):
    """The weight rows lane 4 g + t loads in `tile` (the A operand's rows g and g + 8): gate row o
    and up row o + N/2 (silu_mul), dims i and i + D/2 of a head (rope), else rows g and g + 8
    (tail tiles re-read a valid row and store nothing)."""
    if epilogue == "silu_mul":
        row_a = cutlass.min(tile * (MMA_ROWS // 2) + g, n_out - 1)
        row_b = row_a + n_out
    elif epilogue == "rope_kv" or epilogue == "bias_rope_kv":
        half = head_dim // 2  # slot p: dims i and i + D/2 of head p // (D/2)
        slot = cutlass.min(tile * (MMA_ROWS // 2) + g, n_out - 1)
        row_a = (slot // half) * head_dim + slot % half
        row_b = row_a + half
    else:
        row_a = cutlass.min(tile * MMA_ROWS + g, n_out - 1)
        row_b = cutlass.min(tile * MMA_ROWS + g + 8, n_out - 1)
    return row_a, row_b


def _mma_row_scales(mS, tile, lane, n_out, epilogue, head_dim):
    """fp8: the scales of this lane's weight rows g and g + 8 in `tile` (None for bf16)."""
    if mS is None:
        return None
    row_a, row_b = _mma_rows(tile, lane // 4, n_out, epilogue, head_dim)
    return [cutlass.Float32(mS[row_a]), cutlass.Float32(mS[row_b])]


@_deferred.jit
def _mma_load_weights(mW, tile, first, end, warp, lane, n_out, chunks, epilogue, head_dim):
    """This lane's weight loads of `tile` (16-byte each, all issued at once): per K step of
    this warp (first + warp C + s, clamped below `end`: the CTA's K steps), rows g then g + 8
    of the tile (`_mma_rows`). A chunk is 16 bytes whatever the weights: a K step of 32 bf16
    or 64 fp8 is four chunks, lane t's the t-th."""
    g = lane // 4
    t = lane % 4
    row_a, row_b = _mma_rows(tile, g, n_out, epilogue, head_dim)
    w = []
    for s in cutlass.range_constexpr(chunks):
        chunk = cutlass.min(first + warp * chunks + s, end - 1) * (MMA_K // VEC) + t
        w.append(mW[row_a, chunk, None].load())
        w.append(mW[row_b, chunk, None].load())
    return w


@_deferred.jit
def _mma_x_fragments(mX, mG, first, end, warp, lane, k, warps, chunks, rows, norm, splits, fp8):
    """This warp's B fragments for all of its K steps (the same for every tile, so loaded once):
    b[s * n_tiles + nt], decode row 8 nt + g's x (x * g rounded to bf16 with norm; a padded row
    re-reads the last, whose sums are not stored), and with norm each decode row's sum of x^2
    over this lane's chunks (8-wide, per n-tile). Steps past the CTA's K (`end`; where warps x
    chunks x splits > K / step) are zeros. fp8: a K step is 64 and lane t's 16 weights meet x's
    two 16-byte chunks 2 t and 2 t + 1 of it (eight registers an n-tile)."""
    g = lane // 4
    n_tiles = (rows + 7) // 8
    x_chunks = k // VEC
    xpc = 2 if fp8 else 1  # x chunks a weight chunk
    uneven = warps * chunks * splits > k // (MMA_K * xpc)
    b = []
    sq = [cute.full((VEC,), 0.0, cutlass.Float32) for _ in range(n_tiles)]
    for s in cutlass.range_constexpr(chunks):
        step = first + warp * chunks + s
        if cutlass.const_expr(fp8):
            base = cutlass.min(step, end - 1) * (MMA_K_FP8 // VEC) + (lane % 4) * 2
            x_at = [base, base + 1]
        else:
            x_at = [cutlass.min(step, end - 1) * (MMA_K // VEC) + lane % 4]
        keep = cutlass.Float32(1.0)
        if cutlass.const_expr(uneven):
            keep = cutlass.Float32(cutlass.select_(step < end, cutlass.Float32(1.0), cutlass.Float32(0.0)))
        regs = [[] for _ in range(n_tiles)]
        for h in cutlass.range_constexpr(xpc):
            chunk = x_at[h]
            gv = None
            if cutlass.const_expr(norm):
                gv = mG[chunk, None].load().to(cutlass.Float32)
            for nt in cutlass.range_constexpr(n_tiles):
                m = cutlass.min(nt * 8 + g, rows - 1)
                xv = mX[m * x_chunks + chunk, None].load()
                if cutlass.const_expr(norm or uneven):
                    xf = xv.to(cutlass.Float32) * keep
                    if cutlass.const_expr(norm):
                        sq[nt] = sq[nt] + xf * xf
                        xf = xf * gv
                    xv = xf.to(cutlass.BFloat16)
                regs[nt] = regs[nt] + _as_i32x4(xv)
        for nt in cutlass.range_constexpr(n_tiles):
            b.append(regs[nt])
    return b, sq


@_deferred.jit
def _mma_sq_to_smem(sq, sSq, warp, lane, rows):
    """This warp's sums of x^2 over its K steps, a decode row each (reduced over the row's four
    lanes), into sSq[warp * MMA_ROWS + row]; the caller syncs before reading them."""
    g = lane // 4
    t = lane % 4
    for nt in cutlass.range_constexpr((rows + 7) // 8):
        ss = cutlass.Float32(sq[nt].reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0))
        ss = cute.arch.warp_reduction_sum(ss, threads_in_group=4)
        if t == 0:
            sSq[warp * MMA_ROWS + nt * 8 + g] = ss


def _rstd(ss, k: int, eps: float):
    """1 / sqrt(mean(x^2) + eps) from a decode row's sum of x^2 over all of K."""
    return cutlass.Float32(cute.math.rsqrt(ss * cutlass.Float32(1.0 / k) + cutlass.Float32(eps), fastmath=True))


@_deferred.jit
def _mma_rstd(sq, sSq, warp, lane, k, warps, rows, eps):
    """1 / sqrt(mean(x^2) + eps) of this lane's decode rows 8 nt + 2 t + j, [nt * 2 + j]: each
    warp's sums over its K steps meet in shared memory (`_mma_sq_to_smem`)."""
    _mma_sq_to_smem(sq, sSq, warp, lane, rows)
    return _lane_rows_rstd(sSq, lane, k, warps, rows, eps)


@_deferred.jit
def _lane_rows_rstd(sSq, lane, k, warps, rows, eps):
    """After each warp's sums of x^2 a decode row reach sSq[warp * MMA_ROWS + m]: the rstd of
    this lane's decode rows 8 nt + 2 t + j, [nt * 2 + j]."""
    cute.arch.sync_threads()
    return _summed_rstd(sSq, 0, 0, lane, k, warps, rows, eps)


@_deferred.jit
def _summed_rstd(mSq, at, first, lane, k, parts, rows, eps):
    """The rstd of this lane's decode rows 8 nt + 2 t + j, [nt * 2 + j], from `parts` sums of x^2
    a row at mSq[at + (first + part) * MMA_ROWS + m], added in part order (a CTA's warps' in
    shared memory; a split tile's CTAs' in the workspace)."""
    t = lane % 4
    rstd = []
    for nt in cutlass.range_constexpr((rows + 7) // 8):
        for j in cutlass.range_constexpr(2):
            m = cutlass.min(nt * 8 + 2 * t + j, rows - 1)
            ss = cutlass.Float32(0.0)
            for part in cutlass.range_constexpr(parts):
                ss = ss + mSq[at + (first + part) * MMA_ROWS + m]
            rstd.append(_rstd(ss, k, eps))
    return rstd


@_deferred.jit
def _mma_store_sq(sq, sSq, mPart, tile, split, warp, lane, warps, rows, splits, tile_group, sq_at):
    """`_mma_rstd` where K is split over CTAs (splits > 1): this CTA's sums of x^2 over its part of
    K, a decode row each (the warps' sums met in shared memory), stored by warp 0's lane m < rows
    at sq_at + part x MMA_ROWS + m for each of its tiles' parts (part = tile x splits + split; a
    tile group's G tiles share them). The tile's last CTA adds the splits' sums for the rstd and
    scales the tile's sums once (`_mma_finish_split`): no CTA reads x beyond its own K. Warp 0's
    fence after its partial sums (`_mma_store_split`) covers these stores too."""
    _mma_sq_to_smem(sq, sSq, warp, lane, rows)
    cute.arch.sync_threads()
    if warp == 0:
        if lane < rows:
            total = cutlass.Float32(0.0)
            for wi in cutlass.range_constexpr(warps):
                total = total + sSq[wi * MMA_ROWS + lane]
            for j in cutlass.range_constexpr(tile_group):
                mPart[sq_at + ((tile + j) * splits + split) * MMA_ROWS + lane] = total


def _split_sq_at(num_tiles: int, splits: int, rows: int) -> int:
    """Where a split plan's workspace keeps the CTAs' sums of x^2 (`_mma_store_sq`, with the
    norm): after the partial sums' num_tiles x splits parts of n-tiles x 4 x 32 slots."""
    return num_tiles * splits * ((rows + 7) // 8) * 4 * 32


def _mma_products(w, b, chunks: int, rows: int, fp8: bool = False) -> list:
    """This warp's sums of one tile over its K steps, c[nt] = its four accumulators (two
    chains, K 8t .. 8t+3 and 8t+4 .. 8t+7, added at the end). fp8: each step's 16 codes a row
    widened to eight bf16 pairs (`_widen_e4m3_x16`), four products a step (16 t + 4 p .. + 3,
    p = 0..3, alternating between the two chains)."""
    n_tiles = (rows + 7) // 8
    acc = [[cutlass.Float32(0.0)] * 4 for _ in range(2 * n_tiles)]  # [nt * 2 + half]
    for s in range(chunks):
        widen = _widen_e4m3_x16 if fp8 else _as_i32x4
        wa = widen(w[2 * s])
        wb = widen(w[2 * s + 1])
        for nt in range(n_tiles):
            for h in range(4 if fp8 else 2):
                a, bb = mma_operands(wa, wb, b[s * n_tiles + nt], h)
                acc[nt * 2 + h % 2] = _mma_bf16(a, bb, acc[nt * 2 + h % 2])
    return [[acc[nt * 2][i] + acc[nt * 2 + 1][i] for i in range(4)] for nt in range(n_tiles)]


@_deferred.jit
def _mma_tile(c, tile, it, sAcc, rstd, best_val, best_idx, mY, mE, mPos, mCS, mSlot, mKC, mVC,
              mPart, mCounter, sLast, split, tidx, pre, warps, n_out, epilogue, rows, norm, head_dim,
              q_heads, kv_heads, splits, k, eps, sq_at, scl=None, mS=None):
    """One tile from this warp's sums c (`_mma_products`): the warps' sums added in shared
    memory (buffer it % 2: a warp may write the next tile's while warp 0 still reads this
    one's), and warp 0 finishes the tile (splits > 1: stores the CTA's sums for the last of the
    tile's CTAs to finish, unscaled: with the norm the last applies the rstd from the splits'
    sums of x^2 at sq_at, `_mma_store_sq`). Returns the lane's running argmax pair. fp8: scl the
    lane's two rows' scales (`_mma_row_scales`), mS all of them (for the split's last CTA)."""
    warp = tidx // 32
    lane = tidx % 32
    n_tiles = (rows + 7) // 8
    if cutlass.const_expr(warps == 1 and splits == 1):
        best_val, best_idx = _mma_epilogue(c, tile, rstd, best_val, best_idx, mY, mE, mPos, mCS, mSlot, mKC,
                                           mVC, lane, n_out, epilogue, rows, norm, head_dim, q_heads, kv_heads,
                                           pre, scl)
    elif cutlass.const_expr(warps == 1):
        _mma_store_split(mPart, c, tile * splits + split, lane, rows)
    else:
        per_warp = n_tiles * 4 * 32
        base = (it % 2) * warps * per_warp
        for nt in cutlass.range_constexpr(n_tiles):
            for i in cutlass.range_constexpr(4):
                sAcc[base + warp * per_warp + (nt * 4 + i) * 32 + lane] = c[nt][i]
        cute.arch.sync_threads()
        if warp == 0:
            total = []
            for nt in cutlass.range_constexpr(n_tiles):
                row = []
                for i in cutlass.range_constexpr(4):
                    v = c[nt][i]
                    for wi in cutlass.range_constexpr(1, warps):
                        v = v + sAcc[base + wi * per_warp + (nt * 4 + i) * 32 + lane]
                    row.append(v)
                total.append(row)
            if cutlass.const_expr(splits == 1):
                best_val, best_idx = _mma_epilogue(total, tile, rstd, best_val, best_idx, mY, mE, mPos, mCS,
                                                   mSlot, mKC, mVC, lane, n_out, epilogue, rows, norm, head_dim,
                                                   q_heads, kv_heads, pre, scl)
            else:
                _mma_store_split(mPart, total, tile * splits + split, lane, rows)
    if cutlass.const_expr(splits > 1):
        _mma_finish_split(mPart, mCounter, sLast, tile, tidx, pre, mY, mE, mPos, mCS, mSlot, mKC, mVC, n_out,
                          epilogue, rows, norm, head_dim, q_heads, kv_heads, splits, k, eps, sq_at, mS)
    return best_val, best_idx


def _next_tile(tile, gdim, num_tiles):
    """The tile a looping CTA prefetches after `tile`: the next one, or `tile` itself at the end."""
    nxt = tile + gdim
    return cutlass.Int32(cutlass.select_(nxt < num_tiles, nxt, tile))


def _mma_store_split(mPart, c, part, lane, rows):
    """A CTA's sums of its K steps (warp 0's lanes), part = tile x splits + split: each lane its
    own slots, fenced before the CTA counts itself done."""
    n_tiles = (rows + 7) // 8
    for nt in range(n_tiles):
        for i in range(4):
            mPart[(part * n_tiles * 4 + nt * 4 + i) * 32 + lane] = c[nt][i]
    cute.arch.fence_acq_rel_gpu()


@_deferred.jit
def _mma_finish_split(mPart, mCounter, sLast, tile, tidx, pre, mY, mE, mPos, mCS, mSlot, mKC, mVC, n_out,
                      epilogue, rows, norm, head_dim, q_heads, kv_heads, splits, k, eps, sq_at, mS=None):
    """The tile's CTAs count themselves done (a counter a tile); the last adds their sums (its
    warp 0, each lane its own slots, in split order) and applies the epilogue (fp8: the rows'
    scales from mS; the norm: each decode row's rstd from the splits' sums of x^2 at sq_at,
    added in split order), then resets the counter for the next launch."""
    n_tiles = (rows + 7) // 8
    lane = tidx % 32
    cute.arch.sync_threads()
    if tidx == 0:
        sLast[0] = cutlass.utils.distributed.atomicAdd(mCounter.iterator + tile, cutlass.Int32(1))
    cute.arch.sync_threads()
    if sLast[0] == splits - 1:
        cute.arch.fence_acq_rel_gpu()
        if tidx < 32:
            total = []
            for nt in cutlass.range_constexpr(n_tiles):
                row = []
                for i in cutlass.range_constexpr(4):
                    v = cutlass.Float32(0.0)
                    for sp in cutlass.range_constexpr(splits):
                        v = v + mPart[((tile * splits + sp) * n_tiles * 4 + nt * 4 + i) * 32 + lane]
                    row.append(v)
                total.append(row)
            rstd = []
            if cutlass.const_expr(norm):  # the splits' sums of x^2 of this tile (`_mma_store_sq`)
                rstd = _summed_rstd(mPart, sq_at, tile * splits, lane, k, splits, rows, eps)
            _mma_epilogue(total, tile, rstd, cutlass.Float32(0.0), cutlass.Int32(0), mY, mE, mPos, mCS, mSlot, mKC,
                          mVC, lane, n_out, epilogue, rows, norm, head_dim, q_heads, kv_heads, pre,
                          _mma_row_scales(mS, tile, lane, n_out, epilogue, head_dim))
        if tidx == 0:
            mCounter[tile] = cutlass.Int32(0)


@_deferred.jit
def _mma_epilogue(c, tile, rstd, best_val, best_idx, mY, mE, mPos, mCS, mSlot, mKC, mVC, lane, n_out,
                  epilogue, rows, norm, head_dim, q_heads, kv_heads, pre=None, scl=None):
    """Lane 4 g + t finishes decode rows m = 8 nt + 2 t + j from c[nt] = (row g: m = 2t, 2t+1;
    row g + 8: the same), each as the CUDA-core form's epilogue does; argmax folds the tile into
    the lane's running pair (lane g = 2 nt + j keeps decode row m's). pre: the tile's
    `_mma_epilogue_inputs`, loaded before the products (None: loaded here). scl (fp8): rows g
    and g + 8's scales; each sum is times 2^120 (the widening's) and its row's scale first."""
    g = lane // 4
    t = lane % 4
    n_tiles = (rows + 7) // 8
    rope = epilogue == "rope_kv" or epilogue == "bias_rope_kv"
    for nt in cutlass.range_constexpr(n_tiles):
        for j in cutlass.range_constexpr(2):
            m = nt * 8 + 2 * t + j
            lo = c[nt][j]
            hi = c[nt][2 + j]
            if cutlass.const_expr(scl is not None):
                lo = lo * cutlass.Float32(E4M3_BF16_SCALE) * scl[0]
                hi = hi * cutlass.Float32(E4M3_BF16_SCALE) * scl[1]
            if cutlass.const_expr(norm):
                lo = lo * rstd[nt * 2 + j]
                hi = hi * rstd[nt * 2 + j]
            if cutlass.const_expr(epilogue in ("none", "bias", "residual")):
                for h in cutlass.range_constexpr(2):
                    out = tile * MMA_ROWS + g + 8 * h
                    y = [lo, hi][h]
                    if cutlass.const_expr(epilogue != "none"):
                        if cutlass.const_expr(pre is None):
                            pre = _mma_epilogue_inputs(tile, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows,
                                                       head_dim, q_heads, kv_heads)
                        y = y + pre[nt * 2 + j][h]  # the bias, or this decode row's residual
                    if m < rows:
                        if out < n_out:
                            mY[m * n_out + out] = y.to(mY.element_type)
            if cutlass.const_expr(epilogue == "silu_mul"):
                out = tile * (MMA_ROWS // 2) + g
                y = lo / (cutlass.Float32(1.0) + cute.math.exp(-lo, fastmath=True)) * hi
                if m < rows:
                    if out < n_out:
                        mY[m * n_out + out] = y.to(mY.element_type)
            if cutlass.const_expr(rope):
                slot = tile * (MMA_ROWS // 2) + g
                if cutlass.const_expr(pre is None):
                    pre = _mma_epilogue_inputs(tile, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows, head_dim,
                                               q_heads, kv_heads)
                bias_lo, bias_hi = pre[0]
                cs, sn, pool_slot = pre[1][nt * 2 + j]
                lo = lo + bias_lo
                hi = hi + bias_hi
                rot_lo = (lo * cs - hi * sn).to(mY.element_type)
                rot_hi = (hi * cs + lo * sn).to(mY.element_type)
                if m < rows:
                    if slot < n_out:
                        _rope_kv_store(mY, mKC, mVC, slot, rot_lo, rot_hi, pool_slot, m * (2 * n_out),
                                       head_dim, q_heads, kv_heads)
            if cutlass.const_expr(epilogue == "argmax"):
                best_val, best_idx = _mma_argmax_step(lo, hi, tile, g, nt * 2 + j, best_val, best_idx, n_out)
    return best_val, best_idx


def _mma_epilogue_inputs(tile, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows, head_dim, q_heads, kv_heads):
    """What the epilogue of `tile` reads besides the sums, loaded before the products (after
    the PDL wait: the residual, positions and slots are the step's inputs) so their latency
    hides behind them: bias / residual, per decode row nt * 2 + j the values to add to weight
    rows g and g + 8; rope: `_mma_preputs`; None for the other epilogues."""
    if epilogue == "rope_kv" or epilogue == "bias_rope_kv":
        return _mma_preputs(tile, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows, head_dim, q_heads,
                                kv_heads)
    if epilogue != "bias" and epilogue != "residual":
        return None
    adds = []
    for nt in range((rows + 7) // 8):
        for j in range(2):
            mm = cutlass.min(nt * 8 + 2 * (lane % 4) + j, rows - 1)
            pair = []
            for h in range(2):
                safe = cutlass.min(tile * MMA_ROWS + lane // 4 + 8 * h, n_out - 1)
                pair.append(mE[safe if epilogue == "bias" else mm * n_out + safe].to(cutlass.Float32))
            adds.append(pair)
    return adds


def _mma_preputs(tile, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows, head_dim, q_heads, kv_heads):
    """What the rope epilogue of `tile` reads besides the sums, for this lane's slot (dims i and
    i + D/2 of head h) and decode rows: [(bias of both dims, 0 without one), [(cos, sin, pool
    slot) per decode row, nt * 2 + j]] (a v head: cos 1, sin 0)."""
    g = lane // 4
    half = head_dim // 2
    safe = cutlass.min(tile * (MMA_ROWS // 2) + g, n_out - 1)
    r1 = (safe // half) * head_dim + safe % half
    rotate = safe // half < q_heads + kv_heads
    bias = (cutlass.Float32(0.0), cutlass.Float32(0.0))
    if epilogue == "bias_rope_kv":
        bias = (mE[r1].to(cutlass.Float32), mE[r1 + half].to(cutlass.Float32))
    per_row = []
    for nt in range((rows + 7) // 8):
        for j in range(2):
            mm = cutlass.min(nt * 8 + 2 * (lane % 4) + j, rows - 1)
            pos = cutlass.Int32(mPos[mm])
            cs = cutlass.Float32(cutlass.select_(rotate, mCS[pos * head_dim + safe % half], cutlass.Float32(1.0)))
            sn = cutlass.Float32(cutlass.select_(rotate, mCS[pos * head_dim + half + safe % half],
                                                 cutlass.Float32(0.0)))
            per_row.append((cs, sn, cutlass.Int32(mSlot[mm])))
    return [bias, per_row]


def _mma_argmax_step(lo, hi, tile, g, pair, best_val, best_idx, n_out):
    """Fold a tile's sums of one decode row (rows g and g + 8 in this lane) into the running
    pair of the lane that keeps that decode row (g == pair): the best over the 16 rows by
    shuffles across g, ties to the lower index (torch's rule)."""
    out_a = tile * MMA_ROWS + g
    val = cutlass.Float32(cutlass.select_(out_a < n_out, lo, cutlass.Float32(-math.inf)))
    hi = cutlass.Float32(cutlass.select_(out_a + 8 < n_out, hi, cutlass.Float32(-math.inf)))
    idx = cutlass.Int32(cutlass.select_(hi > val, out_a + 8, out_a))
    val = cutlass.Float32(cutlass.select_(hi > val, hi, val))
    for offset in (4, 8, 16):  # across g (lanes 4 g + t share t)
        other_val = cute.arch.shuffle_sync_bfly(val, offset=offset)
        other_idx = cute.arch.shuffle_sync_bfly(idx, offset=offset)
        val, idx = _argmax_pick(val, idx, other_val, other_idx)
    new_val, new_idx = _argmax_pick(best_val, best_idx, val, idx)
    mine = g == pair
    return (cutlass.Float32(cutlass.select_(mine, new_val, best_val)),
            cutlass.Int32(cutlass.select_(mine, new_idx, best_idx)))


@_deferred.jit
def _mma_argmax_finish(mTokens, mPartVal, mPartIdx, mCounter, sLast, best_val, best_idx, tidx, bidx, gdim,
                       warps, grid, rows):
    """Warp 0's lane 4 g + t holds decode row 8 (g // 2) + 2 t + g % 2's best pair over this
    CTA's tiles (g < 2 n-tiles): it becomes the CTA's partial; the last CTA reduces them."""
    lane = tidx % 32
    g = lane // 4
    m = (g // 2) * 8 + 2 * (lane % 4) + g % 2
    if tidx < 32:
        if g < 2 * ((rows + 7) // 8):
            if m < rows:
                mPartVal[m * grid + bidx] = best_val
                mPartIdx[m * grid + bidx] = best_idx
        cute.arch.fence_acq_rel_gpu()
    _argmax_last_cta_rows(mTokens, mPartVal, mPartIdx, mCounter, sLast, tidx, gdim, warps, grid, rows)


@_deferred.kernel
def _mma_kernel(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC, mMid, mLse,
                mKvLen, k, n_out, epilogue, warps, chunks, pdl, grid, norm, eps, head_dim, q_heads, kv_heads, rows,
                splits, tile_group, merge, fp8, mS):
    # The tensors as `_gemv_kernel` takes them (bf16, or fp8 codes with their row scales mS
    # (None for bf16); K steps of 32 bf16 or 64 fp8; with splits > 1 mPartVal is the workspace
    # [tiles x splits, n-tiles x 4, 32] of the CTAs' sums and mCounter [tiles] their counters). A
    # CTA's warps split its K (warp w: steps w C .. w C + C - 1, C = chunks, from the CTA's
    # first); it walks tiles bidx, bidx + grid, ... (splits > 1: CTA bidx computes split
    # bidx % splits of tile bidx // splits alone; tile_group G > 1: CTA bidx computes tiles
    # G b .. G b + G - 1 for b = bidx // splits, split bidx % splits). The first tile's weight
    # loads (a group's: all G tiles') are issued before the PDL wait; x (and g) are read once
    # after it. merge (`merge_in`): x merged from the attention's split partials into shared
    # memory first (`_gemv_kernel`'s), the fragments read from there.
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    lane = tidx % 32
    warp = tidx // 32
    n_tiles = (rows + 7) // 8
    pairs = 2 if epilogue in ("silu_mul", "rope_kv", "bias_rope_kv") else 1
    num_tiles = (n_out + MMA_ROWS // pairs - 1) // (MMA_ROWS // pairs)
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_launch_dependents()
    steps = k // (MMA_K_FP8 if fp8 else MMA_K)
    if cutlass.const_expr(fp8):  # the codes as bytes: the widening is integer work (`_widen_e4m3`)
        mW = cute.recast_tensor(mW, cutlass.Uint8)
    smem = cutlass.utils.SmemAllocator()
    merging = len(merge) > 0
    sX = None
    counts = []
    most = 0
    if cutlass.const_expr(merging):
        sX = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((rows * (k // VEC), VEC), stride=(VEC, 1)),
                                  byte_alignment=16)
        counts, most = _merge_counts(mKvLen, rows, merge)
    tile = bidx
    split = 0
    first = 0
    end = steps
    if cutlass.const_expr(splits > 1):
        per_split = (steps + splits - 1) // splits
        tile = bidx // splits
        split = bidx % splits
        first = split * per_split
        end = cutlass.min(first + per_split, steps)
    if cutlass.const_expr(tile_group > 1):
        tile = tile * tile_group
    w = _mma_load_weights(mW, tile, first, end, warp, lane, n_out, chunks, epilogue, head_dim)
    w_group = [w]  # the group's tiles' loads, all in flight across the wait
    for j in cutlass.range_constexpr(1, tile_group):
        w_group.append(_mma_load_weights(mW, tile + j, first, end, warp, lane, n_out, chunks, epilogue,
                                         head_dim))
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()  # x, the residual, positions and slots: the previous kernel's
    if cutlass.const_expr(merging):
        _merge_x(mMid, mLse, sX, counts, most, tidx, warps * 32, k // VEC, rows, merge)
        cute.arch.sync_threads()
    b, sq = _mma_x_fragments(sX if merging else mX, mG, first, end, warp, lane, k, warps, chunks, rows, norm,
                             splits, fp8)
    pre = _mma_epilogue_inputs(tile, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows, head_dim, q_heads,
                               kv_heads)
    scl = _mma_row_scales(mS, tile, lane, n_out, epilogue, head_dim)
    sAcc = None
    if cutlass.const_expr(warps > 1):
        sAcc = smem.allocate_tensor(cutlass.Float32, cute.make_layout(2 * warps * n_tiles * 4 * 32),
                                    byte_alignment=16)
    sLast = None
    if cutlass.const_expr(epilogue == "argmax" or splits > 1):
        sLast = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), byte_alignment=16)
    rstd = []
    if cutlass.const_expr(norm):
        sSq = smem.allocate_tensor(cutlass.Float32, cute.make_layout(warps * MMA_ROWS), byte_alignment=16)
        if cutlass.const_expr(splits == 1):  # (split: its part of the sums, after the products)
            rstd = _mma_rstd(sq, sSq, warp, lane, k, warps, rows, eps)
    best_val = cutlass.Float32(-math.inf)
    best_idx = cutlass.Int32(0)
    # A looping CTA issues its next tile's weight loads right after this tile's products, so
    # they fly during the warps' reduction and the epilogue (the last tile re-reads its own:
    # L2, no DRAM bytes).
    loops = splits == 1 and tile_group == 1 and grid < num_tiles
    sq_at = _split_sq_at(num_tiles, splits, rows)
    c = _mma_products(w, b, chunks, rows, fp8)
    if cutlass.const_expr(norm and splits > 1):  # this CTA's K is a part of x's: its sums of x^2 for the last CTA
        _mma_store_sq(sq, sSq, mPartVal, tile, split, warp, lane, warps, rows, splits, tile_group, sq_at)
    if cutlass.const_expr(loops):
        w = _mma_load_weights(mW, _next_tile(tile, gdim, num_tiles), 0, steps, warp, lane, n_out, chunks,
                              epilogue, head_dim)
    best_val, best_idx = _mma_tile(c, tile, 0, sAcc, rstd, best_val, best_idx, mY, mE, mPos, mCS, mSlot,
                                   mKC, mVC, mPartVal, mCounter, sLast, split, tidx, pre, warps, n_out,
                                   epilogue, rows, norm, head_dim, q_heads, kv_heads, splits, k, eps, sq_at, scl, mS)
    for j in cutlass.range_constexpr(1, tile_group):  # the group's other tiles, against the same x
        pre = _mma_epilogue_inputs(tile + j, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows, head_dim, q_heads,
                                   kv_heads)
        scl = _mma_row_scales(mS, tile + j, lane, n_out, epilogue, head_dim)
        c = _mma_products(w_group[j], b, chunks, rows, fp8)
        best_val, best_idx = _mma_tile(c, tile + j, j, sAcc, rstd, best_val, best_idx, mY, mE, mPos, mCS, mSlot,
                                       mKC, mVC, mPartVal, mCounter, sLast, split, tidx, pre, warps, n_out,
                                       epilogue, rows, norm, head_dim, q_heads, kv_heads, splits, k, eps, sq_at,
                                       scl, mS)
    if cutlass.const_expr(loops):
        for cur in range(bidx + gdim, num_tiles, gdim):
            pre = _mma_epilogue_inputs(cur, lane, mPos, mCS, mSlot, mE, n_out, epilogue, rows, head_dim, q_heads,
                                       kv_heads)
            scl = _mma_row_scales(mS, cur, lane, n_out, epilogue, head_dim)
            c = _mma_products(w, b, chunks, rows, fp8)
            w = _mma_load_weights(mW, _next_tile(cur, gdim, num_tiles), 0, steps, warp, lane, n_out, chunks,
                                  epilogue, head_dim)
            best_val, best_idx = _mma_tile(c, cur, (cur - bidx) // gdim, sAcc, rstd, best_val, best_idx, mY,
                                           mE, mPos, mCS, mSlot, mKC, mVC, mPartVal, mCounter, sLast, 0, tidx,
                                           pre, warps, n_out, epilogue, rows, norm, head_dim, q_heads,
                                           kv_heads, 1, k, eps, sq_at, scl, mS)
    if cutlass.const_expr(epilogue == "argmax"):
        _mma_argmax_finish(mY, mPartVal, mPartIdx, mCounter, sLast, best_val, best_idx, tidx, bidx, gdim,
                           warps, grid, rows)


@_deferred.jit
def _mma_launch(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC, mMid, mLse,
                mKvLen, stream, k, n_out, epilogue, warps, chunks, pdl, grid, norm, eps, head_dim, q_heads,
                kv_heads, rows, splits, tile_group, merge, min_ctas):
    """The tensor-core form (bf16 weights; one row only where asked)."""
    _mma_kernel_compiled(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                         mMid, mLse, mKvLen, k, n_out, epilogue, warps, chunks, pdl, grid, norm, eps, head_dim,
                         q_heads, kv_heads, rows, splits, tile_group, merge, False, None).launch(
        grid=[grid, 1, 1], block=[warps * 32, 1, 1], stream=stream, use_pdl=pdl,
        min_blocks_per_mp=min_ctas)


@_deferred.jit
def _mma_launch_fp8(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC, mMid, mLse,
                    mKvLen, mS, stream, k, n_out, epilogue, warps, chunks, pdl, grid, norm, eps, head_dim, q_heads,
                    kv_heads, rows, splits, tile_group, merge, min_ctas):
    """The tensor-core form with fp8 weights (1 to 16 rows) and their row scales mS [n_rows] fp32."""
    _mma_kernel_compiled(mW, mX, mY, mE, mG, mPartVal, mPartIdx, mCounter, mPos, mCS, mSlot, mKC, mVC,
                         mMid, mLse, mKvLen, k, n_out, epilogue, warps, chunks, pdl, grid, norm, eps, head_dim,
                         q_heads, kv_heads, rows, splits, tile_group, merge, True, mS).launch(
        grid=[grid, 1, 1], block=[warps * 32, 1, 1], stream=stream, use_pdl=pdl,
        min_blocks_per_mp=min_ctas)


_MMA_PLAN_PARAMS = ("k", "n_out", "epilogue", "warps", "chunks", "pdl", "grid", "norm", "eps", "head_dim",
                    "q_heads", "kv_heads", "rows", "splits", "tile_group", "merge", "min_ctas")  # the launchers'
_MMA_KERNEL_PARAMS = (*_MMA_PLAN_PARAMS[:-1], "fp8")


_PLAN_PARAMS = ("n_out", "lanes", "chunks", "outs_per_group", "warps", "epilogue", "pdl", "grid",
                "staged", "norm", "eps", "head_dim", "q_heads", "kv_heads", "stages", "late_g",
                "min_ctas", "rows", "fp8", "merge")
_CONSTEXPR_PARAMS = {_gemv_kernel: _PLAN_PARAMS, _gemv_launch: _PLAN_PARAMS, _gemv_launch_fp8: _PLAN_PARAMS,
                     _mma_launch_fp8: _MMA_PLAN_PARAMS,
                     _rope_kv_store: ("head_dim", "q_heads", "kv_heads"),
                     _stage_tile: ("n_out", "lanes", "chunks", "outs_per_group", "groups_per_cta",
                                   "rows_per_out"),
                     _argmax_finish: ("warps", "grid"), _argmax_cta: ("warps",),
                     _argmax_finish_rows: ("warps", "grid", "lanes", "rows"),
                     _argmax_last_cta_rows: ("warps", "grid", "rows"),
                     _mma_kernel: _MMA_KERNEL_PARAMS, _mma_launch: _MMA_PLAN_PARAMS,
                     _mma_load_weights: ("n_out", "chunks", "epilogue", "head_dim"),
                     _mma_x_fragments: ("k", "warps", "chunks", "rows", "norm", "splits", "fp8"),
                     _mma_finish_split: ("n_out", "epilogue", "rows", "norm", "head_dim", "q_heads", "kv_heads",
                                         "splits", "k", "eps", "sq_at"),
                     _mma_rstd: ("k", "warps", "rows", "eps"), _mma_sq_to_smem: ("rows",),
                     _mma_store_sq: ("warps", "rows", "splits", "tile_group", "sq_at"),
                     _lane_rows_rstd: ("k", "warps", "rows", "eps"), _summed_rstd: ("k", "parts", "rows", "eps"),
                     _mma_tile: ("warps", "n_out", "epilogue", "rows", "norm", "head_dim", "q_heads",
                                 "kv_heads", "splits", "k", "eps", "sq_at"),
                     _mma_epilogue: ("n_out", "epilogue", "rows", "norm", "head_dim", "q_heads", "kv_heads"),
                     _mma_argmax_finish: ("warps", "grid", "rows"),
                     _merge_split_count: ("merge",), _merge_counts: ("rows", "merge"),
                     _merge_x: ("threads", "x_chunks", "rows", "merge"),
                     _dot_rows: ("lanes", "chunks", "x_chunks", "rows", "rows_in_flight", "norm", "eps", "vec"),
                     _fp8_partials: ("lanes", "chunks", "x_chunks", "rows", "rows_in_flight", "norm")}


# ---------------------------------------------------------------------------------------------
# The host side.

def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # tracing on a CPU machine: plan for the H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def _disk_key(plan: GemvPlan, device: torch.device) -> str | None:
    """The plan's file in cute_disk_cache (None off the GPU, with the cache off, or with a DSL
    that cannot load one)."""
    if device.type != "cuda" or cute_disk_cache.usable_dir() is None:
        return None
    props = torch.cuda.get_device_properties(device)
    version = dsl_version() or getattr(_dsl()["cutlass"], "__version__", "")
    return cute_disk_cache.kernel_key(plan, f"sm_{props.major}{props.minor} x{props.multi_processor_count}",
                                      version)


_ROPE_ALIGN = (8, 4, 8, 2, 2)  # position, table, slot, k pool, v pool (RopeKV.flat's order)
_COMPILED: dict = {}  # (plan, device) -> the compiled launcher (see CuteGemv.compile)
_DUMMY_NUMEL = 8  # the bf16 stand-in of an absent bias / norm weight / pool (one 16-byte load)


@dataclasses.dataclass(frozen=True)
class _HostDevice:
    """Where a stand-in GEMV traces (CuteGemv.stand_in): the host, without torch."""
    type: str = "cpu"


_HOST = _HostDevice()


def _buffer_sizes(p: GemvPlan) -> tuple[int, int]:
    """A plan's partials and counters: the argmax's per-CTA partials (one counter), or
    split-K's fp32 sums of each CTA's K (a lane's slots) and a counter a tile; else one of each."""
    if p.splits > 1:  # with the norm, each part's sums of x^2 after them (`_split_sq_at`)
        partials = _split_sq_at(p.num_tiles, p.splits, p.rows)
        return partials + (p.num_tiles * p.splits * MMA_ROWS if p.norm else 0), p.num_tiles
    return (p.grid * p.rows if p.epilogue == "argmax" else 1), 1


class CuteGemv:
    """One compiled GEMV for a fixed weight shape [N, K] and epilogue; call it with tensors.

    `gemv(x, weight, extra)` with x [M, K] (M = `rows`, 1 by default) -> y (bf16 [M, N], or
    [M, N/2] for silu_mul) or the tokens (int32 [M] for argmax). `extra` is the bias [N] (bias,
    bias_rope_kv: the layer's one bias, added to every row) or the residual [M, N] (residual:
    may be `out` itself, updated in place), else None. With norm=True the call also takes
    `norm_weight` [K] and multiplies RMSNorm(x) * norm_weight (each row its own rstd) instead of
    x. The argmax counter and partials belong to this object: do not run one object on two
    streams at once.

    The rope epilogues (`rope=RopeShape(...)`) take `rope_kv=RopeKV(...)` at the call: out is
    [M, N] with the q and k heads rotated, each row at its own position, and each row's k and v
    heads go into the pool at its own slot.
    """

    def __init__(self, n_rows: int, k: int, epilogue: str = "none", *, device="cuda",
                 pdl: bool = False, max_loads: int = 16, staged: bool | None = None,
                 norm: bool = False, eps: float = 1e-6, rope: RopeShape | None = None, rows: int = 1,
                 fp8: bool = False, **knobs):
        """rows: decode rows per call (1 to MAX_ROWS, compiled in). fp8: the weight is e4m3
        [N, K] and each call passes its row scales (`scale=`, fp32 [N]). knobs: plan_gemv's plan
        overrides (warps, outs_per_group, ctas_per_sm, stages, late_g, min_ctas_per_sm, tuned);
        by default TUNED_PLANS or the heuristic decide."""
        device = torch.device(device)
        self._setup(device, plan_gemv(n_rows, k, epilogue, num_sms=_num_sms(device), pdl=pdl,
                                      max_loads=max_loads, staged=staged, norm=norm, eps=eps,
                                      rope=rope, rows=rows, fp8=fp8, **knobs))

    @classmethod
    def stand_in(cls, plan: GemvPlan) -> CuteGemv:
        """A GEMV that only traces a plan made elsewhere, with stand-ins on the host (no buffers,
        no GPU, no torch): what cute_precompile's workers compile and export."""
        gemv = cls.__new__(cls)
        gemv.device, gemv.plan = _HOST, plan
        gemv._compiled, gemv.compile_seconds, gemv.from_disk = None, None, False
        return gemv

    def _setup(self, device: torch.device, plan: GemvPlan) -> None:
        """The plan's own buffers (the argmax's partials, split-K's sums and counters)."""
        self.device, self.plan = device, plan
        f32, i32 = torch.float32, torch.int32
        parts, counters = _buffer_sizes(plan)
        self._parts_val = torch.zeros(parts, dtype=f32, device=self.device)
        self._parts_idx = torch.zeros_like(self._parts_val, dtype=i32)
        self._counter = torch.zeros(counters, dtype=i32, device=self.device)  # the kernel resets them
        self._dummy = torch.zeros(_DUMMY_NUMEL, dtype=torch.bfloat16, device=self.device)
        self._dummy_parts = SplitPartials(torch.zeros(VEC, dtype=f32, device=self.device),
                                          torch.zeros(VEC, dtype=f32, device=self.device),
                                          torch.zeros(4, dtype=i32, device=self.device), ())
        self._dummy_rope = RopeKV(torch.zeros(2, dtype=torch.int64, device=self.device),
                                  torch.zeros(4, dtype=f32, device=self.device),
                                  self._dummy, self._dummy,
                                  torch.zeros(2, dtype=torch.int64, device=self.device))
        self._compiled = None
        self.compile_seconds: float | None = None
        self.from_disk = False  # the launcher was loaded from cute_disk_cache, not compiled

    def out_like(self) -> torch.Tensor:
        """A new output tensor of the right shape and dtype: [M, outputs], or int32 [M] tokens."""
        if self.plan.epilogue == "argmax":
            return torch.zeros(self.plan.rows, dtype=torch.int32, device=self.device)
        return torch.empty(self.plan.rows, self._out_numel, dtype=torch.bfloat16, device=self.device)

    @property
    def _out_numel(self) -> int:
        """Outputs stored per decode row: n_out, or every row of W for the rope epilogues."""
        return self.plan.n_rows if self.plan.rope else self.plan.n_out

    @property
    def _extra_numel(self) -> int:
        """The bias is the layer's (one for all rows); the residual is each row's."""
        return self._out_numel * (self.plan.rows if self.plan.epilogue == "residual" else 1)

    def _check(self, x, weight, extra, out, norm_weight, rope_kv=None, scale=None):
        """Refuse, before any launch, what the compiled layouts would misread."""
        p = self.plan

        def bad(t, numel, dtype):  # the kernel assumes contiguous, 16-byte aligned tensors
            return t.numel() != numel or t.dtype != dtype or not t.is_contiguous() or t.data_ptr() % 16

        if weight.shape != (p.n_rows, p.k) or bad(weight, p.n_rows * p.k, p.weight_dtype):
            raise ValueError(f"weight must be a contiguous, 16-byte aligned {p.weight_dtype} [{p.n_rows}, {p.k}] "
                             f"(nn.Linear's layout), got {weight.dtype} {tuple(weight.shape)}")
        if p.fp8 != (scale is not None):
            raise ValueError(f"a GEMV planned with fp8={p.fp8} {'needs' if p.fp8 else 'takes no'} scale")
        if scale is not None and (scale.shape != (p.n_rows,) or bad(scale, p.n_rows, torch.float32)):
            raise ValueError(f"scale must be a contiguous, 16-byte aligned float32 [{p.n_rows}] (one per "
                             f"weight row), got {scale.dtype} {tuple(scale.shape)}")
        if p.merge:
            if not isinstance(x, SplitPartials):
                raise ValueError(f"a merge GEMV's x is the attention's SplitPartials, got {type(x).__name__}")
            if not same_split_rule(x.rule, p.merge):  # (the group of splits a round is the GEMV's own)
                raise ValueError(f"partials split by {tuple(x.rule)} given to a GEMV that merges "
                                 f"{p.merge}: it would count or read the splits wrong")
            slots, heads = p.rows * p.merge[0], p.k // p.merge[3]
            for name, t, numel, dtype in (("mid_o", x.mid_o, slots * p.k, partial_dtype(p.merge)),
                                          ("mid_lse", x.mid_lse, slots * heads, torch.float32),
                                          ("kv_lens", x.kv_lens, p.rows, torch.int32)):
                if t.numel() < numel or t.dtype != dtype or not t.is_contiguous() or t.data_ptr() % 16:
                    raise ValueError(f"SplitPartials.{name} must be a contiguous, 16-byte aligned {dtype} of at "
                                     f"least {numel}, got {t.dtype} {tuple(t.shape)}")
        elif bad(x, p.rows * p.k, torch.bfloat16):
            raise ValueError(f"x must be a contiguous, 16-byte aligned bf16 [rows={p.rows}, {p.k}], "
                             f"got {x.dtype} {tuple(x.shape)}")
        wants_extra = p.epilogue in ("bias", "residual", "bias_rope_kv")
        if wants_extra != (extra is not None):
            raise ValueError(f"epilogue {p.epilogue!r} {'needs' if wants_extra else 'takes no'} extra tensor")
        if extra is not None and bad(extra, self._extra_numel, torch.bfloat16):
            what = "residual [rows, N]" if p.epilogue == "residual" else "bias [N] (shared by the rows)"
            raise ValueError(f"{p.epilogue}: the {what} must be a contiguous, 16-byte aligned bf16 tensor of "
                             f"{self._extra_numel}, got {extra.dtype} {tuple(extra.shape)}")
        if (p.rope is not None) != (rope_kv is not None):
            raise ValueError(f"epilogue {p.epilogue!r} {'needs' if p.rope else 'takes no'} rope_kv")
        if rope_kv is not None:
            rope_kv.check(p.rope, bad, p.rows)
        if p.norm != (norm_weight is not None):
            raise ValueError(f"a GEMV planned with norm={p.norm} {'needs' if p.norm else 'takes no'} norm_weight")
        if norm_weight is not None and bad(norm_weight, p.k, torch.bfloat16):
            raise ValueError(f"norm_weight must be a contiguous, 16-byte aligned bf16 tensor of {p.k}, "
                             f"got {norm_weight.dtype} {tuple(norm_weight.shape)}")
        shape, dtype = (((p.rows,), torch.int32) if p.epilogue == "argmax"
                        else ((p.rows, self._out_numel), torch.bfloat16))
        if tuple(out.shape) != shape or bad(out, math.prod(shape), dtype):
            raise ValueError(f"out must be a contiguous, 16-byte aligned {dtype} {shape}, "
                             f"got {out.dtype} {tuple(out.shape)}")

    def _args(self, x, weight, extra, out, norm_weight, rope_kv=None, scale=None):
        """The launcher's tensor arguments (fp8: the row scales last)."""
        d = _dsl()
        p = self.plan
        def aligned(t):  # detached: DLPack refuses a tensor that requires grad (a Parameter)
            return d["from_dlpack"](t.detach(), assumed_align=16)

        v = p.vec  # weights a 16-byte chunk (x and g: 8 bf16 a chunk whatever the weights)
        scales = [aligned(scale)] if p.fp8 else []
        norm_weight = norm_weight.view(p.k // VEC, VEC) if norm_weight is not None else self._dummy.view(1, VEC)
        # the merge inputs (`merge_in`: each row's splits' partials; dummies without merge)
        parts = x if p.merge else self._dummy_parts
        slots = p.rows * p.merge[0] if p.merge else 1
        heads = p.k // p.merge[3] if p.merge else VEC
        merge = [aligned(parts.mid_o.view(-1)[: slots * p.k if p.merge else VEC].view(-1, VEC)),
                 aligned(parts.mid_lse.view(-1)[: slots * heads]),
                 d["from_dlpack"](parts.kv_lens.view(-1)[: p.rows if p.merge else 1], assumed_align=4)]
        x = self._dummy if p.merge else x
        return [aligned(weight.view(p.n_rows, p.k // v, v)),
                aligned(x.reshape(-1, VEC) if p.merge else x.reshape(p.rows * p.k // VEC, VEC)),
                aligned(out.view(-1)), aligned(extra.view(-1) if extra is not None else self._dummy),
                aligned(norm_weight),
                d["from_dlpack"](self._parts_val, assumed_align=4),
                d["from_dlpack"](self._parts_idx, assumed_align=4),
                d["from_dlpack"](self._counter, assumed_align=4),
                *(d["from_dlpack"](t.detach(), assumed_align=a)  # scalar reads: element alignment
                  for t, a in zip((rope_kv or self._dummy_rope).flat(), _ROPE_ALIGN)), *merge, *scales]

    def _stream(self):
        d = _dsl()
        handle = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        return d["cuda"].CUstream(handle)

    def _fake_args(self):
        """Global-memory stand-ins with the call's shapes, for tracing on a machine without a
        GPU (from_dlpack of a CPU tensor would give generic pointers, which cp.async refuses)."""
        d = _dsl()
        p = self.plan
        c = d["cutlass"]

        def fake(dtype, shape, align):
            return d["make_fake"](dtype, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                  assumed_align=align)

        out_shape = (p.rows,) if p.epilogue == "argmax" else (p.rows * self._out_numel,)
        extra_shape = (self._extra_numel,) if p.epilogue in ("bias", "residual", "bias_rope_kv") else (_DUMMY_NUMEL,)
        parts, counters = _buffer_sizes(p)
        r = p.rope
        rope_shapes = ([(p.rows,), (r.table_rows * r.head_dim,), (p.rows,),
                        (r.cache_slots * r.num_kv_heads * r.head_dim,)] if r else [(2,), (4,), (2,), (8,)])
        v = p.vec
        scales = [fake(c.Float32, (p.n_rows,), 16)] if p.fp8 else []
        slots, heads = (p.rows * p.merge[0], p.k // p.merge[3]) if p.merge else (1, VEC)
        mid = c.BFloat16 if p.merge and p.merge[5] == "bf16" else c.Float32
        merge = [fake(mid, (slots * p.k // VEC if p.merge else 1, VEC), 16),
                 fake(c.Float32, (slots * heads,), 16), fake(c.Int32, (p.rows if p.merge else 1,), 4)]
        return [fake(c.Float8E4M3FN if p.fp8 else c.BFloat16, (p.n_rows, p.k // v, v), 16),
                fake(c.BFloat16, (1, VEC) if p.merge else (p.rows * p.k // VEC, VEC), 16),
                fake(c.Int32 if p.epilogue == "argmax" else c.BFloat16, out_shape, 16),
                fake(c.BFloat16, extra_shape, 16),
                fake(c.BFloat16, (p.k // VEC, VEC) if p.norm else (1, VEC), 16),
                fake(c.Float32, (parts,), 4), fake(c.Int32, (parts,), 4), fake(c.Int32, (counters,), 4),
                *(fake(dtype, shape, align) for dtype, shape, align in
                  zip((c.Int64, c.Float32, c.Int64, c.BFloat16, c.BFloat16),
                      (*rope_shapes, rope_shapes[3]), _ROPE_ALIGN)), *merge, *scales]

    def compile(self, rope_kv: RopeKV | None = None) -> float:
        """Compile for this plan (once a process: objects with the same plan on the same device
        share the compiled kernel, which holds no tensor; on a GPU, once a machine: the launcher
        is kept on disk, cute_disk_cache); returns the seconds it took (0 when the kernel was
        compiled before in this process; `from_disk` says whether it was loaded). rope_kv: the
        call's own step tensors, so that compiling a rope variant allocates no stand-in of a
        pool layer's size."""
        key = (self.plan, str(self.device))
        if self._compiled is None and key in _COMPILED:
            self._compiled, self.compile_seconds = _COMPILED[key], 0.0
        if self._compiled is None:
            t0 = time.perf_counter()
            disk_key = _disk_key(self.plan, self.device)
            self._compiled = cute_disk_cache.load(disk_key) if disk_key else None
            if self._compiled is None and disk_key:  # a worker's, where one is at it
                self._compiled = cute_precompile.load(disk_key)
            self.from_disk = self._compiled is not None
            if self._compiled is None:
                self._compiled = self._compile_now(rope_kv)
                if disk_key:
                    cute_disk_cache.store(disk_key, self._compiled)
            self.compile_seconds = time.perf_counter() - t0
            _COMPILED[key] = self._compiled
        return self.compile_seconds

    def _compile_now(self, rope_kv: RopeKV | None):
        """cute.compile of this plan's launcher, traced with stand-ins of the call's shapes."""
        d = _dsl()
        p = self.plan
        if self.device.type == "cuda":
            # Stand-ins with the call's shapes: layouts are compiled in, pointers are arguments.
            slots = p.rows * p.merge[0] if p.merge else 0
            x = (SplitPartials(torch.zeros(slots * p.k, dtype=partial_dtype(p.merge), device=self.device),
                               torch.zeros(slots * p.k // p.merge[3], dtype=torch.float32, device=self.device),
                               torch.ones(p.rows, dtype=torch.int32, device=self.device), p.merge)
                 if p.merge else torch.empty(p.rows, p.k, dtype=torch.bfloat16, device=self.device))
            w = torch.empty(p.n_rows, p.k, dtype=p.weight_dtype, device=self.device)
            scale = torch.empty(p.n_rows, dtype=torch.float32, device=self.device) if p.fp8 else None
            extra = (torch.empty(self._extra_numel, dtype=torch.bfloat16, device=self.device)
                     if p.epilogue in ("bias", "residual", "bias_rope_kv") else None)
            g = torch.empty(p.k, dtype=torch.bfloat16, device=self.device) if p.norm else None
            args = self._args(x, w, extra, self.out_like(), g,
                              rope_kv or RopeKV.like(p.rope, self.device, p.rows), scale)
        else:
            args = self._fake_args()
        launcher = ("launcher_mma" if p.mma else "launcher") + ("_fp8" if p.fp8 else "")
        params = _MMA_PLAN_PARAMS if p.mma else _PLAN_PARAMS
        return d["cute"].compile(d[launcher], *args, self._stream(), *(getattr(p, name) for name in params))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None = None,
                 *, out: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 rope_kv: RopeKV | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        out = self.out_like() if out is None else out
        self._check(x, weight, extra, out, norm_weight, rope_kv, scale)
        self.compile(rope_kv)
        self._compiled(*self._args(x, weight, extra, out, norm_weight, rope_kv, scale), self._stream())
        return out


@dataclasses.dataclass
class RopeKV:
    """The rope epilogues' step tensors: positions [M] int64 (one per decode row), the fp32
    cos | sin table [table_rows, D], one layer's pool k_cache / v_cache [pages, page_size, Hkv,
    D] bf16 (contiguous: slot s is row s of the flat [pages * page_size, Hkv, D] view) and
    slot_mapping [M] int64 (each row's slot; a negative slot skips that row's pool write)."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def flat(self) -> list[torch.Tensor]:
        """In the kernel's argument order: position, table, slot, k pool, v pool (1-D views)."""
        return [self.positions.view(-1), self.cos_sin_cache.view(-1), self.slot_mapping.view(-1),
                self.k_cache.view(-1), self.v_cache.view(-1)]

    def check(self, shape: RopeShape, bad, rows: int = 1) -> None:
        d, hkv = shape.head_dim, shape.num_kv_heads
        pool = shape.cache_slots * hkv * d
        for name, t, numel, dtype in (("positions", self.positions, rows, torch.int64),
                                      ("slot_mapping", self.slot_mapping, rows, torch.int64),
                                      ("cos_sin_cache", self.cos_sin_cache, shape.table_rows * d, torch.float32),
                                      ("k_cache", self.k_cache, pool, torch.bfloat16),
                                      ("v_cache", self.v_cache, pool, torch.bfloat16)):
            per_row = name in ("positions", "slot_mapping")
            if not per_row and (bad(t, numel, dtype) or t.shape[-1] != d):
                raise ValueError(f"{name} must be a contiguous, 16-byte aligned {dtype} of {numel} elements "
                                 f"(rows of head_dim {d}), got {t.dtype} {tuple(t.shape)}")
            if per_row and (t.numel() != rows or t.dtype != dtype or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {dtype} of {rows} (one per decode row), "
                                 f"got {t.dtype} {tuple(t.shape)}")
        if self.k_cache.dim() > 2 and tuple(self.k_cache.shape[-2:]) != (hkv, d):
            raise ValueError(f"k_cache rows must be [Hkv={hkv}, D={d}], got {tuple(self.k_cache.shape)}")

    @staticmethod
    def like(shape: RopeShape | None, device, rows: int = 1) -> RopeKV | None:
        """Stand-ins with the compiled shapes (compile time only)."""
        if shape is None:
            return None
        pool = (shape.cache_slots, shape.num_kv_heads, shape.head_dim)
        return RopeKV(torch.zeros(rows, dtype=torch.int64, device=device),
                      torch.zeros(shape.table_rows, shape.head_dim, dtype=torch.float32, device=device),
                      torch.zeros(pool, dtype=torch.bfloat16, device=device),
                      torch.zeros(pool, dtype=torch.bfloat16, device=device),
                      torch.zeros(rows, dtype=torch.int64, device=device))


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, epilogue: str = "none",
                   extra: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   eps: float = 1e-6, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The slow obvious answer in fp32 on the same bf16 inputs, x [M, K] (or [K]) -> [M, N]
    (argmax: the fp32 logits' argmax per row, int32 [M]). extra: the bias [N] (every row) or
    the residual [M, N]. With norm_weight: of RMSNorm(x) * norm_weight per row, kept in fp32
    (as the kernel keeps it). With scale (fp32 [N]): weight is fp8 and W = weight * scale per
    row, dequantized in fp32 (the numerics of quantization.dequant_linear)."""
    x = x.float().reshape(-1, weight.shape[1])
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.float()
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    y = x @ w.t()
    if epilogue in ("bias", "residual"):
        y = y + extra.float().reshape(-1, y.shape[-1])
    if epilogue == "silu_mul":
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    if epilogue == "argmax":
        return y.argmax(dim=-1).to(torch.int32)
    return y


def rope_kv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      rope: RopeShape, rope_kv: RopeKV, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, dtype: torch.dtype | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """The rope epilogues the slow obvious way, row by row of x [M, K]: y = W x (+ b) in fp32
    (x RMS-normalised first with norm_weight), q and k heads rotated in fp32 with the fp32 table
    row at the row's position (rotate-half, as `TorchOps.rope`), rounded once to dtype (None:
    bf16, the kernel's; fp32 for the CPU wiring tests); k and v heads copied into the pool at the
    row's slot (skipped when negative). scale: fp8 weights' row scales (gemv_reference's).
    Returns y [M, N]; the pool is updated in place."""
    dtype = torch.bfloat16 if dtype is None else dtype
    y = gemv_reference(x, weight, "none", norm_weight=norm_weight, eps=eps, scale=scale)
    if bias is not None:
        y = y + bias.float().reshape(1, -1)
    d, hq, hkv = rope.head_dim, rope.num_q_heads, rope.num_kv_heads
    heads = y.view(y.shape[0], hq + 2 * hkv, d)
    cos, sin = rope_kv.cos_sin_cache[rope_kv.positions.reshape(-1)].float()[:, None].chunk(2, dim=-1)
    x1, x2 = heads[:, : hq + hkv].chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = torch.cat((rotated, heads[:, hq + hkv:]), dim=1).to(dtype)
    for m, slot in enumerate(rope_kv.slot_mapping.reshape(-1).tolist()):
        if slot >= 0:
            rope_kv.k_cache.view(-1, hkv, d)[slot] = out[m, hq: hq + hkv].to(rope_kv.k_cache.dtype)
            rope_kv.v_cache.view(-1, hkv, d)[slot] = out[m, hq + hkv:].to(rope_kv.v_cache.dtype)
    return out.reshape(out.shape[0], -1)
