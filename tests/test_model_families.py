"""Every family and RoPE type against Hugging Face transformers' own `generate` (CPU, fp32):
tiny random models built with transformers' config classes, saved as HF folders, run through
the public `LLM` API with 4-token pages and 16-token steps (paging and chunked prefill), with
prompts and generations long enough to pass the original context of scaled RoPE."""

import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from flashlet import LLM, SamplingParams
from flashlet.models.model import ModelConfig
from flashlet.models.weights import ModelLoadError, load_model

DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, eos_token_id=1)
ORIGINAL = 16  # the pre-scaling context of every scaled-RoPE config below

FAMILIES = {
    # name: (config class, model class, config kwargs, prompt length, new tokens)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(max_position_embeddings=128), 24, 16),
    "llama-bias": (LlamaConfig, LlamaForCausalLM,
                   dict(max_position_embeddings=128, attention_bias=True), 16, 8),
    "llama-linear": (LlamaConfig, LlamaForCausalLM, dict(
        max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}), 24, 16),
    # dynamic NTK: the prompt stays within max_position_embeddings, the generation passes it
    # (flashlet/models/rope.py says why longer prompts cannot match Transformers in a paged engine)
    "llama-dynamic": (LlamaConfig, LlamaForCausalLM, dict(
        max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}), 12, 24),
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(
        max_position_embeddings=4 * ORIGINAL, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                         "rope_theta": 500000.0}), 24, 16),
    "qwen2-yarn": (Qwen2Config, Qwen2ForCausalLM, dict(
        max_position_embeddings=4 * ORIGINAL, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                         "original_max_position_embeddings": ORIGINAL}), 24, 16),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        max_position_embeddings=128, head_dim=32, tie_word_embeddings=True), 24, 16),
    "qwen3-yarn": (Qwen3Config, Qwen3ForCausalLM, dict(
        max_position_embeddings=4 * ORIGINAL, head_dim=8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                         "original_max_position_embeddings": ORIGINAL, "attention_factor": 1.3,
                         "beta_fast": 16.0, "beta_slow": 2.0}), 24, 16),
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        max_position_embeddings=256, sliding_window=48, head_dim=24), 24, 16),
}


def save_family(name: str, folder, seed: int = 0, **overrides):
    config_cls, model_cls, kwargs, _, _ = FAMILIES[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**DIMS, **kwargs, **overrides}))
    with torch.no_grad():  # peaked, non-degenerate greedy choices in a tiny model
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.normal_(1.0, 0.1)
    model.save_pretrained(folder)
    return folder


def hf_greedy(folder, prompt, n):
    """A fresh model per prompt: Transformers' dynamic RoPE keeps state between calls."""
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(length, count=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (length - 3 * i,), generator=g).tolist() for i in range(count)]


def paged_llm(folder, **kwargs):
    return LLM(str(folder), page_size=4, max_num_seqs=4, max_num_batched_tokens=16, **kwargs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_transformers(name, tmp_path):
    folder = save_family(name, tmp_path / name)
    *_, prompt_len, n = FAMILIES[name]
    batch = prompts(prompt_len)
    outs = paged_llm(folder).generate(batch, SamplingParams(max_new_tokens=n, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(folder, prompt, n), name


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    folder = tmp_path / "sharded"
    config_cls, model_cls, kwargs, _, _ = FAMILIES["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**DIMS, **kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(folder, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) > 3
    prompt = prompts(20, count=1)[0]
    out = paged_llm(folder).generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(folder, prompt, 12)


def test_sharded_checkpoint_with_a_missing_shard_names_it(tmp_path):
    folder = save_family("llama", tmp_path / "m")
    AutoModelForCausalLM.from_pretrained(str(folder)).save_pretrained(folder, max_shard_size="60KB")
    (folder / "model.safetensors").unlink(missing_ok=True)
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_model(str(folder))


def test_sliding_window_caps_the_context(tmp_path):
    folder = save_family("mistral", tmp_path / "mistral")
    llm = paged_llm(folder)
    assert llm.engine.max_model_len == 48
    with pytest.raises(ValueError, match="sliding window"):
        llm.generate([list(range(2, 52))], SamplingParams(max_new_tokens=20))
    no_window = save_family("mistral", tmp_path / "mistral-full", sliding_window=None)
    assert paged_llm(no_window).engine.max_model_len == 256


def qwen2_config(**changes):
    cfg = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 32768,
           "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 2}
    return {**cfg, **changes}


def test_qwen_sliding_window_only_when_switched_on():
    assert ModelConfig.from_hf(qwen2_config()).max_context_len == 32768
    assert ModelConfig.from_hf(qwen2_config(use_sliding_window=True)).max_context_len == 4096
    # every layer below max_window_layers: Transformers slides in none of them
    on_but_unused = qwen2_config(use_sliding_window=True, max_window_layers=4)
    assert ModelConfig.from_hf(on_but_unused).sliding_window is None


def test_scaled_rope_contexts():
    def ctx(scaling, max_pos=4096):
        return ModelConfig.from_hf(qwen2_config(max_position_embeddings=max_pos,
                                                rope_scaling=scaling)).max_context_len

    assert ctx({"type": "linear", "factor": 2.0}) == 8192
    assert ctx({"rope_type": "dynamic", "factor": 4.0}) == 16384
    assert ctx({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
               32768) == 131072
    assert ctx({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072) == 131072


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen2_moe", "num_experts": 8}, "mixture-of-experts"),
    ({"model_type": "mixtral"}, "mixture-of-experts"),
    ({"model_type": "phi3"}, "unsupported model_type 'phi3'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1], "long_factor": [1]}},
     "unsupported RoPE scaling 'longrope'"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "'yarn' lacks factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
])
def test_unsupported_configs_fail_at_load_naming_what_is_missing(tmp_path, change, message):
    folder = save_family("llama", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None) if "rope_scaling" in change else None
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(folder))


def test_quantized_tensors_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_family("llama", tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 128, dtype=torch.int8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="down_proj.weight is I8"):
        load_model(str(folder))


def test_wrong_shape_in_checkpoint_is_named(tmp_path):
    folder = save_family("llama", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match="gate_proj.weight"):
        load_model(str(folder))


def test_generation_config_eos_ids_stop_generation(tmp_path):
    folder = save_family("qwen3", tmp_path / "q3")
    prompt = prompts(12, count=1)[0]
    free = paged_llm(folder).generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))
    tokens = free[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if t != 1 and t not in tokens[:i])
    for eos in ([7, tokens[stop_at]], tokens[stop_at]):  # a list or one int
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        out = paged_llm(folder).generate([prompt], SamplingParams(max_new_tokens=10))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == tokens[:stop_at + 1]


def test_tokenizer_and_chat_template_come_from_the_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = save_family("qwen3", tmp_path / "chat")
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "[", "]", "hello", "there", "user"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m.role }} [ {{ m.content }} ]{% endfor %}"
    tok.save_pretrained(folder)
    llm = paged_llm(folder)
    ids = llm.apply_chat_template([{"role": "user", "content": "hello there"}])
    assert ids == [vocab[w] for w in ["user", "[", "hello", "there", "]"]]
    assert 1 in llm.engine.eos_token_ids  # the tokenizer's eos
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_new_tokens=4))[0]
    assert out.token_ids and isinstance(out.text, str)
