"""The fused decode path for 1 to 16 rows: a few kernels a layer where the per-op path runs ten.

A pure-decode step of M <= SERVED_ROWS rows (sequences; or a verify step's query tokens, each a
decode row of its own: `verify_as_decode_rows`; SERVED_ROWS is where a fused step was measured
faster than per-op, MAX_ROWS the kernel's limit) runs, per layer, each GEMV reading its weights
once for all M rows,
    QKV GEMV with the RMSNorm folded in (+ bias)         one CuTe kernel (cute_gemv, norm=True)
    (Qwen3: + per-head q/k RMSNorm) RoPE + K/V write   the pool's fused kernel (write_rope), or
                                                         the QKV GEMV's epilogue (kv_pool given)
    decode attention                                     triton's one-launch split-KV (whatever
                                                         the step backend is)
    O GEMV + residual add, written in place              one CuTe kernel
    gate+up GEMV with the RMSNorm folded in + SiLU-mul   one CuTe kernel
    down GEMV + residual add, written in place           one CuTe kernel (K <= MAX_DOWN_K), else
                                                         one cuBLAS GEMM into the residual (addmm_)
and then the final RMSNorm + LM head (logits), or + argmax (the greedy token) in one kernel
(where the head's K is too wide for that GEMV, `wide_head`: the norm, cuBLAS and an argmax).
Six to seven kernels a layer where the per-op path runs about ten, and the GEMVs stream at
several times cuBLAS's bandwidth on these skinny shapes (FUSED_NOTES.md).

The residual stream lives in one buffer that the O and down GEMVs update in place, so no
separate add or norm kernel runs: where the per-op path keeps (x, residual) and adds them in
the next norm, here the residual epilogue adds, and the next GEMV's prologue normalises.
Rounding differs from the per-op path (products and the norm stay in fp32 until each GEMV's
output is rounded once), so logits agree to bf16 precision, not bit for bit.

With pdl=True every GEMV launches with Programmatic Dependent Launch: it starts while its
predecessor drains, loads its weights (and the norm's), then waits (`griddepcontrol.wait`)
before reading x or the residual and before any store. Only a CuTe GEMV that follows another
(O -> gate+up -> down -> next layer's QKV) overlaps; after a Triton kernel (RoPE + K/V write,
attention), which never signals early, it waits for that kernel's end as usual.

The GEMVs take the model's own weight tensors (fused QKV and gate|up already), no copies. The
step's buffers belong to this object and keep their addresses, so the CUDA graph the runner
captures around `logits` / `token` replays them. The CuTe DSL is imported when this object is
built; `CuteUnavailable` says how to install it.

With a kv_pool (`FusedParts.rope`) the QKV GEMV also applies RoPE to the q and k
heads and writes k and v into the pool (the `bias_rope_kv` / `rope_kv` epilogue: a lane group
owns both rows of a rotate-half pair), so the attention backend only attends
(`AttentionBackend.attend`): one kernel and one dependent boundary fewer a layer. The rounding
differs from the two-kernel path once more: q and k are rotated from the fp32 sums, not from
their bf16 rounding (FUSED_NOTES.md, "Stage 2, plan A").

With one_launch_attention (`FusedParts.attn`) attention is one kernel a layer
(`TritonBackend.attend_one_launch`: split-KV whose last split program merges) instead of a split
kernel and a merge kernel, from the step backend where it is triton, else from a triton backend
of the fused path's own over the same pool (the runner's `fused_attention`: FlashInfer, which
auto may pick for prefill, has no one-launch form); with pdl too it and the step's first kernel (the
embedding gather, `kernels/embedding.py`) take part in PDL, so the O GEMV after attention and
layer 0's QKV GEMV load their weights while their predecessors run (FUSED_NOTES.md, "Stage 2,
plan C"). Without pdl the embedding is `torch.index_select`, as before.

Several rows: the GEMVs come in one set per row count the runner pads decode steps to
(`Gemvs`, `row_counts`); the embedding gather, the QKV epilogue's RoPE + K/V write (each row at
its own position and slot) and the one-launch attention (each row over its own pages) take all M
rows; the argmax writes M int32 tokens, cast once to the engine's int64.

FP8 weights (`--quantization fp8`, an FP8 checkpoint: the four projections are `QuantizedWeight`s)
stream through the GEMVs' fp8 form (`CuteGemv(..., fp8=True)`: e4m3 codes, 16 a 16-byte load,
each sum scaled by its row's scale; `_weight` hands a GEMV the codes and scales), weight-only as
the per-op path; the LM head stays bf16 (an fp8 one cost SmolLM2 5.4 more points of agreement
and took its perplexity past +3% over bf16: quantization.py). Widths must
then be multiples of 16 (`refusals`). `EngineConfig.fused_decode_fp8_mma` (`--fused-decode-fp8-mma`;
auto: the shapes in FP8_MMA_SHAPES, where it measured faster) puts the
fp8 GEMVs on the tensor cores (`CuteGemv(..., fp8=True, mma=True)`, every row count) where every
width is a multiple of 64, and lets the fp8 path serve SERVED_ROWS rows. With fp8 weights auto
turns the path on as for bf16 (the GPU tests hold it to the per-op fp8 path's tokens,
tests/gpu/test_gpu_fused_fp8.py): one stream measured 1,953 tok/s at the 0.5B shape against
per-op's 951, 1,005 against 610 at the 1.5B, 342 against 304 at the 7B and 307 against 300 at
Llama-3.1-8B's (FUSED_NOTES.md, "Issue 31").

The runner builds this object where `EngineConfig.fused_decode` asks for it (True) or leaves it
to auto (None): then only where `auto_declines` finds nothing against it; each of pdl, the
RoPE epilogue and the one-launch attention is on where it applies (`FusedParts`: not a user
setting; tests and measurements name one variant through `Engine(..., fused_parts=)`).
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from flashlet.attention.selection import Platform, fused_decline
from flashlet.kernels import cute_precompile
from flashlet.kernels.cute_gemv import (FP8_VEC, MAX_ROWS, MMA_K, MMA_K_FP8, CuteGemv, CuteUnavailable, RopeKV,
                                        PARTIAL_DTYPES, RopeShape, SplitPartials, VEC, cute_available, lanes_for,
                                        plan_gemv)
from flashlet.models import quantization
from flashlet.models.quantization import QuantizedWeight, is_quantized
from flashlet.runner.batch import StepLayout


# The longest down projection (K = intermediate_size) the one-row GEMV streams well: each output
# row is one lane group's walk over all of K, with no split-K, so a long K leaves most of the
# GPU idle (Qwen2.5-1.5B's 8,960 ran faster than per-op, Qwen2.5-7B's 18,944 ~12x slower:
# BENCHMARKS.md). Past it the fused step runs that one GEMV on cuBLAS (split-K), accumulating
# into the residual stream in place, and keeps the rest fused.
MAX_DOWN_K = 16_384

# The most 16-byte chunks of x a lane may hold in the one-row GEMVs that fold the RMSNorm in
# (QKV, gate+up: x, the norm's weight g and the weights, each C chunks a lane, held at once).
# Past it bf16's one row takes the tensor-core form instead (`bf16_one_row_tensor_cores`), and auto
# declines the path but at the shapes measured faster fused (BF16_ONE_ROW_MMA_SHAPES). Measured on the H200, one stream (2026-12-02, spec_bench's
# plain row and profile_step at the Qwen2.5-7B shape, hidden 3,584: 14 chunks): 45.8 ms a step
# fused (22 tok/s) against per-op's 4.50 (222); its gate+up GEMV took 1.38 ms for 272 MB and
# QKV 182 us for 33 MB (~0.19 TB/s each), while the down projection on cuBLAS took 44 us and O
# (no norm, also 14 chunks) 29 us. At 8 (Llama-3.2-1B, hidden 2,048) the path ran at 1,156
# tok/s, 67% of its byte limit. Nothing between 8 and 14 was measured on the CUDA cores, nor
# above 14 (Llama-3.1-8B / Mistral-7B 16, Qwen2.5-14B 20).
MAX_NORM_CHUNKS = 8

# MAX_ROWS (cute_gemv's): the most decode rows (sequences, or a verify step's query tokens) one
# fused step can compute: a GEMV of up to 16 rows is still bound by its weight bytes (`rows=`).

# The most rows the fused path SERVES: the row counts where a fused step was measured faster than
# the per-op one. The one place to change when the M-row GEMVs change (up to MAX_ROWS).
# Measured on the H200, Qwen2.5-0.5B shape, random weights, time a step, fused against per-op:
#   with the CUDA-core M-row GEMVs (2026-12-02 ~04:10 UTC, 874a93a): 4 rows 0.905 ms fused against
#   1.08 per-op; 16 rows 2.97 against 1.23 (per-op past 4 rows);
#   with the tensor-core ones (2026-12-02 ~08:30 UTC, profile_step --prompt-len 400, PDL, RoPE
#   and one-launch attention): 4 rows 0.690 ms, 16 rows 0.864 (per-op 1.23)    -> fused up to 16
SERVED_ROWS = 16
# fp8 weights on the CUDA-core M-row GEMVs (outside FP8_MMA_SHAPES, or asked for), whose 8- and
# 16-row steps measured slower than per-op (the first line above); their tensor-core form
# (`fp8_tensor_cores`) serves SERVED_ROWS.
SERVED_ROWS_FP8 = 4
# bf16 shapes in BF16_ONE_ROW_MMA_SHAPES (7B-class widths, where per-op's cuBLAS is the
# alternative at every row count): the most rows a fused step serves there. Qwen2.5-7B on an
# H100 (session 64, 2026-12-07, `gpu_run.sh bf16-mma-ab`, the closed loop of 32 requests, per-op
# against the fused path up to 16 rows): c = 1 171 -> 182 tok/s, c = 4 647 -> 670, c = 16 2,209
# -> 1,070 (ITL 6.14 -> 13.8 ms: the 16-row M-row GEMVs' layer chain 467 us alone against 169 at 4
# rows, `gemv_sweep.py --config qwen2.5-7b --rows 16`). 8 against 4 (session 65, one H100,
# `served-rows-ab`): c = 8 1,239 against 1,225, c = 16 2,204 against 2,208 (noise; 4 kept).
SERVED_ROWS_BF16_LARGE = 4
# fp8 weights on the tensor cores at a shape of FP8_MMA_SHAPES (the 7B's): the most rows a fused
# step serves there. Qwen2.5-7B on an H100 (session 65, 2026-12-07, `SERVED_ARGS="--quantization
# fp8" gpu_run.sh served-rows-ab`, the closed loop of 32 requests, one call): c = 8 fused 1,693 /
# 1,696 tok/s against 1,584 with 5-8 rows per-op (+7%); c = 16 16-row fused steps 2,469 against
# 2,775 with 9-16 rows per-op (-11%; per-op's cuBLAS 2,776 without the DSL, another call).
SERVED_ROWS_FP8_LARGE = 8

# Fused steps whose RoPE is not in the QKV epilogue (Qwen3's, whose per-head norms keep it out)
# normalise and rotate q and each row's newest k, and write its K/V row, inside the one-launch
# attention (`TritonBackend.attend_one_launch(rope_in=)`) instead of the pool's RoPE + K/V write
# kernel before it: one kernel a layer fewer, and the attention follows the QKV GEMV in the PDL
# chain (FUSED_NOTES.md, "RoPE in the attention kernel"). On by default ("1") where the epilogue
# does not apply: measured on the H200 (2026-12-05, through LLM.generate), Qwen3-0.6B one stream
# 1,306 -> 1,473 tok/s, four 4,714 -> 5,737, sixteen 15,976 -> 16,630; Qwen3-1.7B one stream
# 674 -> 701. $FLASHLET_ROPE_IN_ATTENTION for a fresh process (an A/B): "0" off; "all" also where
# the epilogue would apply (measured at Qwen2.5-0.5B: one stream 2,246 -> 2,150, four level,
# sixteen -2%: the epilogue stays there).
ROPE_IN_ATTENTION_ENV = "FLASHLET_ROPE_IN_ATTENTION"
ROPE_IN_ATTENTION = os.environ.get(ROPE_IN_ATTENTION_ENV, "1")
if ROPE_IN_ATTENTION not in ("0", "1", "all"):
    raise ValueError(f"{ROPE_IN_ATTENTION_ENV}={ROPE_IN_ATTENTION!r}: expected 0, 1 or all")

# The one-launch attention launches with Programmatic Dependent Launch like the GEMVs around it:
# its programs start while the QKV GEMV still runs, load their page ids and first K/V blocks, and
# wait for q. $FLASHLET_ATTENTION_PDL (a fresh process; an A/B, `gpu_run.sh attn-pdl-ab`): "0"
# launches it in plain stream order instead, "one-row" so on steps of several rows only (the
# candidate rule should the A/B find PDL's early start pays at one row and costs at more). The
# question it answers: under the pinned Triton (3.7.1) the attention needs 128 registers a thread
# against 3.6's 185, so twice as many of its programs fit beside the GEMV's blocks, and the closed
# loop at 4 / 16 rows read 5-6% slower although each kernel alone reads the same (FUSED_NOTES.md,
# session 41's outcomes).
ATTENTION_PDL_ENV = "FLASHLET_ATTENTION_PDL"
ATTENTION_PDL = os.environ.get(ATTENTION_PDL_ENV, "1")
if ATTENTION_PDL not in ("0", "1", "one-row"):
    raise ValueError(f"{ATTENTION_PDL_ENV}={ATTENTION_PDL!r}: expected 0, 1 or one-row")

# A step's attention leaves its split partials, and the O GEMV merges them in its prologue
# (`cute_gemv.merge_in`, `TritonBackend.attend_one_launch(partials_out=)`): the attention's tail
# (a CTA barrier, the counter's acq_rel atomic, the last program's loads of the partials and its
# store of x) leaves the chain, and each O CTA loads the partials where it loaded x (FUSED_NOTES.md,
# "Session 68" and "Session 69"). By default ("auto") at the shapes of MERGE_IN_O_SHAPES, each in
# the form measured best there; every other shape keeps the merge in the attention. On H100s
# (2026-12-07, `gpu_run.sh merge-in-o-ab`: one stream through LLM.generate after 1,000 tokens,
# two interleaved fresh-process pairs; `merge-rows-ab`: the closed loop, 128 new tokens):
# - Qwen2.5-0.5B, four warps a CTA: 1,739 / 1,742 -> 1,864 / 1,856 tok/s (+7%, a7a9116); O's own
#   plan (448 one-warp CTAs, each loading all the partials) 1,579 (-9%). Steps of up to four rows
#   too (O's M-row plan): the closed loop at c = 4 5,372 / 5,364 -> 5,650 / 5,666 tok/s (+5%), c = 1
#   and c = 16 level (session 69). Eight warps do not fit its K = 896 staged (57 KB of shared memory).
# - Qwen2.5-1.5B, eight warps and all 16 splits loaded in one round: 676.7 / 676.5 against four
#   warps and rounds of four 729.9 / 730.4 (+7.9%, session 69); four warps against the attention's
#   merge 632 / 631 -> 680 / 680 (+8%, a7a9116).
# - Qwen3-0.6B, eight warps (O's own plan's) and 16 splits a round: 1,224.5 / 1,226.1 -> 1,282.4 /
#   1,282.6 (+4.7%, session 69); four warps in rounds of four lost 6.5% (1,231 -> 1,151).
# - Not taken: Qwen3-1.7B 634.0 / 633.7 -> 612.4 / 612.3 and Llama-3.2-1B 985.5 / 984.1 -> 962.8 /
#   961.5 in the 1.5B's form (-3.4%, -2.3%, session 69).
# - TinyLlama-1.1B, eight warps, 16 splits a round and a looping grid of one CTA an SM (each
#   merging once for all its tiles): 967.7 / 969.5 -> 1,001.4 / 1,001.8 (+3.4%; the same without
#   the looping grid 975.8 / 975.4, +0.7%; session 71).
# - Refuted and removed in session 71: a fold of the splits in the attention before O (Llama-3.2-1B
#   977 -> 868 against "w8g16", Qwen3-1.7B 617 -> 479) and the long steps' merge in O (the 0.5B after
#   8,000 tokens 1,357 -> 1,251 "g16", 1,249 with the one-launch kernel's partials under PDL).
# $FLASHLET_MERGE_IN_O for a fresh process (an A/B, `gpu_run.sh merge-in-o-ab`): "0" off
# everywhere; "1" on at every shape with O's own plan; "w1" / "w2" / "w4" / "w8" on at every
# shape with that many warps a CTA, with "g8" / "g16" after it ("w8g16") that many splits
# loaded a round (4 otherwise: `cute_gemv.merge_in`), and with "c1" / "c2" / "c4" last ("w8g16c1")
# a looping grid of that many CTAs an SM, each merging once for all its tiles: fewer CTAs load
# the partials (Llama-3.2-1B's O launches 256 CTAs of eight warps, each loading all 128 KB).
# $FLASHLET_MERGE_IN_O_ROWS=N (1 to 8) merges steps of up to N rows wherever the merge is on
# ("auto": the shape's rows, 1 for a forced form).
# Past one row O keeps its M-row plan (the tensor cores at bf16) without its register cap, whose
# ~97 registers a thread the merge's loads overflow: the 0.5B's O at 2 / 4 / 8 rows lowers to 105 /
# 106 / 206 registers and no stack (sm_90a, this CPU), at 16 rows to 254 and 112 bytes of stack.
class MergeForm(NamedTuple):
    """How O merges the attention's partials at a shape: `warps` a CTA (None: O's own plan),
    `group` splits loaded a round (None: the attention's rule's 4), steps of up to `rows` rows,
    `ctas_per_sm` a looping grid (None: one CTA a tile)."""

    warps: int | None
    group: int | None
    rows: int
    ctas_per_sm: int | None = None


MERGE_IN_O_SHAPES = {  # (hidden size, intermediate size) -> "auto"'s form there
    (896, 4864): MergeForm(warps=4, group=None, rows=4),   # Qwen2.5-0.5B
    (1536, 8960): MergeForm(warps=8, group=16, rows=1),    # Qwen2.5-1.5B
    (1024, 3072): MergeForm(warps=8, group=16, rows=1),    # Qwen3-0.6B
    (2048, 5632): MergeForm(warps=8, group=16, rows=1, ctas_per_sm=1),  # TinyLlama-1.1B
}
MERGE_IN_O_ENV = "FLASHLET_MERGE_IN_O"
MERGE_IN_O = os.environ.get(MERGE_IN_O_ENV, "auto")
if not re.fullmatch(r"auto|0|1|w[1248](g(4|8|16))?(c[124])?", MERGE_IN_O):
    raise ValueError(f"{MERGE_IN_O_ENV}={MERGE_IN_O!r}: expected auto, 0, 1, or w1 / w2 / w4 / w8 with an "
                     "optional g4 / g8 / g16, then an optional c1 / c2 / c4")
MERGE_IN_O_ROWS_ENV = "FLASHLET_MERGE_IN_O_ROWS"
MERGE_IN_O_ROWS = os.environ.get(MERGE_IN_O_ROWS_ENV, "auto")
if not re.fullmatch(r"auto|[1-8]", MERGE_IN_O_ROWS):
    raise ValueError(f"{MERGE_IN_O_ROWS_ENV}={MERGE_IN_O_ROWS!r}: expected auto or 1 to 8 (rows a step merging in O)")
# The partials' dtype where the merge is in O ($FLASHLET_MERGE_PARTIALS, an A/B; fp32 until bf16 is
# measured): "bf16" halves the bytes each O CTA loads before its first product (at Qwen3-1.7B's
# and Llama-3.2-1B's O, 16 splits x 2,048 x 4 bytes = 128 KB a CTA at 1,000 tokens, where the merge
# in O lost 2-3%: FUSED_NOTES.md, "Session 69"), and adds one bf16 rounding of each split's output
# before the merge (the log-sum-exps stay fp32).
MERGE_PARTIALS_ENV = "FLASHLET_MERGE_PARTIALS"
MERGE_PARTIALS = os.environ.get(MERGE_PARTIALS_ENV, "fp32")
if MERGE_PARTIALS not in PARTIAL_DTYPES:
    raise ValueError(f"{MERGE_PARTIALS_ENV}={MERGE_PARTIALS!r}: expected one of {', '.join(PARTIAL_DTYPES)}")


def merge_form(shape: tuple[int, int]) -> MergeForm | None:
    """The merge in O at a model shape under MERGE_IN_O and MERGE_IN_O_ROWS (None: the attention
    merges its own partials)."""
    if MERGE_IN_O == "0":
        return None
    if MERGE_IN_O == "auto":
        form = MERGE_IN_O_SHAPES.get(shape)
    else:
        asked = re.fullmatch(r"w(\d+)(?:g(\d+))?(?:c(\d+))?", MERGE_IN_O)
        form = MergeForm(*(int(asked[i]) if asked and asked[i] else None for i in (1, 2)), 1,
                         int(asked[3]) if asked and asked[3] else None)
    if form is not None and MERGE_IN_O_ROWS != "auto":
        form = form._replace(rows=int(MERGE_IN_O_ROWS))
    return form


# fp8 weights on the fused path: the model shapes (hidden size, intermediate size) whose GEMVs take
# the tensor-core form where `EngineConfig.fused_decode_fp8_mma` is left to auto: those where it
# measured faster than the CUDA-core form. H200, one stream (`python3 -m flashlet.bench --config C
# --dtype bfloat16 --quiet --workload single --max-num-pages 8192 --quantization fp8
# [--fused-decode] [--[no-]fused-decode-fp8-mma]`, 2d38664 / a819160, 2026-12-04), tensor cores /
# CUDA cores / per-op tok/s: Qwen2.5-7B (3,584, 18,944) 342 / 329 / 304; Llama-3.1-8B (4,096,
# 14,336) 290 / 307 / 300; Qwen2.5-0.5B (896, 4,864) 1,903 / 1,953 / 951. No rule over the
# shape separates them yet (the 7B's down projection is per-op's, past MAX_DOWN_K; the 8B's a GEMV),
# so every other shape keeps the CUDA-core form.
FP8_MMA_SHAPES = {(3584, 18944)}


def model_shape(model) -> tuple[int, int]:
    """(hidden size, intermediate size): how FP8_MMA_SHAPES and BF16_ONE_ROW_MMA_SHAPES name a model."""
    return model.config.hidden_size, model.layers[0].down_proj.weight.shape[1]


def _ks_fit(model, k_step: int) -> bool:
    """Whether every GEMV's K (hidden, q, intermediate) is a multiple of the tensor-core form's K step."""
    return all(k % k_step == 0 for k in (*model_shape(model), model.layers[0].q_size))


def fp8_tensor_cores(model, asked: bool | None) -> bool:
    """Whether this model's fp8 GEMVs take the tensor-core form: asked for
    (`EngineConfig.fused_decode_fp8_mma`; None: auto, the shapes in FP8_MMA_SHAPES), fp8
    weights, and every GEMV's K a multiple of the form's K step (MMA_K_FP8)."""
    if asked is None:
        asked = model_shape(model) in FP8_MMA_SHAPES
    return bool(asked) and is_quantized(model) and _ks_fit(model, MMA_K_FP8)


# bf16 models (hidden size, intermediate size) past MAX_NORM_CHUNKS that auto takes the fused
# path at: those measured faster than per-op there. Past MAX_NORM_CHUNKS the one-row CUDA-core
# GEMVs collapse, so one row takes the tensor-core form (cute_gemv's mma=True at one row: one real
# column of its 8-row tile; `bf16_one_row_tensor_cores`), and steps of up to
# SERVED_ROWS_BF16_LARGE rows run fused. Qwen2.5-7B (3,584, 18,944), on an H100 (session 64,
# 2026-12-07, `gpu_run.sh bf16-mma-ab` and its one-launch entries (128, 7, *), per-op (the
# default before) against the fused path): one stream through LLM.generate after a cached
# 1,000-token prompt 172.3 -> 183.5 tok/s (+6.5%); the closed loop of 32 requests c = 1 / 4 / 16
# 173 / 648 / 2,218 -> 185 / 680 / 2,216. Llama-3.1-8B (4,096, 14,336) and Qwen2.5-14B (5,120,
# 13,824), where the normed GEMVs split K, lost at one row (161.3 -> 152.3 and 89.0 -> 75.6; with
# the split norm's last CTA taking the rstd, 158.3 and 78.2 on another H100): per-op's, unless
# forced on (`fused_decode=True`). Llama-3.1-8B (and Mistral-7B, the same widths) joined in
# session 65 (H100, 2026-12-07), its normed GEMVs in one CTA up to 8 rows since a662b8c and its
# one-launch entries (128, 4, *) swept: one stream after 1,000 tokens 161.4 -> 171.4 (+6.2%), the
# closed loop c = 1 / 4 / 16 160 / 608 / 2,022 -> 174 / 621 / 2,020 (`bf16-mma-ab`, one call).
# Qwen2.5-14B stays out (78.2 against 89.0 with the split norm; its normed GEMVs keep K in one
# CTA of 20 warps since session 65, not yet timed).
BF16_ONE_ROW_MMA_SHAPES: set[tuple[int, int]] = {(3584, 18944), (4096, 14336)}


def bf16_one_row_tensor_cores(model) -> bool:
    """Whether this bf16 model's one-row GEMVs take the tensor-core form: where the norm-folded
    CUDA-core ones would hold more than MAX_NORM_CHUNKS chunks a lane (they collapse there:
    Qwen2.5-7B ran 22 tok/s on them, 179.6 on the tensor cores) or its shape is in
    BF16_ONE_ROW_MMA_SHAPES, and every GEMV's K a multiple of the form's K step (MMA_K)."""
    wide = norm_chunks_per_lane(model.config.hidden_size) > MAX_NORM_CHUNKS
    return (not is_quantized(model) and (wide or model_shape(model) in BF16_ONE_ROW_MMA_SHAPES)
            and _ks_fit(model, MMA_K))


def norm_chunks_per_lane(hidden_size: int, fp8: bool = False) -> int:
    """16-byte chunks of x each lane holds in the one-row GEMVs with the RMSNorm folded in
    (K = hidden_size; the lanes sharing a row: cute_gemv.lanes_for)."""
    vec = FP8_VEC if fp8 else VEC
    return hidden_size // (vec * lanes_for(hidden_size, vec))


def wide_head(hidden_size: int) -> bool:
    """Whether the LM head runs on cuBLAS (after the final RMSNorm, then an argmax) instead of
    the norm-folded GEMV: where its bf16 K (the LM head stays bf16 under fp8 weights) gives that
    GEMV more than MAX_NORM_CHUNKS chunks a lane. Measured on the H200 (profile_step, Qwen2.5-7B
    with fp8 weights, 14 chunks, 2026-12-04): the GEMV with its argmax 428 us for the 1.09 GB
    head (2.5 TB/s), where the per-op path's cuBLAS read it in 257 (4.2 TB/s)."""
    return norm_chunks_per_lane(hidden_size) > MAX_NORM_CHUNKS


