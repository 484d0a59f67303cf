"""GPU checks: FlashInfer and Triton backends against the torch reference, whole-model parity at
the Qwen2.5-0.5B shape in bf16, and CUDA-graph replay against eager decode."""

import pytest
import torch

from tests.test_attention_backends import compare

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RAGGED = [(0, 37), (16, 1), (100, 1), (0, 1), (33, 16), (250, 1), (17, 64)]
DECODE = [(0, 1), (16, 1), (100, 1), (1000, 1), (4000, 1)]


def flashinfer_backend(pool, hq):
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    from flashlet.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(pool, hq)


def triton_backend(pool, hq):
    from flashlet.attention.triton_backend import TritonBackend

    return TritonBackend(pool, hq)


@pytest.mark.parametrize("make", [flashinfer_backend, triton_backend], ids=["flashinfer", "triton"])
@pytest.mark.parametrize("seqs", [RAGGED, DECODE], ids=["ragged", "decode"])
def test_backend_matches_reference_bf16(make, seqs):
    err = compare(make, seqs, hq=14, hkv=2, d=64, ps=16, dtype=torch.bfloat16, device="cuda")
    assert err < 1e-2


def run_engine(backend, cuda_graph, prompts, n=64, record=None, fused_decode=False, **config):
    """The per-op path unless fused_decode is given: these tests are about the backends and the
    graphs around them (tests/gpu/test_gpu_fused_decode.py checks the fused one-stream path)."""
    from flashlet import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(config="qwen2.5-0.5b", backend=backend, cuda_graph=cuda_graph,
                                 max_num_pages=2048, max_num_seqs=16, max_model_len=4096,
                                 fused_decode=fused_decode, **config))
    if record is not None:
        engine.observe_steps(lambda meta, logits: record.append(logits.clone()))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    engine.check_integrity()
    return [done[i] for i in ids], engine


PROMPTS = [[(i * 31 + 7) % 150000 for i in range(n)] for n in (5, 77, 300)]


@pytest.mark.parametrize("backend", ["torch", "flashinfer", "triton"])
def test_graph_replay_gives_the_eager_tokens(backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    eager, _ = run_engine(backend, False, PROMPTS)
    graphed, engine = run_engine(backend, True, PROMPTS)
    assert engine.stats()["cuda_graphs"] > 0, "no CUDA graph was captured"
    assert graphed == eager


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_greedy_decode_graphs_give_the_logits_graphs_tokens(backend, monkeypatch):
    """Decode steps of plain greedy requests replay the per-op graph that ends in the argmax of
    the bf16 logits (no fp32 copy); the same steps with a step observer replay the logits graph
    and the sampler takes the argmax: the same GEMM, so the same tokens."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    from flashlet.runner.model_runner import ModelRunner

    took, greedy_tokens = [], ModelRunner.greedy_tokens

    def counted(self, input_ids, meta):
        tokens = greedy_tokens(self, input_ids, meta)
        took.append(tokens is not None)
        return tokens

    monkeypatch.setattr(ModelRunner, "greedy_tokens", counted)
    prompts = PROMPTS + [[(i * 13 + 5) % 150000 for i in range(n)] for n in (2, 8, 19, 64, 200)]
    with_logits, engine = run_engine(backend, True, prompts, record=[])
    warm_up = sum(took)  # the observer keeps every step on the logits graphs
    assert warm_up == len(engine.runner.greedy_token_sizes()) > 0
    tokens, engine = run_engine(backend, True, prompts)
    assert sum(took) - 2 * warm_up >= 60, "the greedy graphs did not serve the decode steps"
    assert tokens == with_logits


@pytest.mark.parametrize("backend", ["torch", "flashinfer", "triton"])
def test_overlapped_steps_give_the_tokens_of_one_step_at_a_time(backend):
    """Overlap launches step N before step N-1's tokens reach the host; on a GPU that really
    runs concurrently, so any race on the staging buffers or the fed-back tokens shows here."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    prompts = PROMPTS + [[(i * 17 + 3) % 150000 for i in range(n)] for n in (1, 9, 40, 129, 513)]
    serial, _ = run_engine(backend, True, prompts, overlap=False)
    overlapped, engine = run_engine(backend, True, prompts, overlap=True)
    assert overlapped == serial


@pytest.mark.parametrize("backend", ["torch", "flashinfer", "triton"])
def test_whole_model_logits_match_torch_backend(backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    ref_logits, ours_logits = [], []
    # The oracle: the torch backend with plain PyTorch ops (no Triton kernel on either path).
    ref_tokens, _ = run_engine("torch", False, PROMPTS[:1], record=ref_logits, fused_ops=False)
    tokens, _ = run_engine(backend, True, PROMPTS[:1], record=ours_logits)
    diverged = next((i for i, (a, b) in enumerate(zip(ref_tokens[0], tokens[0])) if a != b), None)
    steps = len(ref_logits) if diverged is None else diverged + 1
    for a, b in zip(ref_logits[:steps], ours_logits[:steps]):
        scale = a.abs().max().item()
        # bf16 through 24 layers: a few percent of the logit range, measured at about 2.4%
        assert (a - b).abs().max().item() <= 0.05 * scale
    if diverged is not None:  # vLLM's rule: each side's token is in the other's top 5
        i = diverged
        assert tokens[0][i] in ref_logits[i][0].topk(5).indices.tolist()
        assert ref_tokens[0][i] in ours_logits[i][0].topk(5).indices.tolist()


def test_step_buffers_stage_pad_and_feed_on_cuda():
    """One step through pinned staging: the device buffers hold the host layout (padded to a
    graph batch on the scratch page), and the fed row takes the previous step's device token."""
    from flashlet.runner.batch import StepBuffers, StepRow, build_layout
    from flashlet.core.request import PLACEHOLDER

    layout = build_layout([StepRow([PLACEHOLDER], 20, [2, 3], True, 1), StepRow([9], 0, [5])], 16)
    buffers = StepBuffers(8, 4, 16, "cuda", scratch_page=99, page_size=16)
    input_ids, meta = buffers.load(layout, torch.tensor([7, 8], device="cuda"), pad_to=4)
    torch.cuda.synchronize()
    assert input_ids.tolist() == [8, 9, 0, 0]
    assert meta.host.qo_indptr.is_pinned() and meta.num_padding == 2
    assert meta.host.slot_mapping.tolist() == [3 * 16 + 4, 5 * 16, 99 * 16, 99 * 16]
    for name in ("positions", "slot_mapping", "qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                 "paged_kv_last_page_len", "kv_lens", "logits_indices"):
        assert getattr(meta, name).is_cuda
        assert getattr(meta, name).tolist() == getattr(meta.host, name).tolist(), name


def test_current_stream_follows_the_current_stream():
    """The engine's events record on the stream current at each record (CurrentStream), not on
    the one current when it was built: a step launched under another stream is read after it."""
    from flashlet.runner.model_runner import CurrentStream

    current = CurrentStream(torch.device("cuda"))
    assert current() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side
        assert current() is current()  # unchanged: the same object, no rebuild
    assert current() == torch.cuda.current_stream()

