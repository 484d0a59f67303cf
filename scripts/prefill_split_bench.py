"""The ragged prefill kernel's split-KV form alone, on a long prompt's chunk beside decodes (issue 32).

What a mixed step under the server's default decode-step bound runs each layer
(`prefill_attention` with the engine's tiles for the step's longest chunk, `tuning.prefill_config`):
one 448-token chunk ending a context of C tokens plus 64 decode rows of --decode-context tokens
each, timed over 24 layers (pools apart, so no layer's K/V sits in L2 from the layer before),
replayed from one CUDA graph. Per model (Qwen2.5-0.5B: 14 query heads, 2 KV heads, head_dim 64;
Qwen3-0.6B: 16, 8, 128), per context C (1k, 4k, 8k, 30k) and per split cap S (1, 2, 4, 8, 16)
and smallest split (--min-split-tokens), at the engine's tile or the key blocks and stages given
(--block-n, --num-stages): milliseconds for the 24 layers and the speed-up over S = 1 at the
engine's tile. Every config is checked against `prefill_attention_reference` on one layer
before it is timed; a wrong one is reported and not timed. The engine's switch for the same thing is
$FLASHLET_PREFILL_SPLITS (`attention/triton_backend.py`).

    python scripts/prefill_split_bench.py                     # H200
    python scripts/prefill_split_bench.py --models qwen2.5-0.5b --contexts 8000 --json out.json
    python scripts/prefill_split_bench.py --chunk 16 --decodes 0 --contexts 8000,30000 --splits 16,32 \
        --min-split-tokens 256,512 --block-n 32,64 --num-stages 2,3,4   # a cached prompt's last page
    python scripts/prefill_split_bench.py --smoke             # CPU: tiny shapes, interpreter, no timing
    python scripts/prefill_split_bench.py --lower 1 8         # CPU: the sm_90a lowering per model and S
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

MODELS = {
    "qwen2.5-0.5b": dict(layers=24, num_q_heads=14, num_kv_heads=2, head_dim=64, page_size=16),
    "qwen3-0.6b": dict(layers=24, num_q_heads=16, num_kv_heads=8, head_dim=128, page_size=16),
}
CONTEXTS = (1024, 4096, 8192, 30000)  # tokens of the prompt up to the end of its chunk
SPLITS = (1, 2, 4, 8, 16)
MIN_SPLIT_TOKENS = (512, 1024)
CHUNK, DECODES, DECODE_CONTEXT = 448, 64, 1024
SMOKE_MODELS = {
    "tiny-g3": dict(layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=16),
    "tiny-g2": dict(layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16),
}
SMOKE = dict(contexts=(60, 200), splits=(1, 2, 4), min_split_tokens=(16, 48), chunk=12, decodes=3,
             decode_context=40, block_m=16, block_n=16)
TOLERANCE = 3e-2  # bf16 outputs of an fp32-accumulated softmax against the fp32 reference


class Step:
    """One mixed step's tensors: a chunk of `chunk` rows ending a context of `context` tokens,
    then `decodes` rows of `decode_context` tokens each, over every layer's own pools."""

    def __init__(self, torch, model: dict, context: int, chunk: int, decodes: int, decode_context: int,
                 device: str, seed: int = 0):
        dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter has no bf16 dots
        gen = torch.Generator(device=device).manual_seed(seed)
        ps, hkv, d, hq = model["page_size"], model["num_kv_heads"], model["head_dim"], model["num_q_heads"]
        kv_lens = [context] + [decode_context] * decodes
        q_lens = [chunk] + [1] * decodes
        pages = [-(-n // ps) for n in kv_lens]
        num_pages = sum(pages) + 1
        shape = (model["layers"], num_pages, ps, hkv, d)
        self.k = torch.randn(shape, generator=gen, device=device).to(dtype)
        self.v = torch.randn(shape, generator=gen, device=device).to(dtype)
        self.indices = torch.randperm(num_pages, generator=gen, device=device)[: sum(pages)].int()
        self.indptr = torch.tensor([0] + pages, device=device).cumsum(0).int()
        self.lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        self.qo = torch.tensor([0] + q_lens, device=device).cumsum(0).int()
        self.q = torch.randn(sum(q_lens), hq, d, generator=gen, device=device).to(dtype)
        self.out = torch.empty_like(self.q)
        self.scale = d**-0.5

    def args(self, layer: int) -> tuple:
        return (self.q, self.k[layer], self.v[layer], self.qo, self.indptr, self.indices, self.lens, self.scale)


def configs(splits, min_split_tokens) -> list[tuple[int, int]]:
    """(S, smallest split) to time: S = 1 once (the smallest split means nothing there)."""
    return [(1, 0)] + [(s, m) for s in splits if s > 1 for m in min_split_tokens]


def run(args) -> list[dict]:
    import torch

    from flashlet.kernels import tuning
    from flashlet.kernels.prefill_attention import prefill_attention, prefill_attention_reference, split_scratch

    device = "cpu" if args.smoke else "cuda"
    models = SMOKE_MODELS if args.smoke else {name: MODELS[name] for name in args.models}
    rows = []
    for name, model in models.items():
        group = model["num_q_heads"] // model["num_kv_heads"]
        tile = tuning.prefill_config(model["head_dim"], group, args.chunk)
        if args.smoke:
            tile = tuning.PrefillConfig(block_m=SMOKE["block_m"], block_n=SMOKE["block_n"])
        # the engine's tile first (the speed-ups' base), then the other key blocks and stages asked for
        tiles = list(dict.fromkeys([tile] + [dataclasses.replace(tile, block_n=bn, num_stages=ns)
                                             for bn in args.block_n or (tile.block_n,)
                                             for ns in args.num_stages or (tile.num_stages,)]))
        for context in args.contexts:
            step = Step(torch, model, context, args.chunk, args.decodes, args.decode_context, device)
            want = prefill_attention_reference(*step.args(0))
            scratch = split_scratch(max(args.splits), step.q.shape[0], model["num_q_heads"], model["head_dim"],
                                    device)
            base_ms = None
            for tile, (splits, min_split) in [(t, c) for t in tiles
                                              for c in configs(args.splits, args.min_split_tokens)]:

                def launch(layer, splits=splits, min_split=min_split, tile=tile):
                    prefill_attention(*step.args(layer), out=step.out, block_m=tile.block_m, block_n=tile.block_n,
                                      num_warps=tile.num_warps, num_stages=tile.num_stages, num_splits=splits,
                                      min_split_tokens=max(1, min_split), scratch=scratch if splits > 1 else None)

                row = dict(model=name, context=context, chunk=args.chunk, decodes=args.decodes,
                           decode_context=args.decode_context, splits=splits, min_split_tokens=min_split,
                           block_m=tile.block_m, block_n=tile.block_n, num_stages=tile.num_stages)
                step.out.fill_(float("nan"))
                launch(0)
                err = float((step.out.double() - want.double()).abs().max() / want.double().abs().max())
                row["max_rel_err"] = err
                if not err < (1e-5 if args.smoke else TOLERANCE):
                    row["wrong"] = True
                    print(f"WRONG {name} C={context} S={splits} min={min_split}: rel err {err:.3g}", flush=True)
                elif not args.smoke:
                    from flashlet.kernels.bench import graph_time_us  # with torch: --smoke runs without CUDA

                    row["ms_24_layers"] = graph_time_us(model["layers"], launch, replays=args.repeats) * 24 / 1e3
                    base_ms = row["ms_24_layers"] if splits == 1 and base_ms is None else base_ms
                    if base_ms:
                        row["speedup"] = base_ms / row["ms_24_layers"]
                rows.append(row)
                print(_fmt(row), flush=True)
            del step, scratch
            if device == "cuda":
                torch.cuda.empty_cache()
    summarize(rows)
    return rows


def lower_for_sm90(model: dict, splits: int, chunk: int = CHUNK) -> dict:
    """The split kernel (and, for S > 1, the merge) compiled for sm_90a at the model's engine
    tiles and launch limits (no GPU needed; pool strides divisible by 16, as the launcher
    specialises them): ptxas's registers / spills and the SASS instruction count."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashlet.kernels import prefill_attention as pa
    from flashlet.kernels import tuning

    group = model["num_q_heads"] // model["num_kv_heads"]
    tile = tuning.prefill_config(model["head_dim"], group, chunk)
    consts = dict(GROUP=group, HEAD_DIM=model["head_dim"], BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                  NUM_SPLITS=splits, PAGE_SIZE=model["page_size"], INPUT_PRECISION=None)
    limits = pa.split_launch_limits(tile.num_warps) if splits > 1 else {}
    kernels = [(pa._prefill_kernel, dict(num_warps=tile.num_warps, num_stages=tile.num_stages, **limits))]
    if splits > 1:
        kernels.append((pa._merge_kernel, dict(num_warps=pa.merge_warps(model["head_dim"]))))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    row = dict(block_m=tile.block_m, block_n=tile.block_n, num_warps=tile.num_warps, **limits)
    for fn, options in kernels:
        names = fn.arg_names
        kc = {k: v for k, v in consts.items() if k in names}
        sig = {n: "i32" for n in names}
        sig.update({n: "*bf16" for n in ("Q", "K", "V", "O")})
        sig.update({n: "*i32" for n in ("QoIndptr", "KvIndptr", "KvIndices", "KvLens")})
        sig.update({n: "*fp32" for n in ("MidAcc", "MidM", "MidL")})
        sig.update(qk_scale="fp32", v_scale="fp32", **{c: "constexpr" for c in kc})
        sig = {n: sig[n] for n in names}
        aligned = [n for n in names if n.startswith("stride") or (n[0].isupper() and n not in kc)]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=kc, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(kernel.asm["ptx"])
            f.flush()
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                  capture_output=True, text=True, check=True).stderr
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", f.name],
                                  capture_output=True, text=True, check=True).stdout
        name = fn.__name__.strip("_")
        row[name + "_ptxas"] = " ".join(line.split(":", 1)[-1].strip() for line in info.splitlines()
                                        if "registers" in line or "spill" in line)
        row[name + "_sass_instructions"] = sum(bool(re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
                                               for line in sass.splitlines())
    return row


def table_entries(rows: list[dict], chunk: int) -> list:
    """The best timed config per model over every context timed (least total ms; a config missing
    a context is left out) as `tuning.load_tables` entries: [[head_dim, group, q-length bucket,
    "prefill"], PrefillConfig fields], for an engine A/B with FLASHLET_DECODE_TABLES before it is
    written into tuning.PREFILL_TABLE."""
    from flashlet.kernels import tuning

    entries = []
    for name in dict.fromkeys(r["model"] for r in rows):
        timed = [r for r in rows if r["model"] == name and "ms_24_layers" in r]
        contexts = {r["context"] for r in timed}
        totals: dict[tuple, list] = {}
        for r in timed:
            totals.setdefault((r["block_n"], r["num_stages"], r["splits"], r["min_split_tokens"]), []).append(r)
        whole = {k: v for k, v in totals.items() if {r["context"] for r in v} == contexts}
        if not whole:
            continue
        (block_n, stages, splits, min_split), _ = min(whole.items(),
                                                      key=lambda kv: sum(r["ms_24_layers"] for r in kv[1]))
        model = MODELS[name]
        group = model["num_q_heads"] // model["num_kv_heads"]
        tile = tuning.prefill_config(model["head_dim"], group, chunk)
        cfg = dataclasses.replace(tile, block_n=block_n, num_stages=stages, num_splits=splits)
        if splits > 1:  # the one scratch holds splits x rows (`tuning.PREFILL_SPLIT_SCRATCH_ROWS`)
            cfg = dataclasses.replace(cfg, min_split_tokens=min_split, split_max_tokens=min(
                tile.split_max_tokens, tuning.PREFILL_SPLIT_SCRATCH_ROWS // splits))
        key = [model["head_dim"], group, tuning.bucket(chunk, tuning.PREFILL_QLEN_BUCKETS), "prefill"]
        entries.append([key, dataclasses.asdict(cfg)])
    return entries


def _fmt(row: dict) -> str:
    head = (f"{row['model']:13s} C={row['context']:6d} S={row['splits']:2d} min={row['min_split_tokens']:5d} "
            f"bn{row['block_n']} st{row['num_stages']} err {row['max_rel_err']:.1e}")
    if "ms_24_layers" not in row:
        return head + ("  WRONG" if row.get("wrong") else "  (checked, not timed)")
    return head + f"  {row['ms_24_layers']:7.3f} ms / 24 layers  x{row.get('speedup', float('nan')):.2f}"


def summarize(rows: list[dict]) -> None:
    """The best split config per (model, context), beside S = 1."""
    timed = [r for r in rows if "ms_24_layers" in r]
    if not timed:
        return
    print("\nbest per shape (ms / 24 layers):")
    for key in dict.fromkeys((r["model"], r["context"]) for r in timed):
        shape = [r for r in timed if (r["model"], r["context"]) == key]
        base = next((r for r in shape if r["splits"] == 1), None)
        best = min(shape, key=lambda r: r["ms_24_layers"])
        print(f"  {key[0]:13s} C={key[1]:6d}  S=1 {base['ms_24_layers'] if base else float('nan'):7.3f}  "
              f"best S={best['splits']} min={best['min_split_tokens']} bn{best['block_n']} st{best['num_stages']} "
              f"{best['ms_24_layers']:7.3f}  "
              f"x{best.get('speedup', float('nan')):.2f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, through the Triton interpreter")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--contexts", default=None, help="tokens of the chunk's prompt, comma-separated")
    p.add_argument("--splits", default=None, help="split caps, comma-separated (1 is always timed)")
    p.add_argument("--min-split-tokens", default=None, help="smallest splits, comma-separated")
    p.add_argument("--chunk", type=int, default=None, help=f"query rows of the prompt's chunk (default {CHUNK})")
    p.add_argument("--decodes", type=int, default=None, help=f"decode rows beside it (default {DECODES})")
    p.add_argument("--decode-context", type=int, default=None, help=f"tokens of each decode (default {DECODE_CONTEXT})")
    p.add_argument("--block-n", default=None, help="key blocks to time besides the engine's, comma-separated")
    p.add_argument("--num-stages", default=None, help="pipeline stages to time besides the engine's, comma-separated")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--table-json", default=None, help="write each model's best config here as a "
                   "FLASHLET_DECODE_TABLES file (`table_entries`)")
    p.add_argument("--lower", type=int, nargs="+", default=None, metavar="S",
                   help="only compile the kernels for sm_90a at these split caps (no GPU needed) and print "
                        "lower_for_sm90's JSON, a line per model and S")
    args = p.parse_args(argv)
    ints = lambda text, default: tuple(int(x) for x in text.split(",")) if text else default  # noqa: E731
    defaults = SMOKE if args.smoke else dict(contexts=CONTEXTS, splits=SPLITS, min_split_tokens=MIN_SPLIT_TOKENS,
                                             chunk=CHUNK, decodes=DECODES, decode_context=DECODE_CONTEXT)
    args.contexts = ints(args.contexts, defaults["contexts"])
    args.splits = tuple(sorted(set(ints(args.splits, defaults["splits"])) | {1}))
    args.min_split_tokens = ints(args.min_split_tokens, defaults["min_split_tokens"])
    args.block_n, args.num_stages = ints(args.block_n, ()), ints(args.num_stages, ())
    if any(bn < 16 or bn & (bn - 1) for bn in args.block_n) or any(ns < 1 for ns in args.num_stages):
        p.error("key blocks must be powers of two >= 16, stages >= 1")
    for name in ("chunk", "decodes", "decode_context"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}")
    if min(args.splits) < 1 or min(args.min_split_tokens) < 1 or args.chunk < 1 or args.decodes < 0:
        p.error("splits, smallest splits and the chunk must be >= 1, decodes >= 0")
    if min(args.contexts) < args.chunk or (args.decodes and args.decode_context < 1):
        p.error(f"every context must hold the chunk ({args.chunk} tokens); decodes need a context >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lower:
        for name in args.models:
            for splits in args.lower:
                row = lower_for_sm90(MODELS[name], splits, args.chunk)
                print(json.dumps(dict(model=name, splits=splits, **row)), flush=True)
        return 0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not __import__("torch").cuda.is_available():
        print("the benchmark times a CUDA device; use --smoke on the CPU", file=sys.stderr)
        return 2
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.table_json:
        with open(args.table_json, "w") as f:
            json.dump(table_entries(rows, args.chunk), f, indent=1)
    return 1 if any(r.get("wrong") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
