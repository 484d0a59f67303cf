"""Tensor parallelism on the CPU: 2 ranks over gloo, tiny random Qwen2 and Llama models in fp32.

The oracle is the same model on one rank: greedy tokens through LLM.generate must be identical,
with chunked prefill, preemption and the prefix cache in play. A worker killed mid-generation
must surface in rank 0 as WorkerDiedError within a bounded time."""

import os
import signal
import threading
import time

import pytest
import torch

from tests.conftest import save_tiny_model
from flashlet import LLM, SamplingParams
from flashlet.distributed.parallel import WorkerDiedError, local_shape, shard_state_dict
from flashlet.models.model import ModelConfig

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [3] * 7, list(range(100, 123))]


def _pair(folder, prompts=PROMPTS, params=GREEDY, **kwargs):
    """Greedy tokens of `prompts` on one rank and on two (twice: the second call reuses cached
    prefixes), plus the two-rank engine's stats."""
    one = LLM(str(folder), device="cpu", **kwargs)
    want = [o.token_ids for o in one.generate(prompts, params)]
    two = LLM(str(folder), device="cpu", tensor_parallel_size=2, **kwargs)
    try:
        got = [o.token_ids for o in two.generate(prompts, params)]
        again = [o.token_ids for o in two.generate(prompts, params)]
        stats = two.engine.stats()
        two.engine.check_integrity()
    finally:
        two.shutdown()
    return want, got, again, stats


@pytest.mark.slow  # starts a second process
def test_qwen2_replicated_kv_head_padded_vocab_chunked_prefill_and_preemption(tmp_path):
    # One K/V head for two ranks (replicated), a vocabulary that does not split evenly, a
    # token budget that chunks every long prompt, a pool too small for all four at once.
    folder = save_tiny_model("qwen2", tmp_path / "q", num_key_value_heads=1, vocab_size=255)
    want, got, again, stats = _pair(folder, max_num_batched_tokens=16, max_num_seqs=4,
                                    page_size=4, max_num_pages=16)
    assert got == want
    assert again == want
    assert stats["num_preemptions"] > 0


def _randomize_biases(folder):
    """HF initialises biases to zero; random ones show a bias added on every rank, not once."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    gen = torch.Generator().manual_seed(0)
    for name, t in state.items():
        if name.endswith(".bias"):
            state[name] = torch.randn(t.shape, generator=gen) * 0.5
    save_file(state, str(path), metadata={"format": "pt"})
    return folder


@pytest.mark.slow  # starts a second process
def test_llama_split_kv_heads_o_bias_prefix_cache(tmp_path):
    # attention_bias: Q/K/V biases split with their heads, O's bias added once.
    folder = _randomize_biases(save_tiny_model("llama", tmp_path / "l", attention_bias=True))
    want, got, again, stats = _pair(folder, max_num_batched_tokens=32, max_num_seqs=4)
    assert got == want
    assert again == want
    assert stats["prefix_cache_hit_rate"] > 0


@pytest.mark.slow  # starts a second process
def test_triton_backend(tmp_path):
    # Interpreted Triton on the CPU is slow: two short prompts, a few tokens.
    folder = save_tiny_model("llama", tmp_path / "l")
    want, got, again, _ = _pair(folder, prompts=PROMPTS[:2], backend="triton",
                                params=SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert got == want
    assert again == want


TORCHRUN_SCRIPT = """
import sys
from flashlet import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=6, ignore_eos=True))
print("TOKENS", out[0].token_ids, flush=True)
llm.shutdown()
"""


@pytest.mark.slow  # starts two processes
def test_torchrun_starts_the_same_engine(tmp_path):
    # Both ranks run the script; rank 1 serves inside the LLM constructor and exits with rank 0.
    import socket
    import subprocess
    import sys

    folder = save_tiny_model("llama", tmp_path / "l")
    want = LLM(str(folder), device="cpu").generate(
        [[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import flashlet

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(flashlet.__file__))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port),
                           str(script), str(folder)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS")]
    assert lines == [f"TOKENS {want}"]  # printed by rank 0 only


@pytest.mark.slow  # starts two worker processes, one after the other
def test_a_second_engine_starts_after_the_first_is_dropped_or_closed(tmp_path):
    """Dropping an LLM (once collected) or leaving its `with` block stops its worker and
    leaves the process group, so the next tensor-parallel LLM in the process starts and
    gives the same tokens. The worker ranks' engines return from their constructor too."""
    import gc

    import torch.distributed as dist

    folder = save_tiny_model("llama", tmp_path / "l")
    first = LLM(str(folder), device="cpu", tensor_parallel_size=2)
    want = [o.token_ids for o in first.generate(PROMPTS[:2], GREEDY)]
    workers = first.engine.tp.workers
    del first
    gc.collect()
    assert not dist.is_initialized() and not any(p.is_alive() for p in workers)
    assert all(p.exitcode == 0 for p in workers)  # served, shut down, returned: no SystemExit
    with LLM(str(folder), device="cpu", tensor_parallel_size=2) as second:
        assert [o.token_ids for o in second.generate(PROMPTS[:2], GREEDY)] == want
        workers = second.engine.tp.workers
    assert not dist.is_initialized() and not any(p.is_alive() for p in workers)
    second.close()  # idempotent


