"""`python -m torchlet.bench`: every rung of the ladder on the same prompts, in one table.

For each version: generated tokens per second at batch 1 and at batch 32 (wall time of one
`generate` call, prefill included, after a short warm-up call), and the speed-up over the
previous rung that ran. Prompts are token ids and EOS is ignored, so every rung does exactly the
same work. Engines with a batch-size limit are sized for the batch they run (max_batch_size =
batch size) and for the longest sequence (max_seq_len).

    python -m torchlet.bench                                  # embedded model, this machine
    python -m torchlet.bench --config qwen2.5-0.5b            # random weights, Qwen2.5-0.5B shape
    python -m torchlet.bench --versions v02 v08 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashlet.models.weights import preset_config_path
from torchlet import VERSIONS

PACKAGE_DIR = Path(__file__).parent
CONFIGS_DIR = PACKAGE_DIR / "configs"


@dataclass
class Row:
    version: str
    tok_s: dict[int, float | None]  # batch size -> tokens per second (None: skipped)
    speedup: dict[int, float | None]  # batch size -> tok/s over the previous rung's
    note: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="torchlet progression benchmark")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF folder or hub id (default: the embedded model)")
    source.add_argument(
        "--config",
        help="config.json path, or a name from torchlet/configs (e.g. qwen2.5-0.5b): "
        "a model of that shape with random weights",
    )
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: per device)")
    parser.add_argument("--max-new-tokens", type=int, help="default: 8 on CPU, 64 on GPU")
    parser.add_argument("--versions", nargs="+", help="versions or prefixes, e.g. v00 v02")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell; best kept")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--markdown", action="store_true", help="plain markdown table")
    parser.add_argument(
        "--triton-on-cpu",
        action="store_true",
        help="also time the Triton rungs on a CPU (Triton's interpreter: slow, not meaningful)",
    )
    return parser.parse_args(argv)


def select_versions(patterns: list[str] | None) -> list[str]:
    if not patterns:
        return list(VERSIONS)
    wanted = [p for pattern in patterns for p in pattern.split(",") if p]
    selected = [v for v in VERSIONS if any(v.startswith(p) for p in wanted)]
    unknown = [p for p in wanted if not any(v.startswith(p) for v in VERSIONS)]
    if unknown:
        raise SystemExit(f"unknown versions {unknown}; known: {', '.join(VERSIONS)}")
    return selected


def resolve_config_path(config: str) -> Path:
    """A config.json path, or the name of one in torchlet/configs."""
    try:
        return preset_config_path(config, CONFIGS_DIR)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def random_model_dir(config_path: Path, dtype: torch.dtype, out_dir: Path) -> Path:
    """A Hugging Face folder (config.json + model.safetensors) with random weights, no
    tokenizer: the shape of the real model, for timing only."""
    from safetensors.torch import save_file

    from torchlet.v00_full_recompute.config import config_from_dict
    from torchlet.v00_full_recompute.model import CausalLM

    raw = json.loads(config_path.read_text())
    config = config_from_dict(raw)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(config).named_parameters()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    generator = torch.Generator().manual_seed(0)
    state = {
        name: random_tensor(name, shape, generator).to(dtype) for name, shape in shapes.items()
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return out_dir


def random_tensor(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=generator) * 0.02


def make_prompts(batch_size: int, vocab_size: int, on_gpu: bool) -> list[list[int]]:
    """Token-id prompts of varied lengths: 8-23 tokens on CPU, 64-191 on GPU (16 / 128 at
    batch 1)."""
    shortest, spread = (64, 128) if on_gpu else (8, 16)
    generator = torch.Generator().manual_seed(batch_size)
    lengths = [shortest + spread // 2] if batch_size == 1 else [
        shortest + (i * 7) % spread for i in range(batch_size)
    ]
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def engine_options(llm_class, batch_size: int, max_seq_len: int) -> dict:
    """Size the engines that take a batch-size or length limit for this run."""
    parameters = inspect.signature(llm_class.__init__).parameters
    options = {"max_batch_size": batch_size, "max_seq_len": max_seq_len}
    return {name: value for name, value in options.items() if name in parameters}


def uses_triton(version: str) -> bool:
    return any((PACKAGE_DIR / version).glob("triton_*.py"))


def time_version(version: str, batch_size: int, model_dir: Path, args, device) -> float | str:
    """Tokens per second of one generate call, or the reason the version cannot run here."""
    if uses_triton(version) and device.type != "cuda" and not args.triton_on_cpu:
        return "skipped: Triton on CPU runs in its interpreter (timing meaningless)"
    llm_class = importlib.import_module(f"torchlet.{version}.llm").LLM
    needs_cuda = importlib.import_module(f"torchlet.{version}.device").NeedsCudaError
    prompts = args.prompts[batch_size]
    max_seq_len = -(-(max(map(len, prompts)) + args.max_new_tokens) // 16) * 16
    options = engine_options(llm_class, batch_size, max_seq_len)
    try:
        llm = llm_class(str(model_dir), device=device, dtype=args.dtype, **options)
    except needs_cuda as e:
        return f"skipped: {e}"
    llm.generate(prompts[:1], max_new_tokens=2, ignore_eos=True)  # warm-up
    best = 0.0
    for _ in range(args.repeats):
        synchronize(device)
        start = time.perf_counter()
        completions = llm.generate(prompts, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        synchronize(device)
        elapsed = time.perf_counter() - start
        best = max(best, sum(len(c.token_ids) for c in completions) / elapsed)
    del llm
    free_memory(device)
    return best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args, versions: list[str], model_dir: Path, device: torch.device) -> list[Row]:
    rows: list[Row] = []
    previous: dict[int, float] = {}  # batch size -> tok/s of the last rung that ran
    for version in versions:
        row = Row(version, tok_s={}, speedup={})
        for batch_size in args.batch_sizes:
            result = time_version(version, batch_size, model_dir, args, device)
            if isinstance(result, str):
                row.tok_s[batch_size], row.speedup[batch_size], row.note = None, None, result
                continue
            row.tok_s[batch_size] = result
            if batch_size in previous:
                row.speedup[batch_size] = result / previous[batch_size]
            else:
                row.speedup[batch_size] = None
            previous[batch_size] = result
        print(f"  {version}: {format_row(row, args.batch_sizes)}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def format_row(row: Row, batch_sizes: list[int]) -> str:
    parts = [f"b{b} {fmt(row.tok_s[b], '{:.1f} tok/s')}" for b in batch_sizes]
    return ", ".join(parts) + (f" ({row.note})" if row.note else "")


def fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def table_cells(rows: list[Row], batch_sizes: list[int]) -> tuple[list[str], list[list[str]]]:
    header = ["version"]
    for b in batch_sizes:
        header += [f"tok/s b={b}", f"x prev b={b}"]
    header.append("note")
    body = []
    for row in rows:
        cells = [row.version]
        for b in batch_sizes:
            cells += [fmt(row.tok_s[b], "{:.1f}"), fmt(row.speedup[b], "{:.2f}x")]
        body.append(cells + [row.note])
    return header, body


def print_table(rows: list[Row], batch_sizes: list[int], title: str, markdown: bool) -> None:
    header, body = table_cells(rows, batch_sizes)
    if not markdown:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            markdown = True
    if markdown:
        print(f"{title}\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for cells in body:
            print("| " + " | ".join(cells) + " |")
        return
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i in (0, len(header) - 1) else "right")
    for cells in body:
        table.add_row(*cells)
    Console().print(table)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    versions = select_versions(args.versions)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    args.max_new_tokens = args.max_new_tokens or (64 if on_gpu else 8)
    with tempfile.TemporaryDirectory(prefix="torchlet-bench-") as scratch:
        model_dir, vocab_size, source = prepare_model(args, device, Path(scratch))
        args.prompts = {b: make_prompts(b, vocab_size, on_gpu) for b in args.batch_sizes}
        title = (
            f"torchlet ladder: {source} on {device} ({args.dtype or 'default dtype'}, "
            f"{torch.get_num_threads()} threads), {args.max_new_tokens} new tokens per request"
        )
        print(f"{title}\n", file=sys.stderr)
        rows = run(args, versions, model_dir, device)
    print_table(rows, args.batch_sizes, title, args.markdown)
    if args.json:
        write_json(args.json, rows, title, args)
    return rows


def prepare_model(args, device: torch.device, scratch: Path) -> tuple[Path, int, str]:
    """The model folder to time, its vocabulary size, and a label for the table."""
    from torchlet.v00_full_recompute.config import load_config
    from torchlet.v00_full_recompute.device import pick_dtype
    from torchlet.v00_full_recompute.weights import resolve_model_dir

    if args.config:
        config_path = resolve_config_path(args.config)
        dtype = pick_dtype(args.dtype, device)
        model_dir = random_model_dir(config_path, dtype, scratch)
        source = f"random weights shaped like {config_path.stem}"
    else:
        model_dir = resolve_model_dir(args.model)
        source = args.model or "embedded model"
    return model_dir, load_config(model_dir).vocab_size, source


def write_json(path: str, rows: list[Row], title: str, args) -> None:
    payload = {
        "title": title,
        "batch_sizes": args.batch_sizes,
        "max_new_tokens": args.max_new_tokens,
        "rows": [asdict(row) for row in rows],
    }
    Path(path).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
