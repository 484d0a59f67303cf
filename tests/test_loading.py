"""Loading a sharded checkpoint streams it: the host never holds the model's tensors all at once.

A ~110 MB fp32 Llama checkpoint in ~20 MB shards (written by scripts/load_bench.py's writer) is
loaded onto the CPU in a fresh process (after a first load warmed it up); the peak RSS above the
start must stay under the model itself (it lives in host memory when the device is the CPU) plus
one shard plus slack. Reading every tensor before building the model, as the loader used to,
peaks at three models (measured: 313 MB above the start against 120 MB streamed)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192,
          "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6,
          "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False}
SHARD = 20 << 20
PROBE = """
import ctypes, gc, json, sys, torch
from flashlet.models.weights import load_model
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
# A first load warms code pages and the allocator; its memory is then handed back to the OS.
model, _, _ = load_model(sys.argv[1], "cpu", torch.float32)
del model
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
start = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to now
model, _, _ = load_model(sys.argv[1], "cpu", torch.float32)
print(json.dumps({"start": start, "peak": status("VmHWM"),
                  "model_bytes": sum(p.numel() * 4 for p in model.parameters())}))
"""


def load_bench():
    spec = importlib.util.spec_from_file_location("load_bench", ROOT / "scripts" / "load_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    return load_bench().write_checkpoint(CONFIG, folder, torch.float32, SHARD)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_host_memory_stays_near_one_shard(sharded):
    shards = list(sharded.glob("*.safetensors"))
    assert len(shards) >= 5
    out = subprocess.run([sys.executable, "-c", PROBE, str(sharded)], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.splitlines()[-1])
    largest = max(f.stat().st_size for f in shards)
    extra = r["peak"] - r["start"] - r["model_bytes"]
    assert r["model_bytes"] > 100e6
    assert extra < largest + (24 << 20), (
        f"peak {r['peak'] / 2**20:.0f} MiB - start {r['start'] / 2**20:.0f} MiB - model "
        f"{r['model_bytes'] / 2**20:.0f} MiB = {extra / 2**20:.0f} MiB above one shard "
        f"({largest / 2**20:.0f} MiB)")


def test_written_checkpoint_loads_with_the_writers_values(sharded):
    from safetensors import safe_open

    from flashlet.models.weights import load_model

    model, tokenizer, _ = load_model(str(sharded), "cpu", torch.float32)
    assert tokenizer is None
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.3.self_attn.k_proj.weight"
    with safe_open(str(sharded / index[name]), framework="pt") as f:
        k = f.get_tensor(name)
    qkv = model.layers[3].qkv_proj.weight
    assert torch.equal(qkv[512:512 + 256], k)
