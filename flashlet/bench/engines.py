"""Building what the benchmarks run: the flashlet Engine, the tiny scheduler-benchmark config,
and a Hugging Face model holding exactly the engine's weights (for the `--peer` runs)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from flashlet.config import EngineConfig
from flashlet.core.engine import Engine
from flashlet.models.weights import preset_config
from flashlet.models.model import hf_to_flashlet_names
from flashlet.models.weights import resolve_model_dir

# A one-layer Qwen2 shape for the scheduler micro-benchmark: the model never runs there, but the
# Engine still builds one (and a KV pool), so keep both negligible.
TINY_SCHED_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1024,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True, "eos_token_id": 1,
}


def write_config(cfg: dict, folder: str | Path | None = None, name: str = "config.json") -> Path:
    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="flashlet-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(cfg, indent=2))
    return path


def hf_config_dict(engine_config: EngineConfig, model_dir: Path | None = None) -> dict:
    """The Hugging Face config.json of what the engine runs: the --config file / preset, else
    the model folder's."""
    if engine_config.config is not None:
        return preset_config(engine_config.config)
    folder = model_dir if model_dir is not None else resolve_model_dir(engine_config.model)
    return json.loads((Path(folder) / "config.json").read_text())


def build_engine(engine_config: EngineConfig) -> Engine:
    return Engine(engine_config)


# ---- the Hugging Face twin -----------------------------------------------------------------
def hf_model_for(engine: Engine):
    """A transformers CausalLM with the engine's exact weights, on its device and dtype.

    With --model both sides read the same folder (`from_pretrained(engine.model_dir)`). With
    --config (random weights) the engine's tensors are split back into Hugging Face's names:
    the inverse of `flashlet.models.model.hf_to_flashlet_names` (fused qkv -> q, k, v; gate_up -> gate,
    up), so no second copy of the weights is ever drawn at random and nothing in the Engine is
    replaced."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if engine.model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype)
        return model.to(engine.device).eval()
    cfg_dict = hf_config_dict(engine.config)
    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("torch_dtype", "dtype")}
    config = AutoConfig.for_model(**cfg_dict)
    with torch.device(engine.device):
        model = AutoModelForCausalLM.from_config(config, dtype=engine.dtype)
    theirs = model.state_dict()
    ours = engine.model.state_dict()
    state = {}
    for our_name, hf_names in hf_to_flashlet_names(engine.model_config):
        sizes = [theirs[n].shape[0] for n in hf_names]
        for name, part in zip(hf_names, torch.split(ours[our_name], sizes, dim=0)):
            if part.shape != theirs[name].shape:
                raise ValueError(f"weight {name}: ours {tuple(part.shape)} vs HF {tuple(theirs[name].shape)}")
            state[name] = part
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if engine.model_config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"HF twin: missing {sorted(set(missing) - tied)[:4]}, unexpected {unexpected[:4]}")
    if tied:
        model.tie_weights()
    return model.eval()


def release(engine: Engine | None) -> None:
    """Drop the engine's tensors (the KV pool above all) so a peer gets the device memory."""
    if engine is None:
        return
    if hasattr(engine, "shutdown"):
        engine.shutdown()  # tensor-parallel workers give their GPUs back too
    for name in ("runner", "kv_pool", "model"):
        if hasattr(engine, name):
            setattr(engine, name, None)
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
