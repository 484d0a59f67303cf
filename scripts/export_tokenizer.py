"""Copy the embedded model's tokenizer files (SmolLM2, converted from its GGUF on first use) into
a folder the GPU machine gets (it has no model hub, and the 94 MB GGUF is too big to carry):

    python scripts/export_tokenizer.py [OUT_DIR]        (default .tok/smollm2, git-ignored)

The server serves random weights at the qwen2.5-0.5b shape with it:
`python -m flashlet.server --config qwen2.5-0.5b-smolvocab --tokenizer .tok/smollm2`
(that preset's vocabulary is the tokenizer's 49152, so every sampled id decodes).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Copy the embedded model's tokenizer files into a folder.")
    parser.add_argument("out_dir", nargs="?", default=".tok/smollm2", help="where to write (default %(default)s)")
    out = Path(parser.parse_args(argv).out_dir)
    from flashlet.models.weights import embedded_model_dir, load_tokenizer

    source = embedded_model_dir()
    out.mkdir(parents=True, exist_ok=True)
    copied = [f for f in TOKENIZER_FILES if (source / f).is_file()]
    for name in copied:
        shutil.copy2(source / name, out / name)
    tokenizer = load_tokenizer(out)  # the copy must load on its own
    if tokenizer is None or not tokenizer.encode("hello world"):
        print(f"error: {out} does not hold a working tokenizer", file=sys.stderr)
        return 1
    size = sum((out / f).stat().st_size for f in copied) / 2**20
    print(f"{out}: {', '.join(copied)} ({size:.1f} MiB), vocab {len(tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