def check_fused_decode(model, device: torch.device, kv_pool=None) -> None:
    """Raise ValueError naming what the fused path cannot run (before anything compiles)."""
    why = refusals(model, device) + (rope_refusals(model, kv_pool) if kv_pool is not None else [])
    if why:
        raise ValueError("fused_decode cannot run this model: " + "; ".join(why))


def refusals(model, device: torch.device) -> list[str]:
    """What keeps the fused path from running this model on `device` (empty: nothing)."""
    cfg = model.config
    why = []
    if device.type != "cuda":
        why.append(f"it runs on CUDA only (device {device})")
    if model.tp is not None:
        why.append("it has no tensor parallelism (tensor_parallel_size must be 1)")
    if cfg.o_bias:
        why.append("the O projection has a bias (attention_bias on Llama / Qwen3)")
    dtype = model.embed_tokens.weight.dtype
    if dtype != torch.bfloat16:
        why.append(f"its kernels are bf16 only (dtype {dtype})")
    layer = model.layers[0]
    vec, weights = (FP8_VEC, "fp8") if is_quantized(model) else (VEC, "bf16")
    for name, k in (("hidden_size", cfg.hidden_size), ("num_heads * head_dim", layer.q_size),
                    ("intermediate_size", layer.down_proj.weight.shape[1])):
        if k % vec:
            why.append(f"{name} = {k} is not a multiple of {vec} (16-byte loads of {weights} weights)")
    return why


