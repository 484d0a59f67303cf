"""The fused decode path for one sequence: a few kernels a layer where the per-op path runs ten.

A pure-decode step with exactly one row runs, per layer,
    QKV GEMV with the RMSNorm folded in (+ bias)         one CuTe kernel (cute_gemv, norm=True)
    (Qwen3: + per-head q/k RMSNorm) RoPE + K/V write   the pool's fused kernel (write_rope), or
                                                         the QKV GEMV's epilogue (kv_pool given)
    decode attention                                     triton's one-launch split-KV (whatever
                                                         the step backend is)
    O GEMV + residual add, written in place              one CuTe kernel
    gate+up GEMV with the RMSNorm folded in + SiLU-mul   one CuTe kernel
    down GEMV + residual add, written in place           one CuTe kernel (K <= MAX_DOWN_K), else
                                                         one cuBLAS GEMM into the residual (addmm_)
and then the final RMSNorm + LM head (logits), or + argmax (the greedy token) in one kernel.
Six to seven kernels a layer where the per-op path runs about ten, and the GEMVs stream at
several times cuBLAS's bandwidth on these skinny shapes (FUSED_NOTES.md).

The residual stream lives in one buffer that the O and down GEMVs update in place, so no
separate add or norm kernel runs: where the per-op path keeps (x, residual) and adds them in
the next norm, here the residual epilogue adds, and the next GEMV's prologue normalises.
Rounding differs from the per-op path (products and the norm stay in fp32 until each GEMV's
output is rounded once), so logits agree to bf16 precision, not bit for bit.

With pdl=True every GEMV launches with Programmatic Dependent Launch: it starts while its
predecessor drains, loads its weights (and the norm's), then waits (`griddepcontrol.wait`)
before reading x or the residual and before any store. Only a CuTe GEMV that follows another
(O -> gate+up -> down -> next layer's QKV) overlaps; after a Triton kernel (RoPE + K/V write,
attention), which never signals early, it waits for that kernel's end as usual.

The GEMVs take the model's own weight tensors (fused QKV and gate|up already), no copies. The
step's buffers belong to this object and keep their addresses, so the CUDA graph the runner
captures around `logits` / `token` replays them. The CuTe DSL is imported when this object is
built; `CuteUnavailable` says how to install it.

With a kv_pool (`FusedParts.rope`) the QKV GEMV also applies RoPE to the q and k
heads and writes k and v into the pool (the `bias_rope_kv` / `rope_kv` epilogue: a lane group
owns both rows of a rotate-half pair), so the attention backend only attends
(`AttentionBackend.attend`): one kernel and one dependent boundary fewer a layer. The rounding
differs from the two-kernel path once more: q and k are rotated from the fp32 sums, not from
their bf16 rounding (FUSED_NOTES.md, "Stage 2, plan A").

With one_launch_attention (`FusedParts.attn`) attention is one kernel a layer
(`TritonBackend.attend_one_launch`: split-KV whose last split program merges) instead of a split
kernel and a merge kernel, from the step backend where it is triton, else from a triton backend
of the fused path's own over the same pool (the runner's `fused_attention`: FlashInfer, which
auto may pick for prefill, has no one-launch form); with pdl too it and the step's first kernel (the
embedding gather, `kernels/embedding.py`) take part in PDL, so the O GEMV after attention and
layer 0's QKV GEMV load their weights while their predecessors run (FUSED_NOTES.md, "Stage 2,
plan C"). Without pdl the embedding is `torch.index_select`, as before.

The runner builds this object where `EngineConfig.fused_decode` asks for it (True) or leaves it
to auto (None): then only where `auto_declines` finds nothing against it; each of pdl, the
RoPE epilogue and the one-launch attention is on where it applies (`FusedParts`: not a user
setting; tests and measurements name one variant through `Engine(..., fused_parts=)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashlet.attention.selection import Platform, fused_decline
from flashlet.kernels.cute_gemv import CuteGemv, CuteUnavailable, RopeKV, RopeShape, cute_available, VEC
from flashlet.models.quantization import is_quantized


# The longest down projection (K = intermediate_size) the one-row GEMV streams well: each output
# row is one lane group's walk over all of K, with no split-K, so a long K leaves most of the
# GPU idle (Qwen2.5-1.5B's 8,960 ran faster than per-op, Qwen2.5-7B's 18,944 ~12x slower:
# BENCHMARKS.md). Past it the fused step runs that one GEMV on cuBLAS (split-K), accumulating
# into the residual stream in place, and keeps the rest fused.
MAX_DOWN_K = 16_384


def check_fused_decode(model, device: torch.device, kv_pool=None) -> None:
    """Raise ValueError naming what the fused path cannot run (before anything compiles)."""
    why = refusals(model, device) + (rope_refusals(model, kv_pool) if kv_pool is not None else [])
    if why:
        raise ValueError("fused_decode cannot run this model: " + "; ".join(why))


def refusals(model, device: torch.device) -> list[str]:
    """What keeps the fused path from running this model on `device` (empty: nothing)."""
    cfg = model.config
    why = []
    if device.type != "cuda":
        why.append(f"it runs on CUDA only (device {device})")
    if model.tp is not None:
        why.append("it has no tensor parallelism (tensor_parallel_size must be 1)")
    if cfg.o_bias:
        why.append("the O projection has a bias (attention_bias on Llama / Qwen3)")
    dtype = model.embed_tokens.weight.dtype
    if dtype != torch.bfloat16:
        why.append(f"its kernels are bf16 only (dtype {dtype})")
    layer = model.layers[0]
    if is_quantized(model):
        why.append("its GEMVs stream bf16 weights, not fp8 ones (--quantization fp8 / an FP8 checkpoint)")
    for name, k in (("hidden_size", cfg.hidden_size), ("num_heads * head_dim", layer.q_size),
                    ("intermediate_size", layer.down_proj.weight.shape[1])):
        if k % VEC:
            why.append(f"{name} = {k} is not a multiple of {VEC} (16-byte loads)")
    return why


def rope_refusals(model, kv_pool) -> list[str]:
    """What keeps RoPE + the K/V write out of the QKV GEMV's epilogue (FusedParts.rope)."""
    layer, why = model.layers[0], []
    if hasattr(layer, "q_norm"):
        why.append("RoPE in the QKV epilogue: the q / k heads are normalised (Qwen3) between the QKV "
                   "projection and RoPE")
    if model.cos_sin_cache.shape[-1] != layer.head_dim or model.cos_sin_cache.dtype != torch.float32:
        why.append(f"RoPE in the QKV epilogue: the cos | sin table must be fp32 [positions, head_dim], got "
                   f"{model.cos_sin_cache.dtype} {tuple(model.cos_sin_cache.shape)}")
    if kv_pool.k_cache.dtype != torch.bfloat16 or kv_pool.head_dim != layer.head_dim:
        why.append(f"RoPE in the QKV epilogue: the pool must be bf16 with head_dim {layer.head_dim}")
    return why


