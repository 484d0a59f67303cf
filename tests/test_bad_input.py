"""Bad input raises a clear error naming the problem, and leaves no KV page allocated."""

import json
import shutil

import pytest

from flashlet import LLM, SamplingParams
from flashlet.models.weights import ModelLoadError, embedded_gguf_path, load_model


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return LLM(str(tiny_qwen2), max_model_len=64)


def no_pages_held(llm):
    stats = llm.engine.stats()
    return stats["kv_pages_used"] == stats["kv_pages_cached"]


@pytest.mark.parametrize("prompt, message", [
    ([[]], "prompt is empty"),
    ([[1, 2, 999999]], "token ids must be integers"),
    ([[5] * 60], "exceeds the model's context"),
    ([], "no prompts given"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_new_tokens=10))
    assert no_pages_held(llm) and not llm.engine.has_unfinished()


@pytest.mark.parametrize("prompts, message", [
    (None, r"prompts: a prompt is a string.*got NoneType"),
    (5, r"prompts: a prompt is a string.*got int"),
    ([None], r"prompts\[0\]: a prompt is a string.*got NoneType"),
    ([[3, 4], 2.5], r"prompts\[1\]: a prompt is a string.*got float"),
    ([{"prompt": 3}], r"prompts\[0\]: a prompt is a string.*got int"),
])
def test_a_prompt_of_no_known_form_is_named(llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, SamplingParams(max_new_tokens=2))
    assert no_pages_held(llm) and not llm.engine.has_unfinished()


def test_text_prompt_without_tokenizer_is_an_error(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")


class _PastTheVocabulary:
    """A tokenizer that holds ids the model's embedding does not (a mismatched tokenizer)."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text, **kwargs):
        return [1, self.vocab_size + 3]


def test_a_text_prompt_the_tokenizer_encodes_past_the_vocabulary_is_refused(llm, monkeypatch):
    monkeypatch.setattr(llm.engine, "tokenizer", _PastTheVocabulary(llm.engine.model_config.vocab_size))
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate("hello", SamplingParams(max_new_tokens=2))
    assert no_pages_held(llm) and not llm.engine.has_unfinished()


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[5, 6], []])
    assert not llm.engine.has_unfinished() and no_pages_held(llm)


def test_any_iterable_of_prompts_or_ids_is_taken(llm):
    params = SamplingParams(max_new_tokens=2)
    want = [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]
    assert [o.token_ids for o in llm.generate((p for p in ([5, 6, 7], (8, 9))), params)] == want


def test_any_integer_seed_runs_and_reproduces(llm):
    """OpenAI's seed is any integer (the server takes it modulo 2**64): the torch sampler's
    generator too, where 2**70 once failed inside the step."""
    for seed in (2**70, -5, 2**64 - 1):
        params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=seed)
        first, again = (llm.generate([[5, 6, 7]], params)[0].token_ids for _ in range(2))
        assert first == again and len(first) == 4
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed="7")


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(skip_special_tokens=0), "skip_special_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_minus_one_is_off_as_vllm_had_it():
    assert SamplingParams(top_k=-1).top_k == SamplingParams().top_k == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=-1), "max_model_len must be >= 1"),
    (dict(max_model_len=0), "max_model_len must be >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
])
def test_bad_engine_limits_name_the_field(tiny_qwen2, kwargs, message):
    """Each refused before the model loads, by its own name (max_model_len=-1 once ran with a
    context of -1 tokens; max_num_batched_tokens=0 was refused as max_decode_step_tokens)."""
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen2), **kwargs)


def test_unknown_model_path_or_id(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tiny_qwen2, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen2, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read safetensors"):
        load_model(str(broken))


def test_unsupported_architecture_in_config(tiny_qwen2, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_qwen2, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'mamba'"):
        load_model(str(other))


def test_truncated_gguf(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(embedded_gguf_path().read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(junk))


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model(str(path))


class _Id(int):
    pass


@pytest.mark.parametrize("ids", [
    [1, 2, 3], [0, 9], [10], [-1], [True], [1, False], [1.0], [_Id(3)], [_Id(3), 2], [_Id(12)],
    ["1"], [None], [2**70], [9, 3.5], list(range(10)) * 50 + [10]])
def test_the_token_id_check_is_the_per_id_rule(ids):
    """Plain int lists take a min/max fast path; anything else the per-id rule it stands for."""
    from flashlet.core.request_check import RequestError, RequestLimits

    limits = RequestLimits(max_model_len=1000, vocab_size=10, page_size=16, num_pages=100)
    valid = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 10 for t in ids)
    if valid:
        assert limits.check_prompt_ids(ids) == ids
    else:
        with pytest.raises(RequestError, match="token ids must be integers"):
            limits.check_prompt_ids(ids)


@pytest.mark.parametrize("ids", [
    [1, 2, 3], [0, 9], [10], [-1], [True], [1, False], [1.0], ["1"], [None], [2**70], [9, 3.5],
    list(range(10)) * 50 + [10], list(range(10)) * 50])
def test_the_servers_check_of_strictly_validated_ids_is_the_per_id_rule(ids):
    """The API process checks a prompt of token ids after the protocol's strict models hold it
    to ints >= 0 (`typed`: only the vocabulary's bound left): together, the per-id rule."""
    from pydantic import ValidationError

    from flashlet.core.request_check import RequestError, RequestLimits
    from flashlet.server.protocol import GenerateRequest

    limits = RequestLimits(max_model_len=1000, vocab_size=10, page_size=16, num_pages=100)
    valid = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 10 for t in ids)
    try:
        prompt = GenerateRequest.model_validate({"prompt": ids}).prompt
        checked = limits.check_prompt_ids(prompt, typed=True)
    except (ValidationError, RequestError):
        checked = None
    assert checked == (ids if valid else None)
