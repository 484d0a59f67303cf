"""Kernel sweep: every Triton kernel of this package against its PyTorch reference and, where
`flashinfer` imports, against FlashInfer's equivalent.

Each row gives the median time in microseconds (CUDA events around each call, replayed from a
CUDA graph where it can be captured so that the host's launch cost is not timed; the L2 flushed
before each repeat by zeroing a 256 MiB buffer), the bytes the kernel must move (its floor, as
the kernel's docstring derives it) and the FLOPs it must do, the achieved bandwidth
(bytes / time) and its fraction of the copy bandwidth measured in the same run (a
device-to-device copy of a 1 GiB buffer, counting its read and its write).

    rows = run_kernel_sweep("cuda")                      # the full sweep (GPU only)
    rows = run_kernel_sweep("cpu", smoke=True)           # tiny shapes, functional check only
    python -m flashlet.kernels.bench [--smoke] [--json FILE]

On the CPU the sweep refuses to run except in smoke mode: the Triton interpreter is not a
timing target. Smoke mode on the CPU needs TRITON_INTERPRET=1; it sets it itself when the
kernel modules have not been imported yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

KERNELS = ("decode", "prefill", "mixed", "rope_kv_write", "rms_norm", "add_rms_norm", "silu_mul")

# Qwen2.5-0.5B shapes.
DEFAULT_SHAPES = dict(num_q_heads=14, num_kv_heads=2, head_dim=64, page_size=16, hidden=896, intermediate=4864)
SMOKE_SHAPES = dict(num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=4, hidden=40, intermediate=24)


def _kernels():
    """Import the kernel modules (late, so smoke mode can turn the interpreter on first)."""
    from flashlet.kernels import decode_attention, prefill_attention, rmsnorm, rope_kv_write, silu_mul

    return decode_attention, prefill_attention, rope_kv_write, rmsnorm, silu_mul


def _ensure_runnable(device: torch.device, smoke: bool) -> None:
    if device.type == "cuda":
        return
    if not smoke:
        raise RuntimeError(
            f"the kernel sweep needs a CUDA device, got {device}: the Triton interpreter on the CPU "
            "is not a timing target (use smoke=True / --smoke for a tiny functional check)"
        )
    if device.type != "cpu":
        raise RuntimeError(f"unsupported device {device}")
    if "flashlet.kernels.decode_attention" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") != "1" or type(_kernels()[0]._decode_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "smoke mode on the CPU needs TRITON_INTERPRET=1 set before flashlet.kernels is first imported"
        )


class _Timer:
    def __init__(self, device: torch.device, repeats: int, warmup: int, flush_l2: bool):
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.flush = (
            torch.empty(256 << 20, dtype=torch.uint8, device=device) if (flush_l2 and device.type == "cuda") else None
        )

    def __call__(self, fn: Callable[[], object], graph: bool = True) -> float:
        """Median microseconds of fn() on the device.

        On CUDA, fn is captured in a CUDA graph when it can be (as the engine runs its decode
        steps) and the graph is replayed between the timing events: otherwise the host's launch
        cost (tens of microseconds for a Triton kernel launched from Python) would be timed
        instead of a small kernel. graph=False (for a function known to sync with the host), or a
failed capture, times fn as it is called."""
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        run = (_as_graph(fn) if graph else None) or fn
        torch.cuda.synchronize(self.device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        for i in range(self.repeats):
            if self.flush is not None:
                self.flush.zero_()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def _as_graph(fn: Callable[[], object]) -> Callable[[], object] | None:
    """fn captured in a CUDA graph (its replay), or None when fn cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()  # warm on the side stream, as torch.cuda.graphs advises
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # a host sync or another uncapturable call: time it as it is called
        torch.cuda.synchronize()
        return None
    return graph.replay


