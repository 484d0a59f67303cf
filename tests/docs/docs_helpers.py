"""Helpers for the documentation site tests: running the builder, and a small fake repository.

The fake repository has the real docs/ sources and flashlet/ package but its own three-version
torchlet ladder and BENCHMARKS.md, so the tests do not depend on how far the real ladder has got.
(A module of its own rather than conftest.py, whose name another conftest may shadow.)
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "tools" / "build_docs.py"
CHROMIUM = os.environ.get("DOCS_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("DOCS_TEST_ARTIFACTS", REPO / "test-artifacts" / "docs"))

FIXTURE_VERSIONS = ("v00_full_recompute", "v01_0_ragged_batch", "v02_kv_cache")

# A 1x1 PNG, enough to stand for a benchmark plot.
TINY_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def run_builder(*args: str | Path) -> subprocess.CompletedProcess:
    """Run tools/build_docs.py as a user would; returns the finished process."""
    return subprocess.run(
        [sys.executable, str(BUILDER), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _model_py(changed: bool) -> str:
    """A long file whose only change sits in the middle, so unchanged runs get collapsed."""
    parts = ['"""Layers of the fixture model."""\n', "import torch\n"]
    for i in range(30):
        body = f"    return x * {i} + 1\n"
        if changed and i == 15:
            body = "    y = x * 15\n    return y + 2  # changed in v02\n"
        parts.append(f'\n\ndef layer_{i}(x):\n    """Layer {i}."""\n{body}')
    return "".join(parts)


LLM_V00 = '''"""v00_full_recompute: the simplest engine that generates text.

Every step runs the whole sequence through the model again: slow, but obviously correct.
"""

import torch


class LLM:
    def __init__(self, model):
        self.model = model

    def generate(self, prompt_ids, max_new_tokens):
        """Greedy tokens for one prompt."""
        ids = list(prompt_ids)
        for _ in range(max_new_tokens):
            logits = self.model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
        return ids[len(prompt_ids):]


def greedy(logits):
    return int(logits.argmax())
'''

LLM_V01 = '''"""v01_0_ragged_batch: several prompts packed into one ragged batch.

Prompts of different lengths are concatenated with cumulative offsets instead of padding.
"""

import torch


class LLM:
    def __init__(self, model):
        self.model = model

    def generate(self, prompts, max_new_tokens):
        """Greedy tokens for a batch of prompts."""
        seqs = [list(p) for p in prompts]
        for _ in range(max_new_tokens):
            flat, offsets = pack(seqs)
            logits = self.model(flat, offsets)
            for seq, end in zip(seqs, offsets[1:]):
                seq.append(int(logits[end - 1].argmax()))
        return [s[len(p):] for s, p in zip(seqs, prompts)]


def pack(seqs):
    """Concatenate sequences; offsets[i]:offsets[i+1] is sequence i."""
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    return torch.tensor([t for s in seqs for t in s]), offsets


def greedy(logits):
    return int(logits.argmax())
'''

LLM_V02 = LLM_V01.replace(
    '''"""v01_0_ragged_batch: several prompts packed into one ragged batch.

Prompts of different lengths are concatenated with cumulative offsets instead of padding.
"""''',
    '''"""v02_kv_cache: keys and values of past tokens are kept between steps.

Prefill fills the cache once; each decode step feeds only the newest token.
"""''',
).replace(
    """def pack(seqs):""",
    '''class KVCache:
    """Per-layer keys and values of every token seen so far."""

    def __init__(self):
        self.keys = []
        self.values = []

    def append(self, k, v):
        self.keys.append(k)
        self.values.append(v)


def pack(seqs):''',
)


def make_fixture_repo(root: Path) -> Path:
    """A repository at root with the real docs sources and a three-version fake ladder."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        REPO / "docs",
        root / "docs",
        ignore=shutil.ignore_patterns("_site", "test-artifacts", ".*staging*", "assets"),
    )
    shutil.copytree(
        REPO / "flashlet",
        root / "flashlet",
        ignore=shutil.ignore_patterns("__pycache__", "*.gguf", "*.bin"),
    )
    files = {
        "v00_full_recompute": {
            "llm.py": LLM_V00,
            "model.py": _model_py(False),
            "notes.md": "# Notes\n\nv00.\n",
        },
        "v01_0_ragged_batch": {
            "llm.py": LLM_V01,
            "model.py": _model_py(False),
            "notes.md": "# Notes\n\nv00.\n",
        },
        "v02_kv_cache": {
            "llm.py": LLM_V02,
            "model.py": _model_py(True),
            "cache.py": "CACHE_PAGES = 16\n",
        },
    }
    for version, contents in files.items():
        for name, text in contents.items():
            path = root / "torchlet" / version / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    (root / "torchlet" / "__init__.py").write_text(f"VERSIONS = {list(FIXTURE_VERSIONS)!r}\n")
    (root / "BENCHMARKS.md").write_text(
        "# Benchmarks\n\n"
        "## torchlet progression (H200, batch 8)\n\n"
        "| version | tok/s | ms/step |\n"
        "| --- | ---: | ---: |\n"
        "| `v00_full_recompute` | 41.5 | 190.0 |\n"
        "| `v01_0_ragged_batch` | 288.1 | 27.8 |\n"
        "| `v02_kv_cache` | 1234.5 | 6.5 |\n\n"
        "## flashlet against peers\n\n"
        "| engine | tok/s |\n| --- | ---: |\n| [flashlet](flashlet/core/engine.py) | 9999 |\n"
    )
    plots = root / "docs" / "assets" / "bench"
    plots.mkdir(parents=True)
    (plots / "torchlet_throughput.png").write_bytes(TINY_PNG)
    return root
