"""GPU: a decode step replayed from a CUDA graph reads its inputs where `StepBuffers` put them.

The step buffers are one arena uploaded in one copy, each field at an offset that depends on the
padded batch size only; a graph captured on one step must then read the next steps' inputs,
whose page counts differ, at the same addresses. Decodes whose contexts cross page boundaries,
batches of 3 and 4 sharing the graph of 4, some rows fed from a device tensor: each step's
logits from the graph against the same step run eagerly, padded the same way."""

import pytest
import torch

from flashlet.core.request import PLACEHOLDER
from flashlet.runner.batch import StepRow, build_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE_SIZE = 16


def make_engine(backend):
    from flashlet import Engine, EngineConfig

    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    engine = Engine(EngineConfig(config="qwen2.5-0.5b", backend=backend, dtype="bfloat16",
                                 max_num_pages=512, max_num_seqs=8, max_model_len=2048,
                                 page_size=PAGE_SIZE, warmup_at_start=False))
    torch.manual_seed(0)
    engine.kv_pool.k_cache.normal_()  # earlier positions' K/V: random, the same for both paths
    engine.kv_pool.v_cache.normal_()
    return engine


def steps(pages):
    """(rows, fed tokens) per step: 4 decodes from contexts 13, 30, 45, 60 (one more each step,
    crossing 16, 32, 48, 64), the fourth every other step only; odd steps feed two rows from a
    device tensor: rows 0 and 1 (one gather into them) or rows 0 and 2 (gather and scatter)."""
    fed = torch.tensor([11, 22, 33], device="cuda")
    for step in range(24):
        fed_rows = () if step % 2 == 0 else (0, 1) if step % 4 == 1 else (0, 2)
        rows = []
        for b, start in enumerate((13, 30, 45, 60)[: 4 if step % 2 else 3]):
            token = PLACEHOLDER if b in fed_rows else 3 + 7 * step + b
            rows.append(StepRow([token], start + step, pages[b], True, (b + 1) % 3))
        yield rows, fed


@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_graph_replays_read_each_steps_inputs_as_page_counts_change(backend):
    engine = make_engine(backend)
    runner = engine.runner
    pages = [engine.kv_pool.allocator.allocate(8) for _ in range(4)]
    page_counts = set()
    for rows, fed in steps(pages):
        layout = build_layout(rows, PAGE_SIZE)
        page_counts.add(layout.paged_kv_indices.shape[0])
        runner.use_graphs = True
        assert runner.graph_batch_size(layout) == 4
        graphed = runner.forward(*runner.load(layout, fed)).clone()
        runner.use_graphs = False  # the same step eagerly, padded as the graph's was
        runner.wait_inputs_staged()
        eager = runner.forward(*runner.buffers.load(layout, fed, pad_to=4))
        scale = eager.abs().max().item()
        assert graphed.shape == eager.shape == (len(rows), engine.model_config.vocab_size)
        # Same kernels on the same inputs; stale inputs would be off by the logits' own scale.
        assert (graphed - eager).abs().max().item() <= 0.02 * scale, (backend, rows)
    assert len(page_counts) > 4  # the contexts crossed page boundaries
    assert {key[0] for key in runner.graphs} == {4}
