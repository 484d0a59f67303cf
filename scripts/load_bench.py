"""How fast a sharded safetensors checkpoint loads to the device, and how much host memory it takes.

Writes a random-weight checkpoint at a preset's shape (default qwen2.5-7b, bf16, ~4 GB shards,
model.safetensors.index.json, as the hub ships them) to local disk once, reads every shard once
to warm the page cache, then times `flashlet.models.weights.load_model` to the device (synchronised).
Exits 1 if the load takes longer than --target-s.

    python scripts/load_bench.py                          # qwen2.5-7b to cuda, target 10 s
    python scripts/load_bench.py --config llama-3.1-8b --dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashlet.config import torch_dtype  # noqa: E402
from flashlet.models.weights import preset_config  # noqa: E402


def hf_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds (ties stored once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def write_checkpoint(config: dict, folder: Path, dtype=torch.bfloat16, shard_bytes=4 << 30,
                     seed=0) -> Path:
    """A random checkpoint in shards of about shard_bytes, generated shard by shard (the host
    never holds more than one shard)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = hf_tensor_shapes(config)
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if current and size + nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {n: _random(shapes[n], n, dtype, g) for n in names}
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del shard
    total = sum(torch.Size(s).numel() for s in shapes.values()) * dtype.itemsize
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _random(shape, name, dtype, g):
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def warm_page_cache(folder: Path) -> int:
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen2.5-7b", help="preset or config.json path")
    p.add_argument("--dir", default=None, help="checkpoint folder (written if it has no index)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--target-s", type=float, default=10.0)
    args = p.parse_args(argv)
    from flashlet.models.weights import load_model

    config = preset_config(args.config)
    name = Path(args.config).stem
    folder = Path(args.dir or Path(tempfile.gettempdir()) / f"flashlet-load-{name}")
    dtype = torch_dtype(args.dtype)
    if not (folder / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(config, folder, dtype, int(args.shard_gb * (1 << 30)))
        print(f"wrote {folder} in {time.perf_counter() - t0:.1f} s")
    nbytes = warm_page_cache(folder)
    shards = len(list(folder.glob("*.safetensors")))
    t0 = time.perf_counter()
    model, _, _ = load_model(str(folder), args.device, dtype)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak_host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB -> GiB
    print(f"{name}: {nbytes / 1e9:.2f} GB in {shards} shards loaded to {args.device} in "
          f"{seconds:.2f} s ({nbytes / 1e9 / seconds:.2f} GB/s); peak host RSS {peak_host:.2f} GiB "
          f"(largest shard {max(f.stat().st_size for f in folder.glob('*.safetensors')) / 2**30:.2f} GiB)")
    del model
    if seconds > args.target_s:
        print(f"FAILED: slower than the {args.target_s} s target")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