def has_pdl(device: torch.device) -> bool:
    """Programmatic Dependent Launch: CUDA devices of compute capability 9.0 and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def auto_declines(model, device: torch.device, use_graphs: bool, kv_pool=None) -> str | None:
    """Why `fused_decode` left to auto stays off here (the first condition that fails), or None
    where it turns on. Auto asks for what the path was measured faster with (BENCHMARKS.md):
    the platform's conditions (`attention.selection.fused_decline`: PDL on sm_90+, bf16, one
    GPU, CUDA graphs), a shape the GEMVs serve, and the CuTe DSL. The attention backend is no
    condition: the path attends with its own triton kernel where the backend has none."""
    dtype = model.embed_tokens.weight.dtype
    why = fused_decline(Platform.of(device), dtype, model.tp is not None, use_graphs)
    if why is not None:
        return why
    if kv_pool is not None and kv_pool.is_fp8:
        # Forced on (fused_decode=True) it runs: the pool's own write quantizes and the
        # one-launch attention reads fp8, but RoPE + the K/V write leave the QKV epilogue,
        # which stores bf16 only.
        return ("the KV cache is fp8; its QKV epilogue stores bf16 K/V only, and the path "
                "was measured with a bf16 cache")
    why = refusals(model, device)
    if why:
        return "; ".join(why)
    ok, unavailable = cute_available()
    return None if ok else unavailable  # says how to install it


@dataclass(frozen=True)
class FusedParts:
    """The fused path's three parts; None = on where it applies (what the engine chooses).

    Each part measured faster wherever it works, so a user never sets them; they stay
    nameable for the tests that check one variant against another and for measurements."""

    pdl: bool | None = None   # kernels launch with Programmatic Dependent Launch (sm_90+)
    rope: bool | None = None  # RoPE + K/V write in the QKV GEMV's epilogue (not Qwen3's q/k norm)
    attn: bool | None = None  # one attention launch a layer (triton's, whatever the step backend)

    def named_on(self) -> list[str]:
        return [name for name in ("pdl", "rope", "attn") if getattr(self, name)]


class FusedDecode:
    """Owns the compiled GEMVs and the step buffers of the one-row decode path."""

    def __init__(self, model, device: torch.device, pdl: bool = False, kv_pool=None,
                 one_launch_attention: bool = False):
        """one_launch_attention: attention through the backend's `attend_one_launch` (the
        caller checks that the backend has it); with pdl, that kernel and the embedding gather
        launch with PDL too."""
        check_fused_decode(model, device, kv_pool)
        ok, why = cute_available()
        if not ok:
            raise CuteUnavailable(f"fused_decode needs the CuTe DSL: {why}")
        self.model = model
        cfg = model.config
        layer = model.layers[0]
        h, q, kv = cfg.hidden_size, layer.q_size, layer.kv_size
        inter = layer.down_proj.weight.shape[1]
        vocab = model.lm_head_weight.shape[0]
        eps = cfg.rms_norm_eps
        gemv = dict(device=device, pdl=pdl)
        self.pdl = pdl
        self.one_launch_attention = one_launch_attention
        self.kv_pool = kv_pool  # with a pool: RoPE + K/V write in the QKV epilogue
        self.rope = None
        if kv_pool is not None:
            self.rope = RopeShape(layer.head_dim, layer.num_heads, layer.num_kv_heads,
                                  model.cos_sin_cache.shape[0], kv_pool.k_cache[0].numel() // kv)
            self.qkv = CuteGemv(q + 2 * kv, h, "bias_rope_kv" if cfg.qkv_bias else "rope_kv", norm=True,
                                eps=eps, rope=self.rope, **gemv)
        else:
            self.qkv = CuteGemv(q + 2 * kv, h, "bias" if cfg.qkv_bias else "none", norm=True, eps=eps, **gemv)
        self.o = CuteGemv(h, q, "residual", **gemv)
        self.gate_up = CuteGemv(2 * inter, h, "silu_mul", norm=True, eps=eps, **gemv)
        # None: the down projection runs on cuBLAS (`_down`), see MAX_DOWN_K.
        self.down = CuteGemv(h, inter, "residual", **gemv) if inter <= MAX_DOWN_K else None
        self.lm_head = CuteGemv(vocab, h, "none", norm=True, eps=eps, **gemv)
        self.lm_argmax = CuteGemv(vocab, h, "argmax", norm=True, eps=eps, **gemv)
        empty = dict(dtype=model.embed_tokens.weight.dtype, device=device)  # bf16 (checked above)
        self.residual = torch.empty(1, h, **empty)  # the residual stream, updated in place
        self.qkv_out = torch.empty(1, q + 2 * kv, **empty)
        self.act = torch.empty(1, inter, **empty)    # silu(gate) * up
        self.logits_out = torch.empty(1, vocab, **empty)
        # The argmax writes an int32 token; the engine's tokens are int64. It writes into the low
        # word of an int64 slot whose high word stays 0 (ids are < 2^31, the host is
        # little-endian as CUDA's are): the token is int64 with no cast kernel after it.
        self.token_id = torch.zeros(1, dtype=torch.int64, device=device)
        self.token_out = self.token_id.view(torch.int32)[:1]
        self.split = [q, kv, kv]

    @property
    def parts(self) -> FusedParts:
        """What runs, every part resolved to True / False."""
        return FusedParts(pdl=self.pdl, rope=self.kv_pool is not None, attn=self.one_launch_attention)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions [1] -> the residual stream after the last layer [1, hidden]
        (K/V written through `attn`, planned for this step)."""
        m = self.model
        if self.pdl and self.one_launch_attention:  # layer 0's QKV loads its weights meanwhile
            from flashlet.kernels.embedding import gather_rows  # Triton: imported on CUDA only

            gather_rows(m.embed_tokens.weight, input_ids, self.residual, pdl=True)
        else:
            torch.index_select(m.embed_tokens.weight, 0, input_ids, out=self.residual)
        for i, layer in enumerate(m.layers):
            if self.rope is not None:
                o = self._qkv_rope_attend(i, layer, positions, attn)
            else:
                o = self._qkv_attend(i, layer, positions, attn)
            self.o(o.reshape(1, -1).contiguous(), layer.o_proj.weight, self.residual, out=self.residual)
            self.gate_up(self.residual, layer.gate_up_proj.weight, out=self.act,
                         norm_weight=layer.post_attn_norm)
            self._down(layer)
        return self.residual

    def _down(self, layer) -> None:
        """residual += act @ down^T, in place: the CuTe GEMV, or one cuBLAS GEMM whose beta = 1
        adds into the residual (rounded once, as the GEMV's residual epilogue is)."""
        if self.down is not None:
            self.down(self.act, layer.down_proj.weight, self.residual, out=self.residual)
        else:
            self.residual.addmm_(self.act, layer.down_proj.weight.t())

    def _qkv_attend(self, i: int, layer, positions: torch.Tensor, attn) -> torch.Tensor:
        """QKV GEMV, then the pool's RoPE + K/V write kernel and attention (two more kernels)."""
        m = self.model
        self.qkv(self.residual, layer.qkv_proj.weight, layer.qkv_proj.bias, out=self.qkv_out,
                 norm_weight=layer.input_norm)
        q, k, v = self.qkv_out.split(self.split, dim=-1)
        q = q.view(1, layer.num_heads, layer.head_dim)
        k = k.view(1, layer.num_kv_heads, layer.head_dim)
        v = v.view(1, layer.num_kv_heads, layer.head_dim)
        qk_norm = layer.qk_norm()  # Qwen3: in the RoPE + K/V write kernel
        if not self.one_launch_attention:
            return attn.run_rope(i, q, k, v, positions, m.cos_sin_cache, qk_norm)
        q = attn.kv_pool.write_rope(i, q, k, v, positions, m.cos_sin_cache, attn.meta.slot_mapping,
                                    qk_norm)
        return self._attend(i, q, attn)

    def _qkv_rope_attend(self, i: int, layer, positions: torch.Tensor, attn) -> torch.Tensor:
        """QKV GEMV with RoPE and the K/V write in its epilogue, then attention alone."""
        pool = self.kv_pool
        step = RopeKV(positions, self.model.cos_sin_cache, pool.k_cache[i], pool.v_cache[i],
                      attn.meta.slot_mapping)
        self.qkv(self.residual, layer.qkv_proj.weight, layer.qkv_proj.bias, out=self.qkv_out,
                 norm_weight=layer.input_norm, rope_kv=step)
        q = self.qkv_out[:, : self.split[0]].view(1, layer.num_heads, layer.head_dim)
        return self._attend(i, q, attn)

    def _attend(self, i: int, q: torch.Tensor, attn) -> torch.Tensor:
        """Attention over the pool, this step's K/V already written."""
        if self.one_launch_attention:
            return attn.attend_one_launch(i, q, pdl=self.pdl)
        return attn.attend(i, q)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """-> logits [1, vocab] fp32 (final RMSNorm folded into the LM head GEMV)."""
        x = self.hidden(input_ids, positions, attn)
        self.lm_head(x, self.model.lm_head_weight, out=self.logits_out, norm_weight=self.model.norm)
        return self.logits_out.float()

    def token(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """-> the greedy token [1] int64: final RMSNorm, LM head and argmax in one kernel."""
        x = self.hidden(input_ids, positions, attn)
        self.lm_argmax(x, self.model.lm_head_weight, out=self.token_out, norm_weight=self.model.norm)
        return self.token_id
