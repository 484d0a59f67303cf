"""The batched decode attention kernel alone, swept over its launch configs, per KV dtype.

What the engine's pure-decode step runs for each layer (`decode_attention`, the two-launch
split-KV form) is timed over a model's worth of layers (Qwen2.5-0.5B's 24 pools, or the shape
`--models` names), so that no layer's K/V sits in L2 from the previous repeat, replayed from one
CUDA graph. Each row gives microseconds per layer, the bytes the kernel must read (K and V of
every token once per KV head, plus q, the output and the page ids) and the achieved GB/s against
the device-to-device copy bandwidth measured in the same run.

Stage 1 sweeps the tiles (block_n x warps x stages x prefetch x KV heads a program) at the
first shape with the split count the engine picks today; stage 2 times the best tiles at every
shape over the split counts that give between a quarter of a program and 16 programs per SM,
split partials merged by a second launch or by each group's last program. Every config is checked against the
PyTorch reference on one layer before it is timed; a wrong one is reported and dropped. The
last lines are `BATCHED_DECODE_TABLE` entries for flashlet/kernels/tuning.py.

`--one-launch` sweeps the fused decode path's attention instead (`decode_attention_one_launch`,
launched as `TritonBackend.attend_one_launch` launches it: PDL on, the look-back of the step's
rows, one scratch and one set of merge counters for every layer) at the fused path's shapes:
rows 1, 4, 8 and 16 at ~300 and ~1,000 tokens and one row at 8,000 and 30,000, for Qwen2.5-0.5B
(head_dim 64, group 7) and Qwen3-0.6B (head_dim 128, group 2), or the shapes `--models` names
(Qwen2.5-1.5B's and -7B's too: the per-op path's 1-16-row decode steps can launch the same form,
`FLASHLET_ONE_LAUNCH_DECODE=1`; off by default, measured slower at the 7B shape without an entry).
Per (model, rows bucket), stage 1 times the tiles (block_n x warps x stages x KV heads a
program) at ~1,000 tokens; stage 2 the best tiles over split caps, smallest splits and (one row)
the long-row rule and the merge width,
at every context of the bucket: one table entry must serve them all (a graph per row count),
so the winner is the best geometric mean of its times over the derived config's. Qwen3's
variants launch as the fused path launches its attention, with the step's rows made in the
kernel (rope_in, in the backend's form for it; `--rope-in off`: without), checked against the
RoPE reference then attention. The winner and
the derived config are then timed with PDL off too. It prints `ONE_LAUNCH_TABLE` entries and a
summary per shape (us a layer, GB/s, against the derived config).

    python scripts/decode_attn_bench.py                      # H200: 128x2000, 32x8000, 1x30000
    python scripts/decode_attn_bench.py --budget-s 300 --json out.json
    python scripts/decode_attn_bench.py --models qwen3-0.6b --shapes 1x8000,1x30000 --kv model
    python scripts/decode_attn_bench.py --one-launch --json out.json   # H200, ~4 min
    python scripts/decode_attn_bench.py --one-launch --models qwen2.5-7b --table-json 7b.json
    python scripts/decode_attn_bench.py --smoke              # CPU: tiny shapes, interpreter, no timing
    python scripts/decode_attn_bench.py --smoke --one-launch
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

SHAPES = ((128, 2000), (32, 8000), (1, 30000))  # (sequences, tokens of context each)
MODEL = dict(layers=24, num_q_heads=14, num_kv_heads=2, head_dim=64, page_size=16)  # Qwen2.5-0.5B
SMOKE_SHAPES = ((3, 37), (1, 70))
SMOKE_MODEL = dict(layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=4)
BLOCK_NS, WARPS = (32, 64, 128, 256), (1, 2, 4, 8)
MIN_SPLIT_TOKENS = 128
TOLERANCE = 3e-2  # bf16 outputs of an fp32-accumulated softmax against the fp32 reference


@dataclass(frozen=True)
class Variant:
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    prefetch: str = "none"
    fp8_as_fp16: bool = True
    kv_pack: int = 1  # KV heads a program (decode_attention's kv_heads_per_program)
    merge_in_kernel: bool = False  # each group's last split program merges (no merge launch)

    def label(self) -> str:
        tail = ("" if self.prefetch == "none" else f" pf-{self.prefetch}") + ("" if self.fp8_as_fp16 else " fp8->bf16")
        pack = ("" if self.kv_pack == 1 else f" kv{self.kv_pack}") + (" merge-in-kernel" if self.merge_in_kernel else "")
        return f"bn{self.block_n} w{self.num_warps} st{self.num_stages} S{self.num_splits}{tail}{pack}"


def viable_tiles() -> list[tuple[int, int, int, str, int]]:
    """(block_n, warps, stages, prefetch, kv_pack) worth compiling: a [16, block_n] fp32 score
    tile of at most 64 values a thread and at least 8 (fewer leaves warps idle). Page ids carried
    by hand let the pipeliner keep stages - 1 blocks in flight; K/V held in registers by hand
    needs no stages. Two KV heads a program share one softmax tile (half its work a key) and
    read twice the bytes a block. Mode by mode, likelier winners first: the sweep may run out
    of time."""
    modes = [(3, "pages", 1), (3, "pages", 2), (4, "pages", 1), (4, "pages", 2), (2, "none", 1), (2, "pages", 1),
             (1, "blocks", 1), (3, "none", 1)]
    shapes = sorted(((bn, w) for bn, w in itertools.product(BLOCK_NS, WARPS) if 8 <= 16 * bn // (32 * w) <= 64),
                    key=lambda t: abs(16 * t[0] // (32 * t[1]) - 16))
    return [(bn, w, st, pf, pack) for st, pf, pack in modes for bn, w in shapes]


# One-warp programs need no CTA barrier in the loop (2 a block, against 12 at 2-4 warps).
QUICK_TILES = [(bn, w, st, "pages", 1) for st in (3, 4)
               for bn, w in ((64, 2), (64, 4), (128, 2), (128, 4), (128, 8), (256, 4), (256, 8))] + [
               (32, 1, 3, "pages", 1), (64, 1, 3, "pages", 1)] + [
               (bn, w, 3, "pages", 2) for bn, w in ((32, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8))] + [
               (bn, w, 4, "pages", 2) for bn, w in ((32, 2), (64, 2))]


def stage1_variant(tile: tuple, base: Variant, max_splits: int = 8) -> Variant:
    """A stage-1 tile at about the engine's config's warps in flight: its split count scaled by
    the tile's KV heads a program and by the engine's warps over the tile's (a power of two, at
    most max_splits), so that packed and one-warp tiles are not judged on a fraction of a grid."""
    bn, w, st, pf, pack = tile
    scale = pack / base.kv_pack * max(1.0, base.num_warps / w)
    splits = 1 << max(0, round(math.log2(max(1.0, base.num_splits * scale))))
    return Variant(bn, w, st, min(splits, max_splits), pf, kv_pack=pack)


def split_candidates(batch: int, num_kv_heads: int, num_sms: int, kv_len: int, cap: int = 128) -> list[int]:
    """Powers of two giving between a quarter of a program and 16 programs per SM, each split
    at least MIN_SPLIT_TOKENS long (num_kv_heads: programs a sequence has per split)."""
    out, s = [], 1
    while s <= cap:
        programs = batch * num_kv_heads * s
        if programs * 4 >= num_sms and programs <= 16 * num_sms and (s == 1 or kv_len // s >= MIN_SPLIT_TOKENS):
            out.append(s)
        s *= 2
    return out or [1]


class Case:
    """One shape's pools (all layers), page table, q, and reference output of layer 0. model:
    layers, heads, head_dim, page_size (and, in the one-launch sweep, its name)."""

    def __init__(self, torch, batch, kv_len, kv, model, device, seed=0):
        # The interpreter's dots cannot take bf16 (numpy has none): the smoke run's model is fp32.
        model_dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.batch, self.kv_len, self.kv, self.model = batch, kv_len, kv, model
        gen = torch.Generator(device=device).manual_seed(seed)
        ps, hkv, d, hq = model["page_size"], model["num_kv_heads"], model["head_dim"], model["num_q_heads"]
        pages_per_seq = -(-kv_len // ps)
        num_pages = batch * pages_per_seq + 1
        shape = (model["layers"], num_pages, ps, hkv, d)
        dtype = torch.float8_e4m3fn if kv == "fp8" else model_dtype
        self.k_scale, self.v_scale = (0.02, 0.02) if kv == "fp8" else (1.0, 1.0)
        # Values of the scale's range (the pool stores K / k_scale): e4m3 holds them unsaturated.
        self.k = (torch.randn(shape, generator=gen, device=device) / self.k_scale).to(dtype)
        self.v = (torch.randn(shape, generator=gen, device=device) / self.v_scale).to(dtype)
        self.indices = torch.randperm(num_pages, generator=gen, device=device)[: batch * pages_per_seq].int()
        self.indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * pages_per_seq
        self.lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, hq, d, generator=gen, device=device).to(model_dtype)
        self.out = torch.empty_like(self.q)
        self.scale = d**-0.5
        self.elem = self.k.element_size()
        self._rope_in = None

    def rope_in_inputs(self, torch):
        """What a rope_in launch reads beside the pool (decode_attention.RopeIn): each row's newest
        k and v as the QKV projection left them, its position (kv_len - 1), a RoPE table, and the
        per-head q / k norms where the model has them (model["qk_norm"]: Qwen3). The newest rows
        are written into a scratch of one layer's pool shape, not the pool: every variant of the
        case reads the same pool (the kernel takes the newest row from registers, not the pool)."""
        if self._rope_in is None:
            from flashlet.kernels.decode_attention import RopeIn
            from flashlet.models.ops import QKNorm

            m, dev, dtype = self.model, self.q.device, self.q.dtype
            gen = torch.Generator(device=dev).manual_seed(7)
            hkv, d = m["num_kv_heads"], m["head_dim"]
            k, v = (torch.randn(self.batch, hkv, d, generator=gen, device=dev).to(dtype) for _ in range(2))
            inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d))
            freqs = torch.outer(torch.arange(self.kv_len, dtype=torch.float32, device=dev), inv)
            weights = [(torch.rand(d, generator=gen, device=dev) + 0.5).to(dtype) for _ in range(2)]
            norm = QKNorm(*weights, 1e-6) if m.get("qk_norm") else None
            self._rope_in = RopeIn(k, v, (self.lens - 1).long(), torch.cat((freqs.cos(), freqs.sin()), dim=-1),
                                   norm, torch.empty_like(self.k[0]), torch.empty_like(self.v[0]))
        return self._rope_in

    def rope_in_reference(self, torch, da):
        """Layer 0's output with this step's rows made as the model makes them
        (`rope_kv_write_reference` into copies of the pool), then the reference attention."""
        from flashlet.kernels.rope_kv_write import rope_kv_write_reference

        r = self.rope_in_inputs(torch)
        ps = self.model["page_size"]
        last = self.lens.long() - 1
        pages = self.indices.long()[self.indptr[:-1].long() + last // ps]
        k_pool, v_pool = self.k[0].clone(), self.v[0].clone()
        q, _ = rope_kv_write_reference(self.q, r.k, r.v, r.positions, r.cos_sin_cache, k_pool, v_pool,
                                       pages * ps + last % ps, kv_scales=(self.k_scale, self.v_scale),
                                       qk_norm=r.qk_norm)
        return da.decode_attention_reference(q, k_pool, v_pool, self.indptr, self.indices, self.lens, self.scale,
                                             k_scale=self.k_scale, v_scale=self.v_scale)

    def kv_bytes(self) -> int:
        """Bytes one layer's call must move: K and V once per KV head, q and out, page ids."""
        m = self.model
        kv = 2 * self.batch * self.kv_len * m["num_kv_heads"] * m["head_dim"] * self.elem
        qo = 2 * self.q.numel() * self.q.element_size()
        return kv + qo + 4 * self.indices.numel()

    def args(self, layer):
        return (self.q, self.k[layer], self.v[layer], self.indptr, self.indices, self.lens, self.scale)


