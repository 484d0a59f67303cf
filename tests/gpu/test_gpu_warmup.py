"""GPU: after Engine start nothing compiles and no graph is captured (the default fused decode
path's CuTe GEMVs included, where it runs), whatever the work: context lengths from 1 to several
thousand tokens, decode batches of every size up to max_num_seqs, chunked prefills mixed with
decodes, greedy and sampled (top-k/top-p, min_p, penalties, logprobs)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT_LENS = [1, 2, 15, 16, 17, 63, 100, 511, 1000, 2047, 3000, 6000]
# Greedy, seeded top-k/top-p, unseeded min_p with penalties (seen-ids capacities of every
# size), and seeded top-p with penalties and logprobs: each sampling kernel and its variants.
SAMPLED = [{}, dict(temperature=0.8, top_k=40, top_p=0.9, seed=7),
           dict(temperature=0.7, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
                repetition_penalty=1.1),
           dict(temperature=0.7, top_p=0.9, seed=3, repetition_penalty=1.2, logprobs=2)]


def _workload(engine, repetitive=False):
    """Yield nothing; run requests in three waves so every decode batch size 1..64 occurs.
    repetitive: prompts that repeat a phrase (n-gram speculation then finds proposals)."""
    from flashlet import SamplingParams

    vocab = engine.model_config.vocab_size
    waves = [
        # long and short prompts together: chunked prefill mixed with decodes, lengths to 6k
        [(n, 8 + i) for i, n in enumerate(PROMPT_LENS)],
        # 64 short requests ending one step apart: the decode batch shrinks through 64..1
        [(3 + i % 5, 2 + i) for i in range(64)],
        # a few sampled requests decoding past 4k tokens of context
        [(4000 + 50 * i, 40) for i in range(3)],
    ]
    for w, wave in enumerate(waves):
        for i, (n, new) in enumerate(wave):
            params = SamplingParams(max_new_tokens=new, ignore_eos=True, **SAMPLED[(i + w) % 4])
            period = 5 + i % 3 if repetitive else n  # a phrase repeated, or none
            engine.add_request([(17 * (j % period) + 31 * i + w) % vocab for j in range(n)], params)
        done = 0
        while engine.has_unfinished():
            for out in engine.step():
                assert out.finish_reason in (None, "length"), out.error
                done += out.finished
        assert done == len(wave)
    engine.check_integrity()


@pytest.mark.parametrize("backend,spec", [("triton", False), ("flashinfer", False), ("auto", False),
                                          ("auto", True)], ids=["triton", "flashinfer", "auto", "auto-ngram"])
def test_nothing_compiles_or_captures_after_start(backend, spec):
    """spec: with n-gram speculation, whose verify steps of up to 16 tokens run the fused path
    as decode rows in graphs of their own (their attention looks back over the step's rows of
    one sequence: `runner.verify_graph_sizes`), captured at start too."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    import triton

    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip(f"triton {triton.__version__} has no compile hooks")
    from flashlet import Engine, EngineConfig
    from flashlet.core.warmup import count_triton_compiles

    from tests.test_speculative import NGRAM

    engine = Engine(EngineConfig(config="qwen2.5-0.5b", backend=backend, max_num_seqs=64,
                                 max_model_len=8192, max_num_pages=64 * 8192 // 16 // 4,
                                 speculative_config=NGRAM if spec else None))
    start = engine.start_report
    fused = engine.runner.fused  # on by default where it applies (sm_90+, the CuTe DSL, triton)
    assert start["warmed_up"]
    # every decode size has a second graph, the one that ends in the greedy tokens: the fused
    # path's (sizes up to fused_decode.SERVED_ROWS: 1, 2, 4, 8, 16), then the per-op ones
    from flashlet.runner import fused_decode

    greedy_sizes = engine.runner.greedy_token_sizes()
    served = ([s for s in engine.runner.graph_sizes if s <= fused_decode.SERVED_ROWS]
              if fused is not None else [])
    assert greedy_sizes == served + [s for s in engine.runner.graph_sizes if s not in served]
    # a size's steps have one graph per context its attention keys on (a long-context entry's
    # steps past ONE_LAUNCH_LONG_CONTEXT have their own): decode_contexts, as the warm-up runs them
    from flashlet.core.warmup import decode_contexts

    def graphs_of(sizes):
        return sum(len(decode_contexts(engine.runner, s, engine.max_model_len)) for s in sizes)

    verify_sizes = engine.runner.verify_graph_sizes()  # logits and greedy tokens again
    assert bool(verify_sizes) == (spec and fused is not None)
    assert start["graphs"] == (graphs_of(engine.runner.graph_sizes) + start["mixed_graphs"] + graphs_of(greedy_sizes)
                               + 2 * graphs_of(verify_sizes))
    assert (start["mixed_graphs"] > 0) == engine.runner.use_mixed_graphs
    graphs = dict(engine.runner.graphs)
    cute = cute_kernels(fused, served)
    if fused is not None:  # every GEMV a step may run, readied at start and counted (in 0 s
        # where an engine before this one in the process readied it)
        assert start["cute_gemvs"] >= len(cute) and start["cute_compile_s"] >= 0
    assert all(k is not None for k in cute.values()), f"CuTe GEMVs not compiled at start: {cute}"
    with count_triton_compiles() as compiles:
        _workload(engine, repetitive=spec)
        if spec:
            assert engine.stats()["spec_num_drafts"] > 0  # verify steps ran
    assert compiles.count == 0, f"compiled after start: {compiles.names}"
    assert engine.runner.graphs.keys() == graphs.keys(), "a CUDA graph was captured after start"
    after = cute_kernels(fused, served)
    assert all(after[n] is cute[n] for n in cute), "a CuTe GEMV was compiled after start"


def cute_kernels(fused, served) -> dict:
    """The fused path's compiled CuTe GEMVs by (rows, name) ({} without the path); the argmax
    of its row counts that end in greedy tokens, `served` (the others serve verify steps only)."""
    names = ("qkv", "o", "gate_up", "down", "lm_head")
    if fused is None:
        return {}
    kernels = {(m, n): getattr(g, n)._compiled for m, g in fused.gemvs.items() for n in names
               if getattr(g, n) is not None}
    return {**kernels, **{(m, "lm_argmax"): fused.gemvs[m].lm_argmax._compiled for m in served}}