@pytest.mark.slow  # starts a second process
def test_dead_worker_raises_a_clear_error_in_rank_0(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "l")
    llm = LLM(str(folder), device="cpu", tensor_parallel_size=2)
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 8
        worker = llm.engine.tp.workers[0]
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker died.*killed by signal 9"):
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=400, ignore_eos=True))
        assert time.monotonic() - t0 < 30
        with pytest.raises(WorkerDiedError):  # the engine stays down, it does not hang
            llm.generate([[4, 5]], GREEDY)
    finally:
        llm.shutdown()


def test_bad_split_is_refused_before_any_process_starts(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "l")  # 4 heads, 2 K/V heads
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(str(folder), device="cpu", tensor_parallel_size=3)


@pytest.mark.parametrize("text", ["soon", "0", "-5", "inf", "nan"])
def test_a_bad_tp_timeout_is_refused_with_its_name(text, monkeypatch):
    from flashlet.distributed import parallel

    monkeypatch.setenv("FLASHLET_TP_TIMEOUT_S", text)
    with pytest.raises(ValueError, match="FLASHLET_TP_TIMEOUT_S=.*positive number of seconds"):
        parallel.timeout()
    monkeypatch.setenv("FLASHLET_TP_TIMEOUT_S", "2.5")
    assert parallel.timeout().total_seconds() == 2.5


def test_a_bad_tp_timeout_stops_the_engine_before_any_process_starts(tmp_path, monkeypatch):
    from flashlet.distributed import parallel

    spawned = []
    monkeypatch.setattr(parallel, "_spawn_workers", lambda *a, **k: spawned.append(a) or [])
    monkeypatch.setenv("FLASHLET_TP_TIMEOUT_S", "later")
    folder = save_tiny_model("llama", tmp_path / "l")
    with pytest.raises(ValueError, match="FLASHLET_TP_TIMEOUT_S='later'"):
        LLM(str(folder), device="cpu", tensor_parallel_size=2)
    assert spawned == []