def make_call(da, torch, case: Case, v: Variant):
    """fn(layer): one decode launch (and merge) of `v` into case.out, scratch allocated once."""
    rows = case.batch * v.num_splits
    hq, d = case.q.shape[1], case.q.shape[2]
    mid_o = torch.empty((rows, hq, d), dtype=torch.float32, device=case.q.device) if v.num_splits > 1 else None
    mid_lse = torch.empty((rows, hq), dtype=torch.float32, device=case.q.device) if v.num_splits > 1 else None
    counts = torch.zeros(case.batch * case.model["num_kv_heads"], dtype=torch.int32, device=case.q.device)

    def fn(layer):
        return da.decode_attention(
            *case.args(layer), out=case.out, num_splits=v.num_splits, min_split_tokens=MIN_SPLIT_TOKENS,
            block_n=v.block_n, mid_o=mid_o, mid_lse=mid_lse, num_warps=v.num_warps, num_stages=v.num_stages,
            k_scale=case.k_scale, v_scale=case.v_scale, fp8_as_fp16=v.fp8_as_fp16, prefetch=v.prefetch,
            kv_heads_per_program=v.kv_pack, merge_counts=counts if v.merge_in_kernel else None)
    return fn


def time_layers_us(fn, layers: int, repeats: int) -> float:
    """Median microseconds per layer: all layers' launches captured in one CUDA graph."""
    from flashlet.kernels.bench import graph_time_us  # with torch: --smoke runs without CUDA

    return graph_time_us(layers, fn, replays=repeats)


class Sweep:
    """Checks, times and records variants of the decode kernel; stops timing past a budget."""

    def __init__(self, torch, da, smoke: bool, budget_s: float, repeats: int, copy: float | None):
        self.torch, self.da, self.smoke, self.repeats, self.copy = torch, da, smoke, repeats, copy
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.rows: list[dict] = []
        self._refs: dict[tuple, object] = {}  # (model name or None, batch, kv_len, kv) -> layer 0's reference output
        self._done: dict[tuple, dict] = {}

    def set_deadline(self, deadline: float) -> None:
        self.deadline = deadline

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def measure(self, case: Case, v) -> dict | None:
        """The variant's row (None when it was out of time); a wrong output gives error, no time.
        v: a Variant (the two-launch form) or a OneLaunchVariant."""
        name = case.model.get("name")
        if isinstance(v, OneLaunchVariant):  # variants that launch the same kernel are timed once
            v = launched_form(v, case.model["head_dim"])
        key = (name, case.batch, case.kv_len, case.kv, v)
        if key in self._done:
            return self._done[key]
        if self.out_of_time():
            return None
        row = dict(batch=case.batch, kv_len=case.kv_len, kv=case.kv, **asdict(v), label=v.label())
        if name:
            row["model"] = name
        self._done[key] = row
        maker = make_one_launch_call if isinstance(v, OneLaunchVariant) else make_call
        fn = maker(self.da, self.torch, case, v)
        try:
            fn(0)
            row["rel_err"] = _rel_err(case.out, self.reference(case, getattr(v, "rope_in", False)))
            if not row["rel_err"] < TOLERANCE:
                row.update(error=f"output differs from the reference (rel err {row['rel_err']:.3g})")
            elif not self.smoke:
                us = time_layers_us(fn, case.model["layers"], self.repeats)
                gbps = case.kv_bytes() / (us * 1e-6) / 1e9
                row.update(us=us, gbps=gbps, frac_copy=gbps / self.copy if self.copy else None)
        except Exception as exc:  # a tile that does not compile or launch (shared memory, registers)
            row.update(error=f"{type(exc).__name__}: {str(exc)[:160]}")
        return self._record(row)

    def reference(self, case: Case, rope_in: bool = False):
        key = (case.model.get("name"), case.batch, case.kv_len, case.kv, rope_in)  # the same seed builds the same case
        if key not in self._refs:
            self._refs[key] = (case.rope_in_reference(self.torch, self.da) if rope_in else
                               self.da.decode_attention_reference(*case.args(0), k_scale=case.k_scale,
                                                                  v_scale=case.v_scale)).float()
        return self._refs[key]

    def _record(self, row: dict) -> dict:
        self.rows.append(row)
        print(_fmt(row), flush=True)
        return row


