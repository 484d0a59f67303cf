"""GPU: mixed steps (prefill chunks with decodes) replayed from CUDA graphs, padded to a token
bucket and as many sequences (max_num_seqs at most), against the same steps run eagerly
unpadded; an engine with mixed graphs against one without graphs; nothing captured after the
warm-up.

fp32 (the Triton prefill kernel then runs IEEE fp32 dots, torch's matmuls no TF32), so the two
paths differ by summation order only (cuBLAS picks kernels by row count): logits agree within
1e-3 of their largest magnitude, where a graph reading stale or misplaced inputs would be off
by about that magnitude itself."""

import random

import pytest
import torch

from flashlet.core.request import PLACEHOLDER
from flashlet.runner.batch import StepRow, build_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE_SIZE = 16
LOGITS_RTOL = 1e-3  # of the step's largest |logit|
# The defaults (a step splits its keys from 4,096 tokens of context: none here but the second
# test's longest prompt), and the split-KV prefill (attention/triton_backend.py's switch) up to 8
# splits of 64+ keys in steps whose longest KV holds 256+ tokens: the contexts of a few hundred
# tokens here split, shorter ones do not, so both variants of a bucket's graph replay.
SPLITS = pytest.mark.parametrize("splits", [None, "8,64,1024,256"], ids=["default", "split"])


def _set_splits(monkeypatch, splits):
    from flashlet.attention.triton_backend import PREFILL_SPLITS_ENV

    if splits is None:
        monkeypatch.delenv(PREFILL_SPLITS_ENV, raising=False)
    else:
        monkeypatch.setenv(PREFILL_SPLITS_ENV, splits)


def random_mixed_rows(rng, num_pages, max_seqs, budget):
    """Decodes (some fed), chunks with and without a cached prefix; at most `budget` tokens,
    at least one chunk. Every sequence has pages of its own (K/V there is random)."""
    rows, tokens, free = [], 0, list(range(num_pages))
    rng.shuffle(free)
    for b in range(rng.randrange(1, max_seqs + 1)):
        chunk = b == 0 or rng.random() < 0.4
        n = rng.randrange(2, max(3, min(300, budget - tokens) + 1)) if chunk else 1
        if tokens + n > budget:
            break
        start = rng.randrange(0, 400)
        pages = [free.pop() for _ in range(-(-(start + n) // PAGE_SIZE))]
        ids = [PLACEHOLDER] if n == 1 and rng.random() < 0.5 else \
            [rng.randrange(1, 1000) for _ in range(n)]
        rows.append(StepRow(ids, start, pages, rng.random() < 0.9, rng.randrange(0, 4)))
        tokens += n
    return rows


@SPLITS
def test_mixed_graph_replays_give_the_eager_logits(monkeypatch, splits):
    from flashlet import Engine, EngineConfig

    _set_splits(monkeypatch, splits)
    engine = Engine(EngineConfig(config="qwen2.5-0.5b", backend="triton", dtype="float32",
                                 max_num_pages=1024, max_num_seqs=8, max_num_batched_tokens=512,
                                 max_model_len=2048, page_size=PAGE_SIZE, warmup_at_start=False))
    runner = engine.runner
    assert runner.use_mixed_graphs and runner.token_buckets[-1] == 512
    assert runner.backend.prefill_config(300).num_splits == 8
    assert runner.backend.prefill_split_min_context == (256 if splits else 4096)
    torch.manual_seed(0)
    engine.kv_pool.k_cache.normal_()
    engine.kv_pool.v_cache.normal_()
    fed = torch.tensor([11, 22, 33, 44], device="cuda")
    rng = random.Random(0)
    for trial in range(30):
        layout = build_layout(random_mixed_rows(rng, 900, 8, rng.choice([16, 60, 200, 512])),
                              PAGE_SIZE)
        if layout.is_pure_decode:
            continue
        runner.use_mixed_graphs = True
        input_ids, meta = runner.load(layout, fed)
        assert meta.token_bucket == next(t for t in runner.token_buckets if t >= layout.num_tokens)
        graphed = runner.forward(input_ids, meta).clone()
        runner.use_mixed_graphs = False  # the same step eagerly, unpadded
        input_ids, meta = runner.load(layout, fed)
        assert meta.token_bucket is None
        eager = runner.forward(input_ids, meta)
        assert graphed.shape == eager.shape and torch.isfinite(graphed).all()
        if eager.numel() == 0:  # no row of this step samples (every chunk is a prompt's middle)
            continue
        scale = eager.abs().max().item()
        assert (graphed - eager).abs().max().item() <= LOGITS_RTOL * scale, layout
    buckets = {key[1] for key in runner.graphs if key[0] == "mixed"}
    assert len(buckets) >= 4, buckets
    split_caps = {key[-1] for key in runner.graphs if key[0] == "mixed"}
    assert split_caps == ({1, 8} if splits else {1}), split_caps


def _greedy_tokens(engine, prompts, late):
    from flashlet import SamplingParams

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        if engine.num_steps == 3:  # a prompt arriving while the others decode: a mixed step
            ids.append(engine.add_request(late, params))
    return [done[i] for i in ids]


@SPLITS
def test_engine_with_mixed_graphs_gives_the_eager_tokens_and_captures_nothing_after_start(monkeypatch, splits):
    from flashlet import Engine, EngineConfig

    _set_splits(monkeypatch, splits)
    cfg = EngineConfig(config="qwen2.5-0.5b", backend="triton", dtype="float32",
                       max_num_pages=2048, max_num_seqs=16, max_num_batched_tokens=1024,
                       max_model_len=8192)
    vocab = 151_000
    prompts = [[(13 * j + 7 * i) % vocab for j in range(n)] for i, n in
               enumerate([5, 40, 300, 1500, 17, 2, 4200])]  # 4,200: its last chunk splits
    late = [(5 * j + 1) % vocab for j in range(100)]  # with the decodes: a smaller bucket
    graphed = Engine(cfg)
    start = graphed.start_report
    assert start["mixed_graphs"] > 0
    before = set(graphed.runner.graphs)
    replays = []

    def counted(input_ids, meta, replay=graphed.runner._replay_mixed):
        replays.append(meta.token_bucket)
        return replay(input_ids, meta)

    graphed.runner._replay_mixed = counted
    got = _greedy_tokens(graphed, prompts, late)
    assert len(set(replays)) >= 2, replays  # mixed steps of several buckets replayed graphs
    assert set(graphed.runner.graphs) == before, "a CUDA graph was captured after start"
    want = _greedy_tokens(Engine(cfg.replace(cuda_graph=False)), prompts, late)
    assert got == want
