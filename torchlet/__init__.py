"""torchlet: a learning ladder of small inference engines for Llama/Qwen2-style decoder models.

Each rung is a folder with a complete, readable engine; a rung changes only the files that its
idea needs (see versions.toml), so the diff between two neighbouring folders is that idea. Run one
with `python -m torchlet.<version>.llm`, and all of them with `python -m torchlet.bench`.
ROADMAP.md (repo root) lists the rungs and where flashlet takes each idea further.
"""

import os

VERSIONS = [
    "v00_full_recompute",
    "v01_0_ragged_batch",
    "v01_1_split_gqa",
    "v02_kv_cache",
    "v03_request_states",
    "v04_continuous_batching",
    "v05_decode_slots",
    "v06_static_buffers",
    "v07_cuda_graph",
    "v08_paged_gqa_py",
    "v09_triton_basics",
    "v10_triton_paged_gqa",
]


def _use_triton_interpreter_without_gpu() -> None:
    """Without a GPU, Triton kernels (v09+) can only run in Triton's CPU interpreter, and that
    must be chosen before triton is first imported (transformers and torch import it early).
    Importing torchlet is early enough; an explicit TRITON_INTERPRET setting is respected."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_use_triton_interpreter_without_gpu()