def _rel_err(a, b) -> float:
    a = a.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _fmt(row: dict) -> str:
    head = f"B={row['batch']:<4} L={row['kv_len']:<6} kv={row['kv']:<5} {row['label']:<28}"
    if "model" in row:
        head = f"{row['model']:<13} {head}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    if "us" not in row:
        return f"{head} ok (rel err {row['rel_err']:.2e})"
    frac = f" ({row['frac_copy']:.2f} of copy)" if row.get("frac_copy") else ""
    return f"{head} {row['us']:9.2f} us  {row['gbps']:8.1f} GB/s{frac}"


def engine_variant(tuning, case: Case, num_sms: int, table: bool = True) -> Variant:
    """What the engine launches for this shape: with its tables (table=True), or from the
    defaults alone (what it launched before BATCHED_DECODE_TABLE was filled)."""
    m = case.model
    group = m["num_q_heads"] // m["num_kv_heads"]
    if table:
        cfg = tuning.batched_decode_config(m["head_dim"], group, case.batch, case.kv)
    else:
        cfg = tuning.default_decode(m["head_dim"], group, tuning.bucket(case.batch, tuning.DECODE_BATCH_BUCKETS))
    max_splits = tuning.measured_split_cap(cfg, 64)  # TritonBackend's cap; its pool-wide length cap is larger
    s = tuning.config_splits(cfg, case.batch, m["num_kv_heads"], num_sms, max_splits)
    return Variant(cfg.block_n, cfg.num_warps, cfg.num_stages, s, cfg.prefetch,
                   kv_pack=tuning.kv_pack_for(cfg, m["num_kv_heads"]), merge_in_kernel=cfg.merge_in_kernel)


def best_of(rows: list[dict]) -> dict | None:
    timed = [r for r in rows if "us" in r]
    return min(timed, key=lambda r: r["us"]) if timed else None


def lower_for_sm90(block_n: int, warps: int, stages: int, kv: str, prefetch: str, arch: int = 90,
                   kv_pack: int = 1, merge_in_kernel: bool = False) -> dict:
    """The decode kernel compiled for sm_`arch` (no GPU needed) at the Qwen2.5-0.5B shape, with
    the divisibility by 16 the launcher's specialisation gives real pool strides: how many
    cp.async copies (and how many move under 16 bytes), single-byte shared-memory loads in the
    block loop (a split's last block, run after it, moves its mask through bytes), the
    most copy groups left in flight at a wait (0: none overlaps the math), e4m3 -> fp16 and
    fp16 -> bf16 conversions, the block loop's SASS instructions a KB of K/V (warp instructions:
    the issue cost of the bytes), and ptxas's register/spill line."""
    import re
    import subprocess
    import tempfile

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashlet.kernels import decode_attention as da

    names = da._decode_kernel.arg_names
    kv_ty = "*fp8e4nv" if kv == "fp8" else "*bf16"
    sig = {n: "i32" for n in names}
    sig.update(Q="*bf16", K=kv_ty, V=kv_ty, O="*bf16", MidO="*fp32", MidLse="*fp32", Counts="*i32", KvIndptr="*i32",
               KvIndices="*i32", KvLens="*i32", qk_scale="fp32", v_scale="fp32")
    consts = dict(NUM_Q_HEADS=14, GROUP=7, GROUP_PAD=da.group_pad(7 * kv_pack), HEAD_DIM=64, PAGE_SIZE=16,
                  BLOCK_N=block_n, SPLIT=True, INPUT_PRECISION=None, KV_PACK=kv_pack, HEADS_CONTIGUOUS=True,
                  MERGE_IN_KERNEL=merge_in_kernel, MERGE_SPLITS=2,
                  **da._loop_constexprs(kv == "fp8", torch.bfloat16, True, prefetch))
    sig.update({c: "constexpr" for c in consts})
    aligned = [n for n in names if n.startswith("stride") or (n[0].isupper() and n not in consts)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn=da._decode_kernel, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", f.name, "-o", "/dev/null"],
                              capture_output=True, text=True, check=True).stderr
    block_kb = block_n * kv_pack * MODEL["head_dim"] * 2 * (1 if kv == "fp8" else 2) / 1024
    loop = _sass_loop(kernel.asm["cubin"], os.path.dirname(ptxas))
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global\S*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(\w+)", ptx)
    return dict(cp_async=len(copies), narrow_copies=sum(int(c, 0) < 16 for c in copies),
                byte_smem_loads=sum(text.split()[0].startswith(("LDS.U8", "LDS.S8")) for text in loop),
                most_in_flight=max(waits, default=0),
                e4m3_to_f16=ptx.count("cvt.rn.f16x2.e4m3x2"), f16_to_bf16=ptx.count("cvt.bf16.f16"),
                loop_instructions_per_kb=round(len(loop) * warps / block_kb, 1),
                ptxas=" ".join(line.strip() for line in info.splitlines() if "registers" in line or "spill" in line))


def _sass_loop(cubin: bytes, bin_dir: str) -> list[str]:
    """The SASS instructions of the kernel's longest loop (its K/V block loop), from cuobjdump."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", sass)]
    back = [(int(m.group(1), 16), addr) for addr, text in ins if (m := re.search(r"BRA\s+0x([0-9a-f]+)", text))
            and int(m.group(1), 16) < addr]
    if not back:
        return []
    start, end = max(back, key=lambda span: span[1] - span[0])
    return [text for addr, text in ins if start <= addr <= end]


def pipeline_report(kvs: list[str], arch: int) -> None:
    """What the pipeliner of this Triton makes of the loop, before any timing."""
    for kv in kvs:
        for bn, w, st, pf, pack in ((64, 4, 2, "none", 1), (64, 2, 3, "pages", 1), (128, 4, 3, "pages", 1),
                                    (64, 2, 3, "pages", 2), (128, 4, 3, "pages", 2)):
            try:
                got = lower_for_sm90(bn, w, st, kv, pf, arch, kv_pack=pack)
            except Exception as exc:  # a report only: the sweep goes on
                got = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"lowered sm_{arch} kv={kv} bn{bn} w{w} st{st} {pf} kv{pack}: {got}", flush=True)


def _compile_variants(kv: str, variants: list[Variant], model: dict, device: str) -> None:
    """In a child process: launch each variant once on a small case of the same dtypes and
    stride divisibility, which leaves its compiled kernel in Triton's on-disk cache."""
    import torch

    from flashlet.kernels import decode_attention as da

    case = Case(torch, 2, 300, kv, {**model, "layers": 1}, device)
    for v in variants:
        try:
            make_call(da, torch, case, v)(0)
        except Exception:  # the main process reports it when it measures the variant
            pass
    if device == "cuda":
        torch.cuda.synchronize()


def precompile(kv: str, variants: list[Variant], model: dict, jobs: int, device: str = "cuda") -> None:
    """Compile the variants in `jobs` processes at once (compiling is the sweep's slow part)."""
    if jobs < 2:
        return
    t0 = time.monotonic()
    chunks = [variants[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_variants, [kv] * jobs, chunks, [model] * jobs, [device] * jobs))
    print(f"compiled {len(variants)} variants in {jobs} processes: {time.monotonic() - t0:.0f} s", flush=True)