# ---- the split itself, no processes --------------------------------------------------------
class _Rank:
    """Stands in for TensorParallel where only the split is needed (no collective runs)."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def shape(self, cfg):
        return local_shape(cfg, self.rank, self.world_size)


@pytest.mark.parametrize("rank", [0, 1])
def test_streamed_checkpoint_slices_match_the_sliced_whole_model(tmp_path, rank):
    from flashlet.models.weights import load_model

    folder = _randomize_biases(save_tiny_model("llama", tmp_path / "l", attention_bias=True,
                                               vocab_size=255))
    whole, _, _ = load_model(str(folder))
    part, _, _ = load_model(str(folder), tp=_Rank(rank, 2))
    want = shard_state_dict(whole.state_dict(), whole.config, local_shape(whole.config, rank, 2))
    got = part.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _cfg(**kw):
    base = dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=6,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-6,
                rope_theta=1e4, max_position_embeddings=16, tie_word_embeddings=True,
                qkv_bias=True)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("world,kv_heads", [(2, 2), (2, 1), (4, 2), (4, 1)])
def test_shards_hold_exactly_their_heads(world, kv_heads):
    cfg = _cfg(num_heads=4, num_kv_heads=kv_heads, intermediate_size=8)
    d, q_size, kv_size = cfg.head_dim, cfg.num_heads * cfg.head_dim, kv_heads * cfg.head_dim
    # Each row/column holds its own index, so a shard shows which rows it took.
    qkv = torch.arange(q_size + 2 * kv_size, dtype=torch.float32)[:, None].expand(-1, 8)
    state = {"layers.0.qkv_proj.weight": qkv, "layers.0.qkv_proj.bias": qkv[:, 0],
             "layers.0.o_proj.weight": torch.arange(q_size, dtype=torch.float32).expand(8, -1),
             "layers.0.gate_up_proj.weight":
                 torch.arange(16, dtype=torch.float32)[:, None].expand(-1, 8),
             "layers.0.down_proj.weight": torch.arange(8, dtype=torch.float32).expand(8, -1),
             "embed_tokens.weight": torch.arange(10, dtype=torch.float32)[:, None].expand(-1, 8),
             "norm": torch.ones(8)}
    group = cfg.num_heads // kv_heads
    for rank in range(world):
        shape = local_shape(cfg, rank, world)
        shard = shard_state_dict(state, cfg, shape)
        q_heads = range(rank * cfg.num_heads // world, (rank + 1) * cfg.num_heads // world)
        kv_heads_used = sorted({h // group for h in q_heads})  # what GQA needs for those heads
        rows = shard["layers.0.qkv_proj.weight"][:, 0].long().tolist()
        want = ([h * d + i for h in q_heads for i in range(d)]
                + [q_size + h * d + i for h in kv_heads_used for i in range(d)]
                + [q_size + kv_size + h * d + i for h in kv_heads_used for i in range(d)])
        assert rows == want
        assert shard["layers.0.qkv_proj.bias"].long().tolist() == want
        cols = shard["layers.0.o_proj.weight"][0].long().tolist()
        assert cols == [h * d + i for h in q_heads for i in range(d)]
        inter = range(rank * 8 // world, (rank + 1) * 8 // world)
        assert shard["layers.0.gate_up_proj.weight"][:, 0].long().tolist() == (
            list(inter) + [8 + i for i in inter])
        assert shard["layers.0.down_proj.weight"][0].long().tolist() == list(inter)
        vocab = shard["embed_tokens.weight"][:, 0].tolist()
        rows_per_rank = -(-10 // world)
        expect = [float(v) if v < 10 else 0.0
                  for v in range(rank * rows_per_rank, (rank + 1) * rows_per_rank)]
        assert vocab == expect  # the last rank's rows past the vocabulary are zeros
        assert torch.equal(shard["norm"], state["norm"])


def test_local_shape_refuses_what_does_not_split():
    with pytest.raises(ValueError, match="attention heads"):
        local_shape(_cfg(num_heads=4), 0, 3)
    with pytest.raises(ValueError, match="K/V heads"):
        local_shape(_cfg(num_heads=12, num_kv_heads=3, intermediate_size=8), 0, 4)
    with pytest.raises(ValueError, match="intermediate size"):
        local_shape(_cfg(intermediate_size=6), 0, 4)
    assert local_shape(_cfg(), 0, 1).num_heads == 4
