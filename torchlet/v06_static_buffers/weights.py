"""Where the weights come from (a local Hugging Face folder, a hub id, or the embedded default
model) and how they get into the model: `config.json` + `*.safetensors`, read with safetensors."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .model import CausalLM


def resolve_model_dir(model: str | os.PathLike | None = None) -> Path:
    """A folder with config.json + *.safetensors: the one given, a hub download, or the default."""
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    return download_from_hub(str(model))


def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct), converted and cached by flashlet."""
    from flashlet.models.weights import embedded_model_dir  # the only thing torchlet takes from flashlet

    return Path(embedded_model_dir())


def download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local folder and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {e})"
        ) from e


def load_model(
    model_dir: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> CausalLM:
    """Build the model without initialising it (meta device), then fill it from safetensors."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_safetensors(model, Path(model_dir))
    return model.requires_grad_(False).eval()


@torch.no_grad()
def load_safetensors(model: CausalLM, model_dir: Path) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights: both names
    loaded: set[int] = set()  # ids of the parameters filled so far
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if name.endswith("rotary_emb.inv_freq"):  # recomputed, never needed
                    continue
                copy_tensor(params, name, tensors.get_tensor(name), file)
                loaded.add(id(params[name]))
    missing = [name for name, param in params.items() if id(param) not in loaded]
    if missing:
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {missing}")


def copy_tensor(params: dict, name: str, tensor: torch.Tensor, file: Path) -> None:
    if name not in params:
        raise ValueError(f"{file.name}: unexpected tensor {name!r} for this architecture")
    if params[name].shape != tensor.shape:
        raise ValueError(
            f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(params[name].shape)}"
        )
    params[name].copy_(tensor)
