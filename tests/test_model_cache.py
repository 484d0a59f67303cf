"""The converted-model cache: keyed on the GGUF file's content, shared safely by any number of
processes (a lock, a temporary folder renamed into place whole)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashlet.models.weights import gguf_cache_name


def write_gguf(path: Path, arch: str = "llama", fill: float = 0.0) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.full((4, 4), fill, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_cache_name_follows_the_content_not_the_path(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = write_gguf(tmp_path / "a" / "m.gguf")
    b = write_gguf(tmp_path / "b" / "m.gguf")
    c = write_gguf(tmp_path / "m.gguf", fill=1.0)
    assert a.stat().st_size == c.stat().st_size
    assert gguf_cache_name(a) == gguf_cache_name(b)  # two checkouts: one cache entry
    assert gguf_cache_name(a) != gguf_cache_name(c)  # same size, new content: a new entry


# Each process converts the same GGUF into the same empty cache. The real conversion (tens of
# seconds) is swapped for a slow fake that writes several files and logs that it ran, so that
# a race (two writers, a half-written folder seen, a temporary folder left) would show.
CONVERT = """
import sys, time
from pathlib import Path
import flashlet.models.weights as w

def slow_convert(gguf_path, folder):
    with open(sys.argv[2], "a") as log:
        log.write("converted\\n")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        time.sleep(0.2)
        (folder / name).write_bytes(Path(gguf_path).read_bytes() + name.encode())

w._convert_into = slow_convert
folder = w.convert_gguf(Path(sys.argv[1]))
print(folder, sorted((p.name, p.read_bytes().hex()) for p in folder.iterdir()))
"""


def test_processes_converting_at_once_share_one_cache(tmp_path):
    gguf_file = write_gguf(tmp_path / "model.gguf")
    cache, log = tmp_path / "cache", tmp_path / "conversions.log"
    env = {**os.environ, "FLASHLET_CACHE": str(cache)}
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT, str(gguf_file), str(log)],
                              cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    outputs = {out.strip() for out, _ in results}
    assert len(outputs) == 1, f"the processes saw different folders or contents: {outputs}"
    assert "model.safetensors" in outputs.pop(), "a process returned a half-written folder"
    assert log.read_text().count("converted") == 1, "more than one process converted"
    entries = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    assert entries == [gguf_cache_name(gguf_file)], f"left behind: {entries}"


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    import flashlet.models.weights as w

    def failing_convert(gguf_path, folder):
        (folder / "config.json").write_text("{}")
        raise w.ModelLoadError("conversion failed")

    monkeypatch.setattr(w, "_convert_into", failing_convert)
    with pytest.raises(w.ModelLoadError, match="conversion failed"):
        w.convert_gguf(write_gguf(tmp_path / "model.gguf"), tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_cache_name_carries_the_conversion_version(tmp_path):
    """A conversion that writes something new bumps the version: older folders are rebuilt."""
    from flashlet.models.weights import CONVERSION_VERSION

    assert gguf_cache_name(write_gguf(tmp_path / "m.gguf")).endswith(f"-v{CONVERSION_VERSION}")


def test_gguf_special_tokens_are_read_from_the_file(tmp_path):
    import gguf

    from flashlet.models.weights import gguf_special_token_ids

    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_eos_token_id(2), writer.add_pad_token_id(2), writer.add_bos_token_id(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    assert gguf_special_token_ids(tmp_path / "t.gguf") == {
        "bos_token": 1, "eos_token": 2, "pad_token": 2}


def test_converted_embedded_model_names_the_gguf_special_tokens(demo_model_dir):
    """Issue 33: the embedded GGUF says eos = pad = id 2 (<|im_end|>), bos = id 1; the
    converted folder's tokenizer files say the same (they used to name <|im_start|> as eos)."""
    import json

    from transformers import AutoTokenizer

    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["pad_token"] == "<|im_end|>"
    assert config["bos_token"] == "<|im_start|>"
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 2, 1)