def rope_refusals(model, kv_pool) -> list[str]:
    """What keeps RoPE + the K/V write out of the QKV GEMV's epilogue (FusedParts.rope)."""
    layer, why = model.layers[0], []
    if hasattr(layer, "q_norm"):
        why.append("RoPE in the QKV epilogue: the q / k heads are normalised (Qwen3) between the QKV "
                   "projection and RoPE")
    if model.cos_sin_cache.shape[-1] != layer.head_dim or model.cos_sin_cache.dtype != torch.float32:
        why.append(f"RoPE in the QKV epilogue: the cos | sin table must be fp32 [positions, head_dim], got "
                   f"{model.cos_sin_cache.dtype} {tuple(model.cos_sin_cache.shape)}")
    if kv_pool.k_cache.dtype != torch.bfloat16 or kv_pool.head_dim != layer.head_dim:
        why.append(f"RoPE in the QKV epilogue: the pool must be bf16 with head_dim {layer.head_dim}")
    return why


def has_pdl(device: torch.device) -> bool:
    """Programmatic Dependent Launch: CUDA devices of compute capability 9.0 and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def auto_declines(model, device: torch.device, use_graphs: bool, kv_pool=None) -> str | None:
    """Why `fused_decode` left to auto stays off here (the first condition that fails), or None
    where it turns on. Auto asks for what the path was measured faster with (BENCHMARKS.md):
    the platform's conditions (`attention.selection.fused_decline`: PDL on sm_90+, bf16, one
    GPU, CUDA graphs), a shape the GEMVs serve, and the CuTe DSL. The attention backend is no
    condition: the path attends with its own triton kernel where the backend has none."""
    dtype = model.embed_tokens.weight.dtype
    why = fused_decline(Platform.of(device), dtype, model.tp is not None, use_graphs)
    if why is not None:
        return why
    # An fp8 KV cache is no condition: RoPE + the K/V write leave the QKV epilogue (which stores
    # bf16 only: `rope_refusals`) for the pool's own kernel, which quantizes, and the one-launch
    # attention reads e4m3. H200, qwen2.5-0.5b one stream with `--kv-cache-dtype fp8` (2026-12-04):
    # 1,790 tok/s fused against 955 per-op.
    why = refusals(model, device)
    if why:
        return "; ".join(why)
    chunks = norm_chunks_per_lane(model.config.hidden_size, is_quantized(model))
    if chunks > MAX_NORM_CHUNKS and (is_quantized(model) or model_shape(model) not in BF16_ONE_ROW_MMA_SHAPES):
        # Forced on (fused_decode=True) it runs: bf16 with one row on the tensor cores, fp8 on
        # the CUDA cores at a fraction of per-op's speed (MAX_NORM_CHUNKS).
        return (f"hidden_size = {model.config.hidden_size} gives its norm-folded one-row GEMVs "
                f"{chunks} 16-byte chunks a lane (more than {MAX_NORM_CHUNKS}), and its shape "
                f"{model_shape(model)} is not one measured faster fused there "
                "(fused_decode.BF16_ONE_ROW_MMA_SHAPES; Llama-3.1-8B read 158 tok/s fused against "
                "per-op's 161)")
    ok, unavailable = cute_available()
    return None if ok else unavailable  # says how to install it


@dataclass(frozen=True)
class FusedParts:
    """The fused path's three parts; None = on where it applies (what the engine chooses).

    Each part measured faster wherever it works, so a user never sets them; they stay
    nameable for the tests that check one variant against another and for measurements."""

    pdl: bool | None = None   # kernels launch with Programmatic Dependent Launch (sm_90+)
    rope: bool | None = None  # RoPE + K/V write in the QKV GEMV's epilogue (not Qwen3's q/k norm)
    attn: bool | None = None  # one attention launch a layer (triton's, whatever the step backend)

    def named_on(self) -> list[str]:
        return [name for name in ("pdl", "rope", "attn") if getattr(self, name)]


@dataclass(frozen=True)
class Gemvs:
    """The compiled GEMVs of one row count M (each reads its weights once for all M rows)."""

    qkv: object
    o: object
    gate_up: object
    down: object | None  # None: the down projection runs on cuBLAS (`_down`), see MAX_DOWN_K
    lm_head: object | None    # None (both): the final norm, cuBLAS and an argmax (`wide_head`)
    lm_argmax: object | None

    def all(self) -> list:
        return [g for g in (self.qkv, self.o, self.gate_up, self.down, self.lm_head, self.lm_argmax)
                if g is not None]


def served_row_counts(padded_sizes: Sequence[int], model, fp8_mma: bool | None = False) -> list[int]:
    """Of the runner's padded decode sizes, those the fused path serves (SERVED_ROWS;
    SERVED_ROWS_FP8 for a model with fp8 weights off the tensor cores (`fp8_tensor_cores` of
    fp8_mma), SERVED_ROWS_FP8_LARGE on them at a shape of FP8_MMA_SHAPES; SERVED_ROWS_BF16_LARGE
    at a bf16 shape of BF16_ONE_ROW_MMA_SHAPES; and no more than the kernel takes): a step padded
    to any other runs per-op."""
    if is_quantized(model) and not fp8_tensor_cores(model, fp8_mma):
        served = SERVED_ROWS_FP8
    elif is_quantized(model) and model_shape(model) in FP8_MMA_SHAPES:
        served = SERVED_ROWS_FP8_LARGE
    elif bf16_one_row_tensor_cores(model):
        served = SERVED_ROWS_BF16_LARGE
    else:
        served = SERVED_ROWS
    return [s for s in padded_sizes if s <= min(served, gemv_row_limit())]


def gemv_row_limit() -> int:
    """The most decode rows one CuteGemv launch serves: MAX_ROWS where the kernel takes `rows`,
    else 1 (a kernel of one row: the path then serves one-row steps only)."""
    takes_rows = any("rows" in inspect.signature(f).parameters for f in (CuteGemv, plan_gemv))
    return MAX_ROWS if takes_rows else 1


class FusedDecode:
    """Owns the compiled GEMVs and the step buffers of the decode path of 1 to MAX_ROWS rows.

    One set of GEMVs per row count in `row_counts` (the runner's padded decode batch sizes up
    to SERVED_ROWS, `served_row_counts`: a step of n rows runs padded to the next one, its
    padding rows on the pool's scratch page, their outputs never read). A GEMV's time is about
    its weight bytes whatever M, so padding 3 rows to 4 costs little, while every row count
    costs its own compiled kernels at start. A row count whose GEMVs the kernel cannot plan for this shape is left out
    (`declined_rows`): steps that would pad to it run per-op. The step buffers hold the largest
    row count's rows; a step uses views of its first M."""

    def __init__(self, model, device: torch.device, pdl: bool = False, kv_pool=None,
                 one_launch_attention: bool = False, row_counts: Sequence[int] = (1,), fp8_mma: bool | None = False):
        """one_launch_attention: attention through the backend's `attend_one_launch` (the
        caller checks that the backend has it); with pdl, that kernel and the embedding gather
        launch with PDL too. row_counts: the step sizes (rows) to build GEMVs for. fp8_mma:
        fp8 GEMVs on the tensor cores where `fp8_tensor_cores` allows (None: auto)."""
        check_fused_decode(model, device, kv_pool)
        ok, why = cute_available()
        if not ok:
            raise CuteUnavailable(f"fused_decode needs the CuTe DSL: {why}")
        limit = gemv_row_limit()
        if not row_counts or min(row_counts) < 1 or max(row_counts) > limit:
            raise ValueError(f"fused_decode row counts must be in 1..{limit}, got {list(row_counts)}")
        self.model = model
        layer = model.layers[0]
        self.fp8 = is_quantized(model)  # the decoder's weights: fp8 codes + row scales (`_weight`)
        self.fp8_mma = fp8_tensor_cores(model, fp8_mma)  # their GEMVs on the tensor cores
        self.bf16_one_row_mma = bf16_one_row_tensor_cores(model)  # one bf16 row on them too
        self.pdl = pdl
        self.one_launch_attention = one_launch_attention
        # Steps without the RoPE epilogue make their rows in the attention kernel (ROPE_IN_ATTENTION)
        self.rope_in_attention = ROPE_IN_ATTENTION != "0" and one_launch_attention
        self.kv_pool = kv_pool  # with a pool: RoPE + K/V write in the QKV epilogue
        self.rope = None
        if kv_pool is not None:
            self.rope = RopeShape(layer.head_dim, layer.num_heads, layer.num_kv_heads,
                                  model.cos_sin_cache.shape[0], kv_pool.k_cache[0].numel() // layer.kv_size)
        self.gemvs: dict[int, Gemvs] = {}
        # The O GEMVs that merge the attention's split partials, by (split rule, rows) (MERGE_IN_O)
        self.merge_o: dict[tuple, CuteGemv] = {}
        self.declined_rows: dict[int, str] = {}  # row counts the kernel cannot plan, and why
        for m in sorted(set(row_counts)):
            try:
                self.gemvs[m] = self._build_gemvs(m, device)
            except ValueError as e:  # the plan's limit for this shape (e.g. lanes a row < M)
                if m == 1:
                    raise
                self.declined_rows[m] = str(e)
        self.row_counts = sorted(self.gemvs)
        self.max_rows = self.row_counts[-1]
        self._allocate_buffers(self.max_rows, device)
        self.device = device
        self.precompile = None  # `start_precompile`'s workers

    def start_precompile(self, attn=None) -> None:
        """Plans not on disk compile in worker processes meanwhile, where that is on (the warm-up's
        first calls then load them; warm_up ends the workers): every row count's GEMVs and, given
        the fused steps' attention backend, the O GEMVs that merge its partials (MERGE_IN_O), each
        under the split rule the backend names for that row count (`partials_rule`). A step whose
        rule differs (another config planned at run time) builds its own at its first call."""
        merges = []
        if attn is not None and self.one_launch_attention and hasattr(attn, "partials_rule"):
            for rows in self.row_counts:
                if self.merges_in_o(rows):
                    rope_in = self.rope is None and self.rope_in_attention  # as `_qkv_attend` calls it
                    rule = attn.partials_rule(rows, rope_in, MERGE_PARTIALS)
                    if rule is not None:
                        merges.append(self._merge_o(rule, rows, self.device))
        every_row_count = [g for gemvs in self.gemvs.values() for g in gemvs.all()]
        self.precompile = cute_precompile.start(every_row_count + merges)

    def _widths(self) -> tuple[int, int, int, int, int]:
        """(hidden, q, kv, intermediate, vocab): the widths the GEMVs and the buffers have."""
        model, layer = self.model, self.model.layers[0]
        return (model.config.hidden_size, layer.q_size, layer.kv_size,
                layer.down_proj.weight.shape[1], model.lm_head_weight.shape[0])

    def _allocate_buffers(self, rows: int, device: torch.device) -> None:
        """The step buffers, `rows` rows each (a step of M rows uses the first M)."""
        model = self.model
        h, q, kv, inter, vocab = self._widths()
        empty = dict(dtype=model.embed_tokens.weight.dtype, device=device)  # bf16 (checked above)
        self.residual = torch.empty(rows, h, **empty)  # the residual stream, updated in place
        self.qkv_out = torch.empty(rows, q + 2 * kv, **empty)
        self.act = torch.empty(rows, inter, **empty)    # silu(gate) * up
        self.logits_out = torch.empty(rows, vocab, **empty)
        # The argmax writes int32 tokens; the engine's tokens are int64. One row writes into the
        # low word of an int64 slot whose high word stays 0 (ids are < 2^31, the host is
        # little-endian as CUDA's are): the token is int64 with no cast kernel after it. M rows
        # write M contiguous int32, which one cast turns into the int64 slots.
        self.token_id = torch.zeros(rows, dtype=torch.int64, device=device)
        self.token_out = self.token_id.view(torch.int32)[:1]
        self.tokens32 = torch.zeros(rows, dtype=torch.int32, device=device)
        self.split = [q, kv, kv]

    def _build_gemvs(self, m: int, device: torch.device) -> Gemvs:
        """The GEMVs of M rows (not compiled yet: each compiles at its first call, the warm-up's).
        With fp8 decoder weights the four projections stream them; the LM head stays bf16."""
        cfg = self.model.config
        h, q, kv, inter, vocab = self._widths()
        # rows= only past one row: the one-row kernels stay exactly the plans they always were
        head = dict(device=device, pdl=self.pdl, **({"rows": m} if m > 1 else {}))
        mma = self.fp8_mma or (m == 1 and self.bf16_one_row_mma)  # bf16 M-row GEMVs: mma by default
        gemv = dict(head, **({"fp8": True} if self.fp8 else {}), **({"mma": True} if mma else {}))
        normed = dict(norm=True, eps=cfg.rms_norm_eps, **gemv)
        head_normed = dict(norm=True, eps=cfg.rms_norm_eps, **head)
        narrow_head = not wide_head(h)
        if self.rope is not None:
            qkv = CuteGemv(q + 2 * kv, h, "bias_rope_kv" if cfg.qkv_bias else "rope_kv", rope=self.rope, **normed)
        else:
            qkv = CuteGemv(q + 2 * kv, h, "bias" if cfg.qkv_bias else "none", **normed)
        return Gemvs(qkv=qkv, o=CuteGemv(h, q, "residual", **gemv),
                     gate_up=CuteGemv(2 * inter, h, "silu_mul", **normed),
                     down=CuteGemv(h, inter, "residual", **gemv) if inter <= MAX_DOWN_K else None,
                     lm_head=CuteGemv(vocab, h, "none", **head_normed) if narrow_head else None,
                     lm_argmax=CuteGemv(vocab, h, "argmax", **head_normed) if narrow_head else None)

    def compiled(self) -> tuple[int, float, int]:
        """(GEMVs ready so far, the seconds they took, how many of them were loaded from the
        disk cache rather than compiled; 0 s for a plan another object readied in this process):
        what the path costs at start."""
        every = [*(g for gemvs in self.gemvs.values() for g in gemvs.all()), *self.merge_o.values()]
        ready = [g for g in every if getattr(g, "compile_seconds", None) is not None]
        return (len(ready), sum(g.compile_seconds for g in ready),
                sum(bool(getattr(g, "from_disk", False)) for g in ready))

    def gemvs_for(self, m: int) -> Gemvs:
        """The GEMVs of a step of m rows (a padded size: one of row_counts)."""
        try:
            return self.gemvs[m]
        except KeyError:
            raise ValueError(f"the fused decode path has GEMVs for {self.row_counts} rows, not {m} "
                             f"(steps are padded to one of them: ModelRunner.load)") from None

    @property
    def parts(self) -> FusedParts:
        """What runs, every part resolved to True / False."""
        return FusedParts(pdl=self.pdl, rope=self.kv_pool is not None, attn=self.one_launch_attention)

    def hidden(self, g: Gemvs, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions [M] -> the residual stream after the last layer [M, hidden]
        through g, the GEMVs of M rows (K/V written through `attn`, planned for this step)."""
        m, rows = self.model, input_ids.shape[0]
        residual, act = self.residual[:rows], self.act[:rows]
        if self.pdl and self.one_launch_attention:  # layer 0's QKV loads its weights meanwhile
            from flashlet.kernels.embedding import gather_rows  # Triton: imported on CUDA only

            gather_rows(m.embed_tokens.weight, input_ids, residual, pdl=True)
        else:
            torch.index_select(m.embed_tokens.weight, 0, input_ids, out=residual)
        for i, layer in enumerate(m.layers):
            if self.rope is not None:
                o = self._qkv_rope_attend(g, i, layer, positions, attn)
            else:
                o = self._qkv_attend(g, i, layer, positions, attn)
            w, scale = _weight(layer.o_proj.weight)
            if isinstance(o, SplitPartials):
                self._merge_o(o.rule, rows, residual.device)(o, w, residual, out=residual)
            else:
                g.o(o.reshape(rows, -1).contiguous(), w, residual, out=residual, **scale)
            w, scale = _weight(layer.gate_up_proj.weight)
            g.gate_up(residual, w, out=act, norm_weight=layer.post_attn_norm, **scale)
            self._down(g, layer, act, residual)
        return residual

    @staticmethod
    def _down(g: Gemvs, layer, act: torch.Tensor, residual: torch.Tensor) -> None:
        """residual += act @ down^T, in place: the CuTe GEMV, or one cuBLAS GEMM whose beta = 1
        adds into the residual (rounded once, as the GEMV's residual epilogue is); fp8 weights
        past MAX_DOWN_K: the per-op path's fp8 GEMM, adding into the residual in its epilogue
        (`quantization.linear_add_`: rounded once too)."""
        if g.down is not None:
            w, scale = _weight(layer.down_proj.weight)
            g.down(act, w, residual, out=residual, **scale)
        elif isinstance(layer.down_proj.weight, QuantizedWeight):
            quantization.linear_add_(act, layer.down_proj.weight, residual)
        else:
            residual.addmm_(act, layer.down_proj.weight.t())

    def _qkv_attend(self, g: Gemvs, i: int, layer, positions: torch.Tensor,
                    attn) -> torch.Tensor | SplitPartials:
        """QKV GEMV, then the pool's RoPE + K/V write kernel and attention (two more kernels)."""
        m, rows = self.model, positions.shape[0]
        qkv_out = self.qkv_out[:rows]
        w, scale = _weight(layer.qkv_proj.weight)
        g.qkv(self.residual[:rows], w, layer.qkv_proj.bias, out=qkv_out, norm_weight=layer.input_norm, **scale)
        q, k, v = qkv_out.split(self.split, dim=-1)
        q = q.view(rows, layer.num_heads, layer.head_dim)
        k = k.view(rows, layer.num_kv_heads, layer.head_dim)
        v = v.view(rows, layer.num_kv_heads, layer.head_dim)
        qk_norm = layer.qk_norm()  # Qwen3: in the RoPE + K/V write kernel (or the attention's)
        if not self.one_launch_attention:
            return attn.run_rope(i, q, k, v, positions, m.cos_sin_cache, qk_norm)
        if self.rope_in_attention:  # (every fused row count: MAX_ROWS is within its look-back)
            from flashlet.kernels.decode_attention import RopeIn  # Triton's module: where it runs

            return attn.attend_one_launch(i, q, pdl=self.attention_pdl(rows),
                                          rope_in=RopeIn(k, v, positions, m.cos_sin_cache, qk_norm),
                                          **self._partials_asked(rows))
        q = attn.kv_pool.write_rope(i, q, k, v, positions, m.cos_sin_cache, attn.meta.slot_mapping,
                                    qk_norm)
        return self._attend(i, q, attn)

    def _qkv_rope_attend(self, g: Gemvs, i: int, layer, positions: torch.Tensor,
                         attn) -> torch.Tensor | SplitPartials:
        """QKV GEMV with RoPE and the K/V write (every row's, at its own position and slot) in
        its epilogue, then attention alone: each row attends to the K/V of all rows before it."""
        pool, rows = self.kv_pool, positions.shape[0]
        qkv_out = self.qkv_out[:rows]
        step = RopeKV(positions, self.model.cos_sin_cache, pool.k_cache[i], pool.v_cache[i],
                      attn.meta.slot_mapping)
        w, scale = _weight(layer.qkv_proj.weight)
        g.qkv(self.residual[:rows], w, layer.qkv_proj.bias, out=qkv_out, norm_weight=layer.input_norm,
              rope_kv=step, **scale)
        q = qkv_out[:, : self.split[0]].view(rows, layer.num_heads, layer.head_dim)
        return self._attend(i, q, attn)

    def attention_pdl(self, rows: int) -> bool:
        """Whether a step of `rows` rows launches its one-launch attention with PDL (ATTENTION_PDL)."""
        return self.pdl and (ATTENTION_PDL == "1" or (ATTENTION_PDL == "one-row" and rows == 1))

    def _attend(self, i: int, q: torch.Tensor, attn) -> torch.Tensor | SplitPartials:
        """Attention over the pool, this step's K/V already written (one row with MERGE_IN_O: its
        split partials where the backend leaves them)."""
        if self.one_launch_attention:
            return attn.attend_one_launch(i, q, pdl=self.attention_pdl(q.shape[0]),
                                          **self._partials_asked(q.shape[0]))
        return attn.attend(i, q)

    def _partials_asked(self, rows: int) -> dict:
        """`attend_one_launch`'s partials arguments for a step of `rows` rows: whether it leaves
        them to O (`merges_in_o`) and their dtype (MERGE_PARTIALS)."""
        return dict(partials_out=self.merges_in_o(rows), partials=MERGE_PARTIALS)

    def merges_in_o(self, rows: int) -> bool:
        """Whether a step of `rows` rows asks the attention for split partials (`merge_form`: bf16
        weights, steps of up to the form's rows, not a one-row O on the tensor cores)."""
        form = merge_form(model_shape(self.model))
        return not (form is None or rows > form.rows or self.fp8 or (rows == 1 and self.bf16_one_row_mma))

    def _merge_o(self, rule: tuple, rows: int, device: torch.device) -> CuteGemv:
        """The O GEMV of `rows` rows that merges partials split by `rule` (compiled at its first
        call, the warm-up's, as every GEMV), in the shape's `merge_form`."""
        if (rule, rows) not in self.merge_o:
            h, q = self._widths()[:2]
            form = merge_form(model_shape(self.model))
            if rows > 1:  # O's M-row plan, uncapped
                knobs = {"rows": rows, "min_ctas_per_sm": 0}
            else:
                knobs = ({"warps": form.warps} if form.warps else {}) | (
                    {"ctas_per_sm": form.ctas_per_sm} if form.ctas_per_sm else {})
            merge = (*rule[:4], form.group, *rule[5:]) if form.group else rule  # the GEMV's group of splits a round
            self.merge_o[rule, rows] = CuteGemv(h, q, "residual", device=device, pdl=self.pdl, merge=merge, **knobs)
        return self.merge_o[rule, rows]

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """-> logits [M, vocab] fp32 (final RMSNorm folded into the LM head GEMV)."""
        g = self.gemvs_for(input_ids.shape[0])
        x = self.hidden(g, input_ids, positions, attn)
        out = self.logits_out[: x.shape[0]]
        if g.lm_head is None:
            return self._wide_head(x, out).float()
        g.lm_head(x, self.model.lm_head_weight, out=out, norm_weight=self.model.norm)
        return out.float()

    def _wide_head(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, then the LM head on cuBLAS into out [M, vocab] (bf16), as the
        per-op path computes it: where `wide_head` keeps the head off the GEMVs."""
        m = self.model
        return torch.mm(m.ops.rms_norm(x, m.norm, m.config.rms_norm_eps), m.lm_head_weight.t(), out=out)

    def token(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """-> the greedy tokens [M] int64: final RMSNorm, LM head and argmax in one kernel (three
        where `wide_head`)."""
        rows = input_ids.shape[0]
        g = self.gemvs_for(rows)
        x = self.hidden(g, input_ids, positions, attn)
        if g.lm_argmax is None:  # into the int64 tokens, no cast after it
            return torch.argmax(self._wide_head(x, self.logits_out[:rows]), dim=-1, out=self.token_id[:rows])
        argmax = g.lm_argmax
        if rows == 1:
            argmax(x, self.model.lm_head_weight, out=self.token_out, norm_weight=self.model.norm)
            return self.token_id[:1]
        argmax(x, self.model.lm_head_weight, out=self.tokens32[:rows], norm_weight=self.model.norm)
        return self.token_id[:rows].copy_(self.tokens32[:rows])


def _weight(w) -> tuple[torch.Tensor, dict]:
    """A projection's weight as a GEMV takes it: a bf16 tensor as it is; fp8, its codes and
    `scale=` its row scales (weight-only: the GEMV scales each sum, x stays bf16)."""
    if isinstance(w, QuantizedWeight):
        return w.qweight, {"scale": w.scale}
    return w, {}


def verify_as_decode_rows(layout: StepLayout, page_size: int, max_rows: int) -> StepLayout | None:
    """A step of verify rows and decodes, every query token sampled and at most max_rows of
    them, as the same step of one decode row per query token -> that layout, or None where it
    does not apply (a prefill chunk, a row that samples less, too many tokens, a pure decode).

    A verify row of k + 1 query tokens of one sequence, computed from position p over a KV
    length L + k + 1, is k + 1 decode rows over the same page-table row with KV lengths
    p + 1 .. p + k + 1 and positions p .. p + k: the step writes every row's K/V before any
    attention reads the pool (the QKV epilogue, or the RoPE + K/V write kernel, runs over all
    rows first), so each row sees exactly its causal prefix. Tokens keep their order, so the
    logits rows are the verify step's own (its logits_indices are every row, in order)."""
    a = layout.arrays
    num_tokens = len(a["positions"])
    if (layout.is_pure_decode or num_tokens > max_rows or len(a["logits_indices"]) != num_tokens
            or not np.array_equal(a["logits_indices"], np.arange(num_tokens))):
        return None
    seq = np.repeat(np.arange(len(a["kv_lens"])), layout.query_lens)
    kv_lens = a["positions"] + 1  # each token's causal prefix, itself included
    pages = -(-kv_lens // page_size)
    kv_ptr = np.zeros(num_tokens + 1, np.int64)
    np.cumsum(pages, out=kv_ptr[1:])
    # token t's pages: the first pages[t] of its sequence's
    first = a["paged_kv_indptr"][:-1].astype(np.int64)[seq]
    indices = a["paged_kv_indices"][np.repeat(first - kv_ptr[:-1], pages) + np.arange(kv_ptr[-1])]
    i32 = np.int32
    arrays = {**a, "qo_indptr": np.arange(num_tokens + 1, dtype=i32),
              "paged_kv_indptr": kv_ptr.astype(i32), "paged_kv_indices": indices,
              "paged_kv_last_page_len": (kv_lens - (pages - 1) * page_size).astype(i32),
              "kv_lens": kv_lens.astype(i32)}
    decode = StepLayout.from_arrays(arrays, verify_as_decode_rows=True)
    decode.query_lens = np.ones(num_tokens, i32)
    decode.is_pure_decode = True
    decode.max_query_len = 1
    return decode
