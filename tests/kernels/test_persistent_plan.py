"""Stage 3's plan (flashlet/kernels/persistent_plan.py) against a dense recompute of a tiny random
model: its queues run in random interleavings give the same token and hidden state, a queue
laid out against the global order deadlocks, a wait too weak reads stale buffers, and the timing
model's step is never under the bytes' floor."""

import dataclasses

import pytest
import torch

from flashlet.kernels import persistent_plan as pp
from flashlet.models.model import CausalLM, ModelConfig
from flashlet.models.ops import TorchOps
from flashlet.models.weights import preset_config_path


def tiny_config(qk_norm: bool) -> ModelConfig:
    return ModelConfig(model_type="qwen3" if qk_norm else "qwen2", vocab_size=96, hidden_size=64,
                       intermediate_size=80, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
                       tie_word_embeddings=not qk_norm, qkv_bias=not qk_norm, qk_norm=qk_norm)


def tiny_model(qk_norm: bool) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(tiny_config(qk_norm))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.shape[0] in (16, 64) else 0.0))
    return model


def dense_forward(model: CausalLM, ids: list[int]):
    """The slow obvious reference: every position recomputed with causal attention, fp32.
    Returns each layer's (keys, values) [Hkv, T, D] and the final normed hidden states [T, H]."""
    c = model.config
    t = torch.tensor(ids)
    pos = torch.arange(len(ids))
    x, residual = model.embed_tokens.weight[t].float(), None
    kv = []
    with torch.no_grad():
        for layer in model.layers:
            h, residual = TorchOps.add_rms_norm(x, residual, layer.input_norm.float(), c.rms_norm_eps)
            qkv = TorchOps.linear(h, layer.qkv_proj.weight.float(),
                                  None if layer.qkv_proj.bias is None else layer.qkv_proj.bias.float())
            q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                 c.num_kv_heads * c.head_dim], -1)
            q = q.view(-1, c.num_heads, c.head_dim)
            k = k.view(-1, c.num_kv_heads, c.head_dim)
            v = v.view(-1, c.num_kv_heads, c.head_dim)
            if layer.qk_norm() is not None:
                q, k = layer.qk_norm().apply(q, k)
            q, k = TorchOps.rope(q, k, pos, model.cos_sin_cache)
            kv.append((k.transpose(0, 1).clone(), v.transpose(0, 1).clone()))
            group = c.num_heads // c.num_kv_heads
            kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            s = torch.einsum("thd,shd->hts", q, kk) / c.head_dim ** 0.5
            s = s.masked_fill(torch.ones(len(ids), len(ids)).triu(1).bool(), float("-inf"))
            o = torch.einsum("hts,shd->thd", s.softmax(-1), vv).reshape(len(ids), -1)
            x = TorchOps.linear(o, layer.o_proj.weight.float())
            h, residual = TorchOps.add_rms_norm(x, residual, layer.post_attn_norm.float(), c.rms_norm_eps)
            x = TorchOps.linear(TorchOps.silu_and_mul(TorchOps.linear(h, layer.gate_up_proj.weight.float())),
                                layer.down_proj.weight.float())
        hidden, _ = TorchOps.add_rms_norm(x, residual, model.norm.float(), c.rms_norm_eps)
    return kv, hidden


def small_shape(cfg: ModelConfig, kv_len: int) -> pp.StepShape:
    # uneven tiles (the last one short) and splits that cut the context in three
    rows = {"qkv": 24, "o": 24, "gate_up": 24, "down": 24, "lm_head": 40}
    return pp.StepShape(cfg, kv_len, rows, split_tokens=4)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("seed", range(4))
def test_the_queues_decode_the_reference_step_in_any_interleaving(qk_norm, seed):
    model = tiny_model(qk_norm)
    ids = [5, 17, 42, 8, 77, 3, 61, 29, 11, 90]
    kv, hidden = dense_forward(model, ids)
    context = [(k[:, :-1].clone(), v[:, :-1].clone()) for k, v in kv]  # before the last token
    queues = pp.plan_step(small_shape(model.config, len(ids)), num_sms=5)
    token, got = pp.execute(model, ids[-1], context, queues, seed=seed)
    torch.testing.assert_close(got, hidden[-1], rtol=1e-4, atol=1e-4)
    assert token == int((model.lm_head_weight.float() @ hidden[-1]).argmax())


