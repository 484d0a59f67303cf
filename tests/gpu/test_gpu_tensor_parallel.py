"""Tensor parallelism on 2 GPUs (NCCL): TP = 2 against TP = 1 on every attention backend with
CUDA graphs and overlapped steps on (all-reduces inside the captured decode graphs), and a
worker killed mid-generation surfacing in rank 0 as WorkerDiedError without a hang."""

import os
import signal
import threading
import time

import pytest
import torch

from tests.conftest import save_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

# head_dim 64: a size every backend (FlashInfer included) supports.
DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
            vocab_size=1001, num_hidden_layers=2)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 90)), [3] * 7, list(range(200, 231))]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tp-gpu"), **DIMS)


def _tokens(folder, tp, backend, dtype):
    from flashlet import LLM, SamplingParams

    # fused_decode=False: TP = 1 on the per-op path, as TP = 2 runs (the fused path is one GPU's)
    llm = LLM(str(folder), backend=backend, device="cuda", dtype=dtype, max_num_seqs=8,
              tensor_parallel_size=tp, max_num_pages=512, fused_decode=False)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend,dtype", [("torch", "float32"), ("triton", "float32"),
                                           ("flashinfer", "bfloat16")])
def test_tp2_matches_tp1(tiny_folder, backend, dtype):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    want = _tokens(tiny_folder, 1, backend, dtype)
    got = _tokens(tiny_folder, 2, backend, dtype)
    if dtype == "float32":
        assert got == want
    else:  # bf16: a partial sum rounded differently may flip a near-tie
        assert sum(a == b for a, b in zip(got, want)) >= 3, (got, want)


def test_dead_worker_raises_in_rank_0(tiny_folder):
    from flashlet import LLM, SamplingParams
    from flashlet.distributed.parallel import WorkerDiedError

    llm = LLM(str(tiny_folder), device="cuda", tensor_parallel_size=2, max_num_pages=512)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        threading.Timer(0.3, os.kill, (llm.engine.tp.workers[0].pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker died"):
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=500, ignore_eos=True))
        assert time.monotonic() - t0 < 60
    finally:
        llm.shutdown()
