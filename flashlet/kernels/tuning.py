"""Launch configurations of the Triton attention kernels, per shape, and the backend `auto` picks.

Every choice here is a function of the model's shape (head_dim, GQA group size) and of a
bucket of the batch, and of a KV length only as one threshold a kind of step (a prefill step's
split past PREFILL_SPLIT_MIN_CONTEXT, a fused decode step's long-context entry past
ONE_LAUNCH_LONG_CONTEXT), each a second graph of its own. That keeps the set of compiled kernel
variants finite and known at engine start (`flashlet/core/warmup.py` compiles all of them), and a
CUDA graph captured for a decode batch size stays valid for any KV lengths on its side of the
threshold: the decode kernel adapts to the lengths on the device (the number of splits a sequence
uses comes from `kv_lens`).

- Decode: bucket = the smallest of DECODE_BATCH_BUCKETS that holds the batch size (the last
  one holds every larger batch). Config: BLOCK_N keys per block, warps, stages, the smallest
  KV split in tokens, and `waves`: how many programs per SM the split count aims at.
- Prefill (every step with a chunk): bucket = the smallest of PREFILL_QLEN_BUCKETS that holds
  the step's longest chunk (mixed steps of decodes and short chunks get smaller tiles). Its
  split-KV cap (num_splits: 8 for chunks past the first bucket; 16 or 32 for short ones, whose
  few tiles alone would leave most SMs idle) applies to steps of at most the config's
  split_max_tokens rows whose longest KV holds at least PREFILL_SPLIT_MIN_CONTEXT tokens (known
  on the host when the step is planned: a second mixed-graph variant per token bucket); how many
  splits a tile uses comes from the KV lengths on the device (min_split_tokens), so those graphs
  serve every length past it.

DECODE_TABLE and PREFILL_TABLE hold measured winners from `scripts/tune_triton.py` (H200),
pasted in as it prints them; shapes not in them get `default_decode` / `default_prefill`.
BATCHED_DECODE_TABLE holds `scripts/decode_attn_bench.py`'s winners for the two-launch decode
per KV dtype (an fp8 pool moves half the bytes per key, so its best tile and split differ).
BACKEND_PREFERENCE is the step backend `--backend auto` picks per (head_dim, group, step kind):
"prefill" (every step with a chunk) and "decode" (pure-decode steps the fused path does not
serve: 17+ rows). Its entries are engine measurements (`bash scripts/gpu_run.sh backend-pref`:
offline and decode-sat, triton against FlashInfer, BENCHMARKS.md); `scripts/tune_triton.py`
prints its kernels-alone comparison in the same form.
ONE_LAUNCH_TABLE holds that script's `--one-launch` winners for the fused decode path's
one-launch form, per (head_dim, group, rows bucket of ONE_LAUNCH_ROW_BUCKETS); a shape without
an entry keeps the form's derived config (`TritonBackend.one_launch_config`). Its context-length
handling (the smallest split, the long-row rule) is made of runtime values: one CUDA graph per
row count serves every length. The one exception, where a sweep measured that it pays:
ONE_LAUNCH_LONG_TABLE's entry for a rows bucket serves the fused steps whose longest row holds
more than ONE_LAUNCH_LONG_CONTEXT tokens, in a second CUDA graph per row count (the graph's key
says "long"; warm-up captures it), as the split prefill has a second mixed graph past
PREFILL_SPLIT_MIN_CONTEXT: one grid cannot be the best for 300 tokens and for 30,000.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

DECODE_BATCH_BUCKETS = (1, 4, 16, 64, 256)
KV_KINDS = ("model", "fp8")  # the KV cache's dtype, as BATCHED_DECODE_TABLE keys it
PREFILL_QLEN_BUCKETS = (16, 1 << 30)
# The most query rows of a step the prefill kernel splits (and its scratch holds) for long
# chunks: a larger step has enough tiles to fill the GPU unsplit (1,024 rows at group 7: 112
# tiles a KV head). Short chunks split more ways over fewer rows (`default_prefill`), so every
# config's splits x rows fits one scratch of PREFILL_SPLIT_SCRATCH_ROWS.
PREFILL_SPLIT_MAX_TOKENS = 1024
PREFILL_SPLIT_SCRATCH_ROWS = 8 * PREFILL_SPLIT_MAX_TOKENS
# The shortest longest-KV of a step that splits. The split kernel, even where every tile takes
# one split, writes its partials and merges them, under a register cap: a 448-token chunk with
# 64 decodes at 1,024 tokens of context took 0.818 ms of attention (24 layers) split (8, 1,024)
# against 0.637 unsplit, and 1.163 against 1.986 at 4,096 (qwen2.5-0.5b; qwen3-0.6b 0.92x /
# 1.09x; H200, scripts/prefill_split_bench.py, 2026-12-03). 2,048 is not measured.
PREFILL_SPLIT_MIN_CONTEXT = 4096
ONE_LAUNCH_ROW_BUCKETS = (1, 4, 8, 16)  # the fused decode path's rows a step; more: no table entry
# A fused step whose longest row holds more than this many tokens takes its rows bucket's
# ONE_LAUNCH_LONG_TABLE entry, where it has one (the one-launch sweep's long contexts, 8,000 and
# 30,000, lie past it; its short ones, 300 and 1,000, before it). A multiple of every page size,
# so the step that crosses it starts a page and loads (no steady replay keeps the short graph:
# `TritonBackend.long_context`).
ONE_LAUNCH_LONG_CONTEXT = 4096
# The most splits a measured entry's num_splits may give (past the backend's default cap of 64,
# which the derived configs keep): one long row over more programs than SMs, as the two-launch
# form's best at 30,000 tokens (S128, DECODE_NOTES.md) spreads it.
MEASURED_SPLIT_CAP = 256


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    min_split_tokens: int = 128
    waves: int = 2  # programs per SM the split count aims at
    num_splits: int | None = None  # a measured split cap for the bucket (None: from `waves`)
    prefetch: str = "none"  # what the two-launch decode loads ahead by hand (`decode_attention`)
    kv_pack: int = 1  # KV heads one program of the two-launch decode reads (`kv_heads_per_program`)
    merge_in_kernel: bool = False  # split partials merged by each group's last program, not a second launch


@dataclass(frozen=True)
class OneLaunchConfig:
    """A launch of `decode_attention_one_launch` (the fused decode path's attention). The tile
    (block_n, warps, stages, kv_pack), the split cap and whether a long-row rule is on are
    compiled in; the split lengths are runtime values. A row of at least long_from_tokens tokens
    (0: no such rule) splits at long_split_tokens, any other at min_split_tokens: with a grid of
    `num_splits` splits a long row can take all of them while short rows keep few, and no
    program is added."""
    block_n: int = 256
    num_warps: int = 8
    num_stages: int = 2
    min_split_tokens: int = 256
    waves: int = 2  # programs per SM the split cap aims at, where num_splits is None
    num_splits: int | None = None  # a measured split cap for the rows bucket
    kv_pack: int = 1  # KV heads a program (`decode_attention_one_launch(kv_heads_per_program=)`)
    long_from_tokens: int = 0
    long_split_tokens: int = 0
    merge_splits: int | None = None  # partials the merging program reads at a time (None: derived)
    prefetch_pages: bool = False  # the block loop's page ids loaded a block ahead (the second before the wait)
    merge_group: int = 0  # splits a first-level merge folds (0: the last program merges them all)

    def smallest_split_tokens(self) -> int:
        """The shortest split any row may get (what bounds the useful split count)."""
        if self.long_from_tokens > 0:
            return min(self.min_split_tokens, self.long_split_tokens)
        return self.min_split_tokens


@dataclass(frozen=True)
class PrefillConfig:
    """A launch of `prefill_attention`. num_splits > 1: split-KV, each tile's keys over up to
    num_splits programs of at least min_split_tokens keys (a runtime rule: a short context uses
    one split), for steps of at most split_max_tokens query rows (padded: the token bucket)."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 1
    min_split_tokens: int = 1024
    split_max_tokens: int = PREFILL_SPLIT_MAX_TOKENS


# (head_dim, group, batch bucket) -> DecodeConfig. Measured on an H200 (scripts/tune_triton.py).
DECODE_TABLE: dict[tuple[int, int, int], DecodeConfig] = {}
# (head_dim, group, kv, batch bucket) -> DecodeConfig of the two-launch (batched) decode only,
# kv "model" (the model's dtype) or "fp8": measured on an H200 by scripts/decode_attn_bench.py.
# Consulted before DECODE_TABLE; the one-launch decode of the fused path never reads it.
BATCHED_DECODE_TABLE: dict[tuple[int, int, str, int], DecodeConfig] = {
    # Qwen2.5-0.5B's shape, measured at 1 x 30,000, 32 x 8,000 and 128 x 2,000 tokens
    # (DECODE_NOTES.md). Bucket 1 holds 64 splits, the backend's split cap (128 measured best).
    # fp8 at 256: the sweep's winner at 128 x 2,000 (`decode_attn_bench.py --shapes 128x2000
    # --quick --kv fp8`, 2026-12-04): small one-warp programs, four splits, the merge in the
    # kernel, 25.5 us a layer against 29.0 for round 2's prediction (both KV heads a program, bn128
    # w4 S2); decode-sat 128 x 2,000 with it 71,740 / 72,035 tok/s against 69,261 / 69,911.
    (64, 7, "fp8", 1): DecodeConfig(block_n=128, num_warps=4, num_stages=3, num_splits=64, prefetch="pages"),
    (64, 7, "fp8", 64): DecodeConfig(block_n=128, num_warps=4, num_stages=3, num_splits=8, prefetch="pages"),
    (64, 7, "fp8", 256): DecodeConfig(block_n=32, num_warps=1, num_stages=3, num_splits=4, prefetch="pages",
                                      merge_in_kernel=True),
    (64, 7, "model", 1): DecodeConfig(block_n=64, num_warps=2, num_stages=3, num_splits=64, prefetch="pages"),
    (64, 7, "model", 64): DecodeConfig(block_n=64, num_warps=2, num_stages=3, num_splits=8, prefetch="pages"),
    (64, 7, "model", 256): DecodeConfig(block_n=64, num_warps=2, num_stages=3, num_splits=2, prefetch="pages"),
    # Qwen3-0.6B's (and 1.7B's) shape, one row: its long steps attend in two launches
    # (ONE_LAUNCH_LONG_TABLE). `gpu_run.sh two-launch-long` (H100, 2026-12-05, f76f346): 49.8 us a
    # layer at 30,000 tokens against the derived config's 51.9 (bn32 w4 S64, no prefetch), 19.1
    # against 21.0 at 8,000. Through LLM.generate (two-launch-long-ab, two interleaved pairs):
    # after 30,000 tokens 484.2 / 484.0 tok/s against 458.4 / 458.7 (+5.6%), after 8,000 808.9 /
    # 809.4 against 776.7 / 776.2 (+4.2%) under Triton 3.6; 480.3 / 481.8 against 466.1 / 466.2
    # (+3.2%) at 30,000 under the pinned 3.7.1.
    (128, 2, "model", 1): DecodeConfig(block_n=64, num_warps=4, num_stages=3, num_splits=32, prefetch="pages"),
}
# (head_dim, group, rows bucket) -> OneLaunchConfig of the fused decode path's one-launch attention,
# the winners of `scripts/decode_attn_bench.py --one-launch` (KV in the model's dtype, PDL and the
# lean merge on, Qwen3's rows made in the kernel: the fused step's launch) that won in the engine
# too. The multi-row entries (4, 8 and 16 rows; `gpu_run.sh lean-sweep` with LEAN_SWEEP_ROWS="4 8
# 16", then `loop-table-ab`: the harness's closed loop, 64 requests x 128 tokens, prompts 32-768,
# two interleaved fresh-process pairs without and with the sweep's table, then 1 / 4 / 16 streams
# through LLM.generate after 400-token prompts; H100, pinned Triton 3.7.1, 2026-12-06, d634cea):
#   Qwen2.5-0.5B (64, 7): c = 4 +9.2% / +9.2%, c = 16 +15.2% / +15.0%; N = 4 +7.5%, N = 16 +10.9%
#   Llama-3.2-1B (64, 4; lab/tables/one-launch-presets-2026-12-05.json): c = 4 +7.5% / +7.2%,
#     c = 16 +8.8% / +8.7%; N = 4 +7.4%, N = 16 +7.8%
#   Qwen3-0.6B (128, 2): c = 4 +4.9% / +4.9%, c = 16 +19.1% / +19.1%; N = 4 +3.7%, N = 16 +19.3%
#   Qwen2.5-1.5B (128, 6; the presets table): c = 4 +13.0% / +13.1%, c = 16 +5.6% / +5.8%;
#     N = 4 +14.2%, N = 16 +7.3%
# c = 1 and N = 1 level (-0.2..+0.9%) in each. The entries they replaced (the 0.5B's 16 rows,
# Qwen3's 4-16) were H200 winners alone, swept without the lean merge (and Qwen3's without its
# rows made in the kernel). One-row entries, and entries swept since, say where each comes from.
ONE_LAUNCH_TABLE: dict[tuple[int, int, int], OneLaunchConfig] = {
    # The 0.5B's 4 rows swept again in the plain-step form (H100, 2026-12-06, session 59, d35c25c,
    # `LEAN_SWEEP_MODELS="qwen2.5-0.5b llama-3.2-1b" LEAN_SWEEP_ROWS="4 8 16" lean-sweep`, then
    # `loop-table-ab`): S32 -> S8, c = 4 +3.8% / +3.7%, N = 4 +4.5%, c = 16 and c = 1 level. Its 8
    # and 16 rows held. Llama's 4-row winner (w8, two KV heads a program) lost in the engine
    # (c = 4 -5.9% / -5.9%) and stayed out; its 8 and 16 rows held.
    (64, 7, 4): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=8, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (64, 7, 8): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=16, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (64, 7, 16): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=16, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (64, 4, 4): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=8, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (64, 4, 8): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=8, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (64, 4, 16): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=4, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    # Qwen3-0.6B's (and 1.7B's) one row, re-swept in the engine's form (rope_in, the lean merge;
    # H100, 2026-12-05, 5e5a580, `gpu_run.sh lean-sweep`): 6.53 us a layer alone at 1,000 tokens
    # against the derived config's 21.25. Through LLM.generate (`lean-sweep-ab` with this entry
    # alone, two interleaved fresh-process pairs, pinned Triton 3.7.1): after 32 tokens 1,515.0 /
    # 1,515.8 tok/s against 1,388.5 / 1,389.9 (+9.1%), after 1,000 1,375.7 / 1,377.8 against
    # 1,191.3 / 1,193.9 (+15.4%), after 8,000 (long steps: ONE_LAUNCH_LONG_TABLE) 848.6 / 845.1
    # against 849.7 / 844.9 (level). The entry it replaced (bn64 w4 st3 S32 min256) was swept
    # without rope_in.
    (128, 2, 1): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=64, waves=2, num_splits=16, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None, prefetch_pages=True),
    # Qwen2.5-1.5B's one row (H100, 2026-12-05, b5a4033, `ONE_LAUNCH_TABLE_JSON=lab/tables/
    # one-launch-presets-2026-12-05.json gpu_run.sh one-launch-presets-ab`, two interleaved
    # fresh-process pairs, pinned Triton 3.7.1): after 1,000 tokens through LLM.generate 657.8 /
    # 656.1 tok/s against 597.5 / 597.6 (+10%); alone 6.61 us a layer against the derived 10.81.
    # The same sweep's one-row entries for Llama-3.2-1B (-0.9%) and TinyLlama-1.1B (+2.4%, one
    # pair) stayed out, as did its long and multi-row entries (not timed in the engine).
    (128, 6, 1): OneLaunchConfig(block_n=32, num_warps=4, num_stages=3, min_split_tokens=32, waves=2, num_splits=16, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None, prefetch_pages=True),
    # Qwen3's 4 and 8 rows swept again once plain decode steps compiled the look-back out
    # (verify_rows; H100, 2026-12-06, session 58, the lean-sweep as above): the 16-row winner
    # held, these two moved (4 rows from bn64 w4 st3 S4; 8 rows from bn32 w2 st3 S8 min32). With
    # them against the tree before the look-back came out (`BASE_AB_TREE_ENV=... base-ab`):
    # Qwen3-0.6B c = 4 +1.4% / +2.4%, c = 16 +1.1% / +1.8%, N = 4 +0.9%, N = 16 +1.4%.
    (128, 2, 4): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=64, waves=2, num_splits=8, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (128, 2, 8): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=4, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (128, 2, 16): OneLaunchConfig(block_n=32, num_warps=2, num_stages=3, min_split_tokens=64, waves=2, num_splits=4, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    # TinyLlama-1.1B (64, 8): the presets table's one-row and multi-row entries (lab/tables/
    # one-launch-presets-2026-12-05.json), timed in the engine in session 59 (H100, d35c25c,
    # `LOOP_CONFIG=tinyllama-1.1b ONE_LAUNCH_TABLE_JSON=... loop-table-ab`, two interleaved pairs):
    # c = 1 +3.8% / +3.5%, c = 4 +12.0% / +12.0%, c = 16 +5.2% / +5.3%; N = 1 / 4 / 16 +4.7% /
    # +12.6% / +6.6%. Its long entry stays out (not timed past 4,096 tokens).
    (64, 8, 1): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=32, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None, prefetch_pages=True),
    (64, 8, 4): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=32, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (64, 8, 8): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=16, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (64, 8, 16): OneLaunchConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=4, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (128, 6, 4): OneLaunchConfig(block_n=64, num_warps=4, num_stages=3, min_split_tokens=64, waves=2, num_splits=16, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (128, 6, 8): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=64, waves=2, num_splits=32, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (128, 6, 16): OneLaunchConfig(block_n=64, num_warps=4, num_stages=3, min_split_tokens=64, waves=2, num_splits=8, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    # Qwen2.5-7B's 1 and 4 rows, once the fused path serves its shape (fused_decode.
    # BF16_ONE_ROW_MMA_SHAPES; H100, 2026-12-07, session 64, `LEAN_SWEEP_MODELS=qwen2.5-7b
    # LEAN_SWEEP_ROWS="1 4" lean-sweep`, lab/tables/one-launch-qwen2.5-7b-2026-12-07.json): alone
    # at 1,000 tokens 12.85 / 16.13 us a layer against the derived config's 17.45 / 18.43; one
    # stream through LLM.generate after 1,000 tokens 178.9 -> 183.5 tok/s (+2.6%). The sweep's
    # long entry stays out (not timed in the engine).
    (128, 7, 1): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=128, waves=2, num_splits=8, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None, prefetch_pages=True),
    (128, 7, 4): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=256, waves=2, num_splits=16, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    # Llama-3.1-8B's 1 and 4 rows (and Mistral-7B's: the same key, 32 / 8 heads of 128), once the
    # fused path serves its shape (H100, 2026-12-07, session 65, `LEAN_SWEEP_MODELS=llama-3.1-8b
    # LEAN_SWEEP_ROWS="1 4" lean-sweep`, lab/tables/one-launch-llama-3.1-8b-2026-12-07.json): alone
    # at 1,000 tokens the sweep's best 9.39 / 11.82 us a layer against the derived config's 15.77
    # / 20.82; with this table one stream through LLM.generate after 1,000 tokens 171.4 tok/s
    # against per-op's 161.4 (+6.2%), the closed loop c = 1 / 4 / 16 174 / 621 / 2,020 against
    # 160 / 608 / 2,022 (`FLASHLET_DECODE_TABLES=... BF16_AB_CONFIGS=llama-3.1-8b bf16-mma-ab`).
    (128, 4, 1): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=64, waves=2, num_splits=64, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
    (128, 4, 4): OneLaunchConfig(block_n=64, num_warps=4, num_stages=2, min_split_tokens=64, waves=2, num_splits=8, kv_pack=1, long_from_tokens=0, long_split_tokens=0, merge_splits=None),
}
# (head_dim, group, rows bucket) -> OneLaunchConfig for the fused steps whose longest row holds
# more than ONE_LAUNCH_LONG_CONTEXT tokens (`decode_attn_bench.py --one-launch`'s long entries:
# the best at the bucket's long contexts, where it beat what those rows run without it), or
# TWO_LAUNCH: those steps attend through the two-launch decode (split kernel + merge kernel,
# BATCHED_DECODE_TABLE's config), measured faster in the engine (`gpu_run.sh long-attn-ab`).
# Qwen2.5-0.5B's one row (H200, 2026-12-05, through LLM.generate, lab/one_stream_pair.py, one
# fresh-process pair each): after 30,000 tokens 1,228 tok/s in two launches against 1,018 in one
# (+21%), after 8,000 1,514 against 1,455 (+4%). The one-launch form's last program merges 59
# partials alone: an ~18 us tail at 30,000 tokens with the GPU idle (Nsight Compute; FUSED_NOTES.md,
# "A long-context graph for one row"). Its sweep's best one-launch config read 6-9% under the
# derived one alone. $FLASHLET_LONG_DECODE=one-launch turns such an entry off (one graph a row count).
# Qwen3-0.6B's one row (H100, 2026-12-05, 6c77db2, the lean merge on in the one-launch form, two
# interleaved fresh-process pairs, `LONG_AB_CONFIG=qwen3-0.6b gpu_run.sh long-attn-ab`): after
# 30,000 tokens 458 / 459 tok/s in two launches against 357 / 356 in one (+29%), after 8,000
# 777 / 777 against 681 / 681 (+14%). Qwen3-1.7B has the same key and the same attention (16 / 8
# heads of 128, 28 layers: the same kernels at the same shapes); its engine figure is not measured.
# Qwen2.5-7B's one row (128, 7), fused since session 64: not measured in the engine past 4,096
# tokens. Its short entry (ONE_LAUNCH_TABLE, 8 splits) read 128.5 us a layer alone at 30,000
# tokens (the derived config 106.9; H100, `lean-sweep`, lab/tables/one-launch-qwen2.5-7b-2026-12-07
# .json), so its long steps take the two launches per-op's decode ran there before, as the two
# shapes measured in the engine do (`long-attn-ab` with LONG_AB_CONFIG=qwen2.5-7b reads it); its
# 2-4 rows too (their entry was swept at 300 and 1,000 tokens only). Read in the engine in session
# 65 (H100, `gpu_run.sh large-long`, one fresh process each): after 8,000 / 30,000 tokens the
# default (two launches) 179.8 / 164.5 tok/s, one launch 160.1 / 113.9, per-op 168.8 / 155.4.
# Llama-3.1-8B's 1 and 4 rows (128, 4), fused since session 65, the same way (its short entries
# were swept at 1,000 tokens at most).
TWO_LAUNCH = "two-launch"
ONE_LAUNCH_LONG_TABLE: dict[tuple[int, int, int], OneLaunchConfig | str] = {
    (64, 7, 1): TWO_LAUNCH,
    (128, 2, 1): TWO_LAUNCH,
    (128, 7, 1): TWO_LAUNCH,
    (128, 7, 4): TWO_LAUNCH,
    (128, 4, 1): TWO_LAUNCH,
    (128, 4, 4): TWO_LAUNCH,
}
# (head_dim, group, q-length bucket) -> PrefillConfig. Measured on an H200.
PREFILL_TABLE: dict[tuple[int, int, int], PrefillConfig] = {}
# (head_dim, group, step kind) -> "triton" | "flashinfer": the faster on the H200, in the engine
# (`gpu_run.sh backend-pref`, 2026-12-03; BENCHMARKS.md). Qwen3-0.6B (128, 2), FlashInfer against
# Triton: decode-sat 38,037 against 42,899 tok/s; offline 23,856 against 22,627, but with
# FlashInfer's prefill beside Triton's decode 22,615 against 22,586 (level), and a first
# 1,000-token prompt's TTFT 18-27 against 5 ms: Triton for both. Qwen2.5-1.5B (128, 6):
# decode-sat 48,722 against 45,824, offline 33,262 against 32,197: FlashInfer for both.
STEP_KINDS = ("prefill", "decode")
BACKEND_PREFERENCE: dict[tuple[int, int, str], str] = {
    (128, 2, "decode"): "triton",
    (128, 2, "prefill"): "triton",
    (128, 6, "decode"): "flashinfer",
    (128, 6, "prefill"): "flashinfer",
}


DERIVED = None  # a sweep table's config that removes its key's entry (load_tables)


def load_tables(path: str) -> dict:
    """Put a sweep's winners (`scripts/decode_attn_bench.py --table-json`: [[key, config fields],
    ...]) into BATCHED_DECODE_TABLE (keys of four: head_dim, group, kv, bucket),
    ONE_LAUNCH_TABLE (three: head_dim, group, rows bucket) or ONE_LAUNCH_LONG_TABLE (four, the
    last "long": head_dim, group, rows bucket, "long"), or PREFILL_TABLE (four, the last
    "prefill": head_dim, group, q-length bucket, "prefill"; `scripts/prefill_split_bench.py
    --table-json`), over any entry of the same key; -> the entries. A null config (DERIVED)
    removes its key's entry: that bucket runs its derived config, for an A/B of a built-in entry
    against none. FLASHLET_DECODE_TABLES=PATH does it at import: an engine run with a sweep's
    winners before they are written here."""
    entries = {}
    for row in read_sweep_file(path, "sweep table", "decode_attn_bench.py --table-json"):
        try:
            key, cfg = row
            table = _table_of(tuple(key))
            if cfg is DERIVED or (table is ONE_LAUNCH_LONG_TABLE and cfg == TWO_LAUNCH):
                entries[tuple(key)] = cfg  # a marker, not a config's fields
                continue
            kind = (DecodeConfig if table is BATCHED_DECODE_TABLE else PrefillConfig if table is PREFILL_TABLE
                    else OneLaunchConfig)
            entries[tuple(key)] = kind(**cfg)
        except (TypeError, ValueError) as e:  # a file of another tree's fields, or not a table
            raise ValueError(f"{path}: the entry {row!r} is not a [key, config fields] pair of "
                             f"this tree's tables: {e}") from None
    for key, cfg in entries.items():
        table = _table_of(key)
        key = key[:3] if table is ONE_LAUNCH_LONG_TABLE or table is PREFILL_TABLE else key
        if cfg is DERIVED:
            table.pop(key, None)
        else:
            table[key] = cfg
    return entries


def _table_of(key: tuple) -> dict:
    """The table a sweep file's key belongs to (`load_tables`); ValueError for another shape."""
    if len(key) == 3:
        return ONE_LAUNCH_TABLE
    if len(key) == 4 and key[3] == "long":
        return ONE_LAUNCH_LONG_TABLE
    if len(key) == 4 and key[3] == "prefill":
        return PREFILL_TABLE
    if len(key) == 4 and key[2] in KV_KINDS:
        return BATCHED_DECODE_TABLE
    raise ValueError(f"a key of (head_dim, group, rows bucket[, 'long']), (head_dim, group, kv, "
                     f"bucket) or (head_dim, group, q-length bucket, 'prefill'), got {key!r}")


def read_sweep_file(path: str, what: str, writer: str) -> list:
    """The entries of a sweep's JSON file (`what`, which `writer` writes; a lone entry reads as
    a list of one); ValueError naming the path where there is no such file or it is not JSON."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable {what} ({writer} writes one): {e}") from None
    return entries if isinstance(entries, list) else [entries]


def load_from_env(variable: str, load) -> None:
    """load($variable) where the variable is set (a sweep's file for an engine run), its
    ValueError naming the variable."""
    if os.environ.get(variable):
        try:
            load(os.environ[variable])
        except ValueError as e:
            raise ValueError(f"{variable}: {e}") from None


load_from_env("FLASHLET_DECODE_TABLES", load_tables)


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value; the last bucket for anything larger."""
    for b in buckets:
        if value <= b:
            return b
    return buckets[-1]


def default_decode(head_dim: int, group: int, batch_bucket: int) -> DecodeConfig:
    """Reasoned defaults. head_dim 64 is the measured Qwen2.5-0.5B choice. At head_dim 128 a
    key block is twice the bytes and the [16, 128] accumulator twice the registers: half the
    keys per block, an extra stage to keep loads in flight, and more splits (more programs)
    since each program streams fewer tokens per iteration."""
    if head_dim >= 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=3, min_split_tokens=128, waves=4)
    return DecodeConfig()


def default_prefill(head_dim: int, group: int, qlen_bucket: int) -> PrefillConfig:
    """Short chunks (mixed steps) fill a 64-row tile only with G >= 4 rows per token: use 32
    rows for small groups. head_dim 128: 8 warps share the [BM, 128] fp32 accumulator."""
    short = qlen_bucket <= PREFILL_QLEN_BUCKETS[0]
    block_m = 32 if short and group < 4 else 64
    # Longer chunks split their keys 8 ways, splits of at least 1,024 keys (past
    # PREFILL_SPLIT_MIN_CONTEXT): within 14% of the best split cap and smallest split measured
    # for both shapes at 4k-30k tokens, within 4% but at qwen2.5-0.5b's 8k (where 4 splits win)
    # (scripts/prefill_split_bench.py on the H200: qwen2.5-0.5b 1.71x / 1.96x / 2.66x at 4k / 8k
    # / 30k, qwen3-0.6b 1.09x / 1.25x / 1.60x). With every step of the long-prompt-gaps
    # workload split, the streams' token gaps went from 3.57 / 5.72-6.07 ms (p50 / p99) to 2.71 /
    # 4.68 and the long prompts' TTFT from 291 to 224 ms.
    # Short chunks (a cached prompt's last page, a speculative verify, decodes beside a short
    # chunk) are one tile a KV head: unsplit, Qwen3-0.6B's 16-token chunk after 8,000 cached
    # tokens took 381 us a layer on 8 programs. Split 16 ways (head_dim 128, splits of 512+ keys)
    # or 32 (head_dim 64, 256+), a 1-token LLM.generate call on that cached prompt went from 13.7
    # to 6.9 ms (Qwen3-0.6B; 45.4 to 11.4-13.6 after 30,000) and from 6.4 to 3.7 ms (Qwen2.5-0.5B;
    # 19.0 to 7.0 after 30,000): `lab/cached_prompt_call.py` with $FLASHLET_PREFILL_SPLITS, H100,
    # 2026-12-05. The other of the two settings read 8.8 / 14.6 ms (Qwen3, 32 x 256) and 3.7 / 9.2
    # (0.5B, 16 x 512). A step of more rows than PREFILL_SPLIT_SCRATCH_ROWS holds at those splits
    # (512 / 256) runs unsplit: it has as many tiles.
    if not short:
        splits = dict(num_splits=8, min_split_tokens=1024)
    elif head_dim >= 128:
        splits = dict(num_splits=16, min_split_tokens=512, split_max_tokens=PREFILL_SPLIT_SCRATCH_ROWS // 16)
    else:
        splits = dict(num_splits=32, min_split_tokens=256, split_max_tokens=PREFILL_SPLIT_SCRATCH_ROWS // 32)
    if head_dim >= 128:
        return PrefillConfig(block_m=block_m, block_n=32 if short else 64, num_warps=8 if not short else 4,
                             **splits)
    return PrefillConfig(block_m=block_m, **splits)


def decode_config(head_dim: int, group: int, num_seqs: int) -> DecodeConfig:
    b = bucket(num_seqs, DECODE_BATCH_BUCKETS)
    return DECODE_TABLE.get((head_dim, group, b)) or default_decode(head_dim, group, b)


def batched_decode_config(head_dim: int, group: int, num_seqs: int, kv: str = "model") -> DecodeConfig:
    """The two-launch decode's config: BATCHED_DECODE_TABLE for the KV dtype (kv: "model" or
    "fp8"), else `decode_config`."""
    if kv not in KV_KINDS:
        raise ValueError(f"kv must be one of {KV_KINDS}, got {kv!r}")
    b = bucket(num_seqs, DECODE_BATCH_BUCKETS)
    return BATCHED_DECODE_TABLE.get((head_dim, group, kv, b)) or decode_config(head_dim, group, num_seqs)


def one_launch_table_config(head_dim: int, group: int, rows: int, long: bool = False) -> OneLaunchConfig | str | None:
    """ONE_LAUNCH_TABLE's entry (long: ONE_LAUNCH_LONG_TABLE's, which may be TWO_LAUNCH) for a
    step of `rows` rows (its bucket), or None: no entry, or more rows than the last bucket."""
    if rows > ONE_LAUNCH_ROW_BUCKETS[-1]:
        return None
    table = ONE_LAUNCH_LONG_TABLE if long else ONE_LAUNCH_TABLE
    return table.get((head_dim, group, bucket(rows, ONE_LAUNCH_ROW_BUCKETS)))


def prefill_config(head_dim: int, group: int, max_q_len: int) -> PrefillConfig:
    b = bucket(max_q_len, PREFILL_QLEN_BUCKETS)
    return PREFILL_TABLE.get((head_dim, group, b)) or default_prefill(head_dim, group, b)


def num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, waves: int, max_splits: int) -> int:
    """Most KV splits per sequence, from the batch shape only (so it is CUDA-graph stable):
    next_pow2(waves * SMs / (B * Hkv)), clamped to [1, prev_pow2(max_splits)]."""
    want = _next_pow2(math.ceil(waves * num_sms / max(1, num_seqs * num_kv_heads)))
    return max(1, min(want, _prev_pow2(max_splits)))


def config_splits(cfg: DecodeConfig | OneLaunchConfig, num_seqs: int, num_kv_heads: int, num_sms: int,
                  max_splits: int) -> int:
    """The split cap a decode config (two-launch or one-launch) gives a batch: its measured
    `num_splits` where it has one (clamped like `num_splits`), else the one its `waves` aim at
    (programs of kv_pack heads)."""
    if cfg.num_splits is not None:
        return max(1, min(_prev_pow2(cfg.num_splits), _prev_pow2(max_splits)))
    groups = num_kv_heads // kv_pack_for(cfg, num_kv_heads)
    return num_splits(num_seqs, groups, num_sms, cfg.waves, max_splits)


def measured_split_cap(cfg: DecodeConfig | OneLaunchConfig, default_cap: int) -> int:
    """The split cap a config runs under: default_cap, raised to a measured entry's num_splits up
    to MEASURED_SPLIT_CAP (the derived configs, with no num_splits, keep default_cap)."""
    if cfg.num_splits is None:
        return default_cap
    return max(default_cap, min(cfg.num_splits, MEASURED_SPLIT_CAP))


def kv_pack_for(cfg: DecodeConfig | OneLaunchConfig, num_kv_heads: int) -> int:
    """The config's KV heads a program, lowered to a power of two that divides num_kv_heads
    (the tables are keyed by head_dim and group, not by the number of KV heads)."""
    pack = _prev_pow2(cfg.kv_pack)
    while num_kv_heads % pack:
        pack //= 2
    return pack


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def preferred_backend(head_dim: int, group: int, flashinfer_ok: bool,
                      kind: str = "prefill") -> tuple[str, str]:
    """(backend, why) for `--backend auto` on CUDA, for one step kind (STEP_KINDS)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"step kind {kind!r}: expected one of {STEP_KINDS}")
    measured = BACKEND_PREFERENCE.get((head_dim, group, kind))
    if measured is not None:
        if measured == "flashinfer" and not flashinfer_ok:
            return "triton", (f"flashinfer measured faster at {kind} steps for head_dim {head_dim}, "
                              f"group {group}, but it is not importable")
        return measured, f"measured faster at {kind} steps for head_dim {head_dim}, group {group} (gpu_run.sh backend-pref)"
    # Not measured: our kernels are tuned at head_dim 64; FlashInfer's FA2 kernels at 128.
    if head_dim >= 128 and flashinfer_ok:
        return "flashinfer", f"no measurement for head_dim {head_dim}, group {group}: FlashInfer's default at head_dim >= 128"
    return "triton", f"no measurement for head_dim {head_dim}, group {group}: Triton (tuned at head_dim 64)" + (
        "" if flashinfer_ok else "; flashinfer is not importable")
