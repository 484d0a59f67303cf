"""Embedding requests on CUDA with graphs on: a one-token prompt among decodes (a step that
would replay a decode graph runs its body eagerly) and prompts in mixed-graph steps give the
same vectors as on the CPU engine (fp32)."""

import pytest
import torch

from flashlet import LLM, SamplingParams
from tests.conftest import save_tiny_model
from tests.test_pooling import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_embeddings_with_graphs_equal_the_cpu_engine(tmp_path, backend):
    folder = save_tiny_model("qwen2", tmp_path / "tiny", hidden_size=256,
                             num_attention_heads=4, num_key_value_heads=2)
    prompts = [[9], list(range(3, 40)), [11]]
    requests = [(list(range(50, 60)), SamplingParams(max_new_tokens=24))]  # decoding throughout
    requests += [(p, SamplingParams(max_new_tokens=1, pooling=m))
                 for p in prompts for m in ("last", "mean")]
    cpu = run(LLM(str(folder), device="cpu", dtype="float32").engine, requests)
    gpu_llm = LLM(str(folder), device="cuda", dtype="float32", backend=backend)
    engine = gpu_llm.engine
    first = engine.add_request(*requests[0])
    engine.step()  # the generation is decoding before the embeddings arrive
    # The one-token prompts alone first: with the decode, a step of one token a row (a
    # decode-graph step); then the long prompt, in a mixed step.
    gpu = run(engine, requests[1:3]) + run(engine, requests[3:5]) + run(engine, requests[5:])
    while engine.has_unfinished():
        engine.step()
    for got, want in zip(gpu, cpu[1:]):
        torch.testing.assert_close(torch.tensor(got.embedding), torch.tensor(want.embedding),
                                   atol=2e-3, rtol=0)
    engine.check_integrity()
    assert first is not None and not engine.pooler.modes