def graph_time_us(calls: int, launch, replays: int = 20) -> float:
    """Median per-call time of `calls` launches captured in one CUDA graph (launch(i) issues call i)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, 3)):  # warm up outside the capture (module loads, allocator)
            launch(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # "relaxed": the DSL's launcher may set kernel attributes at launch, which stricter capture
    # modes refuse; nothing here frees or syncs while capturing.
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        for i in range(calls):
            launch(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy of nbytes (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = _Timer(device, repeats, 2, flush_l2=False)
    us = timer(lambda: dst.copy_(src), graph=False)
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e9


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _paged(batch, kv_len, page_size, num_kv_heads, head_dim, dtype, device, gen):
    pages_per_seq = -(-kv_len // page_size)
    num_pages = batch * pages_per_seq + 1
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    indices = torch.randperm(num_pages, generator=gen, device=device)[: batch * pages_per_seq].to(torch.int32)
    indptr = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * pages_per_seq
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    last = torch.full((batch,), kv_len - (pages_per_seq - 1) * page_size, dtype=torch.int32, device=device)
    return k_cache, v_cache, indptr, indices, lens, last


def _decode_torch(q, k_cache, v_cache, indices, kv_len, scale):
    """Batched PyTorch decode for uniform kv_len: gather the pages, one SDPA call."""
    batch, hq, d = q.shape
    hkv = k_cache.shape[2]
    idx = indices.view(batch, -1).long()
    k = k_cache[idx].flatten(1, 2)[:, :kv_len].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[idx].flatten(1, 2)[:, :kv_len].transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=hq != hkv)
    return o.squeeze(2)


def _flashinfer():
    try:
        import flashinfer  # noqa: F401

        return flashinfer
    except Exception:  # absent or broken: the comparison is skipped
        return None


def _row(kernel, impl_times, nbytes, flops, copy_gbps, **fields):
    row = dict(kernel=kernel, **fields, bytes=int(nbytes), flops=int(flops), copy_gbps=copy_gbps)
    for impl in ("triton", "reference", "flashinfer"):
        us = impl_times.get(impl)
        row[f"{impl}_us"] = us
        gbps = nbytes / (us * 1e-6) / 1e9 if us else None
        row[f"{impl}_gbps"] = gbps
        row[f"{impl}_frac_copy_bw"] = gbps / copy_gbps if (gbps and copy_gbps) else None
        row[f"{impl}_tflops"] = flops / (us * 1e-6) / 1e12 if us else None
    t = impl_times.get("triton")
    row["speedup_vs_reference"] = impl_times["reference"] / t if (t and impl_times.get("reference")) else None
    row["speedup_vs_flashinfer"] = impl_times["flashinfer"] / t if (t and impl_times.get("flashinfer")) else None
    return row


def _try(fn_maker):
    """(callable, None) or (None, error text) for an optional competitor."""
    try:
        fn = fn_maker()
        fn()
        return fn, None
    except Exception as exc:  # flashinfer versions differ; record why instead of failing the sweep
        return None, f"{type(exc).__name__}: {exc}"[:200]


def run_kernel_sweep(
    device: torch.device | str | None = None,
    batches=(1, 8, 32, 128, 256),
    contexts=(128, 1024, 8192),
    *,
    kernels=KERNELS,
    dtype: torch.dtype | str = torch.bfloat16,
    num_q_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    page_size: int | None = None,
    hidden: int | None = None,
    intermediate: int | None = None,
    prefill_chunk: int = 512,
    max_prefill_tokens: int = 32768,
    repeats: int = 20,
    warmup: int = 3,
    flush_l2: bool = True,
    smoke: bool = False,
    quick: bool = False,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    progress=None,
) -> list[dict]:
    """Time each kernel on each (batch, context) and return one dict per (kernel, shape).

    decode: `batch` sequences of `context` tokens, one query row each.
    prefill: `batch` sequences each prefilling the last min(context, prefill_chunk) tokens of
    `context` (skipped above max_prefill_tokens query rows). mixed: one such chunk plus
    batch - 1 decodes of `context` tokens, in one launch.
    rope_kv_write / rms_norm / add_rms_norm / silu_mul: token counts = batches and contexts.
    Shapes default to Qwen2.5-0.5B (14/2 heads, head_dim 64, page 16, hidden 896, MLP 4864).
    device: default cuda (the sweep refuses the CPU unless smoke). dtype: a torch dtype or its
    name ("bfloat16"). quick: batches (1, 32, 256) x contexts (1024,), 10 repeats.
    smoke: one tiny shape per kernel (batch 3, context 9), 1 repeat, fp32 (runs on the CPU
    through the interpreter); batches/contexts/dtype/repeats are ignored.
    log(str) gets each row as a table line; progress (flashlet.bench's Progress, or anything
    with .task(description, total) -> .advance()) is advanced once per row."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    _ensure_runnable(device, smoke)
    if quick and not smoke:
        batches, contexts, repeats = (1, 32, 256), (1024,), min(repeats, 10)
    shapes = dict(SMOKE_SHAPES if smoke else DEFAULT_SHAPES)
    for key, val in dict(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        hidden=hidden, intermediate=intermediate,
    ).items():
        if val is not None:
            shapes[key] = val
    if smoke:
        batches, contexts, dtype, repeats, warmup, prefill_chunk = (3,), (9,), torch.float32, 1, 0, 4
    hq, hkv, d, ps = shapes["num_q_heads"], shapes["num_kv_heads"], shapes["head_dim"], shapes["page_size"]
    scale = d**-0.5
    dec, pre, rope, rms, silu = _kernels()
    from flashlet.kernels import tuning
    from flashlet.kernels.decode_attention import choose_num_splits

    fi = _flashinfer() if device.type == "cuda" else None
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(seed)
    log = log or (lambda s: None)
    copy_gbps = measure_copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 20))
    timer = _Timer(device, repeats, warmup, flush_l2)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    common = dict(device=dev_name, dtype=str(dtype).replace("torch.", ""), num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    rows: list[dict] = []
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device) if fi is not None else None

    token_counts = sorted(set(batches) | set(contexts))
    hidden, inter = shapes["hidden"], shapes["intermediate"]
    n_attn = sum(k in kernels for k in ("decode", "prefill", "mixed")) * len(batches) * len(contexts)
    n_elem = sum(k in kernels for k in ("rope_kv_write", "rms_norm", "add_rms_norm", "silu_mul")) * len(token_counts)
    task = progress.task("kernel sweep", n_attn + n_elem) if progress is not None else None

    def add(kernel, times, nbytes, flops, err, fi_err, **fields):
        row = _row(kernel, times, nbytes, flops, copy_gbps, **common, **fields)
        row["max_rel_err_vs_reference"] = err
        row["flashinfer_note"] = fi_err
        rows.append(row)
        log(format_rows([row], header=len(rows) == 1))
        if task is not None:
            task.advance()

    for batch in batches:
        for ctx in contexts:
            if "decode" in kernels:
                kc, vc, indptr, indices, lens, last = _paged(batch, ctx, ps, hkv, d, dtype, device, gen)
                q = torch.randn(batch, hq, d, generator=gen, device=device).to(dtype)
                cfg = tuning.decode_config(d, hq // hkv, batch)  # what the engine launches
                splits = choose_num_splits(batch, hkv, num_sms, 64, cfg.waves)
                mid_o = torch.empty(batch * splits, hq, d, dtype=torch.float32, device=device)
                mid_lse = torch.empty(batch * splits, hq, dtype=torch.float32, device=device)
                out = torch.empty_like(q)

                def tri():
                    return dec.decode_attention(
                        q, kc, vc, indptr, indices, lens, scale, out=out, num_splits=splits, mid_o=mid_o,
                        mid_lse=mid_lse, min_split_tokens=cfg.min_split_tokens, block_n=cfg.block_n,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                    )

                def ref():
                    return _decode_torch(q, kc, vc, indices, ctx, scale)

                err = _rel_err(tri(), ref())
                times = {"triton": timer(tri), "reference": timer(ref)}
                fi_err = "flashinfer not importable" if fi is None else None
                if fi is not None:

                    def make():
                        # As flashlet's FlashInfer backend runs decode: the FA2 prefill kernel
                        # with one query row per sequence (any GQA group size, e.g. 7).
                        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
                        qo = torch.arange(batch + 1, dtype=torch.int32, device=device)
                        w.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=True,
                               q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
                        return lambda: w.run(q, (kc, vc))

                    fn, fi_err = _try(make)
                    times["flashinfer"] = timer(fn) if fn else None
                nbytes = 2 * batch * ctx * hkv * d * elem + 2 * batch * hq * d * elem + 4 * indices.numel()
                add("decode", times, nbytes, 4 * batch * ctx * hq * d, err, fi_err, batch=batch, context=ctx,
                    tokens=batch, num_splits=splits)
                del kc, vc

            for kind in ("prefill", "mixed"):
                if kind not in kernels:
                    continue
                q_len = min(ctx, prefill_chunk)
                q_lens = [q_len] * batch if kind == "prefill" else [q_len] + [1] * (batch - 1)
                if (kind == "mixed" and batch == 1) or sum(q_lens) > max_prefill_tokens:
                    if task is not None:
                        task.advance()  # a shape this kind does not run
                    continue
                kc, vc, indptr, indices, lens, last = _paged(batch, ctx, ps, hkv, d, dtype, device, gen)
                qo_host = [0]
                for n in q_lens:
                    qo_host.append(qo_host[-1] + n)
                qo = torch.tensor(qo_host, dtype=torch.int32, device=device)
                q = torch.randn(qo_host[-1], hq, d, generator=gen, device=device).to(dtype)
                out = torch.empty_like(q)
                pc = tuning.prefill_config(d, hq // hkv, q_len)  # what the engine launches

                def tri():
                    return pre.prefill_attention(q, kc, vc, qo, indptr, indices, lens, scale,
                                                 out=out, block_m=pc.block_m, block_n=pc.block_n,
                                                 num_warps=pc.num_warps, num_stages=pc.num_stages)

                def ref():
                    return pre.prefill_attention_reference(q, kc, vc, qo, indptr, indices, lens, scale)

                err = _rel_err(tri(), ref())
                times = {"triton": timer(tri), "reference": timer(ref, graph=False)}  # the reference syncs
                fi_err = "flashinfer not importable" if fi is None else None
                if fi is not None:

                    def make():
                        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
                        w.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=True,
                               q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
                        return lambda: w.run(q, (kc, vc))

                    fn, fi_err = _try(make)
                    times["flashinfer"] = timer(fn) if fn else None
                pairs = sum(n * (ctx - n) + n * (n + 1) // 2 for n in q_lens)
                nbytes = 2 * batch * ctx * hkv * d * elem + 2 * qo_host[-1] * hq * d * elem
                add(kind, times, nbytes, 4 * pairs * hq * d, err, fi_err, batch=batch, context=ctx, tokens=qo_host[-1])
                del kc, vc

    for t in token_counts:
        if "rope_kv_write" in kernels:
            max_pos = max(contexts) + 1
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
            freqs = torch.outer(torch.arange(max_pos, device=device).float(), inv)
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen, device=device).to(dtype)
            q, k, v = qkv.split([hq, hkv, hkv], dim=1)
            pos = torch.randint(0, max_pos, (t,), generator=gen, device=device)
            num_pages = -(-t // ps) + 1
            kc = torch.zeros(num_pages, ps, hkv, d, dtype=dtype, device=device)
            vc = torch.zeros_like(kc)
            slots = torch.randperm(num_pages * ps, generator=gen, device=device)[:t]

            def tri():
                return rope.rope_kv_write(q, k, v, pos, cos_sin, kc, vc, slots)

            def ref():
                return rope.rope_kv_write_reference(q, k, v, pos, cos_sin, kc, vc, slots)

            err = max(_rel_err(a, b) for a, b in zip(tri(), ref()))
            times = {"triton": timer(tri), "reference": timer(ref, graph=False)}  # the reference syncs
            fi_err = "flashinfer not importable" if fi is None else None
            if fi is not None:

                def make():
                    qf, kf = q.reshape(t, -1).clone(), k.reshape(t, -1).clone()
                    flat = (-1, hkv, d)

                    def run():
                        fi.rope.apply_rope_with_cos_sin_cache_inplace(pos, qf, kf, d, cos_sin, is_neox=True)
                        kc.view(flat).index_copy_(0, slots, kf.view(t, hkv, d))
                        vc.view(flat).index_copy_(0, slots, v)

                    return run

                fn, fi_err = _try(make)
                fi_err = fi_err or "flashinfer rope + torch index_copy_ for the pool write"
                times["flashinfer"] = timer(fn) if fn else None
            nbytes = t * (hq + 2 * hkv) * d * elem + t * (d * 4 + 16) + t * (hq + hkv) * d * elem + 2 * t * hkv * d * elem
            add("rope_kv_write", times, nbytes, 6 * t * (hq + hkv) * d, err, fi_err, tokens=t)

        eps = 1e-6
        w = torch.randn(hidden, generator=gen, device=device).to(dtype)
        x = torch.randn(t, hidden, generator=gen, device=device).to(dtype)
        r = torch.randn(t, hidden, generator=gen, device=device).to(dtype)
        if "rms_norm" in kernels:
            err = _rel_err(rms.rms_norm(x, w, eps), rms.rms_norm_reference(x, w, eps))
            times = {"triton": timer(lambda: rms.rms_norm(x, w, eps)), "reference": timer(lambda: rms.rms_norm_reference(x, w, eps))}
            fi_err = "flashinfer not importable" if fi is None else None
            if fi is not None:
                fn, fi_err = _try(lambda: (lambda: fi.norm.rmsnorm(x, w, eps)))
                times["flashinfer"] = timer(fn) if fn else None
            add("rms_norm", times, 2 * t * hidden * elem + hidden * elem, 4 * t * hidden, err, fi_err, tokens=t, hidden=hidden)
        if "add_rms_norm" in kernels:
            a, b = rms.add_rms_norm(x, r, w, eps)
            ra, rb = rms.add_rms_norm_reference(x, r, w, eps)
            err = max(_rel_err(a, ra), _rel_err(b, rb))
            times = {
                "triton": timer(lambda: rms.add_rms_norm(x, r, w, eps)),
                "reference": timer(lambda: rms.add_rms_norm_reference(x, r, w, eps)),
            }
            fi_err = "flashinfer not importable" if fi is None else None
            if fi is not None:
                xf, rf = x.clone(), r.clone()
                fn, fi_err = _try(lambda: (lambda: fi.norm.fused_add_rmsnorm(xf, rf, w, eps)))
                fi_err = fi_err or "flashinfer fused_add_rmsnorm works in place"
                times["flashinfer"] = timer(fn) if fn else None
            add("add_rms_norm", times, 4 * t * hidden * elem + hidden * elem, 5 * t * hidden, err, fi_err, tokens=t, hidden=hidden)
        if "silu_mul" in kernels:
            gu = torch.randn(t, 2 * inter, generator=gen, device=device).to(dtype)
            err = _rel_err(silu.silu_and_mul(gu), silu.silu_and_mul_reference(gu))
            times = {"triton": timer(lambda: silu.silu_and_mul(gu)), "reference": timer(lambda: silu.silu_and_mul_reference(gu))}
            fi_err = "flashinfer not importable" if fi is None else None
            if fi is not None:
                fn, fi_err = _try(lambda: (lambda: fi.activation.silu_and_mul(gu)))
                times["flashinfer"] = timer(fn) if fn else None
            add("silu_mul", times, 3 * t * inter * elem, 5 * t * inter, err, fi_err, tokens=t, intermediate=inter)
    return rows


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_rows(rows: list[dict], header: bool = True) -> str:
    """A fixed-width table of the sweep's main columns."""
    cols = [
        ("kernel", 13, "s"), ("batch", 5, "d"), ("context", 7, "d"), ("tokens", 6, "d"),
        ("triton_us", 10, ".1f"), ("reference_us", 12, ".1f"), ("flashinfer_us", 13, ".1f"),
        ("triton_gbps", 11, ".0f"), ("triton_frac_copy_bw", 8, ".2f"), ("flashinfer_frac_copy_bw", 8, ".2f"),
        ("max_rel_err_vs_reference", 9, ".1e"),
    ]
    names = {"triton_frac_copy_bw": "tri/copy", "flashinfer_frac_copy_bw": "fi/copy", "max_rel_err_vs_reference": "rel_err"}
    lines = []
    if header:
        lines.append(" ".join(names.get(c, c).rjust(w) for c, w, _ in cols))
    for r in rows:
        lines.append(" ".join(_fmt(r.get(c), f).rjust(w) for c, w, f in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashlet.kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a functional check (works on the CPU)")
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--contexts", default="128,1024,8192")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    try:
        rows = run_kernel_sweep(
            args.device,
            batches=tuple(int(x) for x in args.batches.split(",")),
            contexts=tuple(int(x) for x in args.contexts.split(",")),
            kernels=tuple(args.kernels.split(",")),
            dtype=getattr(torch, args.dtype),
            repeats=args.repeats,
            smoke=args.smoke,
            log=print,
        )
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if rows:
        print(f"copy bandwidth: {rows[0]['copy_gbps']:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
