"""The Triton attention backend: `flashlet/kernels/` decode and ragged prefill kernels.

- Asked for (`one_launch_decode`, or $FLASHLET_ONE_LAUNCH_DECODE=1 / "nopdl" without PDL, read
  by the constructor), pure-decode steps of up to `one_launch_decode_rows` rows
  (ONE_LAUNCH_DECODE_MAX_ROWS, the one-launch form's rows buckets: 16) attend in ONE launch a
  layer, `attend_one_launch`'s (below; with Programmatic Dependent Launch where
  `pdl_supported`), through every entry: the per-op path's `run` / `run_rope` as well as the
  fused path's. Its merge is in the kernel, so the merge kernel's launch goes (5.1 of 13.7 us a
  layer at Qwen2.5-7B's shape after a 1,000-token prompt, FUSED_NOTES.md, "Issue 31: the 7B fp8
  step, per-op"). Off by default: at that shape, with no measured (128, 7) table entry, one
  stream after 1,000 tokens ran 205 / 205 tok/s with it against 214 / 214 without (two
  interleaved pairs, H200, 2026-12-04). An fp8 pool is read by it too (widened to q's dtype,
  its scales applied as in the two-launch form). Which form a batch size takes is fixed at
  construction, so a CUDA graph keyed by the batch size holds one form.
- Larger pure-decode steps run `decode_attention` (grid (B, Hkv, S): one program per sequence, KV
  group and KV split, then a log-sum-exp merge when S > 1). S, the most splits per sequence,
  and the tile sizes are chosen in `plan` from the batch size alone (`kernels/tuning.py`), so
  a CUDA graph captured for a batch size is valid for any KV lengths; the per-sequence split
  count is derived on the device from `kv_lens`. The split partials live in buffers allocated
  once, in the constructor, shared by both forms (a step runs one of them; each leaves the merge
  counters at zero, and the launches of one stream never overlap on them: a PDL launch touches
  them only after its wait).
- Every other step (prefill chunks, possibly mixed with decodes) runs one `prefill_attention`
  launch over the ragged batch, its tiles chosen from a bucket of the longest chunk. Its grid
  depends on the token and sequence counts only, so a mixed step padded to a token bucket and
  as many sequences (`StepBuffers.load(pad_tokens=)`) replays from a CUDA graph
  (`supports_mixed_graph`; the graph is keyed by `prefill_variant` too). Steps of at most
  the config's `split_max_tokens` rows whose longest KV holds at least
  `prefill_split_min_context` tokens split each tile's keys (the config's `num_splits`;
  $FLASHLET_PREFILL_SPLITS sets them for an A/B), their partials in one scratch allocated here
  (a view of it per config); the split count a tile uses is derived on the device from
  `kv_lens`. Whether a step splits is decided in `plan` from its host
  layout, so a mixed graph is keyed by it too (`mixed_graph_key`; `warm_contexts` gives
  the warm-up a context length that reaches each).

- `attend_one_launch` (the fused decode path's one-launch attention, and the per-op path's up to
  `one_launch_decode_rows` rows): the same split-KV decode in
  ONE launch, each KV group's last split program merging the partials
  (`decode_attention_one_launch`: per-(sequence, KV head) counters owned here, left at zero by
  every launch), optionally with Programmatic Dependent Launch. Its smallest split is
  ONE_LAUNCH_MIN_SPLIT_TOKENS: at batch 1 a merge costs a dependent atomic and an L2 round trip
  (~1.5 us), a 64-key block of one split ~0.25 us once pipelined, so splitting pays only past
  ~6 blocks; 256 tokens (4 blocks) keeps contexts up to 256 unsplit and one merge at most
  per layer up to 4k tokens on 16 splits x Hkv programs (FUSED_NOTES.md, "Stage 2, plan C").
  That derived config holds where `tuning.ONE_LAUNCH_TABLE` (measured per head_dim, group and
  rows bucket) has no entry; an entry sets the tile, the split cap, KV heads a program and the
  split lengths (runtime values: a graph per row count serves every context length). Where
  `tuning.ONE_LAUNCH_LONG_TABLE` has an entry for the rows bucket, a one-launch step whose
  longest row holds more than ONE_LAUNCH_LONG_CONTEXT tokens takes it instead: `graph_key` then
  says "long" (a second graph per row count) and `decode_warm_contexts` gives the warm-up a
  context that reaches it. With $FLASHLET_LONG_DECODE=two-launch (an A/B, read by the
  constructor; =one-launch ignores a TWO_LAUNCH entry), or where the table's entry is
  `tuning.TWO_LAUNCH`, those steps attend through the
  two-launch decode instead (split kernel + merge kernel, the batched table's config; a `rope_in`
  step's rows made by the pool's RoPE + K/V write first).
- A verify step laid out as decode rows (`StepLayout.verify_as_decode_rows`: rows of one
  sequence, each reading K/V rows the rows before it write) compiles the one-launch kernel's
  look-back over earlier rows (`one_launch_lookback`, with PDL or rope_in); a plain decode step,
  every row another sequence's, compiles it out (fewer registers at 2+ rows). `graph_key` says
  "verify" for the first: a graph of its own per row count, captured at the warm-up where the
  engine speculates (`verify_graph_sizes`), else at the first such step.

`decode_variant(B)` and `prefill_variant(max_q_len)` name what a step compiles: a finite set
that `flashlet/core/warmup.py` covers at engine start.

`plan` does host arithmetic only (no device allocation, no copies). `run` launches kernels on
tensors the metadata already holds: no host sync, no `.item()`, no `.tolist()`, so a pure-decode
`run` can be captured in a CUDA graph (its output is allocated by the caching allocator, which
graphs capture). The K/V write (fused with RoPE in the model's path) is the base class's.
An fp8 pool is read as fp8 by the same kernels, with its per-layer k_scale / v_scale.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from flashlet.attention.base import AttentionBackend, AttentionMetadata
from flashlet.kernels import tuning
from flashlet.kernels.cute_gemv import PARTIAL_DTYPES, SplitPartials, merge_in  # plain Python: the DSL loads on first compile
from flashlet.kernels.decode_attention import (RopeIn, decode_attention, decode_attention_one_launch,
                                               one_launch_counters, one_launch_lookback)
from flashlet.kernels.pdl import pdl_supported
from flashlet.kernels.prefill_attention import prefill_attention, split_scratch
from flashlet.kvcache.kv_pool import KVPool


# The decode forms' split cap where the caller gives none and no measured entry says more: the
# derived configs' splits (waves of programs an SM) stop here.
DEFAULT_SPLIT_CAP = 64
# The smallest KV split of the one-launch decode (see the module docstring).
ONE_LAUNCH_MIN_SPLIT_TOKENS = 256
# At head_dim <= 64 one block of the one-launch decode is a whole smallest split, loaded before
# its PDL wait, with 8 warps (255 registers, no spills at sm_90a): after the wait only q and the
# newest K/V row remain to load (faster at batch 1 than 64-key blocks: BENCHMARKS.md). At
# head_dim 128 a 128-key block spills, so the decode config's blocks stay.
ONE_LAUNCH_WHOLE_SPLIT_HEAD_DIM = 64
ONE_LAUNCH_WHOLE_SPLIT_WARPS = 8
# The one-launch form that makes its rows in the kernel (`rope_in`) reads one KV head a program,
# with at least ROPE_IN_MIN_WARPS warps where a block holds ROPE_IN_WIDE_BLOCK+ elements (BLOCK_N x
# head_dim). ptxas (sm_90a, Triton 3.7) at Qwen3's table entries, with the rows made in the kernel
# (without them): one row, 64 keys x 128, 4 warps, 992 bytes spilled (160); 4 rows, two KV heads a
# program, 8 warps, 736 (160); 16 rows, two heads, 32 keys, 4 warps, 228 (68). One head a program,
# 8 warps at 64 keys and 4 at 32: none. At steps of 2+ rows the newest row now opens the softmax
# instead of riding the block loop (`NEWEST_FIRST`, 2026-12-06, FUSED_NOTES "Session 56"): the
# 4-row form 0 (235 registers), the 16-row one 104; one row keeps the loop's splice (992). The
# rule stays until a sweep times the forms it would then allow.
ROPE_IN_MIN_WARPS = 8
ROPE_IN_WIDE_BLOCK = 8192


def rope_in_form(cfg: tuning.OneLaunchConfig, head_dim: int) -> tuning.OneLaunchConfig:
    """A one-launch config as `rope_in` runs it: one KV head a program, and at least
    ROPE_IN_MIN_WARPS warps at wide blocks (the splits stay the config's). The backend and
    the kernel benchmarks (decode_attn_bench.py's rope_in variants) launch this form."""
    warps = cfg.num_warps
    if cfg.block_n * head_dim >= ROPE_IN_WIDE_BLOCK:
        warps = max(warps, ROPE_IN_MIN_WARPS)
    return dataclasses.replace(cfg, kv_pack=1, num_warps=warps)


# "S[,min_split_tokens[,max_tokens[,min_context]]]": the split-KV prefill's settings for a GPU
# A/B without editing code (read once, by the constructor; its arguments win; "1": off). The
# tables' and tuning's values where unset.
PREFILL_SPLITS_ENV = "FLASHLET_PREFILL_SPLITS"
# The most rows of a pure-decode step that attends in one launch: the one-launch form's last rows
# bucket (its table is measured up to there; the PDL look-back covers every earlier row of it).
ONE_LAUNCH_DECODE_MAX_ROWS = tuning.ONE_LAUNCH_ROW_BUCKETS[-1]
# "two-launch": the one-launch steps past ONE_LAUNCH_LONG_CONTEXT tokens (see above) attend in
# two launches; "one-launch": they never do (a TWO_LAUNCH entry is ignored: one graph, as before
# 2026-12-05); unset or "table": ONE_LAUNCH_LONG_TABLE's entry where it has one. Read once, by
# the constructor, for a GPU A/B in a fresh process.
LONG_DECODE_ENV = "FLASHLET_LONG_DECODE"
# "1": pure-decode steps of the per-op path attend in one launch, with PDL where the device has
# it; "nopdl": one launch without PDL; unset or "0": the two-launch form (decode kernel + merge
# kernel). Read once, by the constructor (its one_launch_decode / one_launch_pdl win), for a GPU
# A/B in a fresh process.
ONE_LAUNCH_DECODE_ENV = "FLASHLET_ONE_LAUNCH_DECODE"


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    supports_mixed_graph = True
    supports_one_launch_decode = True

    def __init__(
        self,
        kv_pool: KVPool,
        num_q_heads: int,
        scale: float | None = None,
        *,
        max_batch_size: int = 256,
        max_pages_per_seq: int | None = None,
        max_kv_splits: int | None = None,
        min_split_tokens: int | None = None,
        num_sms: int | None = None,
        decode_block_n: int | None = None,
        prefill_block_m: int | None = None,
        prefill_block_n: int | None = None,
        prefill_num_splits: int | None = None,
        prefill_min_split_tokens: int | None = None,
        prefill_split_max_tokens: int | None = None,
        prefill_split_min_context: int | None = None,
        one_launch_decode: bool | None = None,
        one_launch_pdl: bool | None = None,
    ):
        """max_batch_size: largest decode batch that may use split-KV (larger ones run unsplit,
        which needs no scratch). max_pages_per_seq: longest sequence in pages (default: the
        pool); with min_split_tokens it caps the useful splits. max_kv_splits: hard cap (rounded
        down to a power of two; None: DEFAULT_SPLIT_CAP, which a measured table entry's
        num_splits may pass, up to tuning.MEASURED_SPLIT_CAP). num_sms: the device's SM count
        (read from the device, 4 on CPU).
        min_split_tokens, decode_block_n, prefill_block_m/n: fixed values for every batch
        instead of `flashlet.kernels.tuning`'s per-shape tables (None: the tables).
        prefill_num_splits / prefill_min_split_tokens: the prefill kernel's split-KV cap and
        smallest split for every step (None: $FLASHLET_PREFILL_SPLITS, else the tables), used
        by steps of at most prefill_split_max_tokens query rows (None: that variable's third
        value, else the tables: per bucket, its scratch rows over its splits), whose longest
        KV holds at least prefill_split_min_context tokens (None: its fourth value, else
        tuning.PREFILL_SPLIT_MIN_CONTEXT). one_launch_decode: pure-decode steps of up to
        ONE_LAUNCH_DECODE_MAX_ROWS rows (and max_batch_size) attend in one launch, whatever the
        caller (None: $FLASHLET_ONE_LAUNCH_DECODE, else off); one_launch_pdl: those launches use
        PDL, where the device has it (None: that variable, else on)."""
        super().__init__(kv_pool, num_q_heads, scale)
        if num_q_heads % self.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads do not split into {self.num_kv_heads} KV heads")
        device = kv_pool.k_cache.device
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        if max_pages_per_seq is None:
            max_pages_per_seq = kv_pool.num_pages
        self.group = num_q_heads // self.num_kv_heads
        self.max_tokens = max_pages_per_seq * kv_pool.page_size
        self.max_batch_size = max_batch_size
        self.split_cap = DEFAULT_SPLIT_CAP if max_kv_splits is None else max_kv_splits
        self._split_cap_given = max_kv_splits is not None
        self.num_sms = num_sms
        self._decode_overrides = _given(min_split_tokens=min_split_tokens, block_n=decode_block_n)
        env = prefill_splits_from_env()
        self._prefill_overrides = _given(
            block_m=prefill_block_m, block_n=prefill_block_n,
            num_splits=_first_given(prefill_num_splits, env.get("num_splits")),
            min_split_tokens=_first_given(prefill_min_split_tokens, env.get("min_split_tokens")),
            split_max_tokens=_first_given(prefill_split_max_tokens, env.get("max_tokens")))
        self.prefill_split_min_context = _first_given(prefill_split_min_context, env.get("min_context"),
                                                      tuning.PREFILL_SPLIT_MIN_CONTEXT)
        prefill_cfgs = [self.prefill_config(b) for b in tuning.PREFILL_QLEN_BUCKETS]
        if min([self.prefill_split_min_context] + [min(c.num_splits, c.split_max_tokens) for c in prefill_cfgs]) < 1:
            raise ValueError(f"prefill splits, their token limit and their smallest context must be >= 1, "
                             f"got {[(c.num_splits, c.split_max_tokens) for c in prefill_cfgs]}, "
                             f"{self.prefill_split_min_context}")
        # The split prefill's partials: one buffer of the most splits x rows any bucket's config
        # splits, and each such config's [splits, rows, ...] view of its start (none: no scratch).
        split_cfgs = [c for c in prefill_cfgs if c.num_splits > 1]
        self._prefill_scratch, self._prefill_scratch_views = None, {}
        if split_cfgs and self.max_tokens >= self.prefill_split_min_context:  # reachable
            rows = max(c.num_splits * c.split_max_tokens for c in split_cfgs)
            self._prefill_scratch = tuple(t[0] for t in split_scratch(1, rows, num_q_heads, self.head_dim, device))
            self._prefill_scratch_views = {
                c: tuple(t[:c.num_splits * c.split_max_tokens].view(c.num_splits, c.split_max_tokens, *t.shape[1:])
                         for t in self._prefill_scratch) for c in split_cfgs}
        self.max_kv_splits = max(self._max_splits(cfg.min_split_tokens, cfg)
                                 for cfg in map(self.decode_config, tuning.DECODE_BATCH_BUCKETS))
        # Every batch's one-launch (config, splits), its short and long graphs'.
        widest = {b: (self.one_launch_config(b), self.one_launch_config(b, long=True))
                  for b in range(1, max_batch_size + 1)}
        # Split scratch, sized for the worst batch of either decode form: rows = max over B of B * S(B).
        splits = [max(self._splits_for(b), *(s for _, s in forms)) for b, forms in widest.items()]
        rows = max((b * s for b, s in enumerate(splits, start=1) if s > 1), default=0)
        self._mid_o = torch.empty((rows, num_q_heads, self.head_dim), dtype=torch.float32, device=device)
        self._mid_lse = torch.empty((rows, num_q_heads), dtype=torch.float32, device=device)
        # The same scratch's first half as bf16 rows: partials left to a consumer's merge in bf16
        # (`attend_one_launch(partials="bf16")`).
        self._mid_o_bf16 = self._mid_o.view(-1).view(torch.bfloat16)[: self._mid_o.numel()].view(self._mid_o.shape)
        # The one-launch decode's merge counters, one per (sequence, KV head) and, for a config
        # that merges in two levels, one per group of splits too; zero between launches.
        counters = max(one_launch_counters(b, self.num_kv_heads, s, cfg.merge_group)
                       for b, forms in widest.items() for cfg, s in forms)
        self._merge_counts = torch.zeros(counters, dtype=torch.int32, device=device)
        one_launch = one_launch_decode_from_env()
        on = _first_given(one_launch_decode, one_launch.get("on"), False)
        self.one_launch_decode_rows = min(ONE_LAUNCH_DECODE_MAX_ROWS, max_batch_size) if on else 0
        self.one_launch_pdl = bool(_first_given(one_launch_pdl, one_launch.get("pdl"), True)) and pdl_supported(device)
        self._decode_one_launch = False  # the planned pure-decode step attends in one launch
        # Pure-decode steps of up to this many rows attend in one launch through the fused decode
        # path (the runner sets it where this backend is the fused path's attention): with
        # one_launch_decode_rows, the steps a long-context entry can serve.
        self.fused_rows = 0
        self.long_decode = long_decode_from_env()
        self._long_meta = None  # the last step `long_context` was asked about, and its answer
        self._long = False
        self._num_splits = 1
        self._decode_cfg = self.decode_config(1)
        # decode_variant of each batch size planned so far: a function of the batch size, of
        # what the constructor fixed and of kernels/tuning's tables as that size's first plan
        # read them (a table patched later does not reach a size planned before), so a step (a
        # speculating stream's, ~0.9 ms apart on the H200: BENCHMARKS.md) reads it instead of
        # rebuilding two configs (12.6 us of greedy_tokens in bench_host_step --fused --spec 4
        # on the CPU)
        self._decode_variants: dict[int, tuple] = {}
        self._prefill_cfg = self.prefill_config(1)
        self._prefill_step_splits = 1  # the planned step's split cap (`prefill_splits`)

    # ---- launch configurations: functions of the batch shape only (see kernels/tuning.py) ----
    def decode_config(self, num_seqs: int) -> tuning.DecodeConfig:
        """The two-launch decode's config, measured per KV dtype (`tuning.batched_decode_config`)."""
        kv = "fp8" if self.kv_pool.is_fp8 else "model"
        cfg = tuning.batched_decode_config(self.head_dim, self.group, num_seqs, kv)
        return dataclasses.replace(cfg, **self._decode_overrides)

    def prefill_config(self, max_q_len: int) -> tuning.PrefillConfig:
        cfg = tuning.prefill_config(self.head_dim, self.group, max_q_len)
        return dataclasses.replace(cfg, **self._prefill_overrides)

    def _max_splits(self, split_tokens: int,
                    cfg: tuning.DecodeConfig | tuning.OneLaunchConfig | None = None) -> int:
        """Splits beyond ceil(longest sequence / smallest split) would all be empty; and at most
        the split cap, which a measured entry's num_splits (cfg's) may raise to
        tuning.MEASURED_SPLIT_CAP where the caller gave no cap."""
        cap = self.split_cap
        if cfg is not None and not self._split_cap_given:
            cap = tuning.measured_split_cap(cfg, cap)
        return max(1, min(cap, -(-self.max_tokens // split_tokens)))

    def _splits_for(self, num_seqs: int, cfg: tuning.DecodeConfig | None = None) -> int:
        """The two-launch decode's splits for a batch (cfg: its `decode_config`, when known)."""
        if num_seqs > self.max_batch_size:
            return 1
        cfg = self.decode_config(num_seqs) if cfg is None else cfg
        return tuning.config_splits(cfg, num_seqs, self.num_kv_heads, self.num_sms,
                                    self._max_splits(cfg.min_split_tokens, cfg))

    def one_launch_config(self, num_seqs: int, table: bool = True,
                          long: bool = False) -> tuple[tuning.OneLaunchConfig, int]:
        """(config, splits) of `attend_one_launch` for a batch: `tuning.ONE_LAUNCH_TABLE`'s
        measured entry for the rows bucket (long: `ONE_LAUNCH_LONG_TABLE`'s, where it has one;
        the constructor's fixed block_n / min_split_tokens still win), else (or with
        table=False) the derived config (`derived_one_launch_config`)."""
        cfg = None
        if table and long:
            cfg = tuning.one_launch_table_config(self.head_dim, self.group, num_seqs, long=True)
            cfg = None if cfg == tuning.TWO_LAUNCH else cfg
        if table and cfg is None:
            cfg = tuning.one_launch_table_config(self.head_dim, self.group, num_seqs)
        if cfg is None:
            cfg = self.derived_one_launch_config(num_seqs)
        else:
            cfg = dataclasses.replace(cfg, kv_pack=tuning.kv_pack_for(cfg, self.num_kv_heads),
                                      **self._decode_overrides)
        if num_seqs > self.max_batch_size:
            return cfg, 1
        max_splits = self._max_splits(cfg.smallest_split_tokens(), cfg)
        return cfg, tuning.config_splits(cfg, num_seqs, self.num_kv_heads, self.num_sms, max_splits)

    def derived_one_launch_config(self, num_seqs: int) -> tuning.OneLaunchConfig:
        """The one-launch config where no measurement holds: the decode config with the smallest
        split raised to ONE_LAUNCH_MIN_SPLIT_TOKENS and, at small head dims, blocks of a whole
        split. It starts from `tuning.decode_config`, not the two-launch form's per-KV-dtype
        table (the scratch is sized for both forms)."""
        cfg = tuning.decode_config(self.head_dim, self.group, num_seqs)
        cfg = dataclasses.replace(cfg, **self._decode_overrides)
        cfg = dataclasses.replace(cfg, min_split_tokens=max(cfg.min_split_tokens, ONE_LAUNCH_MIN_SPLIT_TOKENS))
        if self.head_dim <= ONE_LAUNCH_WHOLE_SPLIT_HEAD_DIM and "block_n" not in self._decode_overrides:
            cfg = dataclasses.replace(cfg, block_n=cfg.min_split_tokens, num_warps=ONE_LAUNCH_WHOLE_SPLIT_WARPS)
        return tuning.OneLaunchConfig(block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                      min_split_tokens=cfg.min_split_tokens, waves=cfg.waves)

    def has_long_entry(self, num_seqs: int) -> bool:
        """Does a one-launch step of `num_seqs` rows take a long-context entry past
        ONE_LAUNCH_LONG_CONTEXT tokens? (A step the per-op path runs in two launches does not.)"""
        attends_in_one = num_seqs <= max(self.one_launch_decode_rows, self.fused_rows)
        if not attends_in_one or self.max_tokens <= tuning.ONE_LAUNCH_LONG_CONTEXT:
            return False
        entry = tuning.one_launch_table_config(self.head_dim, self.group, num_seqs, long=True)
        if self.long_decode == "one-launch":
            return entry is not None and entry != tuning.TWO_LAUNCH
        return self.long_decode == "two-launch" or entry is not None

    def long_in_two_launches(self, num_seqs: int) -> bool:
        """Do long one-launch steps of `num_seqs` rows attend in two launches (the table's
        TWO_LAUNCH entry, or $FLASHLET_LONG_DECODE=two-launch; never with =one-launch)?"""
        if self.long_decode != "table":
            return self.long_decode == "two-launch"
        return tuning.one_launch_table_config(self.head_dim, self.group, num_seqs, long=True) == tuning.TWO_LAUNCH

    def long_context(self, meta: AttentionMetadata) -> bool:
        """Does this pure-decode step take its rows bucket's long-context entry (its longest row
        past ONE_LAUNCH_LONG_CONTEXT tokens)? Asked by `graph_key` and `attend_one_launch`,
        not by `plan`: a steady step replays its graph unplanned for it, and reading its KV
        lengths would build the host arrays it skips (its graph stays the one it had). So the
        switch falls on a step that loads: past the threshold, a multiple of the page size, the
        row's newest token is its page's first, which no steady step is (at "at least", the
        step at the threshold replayed the short graph while an eager run took the long
        config, and their tokens parted at near ties: the H100, 2026-12-05)."""
        if meta is not self._long_meta:
            self._long_meta = meta
            self._long = (meta.is_pure_decode and self.has_long_entry(meta.num_seqs)
                          and meta.host.max_kv_len > tuning.ONE_LAUNCH_LONG_CONTEXT)
        return self._long

    def graph_key(self, meta: AttentionMetadata) -> tuple:
        """("long",) for a step that takes a long-context entry (`long_context`), ("verify",)
        for one that compiles the look-back (`looks_back`): each its own graph."""
        return ("long",) * self.long_context(meta) + ("verify",) * self.looks_back(meta)

    @staticmethod
    def looks_back(meta: AttentionMetadata) -> bool:
        """Does this pure-decode step's one-launch attention look back over earlier rows of its
        own sequence: a verify step's decode rows, 2+ of them (`decode_attention_one_launch`'s
        verify_rows; PDL or rope_in decide whether the kernel needs it, not the graph key)."""
        return meta.host.verify_as_decode_rows and one_launch_lookback(meta.num_seqs) > 0

    def decode_warm_contexts(self, num_seqs: int) -> tuple[int, ...]:
        """A pure-decode step's longest KV per graph of `num_seqs` rows: with a long-context
        entry, a short one and ONE_LAUNCH_LONG_CONTEXT."""
        return (0, tuning.ONE_LAUNCH_LONG_CONTEXT) if self.has_long_entry(num_seqs) else (0,)

    def decode_variant(self, num_seqs: int) -> tuple:
        """What a plain pure-decode step of `num_seqs` compiles: (config, splits), a
        `tuning.DecodeConfig` for the two-launch form, a `tuning.OneLaunchConfig` where the step
        attends in one launch (`one_launch_decode_rows`). A verify step's decode rows compile
        the look-back besides (`looks_back`)."""
        if num_seqs <= self.one_launch_decode_rows:
            return self.one_launch_config(num_seqs)
        cfg = self.decode_config(num_seqs)
        return cfg, self._splits_for(num_seqs, cfg)

    def prefill_variant(self, max_q_len: int) -> tuple:
        """What a step with a chunk (longest `max_q_len`) compiles. Whether it splits also
        depends on its (padded) token count, which a mixed graph's key holds beside this."""
        return (self.prefill_config(max_q_len),)

    def prefill_splits(self, max_q_len: int, num_tokens: int, max_kv_len: int) -> int:
        """The split cap of a step with a chunk: its longest chunk's config's, where the step
        has at most that config's split_max_tokens query rows (padded: its token bucket) and its
        longest KV at least prefill_split_min_context tokens; else 1."""
        return self._splits_of(self.prefill_config(max_q_len), num_tokens, max_kv_len)

    def _splits_of(self, cfg: tuning.PrefillConfig, num_tokens: int, max_kv_len: int) -> int:
        if num_tokens > cfg.split_max_tokens or max_kv_len < self.prefill_split_min_context:
            return 1
        return cfg.num_splits

    def _prefill_step(self, meta: AttentionMetadata) -> tuple[tuning.PrefillConfig, int]:
        """(config, split cap) of a step with a chunk, from its host layout."""
        host = meta.host
        cfg = self.prefill_config(host.max_query_len)
        return cfg, self._splits_of(cfg, meta.token_bucket or host.num_tokens, host.max_kv_len)

    def mixed_graph_key(self, meta: AttentionMetadata) -> tuple:
        return self._prefill_step(meta)  # (prefill_variant's config, the split cap)

    def warm_contexts(self, num_tokens: int, max_q_len: int) -> tuple[int, ...]:
        """One step's longest KV per mixed graph of this shape: with splitting reachable, a
        short one and prefill_split_min_context."""
        if self.prefill_splits(max_q_len, num_tokens, self.prefill_split_min_context) > 1:
            return (0, self.prefill_split_min_context)
        return (0,)

    # ---- plan / run -----------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        if meta.is_pure_decode:
            n = meta.num_seqs
            variant = self._decode_variants.get(n)
            if variant is None:
                variant = self._decode_variants[n] = self.decode_variant(n)
            self._decode_one_launch = n <= self.one_launch_decode_rows  # decode_variant's form
            self._decode_cfg, self._num_splits = variant[:2]
        else:
            self._decode_one_launch = False
            self._prefill_cfg, self._prefill_step_splits = self._prefill_step(meta)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.kv_pool.k_cache[layer], self.kv_pool.v_cache[layer]
        k_scale, v_scale = self.kv_pool.scales(layer)  # 1.0 unless an fp8 pool's
        if not meta.is_pure_decode:
            pc, splits = self._prefill_cfg, self._prefill_step_splits
            return prefill_attention(
                q, k_cache, v_cache,
                meta.qo_indptr, meta.paged_kv_indptr, meta.paged_kv_indices, meta.kv_lens, self.scale,
                out=self._prefill_out(q),
                block_m=pc.block_m,
                block_n=pc.block_n,
                num_warps=pc.num_warps,
                num_stages=pc.num_stages,
                k_scale=k_scale,
                v_scale=v_scale,
                num_splits=splits,
                min_split_tokens=pc.min_split_tokens,
                scratch=self._prefill_scratch_views[pc] if splits > 1 else None,
            )
        if self._decode_one_launch:
            return self.attend_one_launch(layer, q, pdl=self.one_launch_pdl)
        return self._two_launch_decode(layer, q, self._decode_cfg, self._num_splits)

    def _two_launch_decode(self, layer: int, q: torch.Tensor, dc: tuning.DecodeConfig, s: int) -> torch.Tensor:
        """A pure-decode step's attention in two launches (split kernel, then merge) with config
        dc and split cap s; rows past the sequences get zeros."""
        meta = self.meta
        k_scale, v_scale = self.kv_pool.scales(layer)
        n = meta.num_seqs
        out = torch.empty_like(q)
        decode_attention(q[:n], self.kv_pool.k_cache[layer], self.kv_pool.v_cache[layer],
                         meta.paged_kv_indptr, meta.paged_kv_indices, meta.kv_lens, self.scale, out=out[:n],
                         num_splits=s, min_split_tokens=dc.min_split_tokens, block_n=dc.block_n,
                         mid_o=self._mid_o[: n * s] if s > 1 else None,
                         mid_lse=self._mid_lse[: n * s] if s > 1 else None,
                         num_warps=dc.num_warps, num_stages=dc.num_stages, k_scale=k_scale, v_scale=v_scale,
                         prefetch=dc.prefetch, kv_heads_per_program=tuning.kv_pack_for(dc, self.num_kv_heads),
                         merge_counts=self._merge_counts if dc.merge_in_kernel else None)
        if q.shape[0] > n:  # rows past the sequences (a padded batch) get zeros
            out[n:].zero_()
        return out

    def _prefill_out(self, q: torch.Tensor) -> torch.Tensor:
        """The prefill kernel writes the rows of sequences only. In a step padded to a token
        bucket (always, for a graph, whatever the captured step's own padding) the rows past them
        start at zero, not whatever the memory held (possibly NaN): they then stay finite
        through the model's row-wise layers."""
        return torch.zeros_like(q) if self.meta.token_bucket is not None else torch.empty_like(q)

    def rope_in_form(self, cfg: tuning.OneLaunchConfig) -> tuning.OneLaunchConfig:
        """A one-launch config as `rope_in` runs it at this pool's head_dim (`rope_in_form`)."""
        return rope_in_form(cfg, self.head_dim)

    def _partials_scratch(self, partials: str) -> torch.Tensor:
        """The split scratch partials left to a consumer go to: fp32, or its bf16 view."""
        return self._mid_o_bf16 if partials == "bf16" else self._mid_o

    def _partials_rule(self, cfg: tuning.OneLaunchConfig, rows: int, splits: int, partials: str) -> tuple | None:
        """The split rule (`cute_gemv.merge_in`) a short step of `rows` rows under (cfg, splits)
        leaves its partials by, or None where it cannot (a config with a long rule, whose split
        length a consumer cannot follow; too little split scratch)."""
        if cfg.long_from_tokens or self._mid_o.shape[0] < rows * splits:
            return None
        return merge_in(splits, cfg.min_split_tokens, cfg.block_n, self.head_dim, partials=partials)

    def partials_rule(self, rows: int, rope_in: bool = False, partials: str = "fp32") -> tuple | None:
        """The rule `attend_one_launch(partials_out=True)` names for a short step of `rows` rows at
        the one-launch table's config (as the fused path's steps plan it; rope_in: its form with
        RoPE in the attention), or None where such a step returns its output: what the consumer's
        merge GEMV can be planned by before any step runs."""
        cfg, splits = self.one_launch_config(rows)
        return self._partials_rule(self.rope_in_form(cfg) if rope_in else cfg, rows, splits, partials)

    def attend_one_launch(self, layer: int, q: torch.Tensor, pdl: bool = False,
                          rope_in: RopeIn | None = None, partials_out: bool = False, partials: str = "fp32"):
        """A pure-decode step's attention (this step's K/V already in the pool) in one kernel:
        split-KV whose last split program merges. pdl: launch with Programmatic Dependent
        Launch (sm_90+). No host sync, fixed scratch: CUDA-graph safe for any KV lengths.
        rope_in: q and this step's K/V as the QKV projection left them; the kernel normalises
        and rotates them and writes the K/V rows itself (`decode_attention_one_launch`: steps of
        up to MAX_LOOKBACK + 1 rows, every fused row count).

        partials_out: where this step runs the one-launch kernel with a config whose split rule a
        consumer can follow (no long rule) over all of q's rows, return the rows' split partials
        (`cute_gemv.SplitPartials`, its `rule` the GEMV's `merge_in`) and leave the merge to the
        O GEMV; otherwise (a long step, such a config, rows past the step's, too little split
        scratch) the output as always. partials: their dtype, "fp32" or "bf16" (`merge_in`'s)."""
        meta = self.meta
        if not meta.is_pure_decode:
            raise ValueError("attend_one_launch serves pure-decode steps only")
        n = meta.num_seqs
        if n > self.max_batch_size:
            raise ValueError(f"attend_one_launch serves at most {self.max_batch_size} sequences, got {n}")
        if partials not in PARTIAL_DTYPES:
            raise ValueError(f"partials must be one of {tuple(PARTIAL_DTYPES)}, got {partials!r}")
        long = self.long_context(meta)
        if long and self.long_in_two_launches(n):
            if rope_in is not None:  # this step's rows rotated and written first, as the per-op path does
                q = self.kv_pool.write_rope(layer, q, rope_in.k, rope_in.v, rope_in.positions,
                                            rope_in.cos_sin_cache, meta.slot_mapping, rope_in.qk_norm)
            dc = self.decode_config(n)
            return self._two_launch_decode(layer, q, dc, self._splits_for(n, dc))
        if long:
            cfg, splits = self.one_launch_config(n, long=True)
        elif self._decode_one_launch:  # planned: the per-op step's own form (same config)
            cfg, splits = self._decode_cfg, self._num_splits
        else:
            cfg, splits = self.one_launch_config(n)
        if rope_in is not None:
            cfg = self.rope_in_form(cfg)
            rope_in = rope_in._replace(k=rope_in.k[:n], v=rope_in.v[:n], positions=rope_in.positions[:n])
        k_scale, v_scale = self.kv_pool.scales(layer)
        rule = self._partials_rule(cfg, n, splits, partials) if partials_out and q.shape[0] == n and not long else None
        partials_out = rule is not None
        mid_o = self._partials_scratch(partials) if partials_out else self._mid_o
        out = torch.empty_like(q)
        decode_attention_one_launch(
            q[:n], self.kv_pool.k_cache[layer], self.kv_pool.v_cache[layer],
            meta.paged_kv_indptr, meta.paged_kv_indices, meta.kv_lens, self.scale,
            out=out[:n],
            mid_o=mid_o,
            mid_lse=self._mid_lse,
            merge_counts=self._merge_counts,
            num_splits=splits,
            min_split_tokens=cfg.min_split_tokens,
            block_n=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            pdl=pdl,
            verify_rows=self.looks_back(meta),
            k_scale=k_scale,
            v_scale=v_scale,
            kv_heads_per_program=cfg.kv_pack,
            long_from_tokens=cfg.long_from_tokens,
            long_split_tokens=cfg.long_split_tokens,
            merge_splits=cfg.merge_splits,
            rope_in=rope_in,
            prefetch_pages=cfg.prefetch_pages,
            merge_group=0 if partials_out else cfg.merge_group,
            partials_out=partials_out,
        )
        if partials_out:
            return SplitPartials(mid_o, self._mid_lse, meta.kv_lens, rule)
        if q.shape[0] > n:
            out[n:].zero_()
        return out


def _given(**values) -> dict:
    return {k: v for k, v in values.items() if v is not None}


def _first_given(*values):
    return next((v for v in values if v is not None), None)


def prefill_splits_from_env() -> dict:
    """$FLASHLET_PREFILL_SPLITS ("S[,min_split_tokens[,max_tokens[,min_context]]]") as
    {num_splits, min_split_tokens, max_tokens, min_context} (the values given); {} when unset."""
    text = os.environ.get(PREFILL_SPLITS_ENV, "").strip()
    if not text:
        return {}
    parts = text.split(",")
    try:
        values = [int(x) for x in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 4 or min(values) < 1:
        raise ValueError(f"{PREFILL_SPLITS_ENV}={text!r}: expected "
                         "'S[,min_split_tokens[,max_tokens[,min_context]]]', positive integers")
    return dict(zip(("num_splits", "min_split_tokens", "max_tokens", "min_context"), values))


def long_decode_from_env() -> str:
    """$FLASHLET_LONG_DECODE: "two-launch", "one-launch" or "table" ("" when unset: the table)."""
    text = os.environ.get(LONG_DECODE_ENV, "").strip().lower()
    if text not in ("", "table", "two-launch", "one-launch"):
        raise ValueError(f"{LONG_DECODE_ENV}={text!r}: expected two-launch (long fused steps attend in "
                         f"two launches), one-launch (never) or table (ONE_LAUNCH_LONG_TABLE's entry, "
                         f"the default)")
    return text or "table"


def one_launch_decode_from_env() -> dict:
    """$FLASHLET_ONE_LAUNCH_DECODE as {on, pdl}: "1" {on: True}, "0" {on: False}, "nopdl" {on:
    True, pdl: False}; {} when unset."""
    text = os.environ.get(ONE_LAUNCH_DECODE_ENV, "").strip().lower()
    forms = {"": {}, "1": {"on": True}, "0": {"on": False}, "nopdl": {"on": True, "pdl": False}}
    if text not in forms:
        raise ValueError(f"{ONE_LAUNCH_DECODE_ENV}={text!r}: expected 1 (one launch, PDL where the device "
                         f"has it), nopdl (one launch without PDL) or 0 (the two-launch form)")
    return forms[text]
