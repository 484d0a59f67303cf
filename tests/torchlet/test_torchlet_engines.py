"""Behaviour beyond equal tokens: scheduling limits, the paged cache's free list, CUDA-only
refusals, config and weight loading, input checks, and the demo entry point."""

import importlib
import json
import subprocess
import sys

import pytest
import torch
from torchlet_testing import DEVICE, llm_class, make_llm, token_ids

from torchlet.v00_full_recompute.config import config_from_dict, load_config
from torchlet.v00_full_recompute.device import pick_dtype
from torchlet.v00_full_recompute.weights import resolve_model_dir

CONTINUOUS_VERSIONS = ["v04_continuous_batching", "v05_decode_slots", "v06_static_buffers",
                       "v08_paged_gqa_py"]


@pytest.mark.parametrize("version", CONTINUOUS_VERSIONS)
def test_requests_join_while_others_decode(version, tiny_model_dirs, tiny_prompts):
    llm = make_llm(version, tiny_model_dirs["qwen2"], max_batch_size=2, page_size=4)
    llm.generate(tiny_prompts, max_new_tokens=6)
    kinds = [kind for kind, _ in llm.step_log]
    assert max(len(ids) for _, ids in llm.step_log) == 2  # never more than max_batch_size
    prefilled = sorted(i for kind, ids in llm.step_log if kind == "prefill" for i in ids)
    assert prefilled == [0, 1, 2, 3, 4]  # each request prefilled exactly once
    first_decode = kinds.index("decode")
    assert "prefill" in kinds[first_decode:], "later requests should be admitted mid-decode"


def test_paged_cache_admits_by_free_pages_and_returns_them(tiny_model_dirs, tiny_prompts):
    """6 usable pages of 4 tokens: a request of up to 13 + 6 tokens may need 5 of them, so only
    one runs at a time although there are 4 slots; every page comes back at the end."""
    reference = make_llm("v00_full_recompute", tiny_model_dirs["llama"])
    expected = token_ids(reference.generate(tiny_prompts, max_new_tokens=6))
    llm = make_llm("v08_paged_gqa_py", tiny_model_dirs["llama"], max_batch_size=4, page_size=4,
                   num_pages=7, max_seq_len=32)
    assert token_ids(llm.generate(tiny_prompts, max_new_tokens=6)) == expected
    running_at_once = [len(ids) for kind, ids in llm.step_log if kind == "decode"]
    assert max(running_at_once) < 4
    assert sorted(llm.kv_cache.free_pages) == list(range(1, 7))
    assert (llm.kv_cache.page_table == 0).all()


def test_paged_cache_refuses_a_request_larger_than_the_pool(tiny_model_dirs):
    llm = make_llm("v08_paged_gqa_py", tiny_model_dirs["llama"], page_size=4, num_pages=3)
    with pytest.raises(ValueError, match="KV pages"):
        llm.generate([[5] * 9], max_new_tokens=2)


@pytest.mark.parametrize("version", ["v04_continuous_batching", "v10_triton_paged_gqa"])
def test_too_long_requests_are_refused(version, tiny_model_dirs):
    llm = make_llm(version, tiny_model_dirs["qwen2"], max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate([[5] * 12], max_new_tokens=8)


def test_cuda_graph_version_refuses_a_cpu_device(tiny_model_dirs):
    device = importlib.import_module("torchlet.v07_cuda_graph.device")
    with pytest.raises(device.NeedsCudaError, match="needs CUDA"):
        llm_class("v07_cuda_graph")(str(tiny_model_dirs["qwen2"]), device="cpu")


def test_cuda_graph_demo_exits_with_the_reason_on_cpu():
    result = subprocess.run(
        [sys.executable, "-m", "torchlet.v07_cuda_graph.llm", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "needs CUDA" in result.stderr


def test_demo_runs_on_the_embedded_model(capsys):
    demo = importlib.import_module("torchlet.v05_decode_slots.demo")
    demo.main(llm_class("v05_decode_slots"), ["--max-new-tokens", "3", "--device", DEVICE])
    out = capsys.readouterr().out
    assert "torchlet v05_decode_slots" in out and "What is the capital of France?" in out
    assert "'max_batch_size': 2" in out and "decode" in out  # 4 questions through 2 slots


# --- configuration, weights, inputs -------------------------------------------------------------

QWEN_CONFIG = json.loads(
    (importlib.resources.files("torchlet") / "configs" / "qwen2.5-0.5b.json").read_text()
)


def test_qwen2_config_with_top_level_rope_theta():
    config = config_from_dict(QWEN_CONFIG)
    assert config.rope_theta == 1_000_000.0
    assert config.head_dim == 896 // 14 and config.group_size == 7
    assert config.qkv_bias and not config.o_proj_bias and config.tie_word_embeddings


def test_llama_config_with_rope_parameters_and_head_dim(demo_model_path):
    config = load_config(demo_model_path)
    assert config.model_type == "llama" and config.rope_theta == 100000.0
    assert config.head_dim == 64 and not config.qkv_bias and config.tie_word_embeddings
    assert 2 in config.eos_token_ids


def test_generation_config_adds_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_CONFIG))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert load_config(tmp_path).eos_token_ids == (151645, 151643)


def test_unsupported_rope_scaling_is_refused():
    raw = dict(QWEN_CONFIG, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="RoPE scaling"):
        config_from_dict(raw)


def test_missing_weights_are_reported(tiny_model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_model_dirs["llama"]
    state = load_file(str(folder / "model.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        llm_class("v00_full_recompute")(str(tmp_path), device="cpu")


def test_unknown_hub_id_error_names_it(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="someone/no-such-model"):
        resolve_model_dir("someone/no-such-model")


@pytest.mark.parametrize(
    "prompts, error",
    [
        ([], "no prompts"),
        ([[]], "empty prompt"),
        ([[5, 999]], r"\[0, 320\)"),
        (["text"], "tokenizer"),
    ],
)
def test_bad_prompts_are_refused(prompts, error, tiny_model_dirs):
    llm = make_llm("v03_request_states", tiny_model_dirs["qwen2"])
    with pytest.raises(ValueError, match=error):
        llm.generate(prompts, max_new_tokens=2)


def test_text_prompts_use_the_tokenizer(demo_model_path):
    llm = llm_class("v02_kv_cache")(demo_model_path, device=DEVICE, dtype="float32")
    [by_text] = llm.generate(["The capital of France is"], max_new_tokens=3)
    ids = llm.tokenizer("The capital of France is")["input_ids"]
    [by_ids] = llm.generate([ids], max_new_tokens=3)
    assert by_text == by_ids and "Paris" in by_text.text


def test_dtype_names():
    cpu = torch.device("cpu")
    assert pick_dtype(None, cpu) is torch.float32
    assert pick_dtype("bf16", cpu) is torch.bfloat16
    assert pick_dtype(torch.float16, cpu) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        pick_dtype("float8", cpu)
