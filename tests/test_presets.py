"""Every `--config` preset: read by ModelConfig and by the matching transformers config class
with the same shapes, the same parameter tensors (a meta-device HF model against our names),
the same RoPE table, and the parameter count the model's publisher states."""

import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

from flashlet.models.weights import PRESETS_DIR
from flashlet.models import rope
from flashlet.models.model import ModelConfig, hf_to_flashlet_names

CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
                  "qwen3": Qwen3Config}
# Parameter counts as published on each model card (tied embeddings counted once).
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": 0.49e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.61e9, "qwen2.5-14b": 14.7e9,
    "qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "llama-3.2-1b": 1.24e9, "llama-3.1-8b": 8.03e9,
    "mistral-7b": 7.24e9, "tinyllama-1.1b": 1.1e9,
    # Qwen2.5-0.5B's 494.0M less the embedding rows (tied to the LM head) of the vocabulary
    # SmolLM2's tokenizer does not have.
    "qwen2.5-0.5b-smolvocab": 494.0e6 - (151936 - 49152) * 896,
}
PRESETS = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def test_every_preset_has_a_published_count():
    assert set(PRESETS) == set(PUBLISHED_PARAMS)


def hf_config(name):
    raw = json.loads((PRESETS_DIR / f"{name}.json").read_text())
    raw.pop("torch_dtype", None)
    return raw, CONFIG_CLASSES[raw["model_type"]](**raw)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_matches_transformers_config(name):
    raw, hf = hf_config(name)
    ours = ModelConfig.from_hf(raw)
    assert (ours.hidden_size, ours.intermediate_size, ours.num_layers, ours.num_heads,
            ours.num_kv_heads, ours.vocab_size) == (
        hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.num_attention_heads,
        hf.num_key_value_heads, hf.vocab_size)
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.rope_scaling["rope_type"] == hf.rope_parameters["rope_type"]
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.sliding_window == getattr(hf, "sliding_window", None)
    assert abs(ours.num_params() / PUBLISHED_PARAMS[name] - 1) < 0.02


@pytest.mark.parametrize("name", PRESETS)
def test_preset_tensors_match_transformers_model(name):
    raw, hf = hf_config(name)
    ours = ModelConfig.from_hf(raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    theirs = dict(model.named_parameters(remove_duplicate=False))
    used = set()
    for _, names in hf_to_flashlet_names(ours):
        assert all(n in theirs for n in names), names
        used.update(names)
    if ours.tie_word_embeddings:
        used.add("lm_head.weight")
    assert used == set(theirs)
    hf_count = sum(p.numel() for p in model.parameters())  # ties counted once
    assert ours.num_params() == hf_count


@pytest.mark.parametrize("name", PRESETS)
def test_preset_rope_table_matches_transformers(name):
    raw, hf = hf_config(name)
    ours = ModelConfig.from_hf(raw)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        d = ours.head_dim
        inv_freq = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        factor = 1.0
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    positions = torch.tensor([0, 1, 4095, 8191, 8192, 30000])
    positions = positions[positions < ours.max_context_len]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    expected = torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1)
    table = rope.cos_sin_cache(ours.head_dim, ours.rope_theta, ours.rope_scaling,
                               ours.max_position_embeddings, int(positions.max()) + 1)
    assert torch.equal(table[positions], expected)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-1.5b"])
def test_bf16_rope_rounds_once_with_the_fp32_table(name):
    """TorchOps.rope in bf16 at a preset's table: the fp32 rotation with the fp32 cos/sin,
    rounded once; its error against the fp64 rotation is the rounding floor, below both
    transformers' way (cos/sin and every op in bf16) and fp32 math on bf16-rounded cos/sin."""
    from flashlet.models.model import rope_cache
    from flashlet.models.ops import TorchOps

    cfg = ModelConfig.from_file(PRESETS_DIR / f"{name}.json")
    table = rope_cache(cfg)[:8320]
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(0, 320), torch.arange(8000, 8320)])
    q = torch.randn(len(pos), cfg.num_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(len(pos), cfg.num_kv_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
    exact_q, exact_k = TorchOps.rope(q.double(), k.double(), pos, table.double())
    got_q, got_k = TorchOps.rope(q, k, pos, table)
    assert got_q.dtype == got_k.dtype == torch.bfloat16
    fp32_q, fp32_k = TorchOps.rope(q.float(), k.float(), pos, table)
    assert torch.equal(got_q, fp32_q.to(torch.bfloat16)) and torch.equal(got_k, fp32_k.to(torch.bfloat16))

    def rms_rel(x, ref):
        return ((x.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).pow(2).mean().sqrt().item()

    floor = rms_rel(exact_q.to(torch.bfloat16), exact_q)
    assert rms_rel(got_q, exact_q) < 1.01 * floor
    cos, sin = table[pos].to(torch.bfloat16).unsqueeze(1).chunk(2, dim=-1)  # transformers' bf16 way
    q1, q2 = q.chunk(2, dim=-1)
    hf_q = torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)
    rounded_table_q, _ = TorchOps.rope(q.float(), k.float(), pos, table.to(torch.bfloat16).float())
    assert rms_rel(hf_q, exact_q) > 1.3 * floor
    assert rms_rel(rounded_table_q.to(torch.bfloat16), exact_q) > 1.15 * floor