def test_every_wait_names_earlier_instructions_and_queues_keep_the_global_order():
    cfg = tiny_config(False)
    instrs = pp.stage_instructions(small_shape(cfg, 10))
    first_of = {}
    for ins in instrs:
        first_of.setdefault(ins.signal, ins.order)
        if ins.wait is not None:
            assert first_of[ins.wait] < ins.order
            assert ins.count == sum(1 for j in instrs if j.signal == ins.wait)
    for q in pp.plan_step(small_shape(cfg, 10), num_sms=7):
        assert [i.order for i in q] == sorted(i.order for i in q)
    assert instrs[-1].stage == "argmax"


def test_a_queue_against_the_global_order_deadlocks():
    cfg = tiny_config(False)
    queues = pp.plan_step(small_shape(cfg, 10), num_sms=3)
    queues[0] = queues[0][::-1]  # SM 0 would start with its argmax
    with pytest.raises(pp.Deadlock):
        list(pp.run_queues(queues))
    with pytest.raises(pp.Deadlock):
        pp.predict_step(queues, pp.H200, kv_bytes_per_key=128)


@pytest.mark.parametrize("stage", ["qkv", "attn", "o", "gate_up", "down", "lm_head"])
def test_a_wait_too_weak_reads_a_stale_buffer_in_some_interleaving(stage):
    # `stage` waiting for one tile of the stage before it, not all of them: some interleaving reads
    # a buffer that tile's siblings have not written yet (a previous layer's, or nothing)
    model = tiny_model(False)
    ids = [5, 17, 42, 8, 77, 3, 61, 29, 11, 90]
    kv, hidden = dense_forward(model, ids)
    context = [(k[:, :-1].clone(), v[:, :-1].clone()) for k, v in kv]
    queues = [[dataclasses.replace(i, count=1) if i.stage == stage else i for i in q]
              for q in pp.plan_step(small_shape(model.config, len(ids)), num_sms=5)]
    want = int((model.lm_head_weight.float() @ hidden[-1]).argmax())
    wrong = 0
    for seed in range(20):
        try:
            token, got = pp.execute(model, ids[-1], context, queues, seed=seed)
        except RuntimeError:  # a merge with no partial of a head yet
            wrong += 1
            continue
        wrong += token != want or not torch.allclose(got, hidden[-1], rtol=1e-4, atol=1e-4)
    assert wrong > 0


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b", "qwen2.5-1.5b"])
def test_the_timing_model_never_beats_the_bytes_and_counts_every_byte(preset):
    cfg = ModelConfig.from_file(preset_config_path(preset))
    shape = pp.default_shape(cfg, kv_len=1000, num_sms=132)
    queues = pp.plan_step(shape, 132)
    kv_bytes = 2 * cfg.head_dim * 2
    weights = sum(i.weight_bytes for q in queues for i in q)
    per_layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size + \
        cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    assert weights == 2 * (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size)
    got = pp.predict_step(queues, pp.H200, kv_bytes)
    assert got["floor_us"] == pytest.approx((weights + cfg.num_layers * cfg.num_kv_heads * 1000 * kv_bytes)
                                            / pp.H200.bandwidth * 1e6)
    assert got["step_us"] > got["floor_us"]
    # free waits and loads make the step the bytes alone (within the tiles' imbalance)
    free = dataclasses.replace(pp.H200, counter_us=0.0, load_us=0.0, tile_us=0.0, smem_bytes=1 << 40)
    assert pp.predict_step(queues, free, kv_bytes)["share"] > 0.9


def test_queues_cut_for_another_context_length_are_refused():
    model = tiny_model(False)
    ids = [5, 17, 42, 8]
    kv, _ = dense_forward(model, ids)
    context = [(k[:, :-1].clone(), v[:, :-1].clone()) for k, v in kv]
    queues = pp.plan_step(small_shape(model.config, 9), num_sms=3)
    with pytest.raises(ValueError, match="attend over 9 keys"):
        pp.execute(model, ids[-1], context, queues)