def run(args) -> list[dict]:
    import torch

    from flashlet.kernels import decode_attention as da
    from flashlet.kernels import tuning
    from flashlet.kernels.bench import measure_copy_bandwidth

    device = "cpu" if args.smoke else "cuda"
    kvs = [k for k in ("model", "fp8") if k in args.kv]
    shapes, model = (SMOKE_SHAPES, SMOKE_MODEL) if args.smoke else (args.shapes, batched_model(args.models))
    num_sms = 4 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    copy = None if args.smoke else measure_copy_bandwidth(torch.device(device), repeats=5)
    print(f"device: {'cpu (interpreter, no timing)' if args.smoke else torch.cuda.get_device_name(0)}, "
          f"{num_sms} SMs; copy bandwidth {copy and round(copy)} GB/s; model {model}", flush=True)
    if not args.smoke:
        import triton

        print(f"triton {triton.__version__}, torch {torch.__version__}", flush=True)
        major, minor = torch.cuda.get_device_capability(0)
        pipeline_report(kvs, 10 * major + minor)
    sweep = Sweep(torch, da, args.smoke, args.budget_s, args.repeats, copy)
    if args.smoke:
        tiles = [(16, 1, 1, "none", 1), (16, 1, 2, "blocks", 1), (16, 1, 3, "pages", 1), (16, 1, 3, "pages", 2)]
    else:
        tiles = QUICK_TILES if args.quick else viable_tiles()
    winners = {}
    share = args.budget_s / len(kvs)  # each KV dtype gets its share; stage 1 at most 60% of it
    for i, kv in enumerate(kvs):
        first = Case(torch, *shapes[0], kv, model, device)
        base = engine_variant(tuning, first, num_sms)
        if not args.smoke:
            precompile(kv, [base] + [stage1_variant(tile, base) for tile in tiles], model, args.jobs)
        print(f"\n== stage 1, kv {kv}: tiles at B={first.batch} L={first.kv_len}, S={base.num_splits} "
              f"(x KV heads a program) ==", flush=True)
        sweep.set_deadline(sweep.start + i * share + 0.6 * share)
        sweep.measure(first, base)
        if base.num_splits > 1:  # the engine's config with its partials merged in the kernel
            sweep.measure(first, replace(base, merge_in_kernel=not base.merge_in_kernel))
        for bn, w, st, pf, pack in tiles:
            sweep.measure(first, stage1_variant((bn, w, st, pf, pack), base))
        stage1 = [r for r in sweep.rows if r["kv"] == kv and r["batch"] == first.batch and "us" in r]
        top = sorted(stage1, key=lambda r: r["us"])[: args.top]
        top_tiles = list(dict.fromkeys((r["block_n"], r["num_warps"], r["num_stages"], r["prefetch"], r["kv_pack"])
                                       for r in top))
        top_tiles = top_tiles or tiles[:1]
        del first
        sweep.set_deadline(sweep.start + (i + 1) * share)
        for batch, kv_len in shapes:
            case = Case(torch, batch, kv_len, kv, model, device)
            print(f"\n== stage 2, kv {kv}: B={batch} L={kv_len} ==", flush=True)
            base, before = engine_variant(tuning, case, num_sms), engine_variant(tuning, case, num_sms, table=False)
            sweep.measure(case, base)
            sweep.measure(case, before)
            for bn, w, st, pf, pack in top_tiles:
                for s in split_candidates(batch, model["num_kv_heads"] // pack, num_sms, kv_len):
                    for merge_in_kernel in (False, True) if s > 1 else (False,):
                        sweep.measure(case, Variant(bn, w, st, s, pf, kv_pack=pack, merge_in_kernel=merge_in_kernel))
            here = [r for r in sweep.rows if (r["kv"], r["batch"], r["kv_len"]) == (kv, batch, kv_len)]
            win = best_of(here)
            if kv == "fp8" and win is not None:  # widening to bf16 instead, at the winner (reported only)
                sweep.measure(case, Variant(win["block_n"], win["num_warps"], win["num_stages"], win["num_splits"],
                                            win["prefetch"], fp8_as_fp16=False, kv_pack=win["kv_pack"],
                                            merge_in_kernel=win["merge_in_kernel"]))
            rows = {v: next((r for r in here if r["label"] == v.label() and "us" in r), None) for v in (base, before)}
            winners[(kv, batch, kv_len)] = (win, rows[base], rows[before])
            del case
    summarize(winners, model, tuning)
    if args.table_json:
        write_table_json(table_entries(winners, model, tuning), args.table_json)
    return sweep.rows


def write_table_json(entries: dict, path: str) -> None:
    """The entries as JSON [[key, config fields], ...]: `tuning.load_tables` puts them in
    tuning.BATCHED_DECODE_TABLE of another process (an engine run with the sweep's winners)."""
    with open(path, "w") as f:
        json.dump([[list(key), asdict(cfg)] for key, cfg in sorted(entries.items())], f, indent=1)


def summarize(winners: dict, model: dict, tuning) -> None:
    print("\n== best per shape; [the engine's config with its tables; from the defaults alone] ==")
    for (kv, batch, kv_len), (win, base, before) in winners.items():
        if win is None:
            print(f"B={batch} L={kv_len} kv={kv}: nothing timed")
            continue
        ref = "; ".join(f"{r['label']}: {r['us']:.2f} us, {r['gbps']:.0f} GB/s" if r else "not timed"
                        for r in (base, before))
        print(f"B={batch} L={kv_len} kv={kv}: {win['label']} {win['us']:.2f} us, {win['gbps']:.0f} GB/s [{ref}]")
    for batch, kv_len in {(b, n) for (_, b, n) in winners}:
        bf, f8 = winners.get(("model", batch, kv_len), (None,))[0], winners.get(("fp8", batch, kv_len), (None,))[0]
        if bf and f8:
            print(f"B={batch} L={kv_len}: fp8 KV is {bf['us'] / f8['us']:.2f}x the speed of bf16 KV")
    print("\n" + table_literal(table_entries(winners, model, tuning)))


def table_entries(winners: dict, model: dict, tuning) -> dict:
    """BATCHED_DECODE_TABLE entries from each (kv, batch, length)'s best row: keyed by the
    batch's bucket (the last shape of a bucket wins where two share one)."""
    group = model["num_q_heads"] // model["num_kv_heads"]
    entries = {}
    for (kv, batch, _), (win, *_) in winners.items():
        if win is None:
            continue
        key = (model["head_dim"], group, kv, tuning.bucket(batch, tuning.DECODE_BATCH_BUCKETS))
        entries[key] = tuning.DecodeConfig(block_n=win["block_n"], num_warps=win["num_warps"],
                                           num_stages=win["num_stages"], min_split_tokens=MIN_SPLIT_TOKENS,
                                           num_splits=win["num_splits"], prefetch=win["prefetch"],
                                           kv_pack=win.get("kv_pack", 1),
                                           merge_in_kernel=win.get("merge_in_kernel", False))
    return entries


def table_literal(entries: dict) -> str:
    """tuning.py source for the entries."""
    lines = ["BATCHED_DECODE_TABLE: dict[tuple[int, int, str, int], DecodeConfig] = {"]
    lines += [f"    {key!r}: {cfg!r}," for key, cfg in sorted(entries.items())]
    return "\n".join(lines + ["}"])


# ---- the one-launch form (the fused decode path's attention): --one-launch ---------------------

ONE_LAUNCH_MODELS = (
    dict(name="qwen2.5-0.5b", layers=24, num_q_heads=14, num_kv_heads=2, head_dim=64, page_size=16),
    dict(name="qwen3-0.6b", layers=28, num_q_heads=16, num_kv_heads=8, head_dim=128, page_size=16, qk_norm=True),
)
# Shapes `--models` may name beside those: the fused path's other presets (head_dim 128 at
# group 6, head_dim 64 at groups 4 and 8: no table entry yet, so the derived config runs), and
# the 7B's, whose per-op decode steps of 1-16 rows can attend in one launch too
# (FLASHLET_ONE_LAUNCH_DECODE=1), from the same table.
ONE_LAUNCH_MORE_MODELS = (
    dict(name="qwen2.5-1.5b", layers=28, num_q_heads=12, num_kv_heads=2, head_dim=128, page_size=16),
    dict(name="llama-3.2-1b", layers=16, num_q_heads=32, num_kv_heads=8, head_dim=64, page_size=16),
    dict(name="tinyllama-1.1b", layers=22, num_q_heads=32, num_kv_heads=4, head_dim=64, page_size=16),
    dict(name="qwen2.5-7b", layers=28, num_q_heads=28, num_kv_heads=4, head_dim=128, page_size=16),
    # the shapes that may join the fused path's BF16_ONE_ROW_MMA_SHAPES next (Mistral-7B's attention
    # is the 8B's: 32 / 8 heads of 128, 32 layers)
    dict(name="llama-3.1-8b", layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16),
    dict(name="qwen2.5-14b", layers=48, num_q_heads=40, num_kv_heads=8, head_dim=128, page_size=16),
)
ONE_LAUNCH_ROWS = (1, 4, 8, 16)  # tuning.ONE_LAUNCH_ROW_BUCKETS: one shape per bucket
ONE_LAUNCH_CONTEXTS = (300, 1000)  # tokens, every rows bucket
ONE_LAUNCH_LONG = (8000, 30000)  # tokens, one row
# The most splits a variant tries: past TritonBackend's default cap (64) a measured entry's splits
# hold up to tuning.MEASURED_SPLIT_CAP; 128 spreads one long row over ~2 programs an SM.
ONE_LAUNCH_MAX_SPLITS = 128
SMOKE_ONE_LAUNCH_MODELS = (dict(name="smoke", layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=4),)
SMOKE_ONE_LAUNCH = dict(rows=(1, 3), contexts=(37,), long=(150,))
# (block_n, warps, stages, KV heads a program) per head_dim, likelier winners first (the sweep may
# run out of time). head_dim 64: the derived whole-split block first, then smaller blocks that
# leave room for two or more programs an SM (at 255 registers x 8 warps one program fills an SM),
# one and both KV heads a program. head_dim 128 (group 2: 2 of 16 rows used with one head): 2 and 4
# KV heads a program fill 4 and 8 rows (8 heads, 16 rows, spill at every tile lowered for sm_90a;
# 4 heads spill at 4 warps, not at 8).
ONE_LAUNCH_TILES = {
    64: ((256, 8, 2, 1), (128, 4, 2, 1), (64, 4, 3, 1), (64, 4, 2, 2), (128, 8, 2, 2), (64, 2, 3, 1),
         (128, 8, 2, 1), (32, 2, 3, 2), (32, 2, 3, 1), (64, 4, 3, 2)),
    128: ((32, 4, 3, 1), (32, 4, 3, 2), (32, 8, 2, 4), (64, 8, 2, 4), (64, 4, 2, 1), (64, 8, 2, 2),
          (64, 4, 3, 1), (32, 2, 3, 1), (16, 2, 3, 2), (32, 8, 3, 4)),
}
SMOKE_ONE_LAUNCH_TILES = ((16, 1, 1, 1), (16, 2, 2, 2))
# runtime values: no compile each. 32 and 64 spread one row of a few hundred to a thousand tokens
# over more programs (Qwen3-0.6B, 8 KV heads: 1,000 tokens at 256 a split is 32 programs of 4 blocks)
ONE_LAUNCH_MIN_SPLITS = (32, 64, 128, 256, 512)
ONE_LAUNCH_LONG_RULES = ((2048, 64), (4096, 128))  # (from tokens, split tokens), one row
# The wide merge tried at the largest split caps: partials read at a time in a [MS, 16, KV heads a
# program x head_dim] fp32 tile of this many elements (the default merge: 4096).
WIDE_MERGE_ELEMENTS = 16384
# The merge in two levels (merge_group: splits a first-level merge folds), tried beside the wide
# merge: the long side's last program otherwise merges up to 64 partials alone (FUSED_NOTES.md).
MERGE_GROUPS = (4, 8)
SMOKE_MIN_SPLITS, SMOKE_LONG_RULES, SMOKE_WIDE_MERGE, SMOKE_MERGE_GROUPS = (16, 32), ((100, 16),), 2, (2,)


@dataclass(frozen=True)
class OneLaunchVariant:
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    min_split_tokens: int = 256
    kv_pack: int = 1
    long_from_tokens: int = 0
    long_split_tokens: int = 0
    merge_splits: int | None = None
    pdl: bool = True
    prefetch_pages: bool = False
    merge_group: int = 0
    rope_in: bool = False  # launched as the engine launches Qwen3's: its rows made in the kernel

    def label(self) -> str:
        tail = (f" kv{self.kv_pack}" if self.kv_pack > 1 else "") + (
            f" long{self.long_split_tokens}@{self.long_from_tokens}" if self.long_from_tokens else "") + (
            f" ms{self.merge_splits}" if self.merge_splits else "") + (" pages" if self.prefetch_pages else "") + (
            f" mg{self.merge_group}" if self.merge_group else "") + (" rope-in" if self.rope_in else "")
        return (f"bn{self.block_n} w{self.num_warps} st{self.num_stages} S{self.num_splits} "
                f"min{self.min_split_tokens}{tail} pdl-{'on' if self.pdl else 'off'}")

    def tile(self) -> tuple:
        return (self.block_n, self.num_warps, self.num_stages, self.kv_pack)

    def at_length(self, kv_len: int) -> OneLaunchVariant:
        """The variant a row of kv_len runs: below long_from_tokens the long rule does nothing (so
        its time there is the rule-free variant's, measured once)."""
        if self.long_from_tokens and kv_len < self.long_from_tokens:
            return replace(self, long_from_tokens=0, long_split_tokens=0)
        return self

    def config(self, tuning):
        """The ONE_LAUNCH_TABLE entry (tuning.OneLaunchConfig) this variant is."""
        return tuning.OneLaunchConfig(
            block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages,
            min_split_tokens=self.min_split_tokens, num_splits=self.num_splits, kv_pack=self.kv_pack,
            long_from_tokens=self.long_from_tokens, long_split_tokens=self.long_split_tokens,
            merge_splits=self.merge_splits, prefetch_pages=self.prefetch_pages, merge_group=self.merge_group)


def launched_form(v: OneLaunchVariant, head_dim: int) -> OneLaunchVariant:
    """The variant as its launch runs it: a rope_in variant in the backend's form for it
    (triton_backend.rope_in_form: one KV head a program, 8 warps at wide blocks), so tiles that
    differ only in what that form overrides are one variant (timed once); others unchanged."""
    if not v.rope_in:
        return v
    from flashlet.attention.triton_backend import rope_in_form
    from flashlet.kernels import tuning

    form = rope_in_form(v.config(tuning), head_dim)
    return replace(v, kv_pack=form.kv_pack, num_warps=form.num_warps)


def make_one_launch_call(da, torch, case: Case, v: OneLaunchVariant):
    """fn(layer): one `decode_attention_one_launch` of `v` into case.out; as the backend does, one
    scratch and one set of merge counters serve every layer (each launch leaves them at zero).
    The case's rows are different sequences': a plain decode step, launched as the backend
    launches one (verify_rows=False: no look-back over rows of one sequence).
    v.rope_in: in the form the backend gives the config (triton_backend.rope_in_form), making
    the step's rows from case.rope_in_inputs."""
    v = launched_form(v, case.model["head_dim"])
    rope_in = case.rope_in_inputs(torch) if v.rope_in else None
    rows = case.batch * v.num_splits
    hq, d = case.q.shape[1], case.q.shape[2]
    mid_o = torch.empty((rows, hq, d), dtype=torch.float32, device=case.q.device)
    mid_lse = torch.empty((rows, hq), dtype=torch.float32, device=case.q.device)
    counts = torch.zeros(da.one_launch_counters(case.batch, case.model["num_kv_heads"], v.num_splits, v.merge_group),
                         dtype=torch.int32, device=case.q.device)

    def fn(layer):
        return da.decode_attention_one_launch(
            *case.args(layer), out=case.out, mid_o=mid_o, mid_lse=mid_lse, merge_counts=counts,
            num_splits=v.num_splits, min_split_tokens=v.min_split_tokens, block_n=v.block_n,
            num_warps=v.num_warps, num_stages=v.num_stages, pdl=v.pdl, k_scale=case.k_scale,
            v_scale=case.v_scale, kv_heads_per_program=v.kv_pack, long_from_tokens=v.long_from_tokens,
            long_split_tokens=v.long_split_tokens, merge_splits=v.merge_splits, prefetch_pages=v.prefetch_pages,
            merge_group=v.merge_group, rope_in=rope_in, verify_rows=False)
    return fn


def derived_one_launch_variant(torch, model: dict, rows: int, num_sms: int, device: str, pdl: bool,
                               table: bool = False) -> OneLaunchVariant:
    """What `TritonBackend.attend_one_launch` launches for `rows` rows of this model: its derived
    config (table=True: with ONE_LAUNCH_TABLE), from a backend over a one-page pool whose
    sequences may be 32k tokens long."""
    from flashlet.attention.triton_backend import TritonBackend
    from flashlet.kvcache.kv_pool import KVPool

    pool = KVPool(1, 1, model["page_size"], model["num_kv_heads"], model["head_dim"], torch.float32, device,
                  fused_rope=False)
    backend = TritonBackend(pool, model["num_q_heads"], max_batch_size=max(ONE_LAUNCH_ROWS), num_sms=num_sms,
                            max_pages_per_seq=32768 // model["page_size"])
    cfg, splits = backend.one_launch_config(rows, table=table)
    return OneLaunchVariant(cfg.block_n, cfg.num_warps, cfg.num_stages, splits, cfg.min_split_tokens, cfg.kv_pack,
                            cfg.long_from_tokens, cfg.long_split_tokens, cfg.merge_splits, pdl, cfg.prefetch_pages,
                            cfg.merge_group)


def one_launch_splits(rows: int, num_kv_heads: int, kv_pack: int, num_sms: int, near: int) -> list[int]:
    """Split caps around `near` (an eighth to twice it), powers of two at most
    ONE_LAUNCH_MAX_SPLITS, giving between an eighth of a program and 4 programs an SM."""
    out = []
    for s in (near // 8, near // 4, near // 2, near, near * 2):
        programs = rows * (num_kv_heads // kv_pack) * s
        if 1 <= s <= ONE_LAUNCH_MAX_SPLITS and programs * 8 >= num_sms and programs <= 4 * num_sms:
            out.append(s)
    return sorted(set(out)) or [max(1, min(near, ONE_LAUNCH_MAX_SPLITS))]


def tile_variant(tile: tuple, derived: OneLaunchVariant) -> OneLaunchVariant:
    """A stage-1 tile at the derived config's programs in flight (its split cap scaled by the KV
    heads a program) and the derived smallest split (at least one block)."""
    bn, w, st, pack = tile
    splits = max(1, min(ONE_LAUNCH_MAX_SPLITS, derived.num_splits * pack // derived.kv_pack))
    return OneLaunchVariant(bn, w, st, splits, max(derived.min_split_tokens, bn), pack, pdl=derived.pdl,
                            rope_in=derived.rope_in)


def stage2_variants(tiles: list[tuple], rows: int, contexts: tuple, model: dict, num_sms: int, smoke: bool,
                    derived: OneLaunchVariant) -> list[OneLaunchVariant]:
    """Every best tile over split caps and smallest splits; with a long context in the bucket,
    also the long-row rules (splits of at least a block), a wide merge at the largest caps, and
    each of those with the block loop's page ids carried a block ahead (prefetch_pages); and at
    the largest smallest split, each of MERGE_GROUPS below the cap (the merge in two levels)."""
    out = []
    min_splits = SMOKE_MIN_SPLITS if smoke else ONE_LAUNCH_MIN_SPLITS
    rules = SMOKE_LONG_RULES if smoke else ONE_LAUNCH_LONG_RULES
    groups = SMOKE_MERGE_GROUPS if smoke else MERGE_GROUPS
    long_bucket = max(contexts) >= 4 * max(min_splits)
    for bn, w, st, pack in tiles:
        wide = SMOKE_WIDE_MERGE if smoke else wide_merge(model, pack)
        near = max(1, min(ONE_LAUNCH_MAX_SPLITS, derived.num_splits * pack // derived.kv_pack))
        for s in one_launch_splits(rows, model["num_kv_heads"], pack, num_sms, near):
            for m in (ms for ms in min_splits if ms >= bn):
                base = OneLaunchVariant(bn, w, st, s, m, pack, pdl=derived.pdl, rope_in=derived.rope_in)
                out.append(base)
                if not long_bucket:
                    continue
                longs = [replace(base, long_from_tokens=lf, long_split_tokens=ls) for lf, ls in rules if ls >= bn]
                longs += [replace(base, merge_splits=wide)] if s >= wide and m == max(min_splits) else []
                paged = [replace(v, prefetch_pages=True) for v in [base, *longs]]
                out += longs + paged
                if m == max(min_splits):
                    out += [replace(v, merge_group=g) for v in [base, paged[0]] for g in groups if g < s]
    return list(dict.fromkeys(out))


def wide_merge(model: dict, kv_pack: int) -> int:
    """Partials at a time in a WIDE_MERGE_ELEMENTS tile: 16 at head_dim 64, 8 at 128 (one KV head)."""
    return max(1, WIDE_MERGE_ELEMENTS // (16 * kv_pack * model["head_dim"]))


class OneLaunchBucket:
    """One (model, rows bucket) of the one-launch sweep: its cases (one per context), the derived
    config, and each variant's times over them."""

    def __init__(self, torch, model: dict, rows: int, contexts: tuple, device: str):
        self.model, self.rows, self.contexts = model, rows, contexts
        self.cases = {n: Case(torch, rows, n, "model", model, device) for n in contexts}

    def times(self, sweep: Sweep, v: OneLaunchVariant) -> dict[int, float] | None:
        """us a layer at every context (None if any was wrong or out of time)."""
        got = {}
        for n, case in self.cases.items():
            row = sweep.measure(case, v.at_length(n))
            if row is None or ("us" not in row and not sweep.smoke):
                return None
            if "error" in row:
                return None
            got[n] = row.get("us", 1.0)  # the smoke run checks, does not time
        return got


def geomean_ratio(times: dict[int, float], ref: dict[int, float]) -> float:
    return math.exp(sum(math.log(times[n] / ref[n]) for n in ref) / len(ref))


def sweep_one_launch_bucket(sweep: Sweep, bucket: OneLaunchBucket, derived: OneLaunchVariant, tiles: tuple,
                            num_sms: int, top: int, start: float, share: float) -> dict:
    """Stage 1 (tiles at the bucket's longest short context; 30% of its share of time), stage 2
    (the best tiles over splits, smallest splits, long rules, merge width, at every context),
    then the winner and the derived config with PDL off too (the last 15%, at least 8 s: later buckets get less).
    -> {"derived_variant", "derived": times, "best": (variant, times) or None, "scored": every
    timed (variant, times)}."""
    model, rows = bucket.model, bucket.rows
    probe = bucket.cases[max(n for n in bucket.contexts if n <= max(ONE_LAUNCH_CONTEXTS))]
    sweep.set_deadline(start + 0.3 * share)
    ref = bucket.times(sweep, derived)
    stage1 = []
    for tile in tiles:
        v = tile_variant(tile, derived)
        row = sweep.measure(probe, v)
        if row is not None and ("us" in row or (sweep.smoke and "error" not in row)):
            stage1.append((row.get("us", 0.0), tile))
    best_tiles = [t for _, t in sorted(stage1)[:top]]
    best_tiles = list(dict.fromkeys([derived.tile()] + best_tiles))
    sweep.set_deadline(start + 0.85 * share)
    ref = ref or bucket.times(sweep, derived)
    scored = []
    for v in stage2_variants(best_tiles, rows, bucket.contexts, model, num_sms, sweep.smoke, derived):
        got = bucket.times(sweep, v)
        if got is not None and ref is not None:
            scored.append((geomean_ratio(got, ref), v, got))
    best = min(scored, key=lambda t: t[0]) if scored else None
    if derived.pdl:  # PDL off: the same configs launched plainly (the best's compiled here: a few s)
        sweep.set_deadline(max(start + share, time.monotonic() + 8.0))
        for v in (derived, best[1]) if best else (derived,):
            bucket.times(sweep, replace(v, pdl=False))
    return dict(derived_variant=derived, derived=ref, best=best and (best[1], best[2]),
                scored=[(v, got) for _, v, got in scored])


def batched_model(name: str | None) -> dict:
    """The shape the batched sweep runs: MODEL (Qwen2.5-0.5B), or the one `--models` names."""
    if not name:
        return MODEL
    models = one_launch_models(name)
    if len(models) != 1:
        raise SystemExit(f"--models: the batched sweep runs one shape, got {name!r}")
    return models[0]


def one_launch_models(names: str | None) -> tuple[dict, ...]:
    """The shapes a one-launch sweep runs: ONE_LAUNCH_MODELS, or those named (comma-separated,
    from it and ONE_LAUNCH_MORE_MODELS)."""
    if not names:
        return ONE_LAUNCH_MODELS
    known = {m["name"]: m for m in ONE_LAUNCH_MODELS + ONE_LAUNCH_MORE_MODELS}
    unknown = [n for n in names.split(",") if n not in known]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: {', '.join(known)}")
    return tuple(known[n] for n in names.split(","))


def run_one_launch(args) -> list[dict]:
    import torch

    from flashlet.kernels import decode_attention as da
    from flashlet.kernels import tuning
    from flashlet.kernels.bench import measure_copy_bandwidth

    device = "cpu" if args.smoke else "cuda"
    models = SMOKE_ONE_LAUNCH_MODELS if args.smoke else one_launch_models(args.models)
    shape = SMOKE_ONE_LAUNCH if args.smoke else dict(rows=ONE_LAUNCH_ROWS, contexts=ONE_LAUNCH_CONTEXTS,
                                                     long=ONE_LAUNCH_LONG)
    if args.rows:
        unknown = sorted(set(args.rows) - set(shape["rows"]))
        if unknown:
            raise SystemExit(f"--rows: {unknown} are not rows buckets of this sweep ({shape['rows']})")
        shape = {**shape, "rows": tuple(args.rows)}
    num_sms = 4 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    # PDL needs sm_90+; the interpreter runs no inline PTX: the smoke run sweeps without it.
    pdl = not args.smoke and da.pdl_supported(torch.device(device))
    copy = None if args.smoke else measure_copy_bandwidth(torch.device(device), repeats=5)
    print(f"one-launch sweep: {'cpu (interpreter, no timing)' if args.smoke else torch.cuda.get_device_name(0)}, "
          f"{num_sms} SMs; copy bandwidth {copy and round(copy)} GB/s; PDL {'on' if pdl else 'off'} "
          f"(then off for the winners)", flush=True)
    sweep = Sweep(torch, da, args.smoke, args.budget_s, args.repeats, copy)
    buckets = [(m, rows) for m in models for rows in shape["rows"]]
    if not args.smoke:
        precompile_one_launch(buckets, shape, num_sms, pdl, args.jobs, device, args.rope_in)
    end = sweep.start + args.budget_s
    # One row has four contexts (two long): twice the time of another bucket.
    weights = [2.0 if rows == 1 else 1.0 for _, rows in buckets]
    results = {}
    for i, (model, rows) in enumerate(buckets):
        contexts = shape["contexts"] + (shape["long"] if rows == 1 else ())
        print(f"\n== one launch, {model['name']}: {rows} row(s) at {contexts} tokens ==", flush=True)
        bucket = OneLaunchBucket(torch, model, rows, contexts, device)
        derived = engine_form(derived_one_launch_variant(torch, model, rows, num_sms, device, pdl), model, args.rope_in)
        tiles = SMOKE_ONE_LAUNCH_TILES if args.smoke else ONE_LAUNCH_TILES[model["head_dim"]]
        start = time.monotonic()
        share = max(1.0, (end - start) * weights[i] / sum(weights[i:]))
        results[(model["name"], rows)] = (model, bucket, sweep_one_launch_bucket(
            sweep, bucket, derived, tiles, num_sms, args.top, start, share))
    summarize_one_launch(results, sweep, tuning)
    if args.table_json:
        write_table_json(one_launch_entries(results, tuning), args.table_json)
    return sweep.rows


def engine_form(derived: OneLaunchVariant, model: dict, rope_in: str = "auto") -> OneLaunchVariant:
    """The derived variant as the fused path launches this model's attention, which every variant
    of its sweep inherits: with the rows made in the kernel where the model has per-head q / k
    norms (Qwen3: `fused_decode.ROPE_IN_ATTENTION`, on by default; rope_in="off": without)."""
    return replace(derived, rope_in=rope_in == "auto" and bool(model.get("qk_norm")))


def _one_launch_items(buckets, shape, num_sms, pdl, device, rope_in: str = "auto") -> list[tuple]:
    """(model, rows, variant) for every variant the sweep may compile (stage 2 for every tile)."""
    import torch

    items = []
    for model, rows in buckets:
        contexts = shape["contexts"] + (shape["long"] if rows == 1 else ())
        derived = engine_form(derived_one_launch_variant(torch, model, rows, num_sms, device, pdl), model, rope_in)
        tiles = [derived.tile()] + list(ONE_LAUNCH_TILES[model["head_dim"]])
        variants = [derived, replace(derived, pdl=False)] + [tile_variant(t, derived)
                                                              for t in tiles]
        variants += stage2_variants(tiles, rows, contexts, model, num_sms, False, derived)
        # min_split_tokens and the long rule's lengths are runtime values (whether it is on is compiled).
        keys = {replace(launched_form(v, model["head_dim"]), min_split_tokens=256,
                        long_from_tokens=4096 if v.long_from_tokens else 0,
                        long_split_tokens=128 if v.long_from_tokens else 0) for v in variants}
        items += [(model, rows, v) for v in keys]
    return items


def _compile_one_launch(items: list[tuple], device: str) -> None:
    """In a child process: launch each (model, rows, variant) once on a short case."""
    import torch

    from flashlet.kernels import decode_attention as da

    cases = {}
    for model, rows, v in items:
        key = (model["name"], rows)
        if key not in cases:
            cases[key] = Case(torch, rows, 300, "model", {**model, "layers": 1}, device)
        try:
            make_one_launch_call(da, torch, cases[key], v)(0)
        except Exception:  # the main process reports it when it measures the variant
            pass
    if device == "cuda":
        torch.cuda.synchronize()


def precompile_one_launch(buckets, shape, num_sms: int, pdl: bool, jobs: int, device: str,
                          rope_in: str = "auto") -> None:
    """Compile every variant the sweep may time in `jobs` processes at once."""
    items = _one_launch_items(buckets, shape, num_sms, pdl, device, rope_in)
    if jobs < 2:
        return
    t0 = time.monotonic()
    chunks = [items[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_one_launch, chunks, [device] * jobs))
    print(f"compiled {len(items)} one-launch variants in {jobs} processes: {time.monotonic() - t0:.0f} s", flush=True)


def _layer_row(sweep: Sweep, model: dict, rows: int, kv_len: int, v: OneLaunchVariant) -> dict | None:
    return sweep._done.get((model["name"], rows, kv_len, "model", launched_form(v.at_length(kv_len), model["head_dim"])))


def summarize_one_launch(results: dict, sweep: Sweep, tuning) -> None:
    print("\n== one launch: per shape, us a layer (GB/s): derived config | best of its rows bucket | "
          "the same two with PDL off ==")
    for (name, rows), (model, bucket, res) in results.items():
        best = res["best"]
        label = best[0].label() if best else "nothing timed"
        print(f"{name} rows {rows}: derived {res['derived_variant'].label()}; best {label}")
        derived = res["derived_variant"]
        shown = [derived, best[0] if best else None]
        shown += [replace(v, pdl=False) if v is not None and v.pdl else None for v in shown]
        for n in bucket.contexts:
            cells = [_cell(_layer_row(sweep, model, rows, n, v)) if v else "-" for v in shown]
            ratio = ""
            if best and res["derived"] and n in res["derived"]:
                ratio = f"  best/derived {best[1][n] / res['derived'][n]:.2f}"
            print(f"  L={n:<6} " + " | ".join(cells) + ratio)
    print("\n" + one_launch_table_literal(one_launch_entries(results, tuning)))


def _cell(row: dict | None) -> str:
    if row is None:
        return "not timed"
    if "error" in row:
        return "error"
    if "us" not in row:
        return "ok"
    return f"{row['us']:.2f} ({row['gbps']:.0f})"


ENTRY_MARGIN = 0.97  # a winner must beat the derived config by 3% (geomean): less is timing noise


def one_launch_entries(results: dict, tuning) -> dict:
    """ONE_LAUNCH_TABLE entries: each (model, rows bucket)'s winner, where it beat the derived
    config over the bucket's contexts by more than the noise (ENTRY_MARGIN; a tie keeps
    today's config: no entry). A bucket with contexts on both sides of
    tuning.ONE_LAUNCH_LONG_CONTEXT is judged on each side: its entry over the short ones, and a
    long entry (key + ("long",), ONE_LAUNCH_LONG_TABLE: a graph of its own) where the best over
    the long ones beats what those rows run without it (the short entry, else the derived
    config) by the margin."""
    entries = {}
    for (name, rows), (model, bucket, res) in results.items():
        derived = res["derived"]
        if not res["best"] or not derived:
            continue
        group = model["num_q_heads"] // model["num_kv_heads"]
        key = (model["head_dim"], group, tuning.bucket(rows, tuning.ONE_LAUNCH_ROW_BUCKETS))
        long_ = [n for n in derived if n >= tuning.ONE_LAUNCH_LONG_CONTEXT]
        short = [n for n in derived if n < tuning.ONE_LAUNCH_LONG_CONTEXT]
        sides = [(key, list(derived))] if not long_ or not short else [(key, short), (key + ("long",), long_)]
        base = (None, derived)  # what a side's rows run without its entry
        for k, ns in sides:
            scored = [(v, got) for v, got in res["scored"] if all(n in got for n in ns)]
            if not scored:
                continue
            ref = {n: base[1][n] for n in ns}
            best = min(scored, key=lambda vg: geomean_ratio(vg[1], ref))
            if geomean_ratio(best[1], ref) < ENTRY_MARGIN:
                entries[k] = best[0].config(tuning)
                if k == key:
                    base = best
    return entries


def one_launch_table_literal(entries: dict) -> str:
    """tuning.py source for the entries."""
    lines = ["ONE_LAUNCH_TABLE: dict[tuple[int, int, int], OneLaunchConfig] = {"]
    lines += [f"    {key!r}: {cfg!r}," for key, cfg in sorted(entries.items()) if len(key) == 3]
    lines += ["}", "ONE_LAUNCH_LONG_TABLE: dict[tuple[int, int, int], OneLaunchConfig] = {"]
    lines += [f"    {key[:3]!r}: {cfg!r}," for key, cfg in sorted(entries.items()) if len(key) == 4]
    return "\n".join(lines + ["}"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, through the Triton interpreter")
    p.add_argument("--one-launch", action="store_true",
                   help="sweep the fused decode path's one-launch attention (ONE_LAUNCH_TABLE), not the batched decode")
    p.add_argument("--kv", default="model,fp8", help="KV dtypes to sweep: model (bf16), fp8")
    p.add_argument("--models", default=None,
                   help="--one-launch: the shapes to sweep, comma-separated (default qwen2.5-0.5b,qwen3-0.6b; "
                        "also qwen2.5-1.5b, llama-3.2-1b, tinyllama-1.1b, qwen2.5-7b); the batched sweep: "
                        "one of them (default qwen2.5-0.5b), whose (head_dim, group) keys its table entries")
    p.add_argument("--rope-in", choices=("auto", "off"), default="auto",
                   help="--one-launch: time Qwen3's shapes with the rows made in the kernel, as the fused path "
                        "launches them (auto), or without (off: the kernel before 58915bd's default)")
    p.add_argument("--rows", type=int, nargs="+", default=None,
                   help="--one-launch: the rows buckets to sweep (default all of ONE_LAUNCH_ROWS)")
    p.add_argument("--shapes", default=None, help="BxL,BxL,... (default 128x2000,32x8000,1x30000)")
    p.add_argument("--top", type=int, default=None,
                   help="tiles of stage 1 that stage 2 times (default 4; --one-launch: 2, beside the derived tile)")
    p.add_argument("--quick", action="store_true",
                   help="stage 1 times only the page-prefetched tiles near the measured winners (QUICK_TILES)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--jobs", type=int, default=None,
                   help="processes that compile the variants ahead of timing (1: none; default 8, "
                        "--one-launch: the CPUs less one, at most 15)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop timing new configs after this long (default 450; --one-launch: 200, compiling included)")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--table-json", default=None,
                   help="write the winners' BATCHED_DECODE_TABLE (--one-launch: ONE_LAUNCH_TABLE) entries here "
                        "(tuning.load_tables; an engine run takes it with FLASHLET_DECODE_TABLES=PATH)")
    p.add_argument("--lower", default=None, nargs="+", metavar="BN,WARPS,STAGES,KV,PREFETCH[,KV_PACK[,MERGE]]",
                   help="only compile these variants for sm_90 (no GPU needed) and print lower_for_sm90's JSON, "
                        "a line each (MERGE: 'kernel' for the last-program merge)")
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 200.0 if args.one_launch else 450.0
    if args.top is None:
        args.top = 2 if args.one_launch else 4
    if args.jobs is None:
        cpus = os.cpu_count() or 1
        args.jobs = max(1, min(15, cpus - 1)) if args.one_launch else min(8, cpus)
    args.kv = args.kv.split(",")
    args.shapes = (tuple(tuple(int(x) for x in s.split("x")) for s in args.shapes.split(","))
                   if args.shapes else SHAPES)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lower:
        for spec in args.lower:  # one process for all: its imports cost more than a compile
            bn, warps, stages, kv, prefetch, *rest = spec.split(",")
            print(json.dumps(lower_for_sm90(int(bn), int(warps), int(stages), kv, prefetch,
                                            kv_pack=int(rest[0]) if rest else 1,
                                            merge_in_kernel=rest[1:2] == ["kernel"])), flush=True)
        return 0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not __import__("torch").cuda.is_available():
        print("the sweep times a CUDA device; use --smoke on the CPU", file=sys.stderr)
        return 2
    rows = run_one_launch(args) if args.one_launch else run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
