"""RoPE frequencies for every scaling type we run, computed once at load as a cos/sin table.

The table is what every RoPE consumer reads (`TorchOps.rope`, the fused Triton
`rope_kv_write`): row p = cos(p * inv_freq) | sin(p * inv_freq), each times the type's
attention factor, in fp32, [num_positions, head_dim]. The formulas follow Hugging Face
transformers' `modeling_rope_utils` step for step (same fp32 operations in the same order), so
the tables match theirs bit for bit on the same device:

    default  inv_freq = 1 / theta^(2i/d)
    linear   inv_freq / factor                         (position interpolation)
    llama3   low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1+)
    yarn     per-frequency blend of interpolation and extrapolation, cos/sin times
             attention_factor (0.1 * ln(factor) + 1 unless the config gives it)
    dynamic  NTK-aware: theta grows with the sequence length once it passes
             max_position_embeddings (see `dynamic_cache`)

`dynamic` and a paged engine. Transformers recomputes inv_freq in every forward pass from
seq_len = the largest position in that pass + 1 (never below max_position_embeddings). In
its single-sequence `generate`, a decode step at position p therefore uses seq_len = p + 1, and
every prompt token uses seq_len = the prompt length. Our K/V pages are shared between requests
(the prefix cache) and recomputed after preemption, so a token's rotated key must depend on its
position only: row p of our table uses seq_len = max(p + 1, max_position_embeddings). That is
exactly Transformers' rotation for every decode token and for prompts up to
max_position_embeddings; the one unavoidable difference is a prompt longer than
max_position_embeddings, whose tokens Transformers rotates all with the prompt length's theta
and we with each token's own position + 1 (a smaller theta for the earlier ones).
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# The keys each type reads (besides rope_type / rope_theta); a missing required key is an error.
REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_parameters(hf_config: dict) -> dict:
    """The config's RoPE scaling dict, normalised: `rope_type` set ("default" when absent), no
    `rope_theta`; raises ValueError for a type or a field we do not implement."""
    raw = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_type = raw.pop("rope_type", None) or raw.pop("type", None) or "default"
    raw.pop("type", None)
    raw.pop("rope_theta", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    partial = raw.pop("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"unsupported partial_rotary_factor {partial}: only full-width RoPE is implemented")
    if rope_type in ("yarn", "llama3") and "original_max_position_embeddings" not in raw:
        # Transformers falls back to max_position_embeddings for these types.
        raw["original_max_position_embeddings"] = hf_config.get("max_position_embeddings")
    missing = [k for k in REQUIRED_KEYS[rope_type] if raw.get(k) is None]
    if missing:
        raise ValueError(f"RoPE scaling {rope_type!r} lacks {', '.join(missing)}")
    return {"rope_type": rope_type, **raw}


def rope_theta(hf_config: dict) -> float:
    """theta from the top level (published configs) or inside rope_parameters (Transformers 5)."""
    inner = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    return float(hf_config.get("rope_theta") or inner.get("rope_theta") or 10000.0)


def context_length(scaling: dict, max_position_embeddings: int) -> int:
    """How many positions the scaled RoPE is meant for (vLLM's convention): linear and dynamic
    stretch max_position_embeddings by `factor`, yarn stretches its original context, llama3's
    max_position_embeddings already states the extended length."""
    rope_type = scaling["rope_type"]
    if rope_type in ("linear", "dynamic"):
        return int(max_position_embeddings * scaling["factor"])
    if rope_type == "yarn":
        factor = scaling.get("factor") or max_position_embeddings / scaling["original_max_position_embeddings"]
        return max(max_position_embeddings, int(scaling["original_max_position_embeddings"] * factor))
    return max_position_embeddings


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def linear_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    return default_inv_freq(head_dim, theta) / scaling["factor"]


def llama3_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, theta)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq_and_factor(head_dim: int, theta: float, scaling: dict,
                             max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    d, original = head_dim, scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (d * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as Transformers does: no zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the original frequency (extrapolate), 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_factor(head_dim: int, theta: float, scaling: dict,
                        max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """A static type's inverse frequencies [head_dim / 2] and cos/sin factor."""
    rope_type = scaling["rope_type"]
    if rope_type in ("default", "dynamic"):  # dynamic: the plain ones below max_position_embeddings
        return default_inv_freq(head_dim, theta), 1.0
    if rope_type == "linear":
        return linear_inv_freq(head_dim, theta, scaling), 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(head_dim, theta, scaling), 1.0
    return yarn_inv_freq_and_factor(head_dim, theta, scaling, max_position_embeddings)


def dynamic_cache(head_dim: int, theta: float, factor: float, max_position_embeddings: int,
                  num_positions: int) -> torch.Tensor:
    """Dynamic NTK table: row p uses Transformers' theta for seq_len = max(p + 1, max_pos)."""
    d, m = head_dim, max_position_embeddings
    positions = torch.arange(num_positions, dtype=torch.int64)
    seq_len = torch.maximum(positions + 1, torch.tensor(m))
    base = theta * ((factor * seq_len / m) - (factor - 1)) ** (d / (d - 2))  # [P] fp32
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    inv_freq = 1.0 / (base[:, None] ** exponents[None, :])  # [P, D/2]
    inv_freq[:m] = default_inv_freq(d, theta)  # below max_pos Transformers keeps the originals
    freqs = positions.float()[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def cos_sin_cache(head_dim: int, theta: float, scaling: dict, max_position_embeddings: int,
                  num_positions: int) -> torch.Tensor:
    """[num_positions, head_dim] fp32: cos | sin of each position's angles, times the factor."""
    if scaling["rope_type"] == "dynamic":
        return dynamic_cache(head_dim, theta, scaling["factor"], max_position_embeddings, num_positions)
    inv_freq, factor = inv_freq_and_factor(head_dim, theta, scaling, max_position_embeddings)
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.int64).float(), inv_freq)
    return torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1)
