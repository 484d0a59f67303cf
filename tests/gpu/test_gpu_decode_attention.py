"""The batched decode attention at the Qwen2.5-0.5B shape on the GPU, bf16 and fp8 pools, in
every load mode the sweep (`scripts/decode_attn_bench.py`) can put in the table, against the
fp32 reference: what the interpreter cannot check (bf16 dots, the pipelined code, sm_90 fp8)."""

import pytest
import torch

from flashlet.kernels import tuning
from flashlet.kernels.decode_attention import PREFETCH_MODES, decode_attention, decode_attention_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn
LENS = [2000, 1999, 17, 1, 0, 513, 1024, 31]  # ends mid-page, a page, a block; an empty row


def _case(kv: str, seed: int = 0, head_dim: int = 64, group: int = 7, kv_heads: int = 2):
    """Eight rows of LENS keys over a shuffled paged pool (16-token pages): the 0.5B's shape by
    default (2 KV heads of 64, 7 query heads each)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-n // 16) for n in LENS]
    num_pages = sum(pages) + 1
    shape = (num_pages, 16, kv_heads, head_dim)
    scale = 0.05 if kv == "fp8" else 1.0
    k, v = ((torch.randn(shape, device="cuda", generator=g) / scale).to(FP8 if kv == "fp8" else torch.bfloat16)
            for _ in range(2))
    indices = torch.randperm(num_pages, device="cuda", generator=g)[: sum(pages)].int()
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    q = torch.randn(len(LENS), kv_heads * group, head_dim, device="cuda", generator=g).bfloat16()
    return (q, k, v, indptr, indices, lens, head_dim**-0.5), dict(k_scale=scale, v_scale=scale)


@pytest.mark.parametrize("kv", ["model", "fp8"])
@pytest.mark.parametrize("prefetch", list(PREFETCH_MODES))
@pytest.mark.parametrize("block_n,warps,stages,splits", [(64, 4, 3, 2), (128, 4, 4, 1), (32, 1, 2, 8), (256, 8, 3, 4)])
@pytest.mark.parametrize("kv_pack", [1, 2])
def test_batched_decode_matches_the_reference(kv, prefetch, block_n, warps, stages, splits, kv_pack):
    """Every load mode, one or both KV heads a program (at half the keys a block, the same bytes:
    a 256-key block of both bf16 heads over 3 stages wants 268 KB of shared memory); an fp8
    pool with pages carried runs V's prmt widening (inline PTX: the interpreter runs the
    shift-and-mask form instead)."""
    block_n = max(16, block_n // kv_pack)
    args, scales = _case(kv)
    want = decode_attention_reference(*args, **scales).float()
    got = decode_attention(*args, num_splits=splits, min_split_tokens=128, block_n=block_n, num_warps=warps,
                           num_stages=stages, prefetch=prefetch, kv_heads_per_program=kv_pack, **scales).float()
    assert torch.equal(got[LENS.index(0)], torch.zeros_like(got[0]))
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 2e-2, err


def test_fp8_dots_in_fp16_agree_with_the_widening_path():
    """Both read the same stored values; fp16 keeps more of q's and P's bits than bf16 does."""
    args, scales = _case("fp8", seed=1)
    want = decode_attention_reference(*args, **scales).float()
    errs = [((decode_attention(*args, num_splits=2, fp8_as_fp16=f, **scales).float() - want).norm() / want.norm()).item()
            for f in (True, False)]
    assert errs[0] <= errs[1] * 1.2 and errs[0] < 1e-2, errs  # no worse (the bf16 output rounding is shared)


# The KV heads of the shape each BATCHED_DECODE_TABLE key was measured at, by (head_dim, group):
# Qwen2.5-0.5B's, Qwen3-0.6B's. A key at another shape must be added here.
MEASURED_KV_HEADS = {(64, 7): 2, (128, 2): 8}


@pytest.mark.parametrize("key,cfg", sorted(tuning.BATCHED_DECODE_TABLE.items()))
def test_every_table_entry_runs_and_matches_the_reference(key, cfg):
    """Each measured config, at the shape it was measured at (its key's head_dim and group: the
    0.5B's 2 KV heads of 64, Qwen3's 8 of 128), stays correct."""
    head_dim, group, kv, _ = key
    args, scales = _case(kv, seed=2, head_dim=head_dim, group=group, kv_heads=MEASURED_KV_HEADS[head_dim, group])
    want = decode_attention_reference(*args, **scales).float()
    got = decode_attention(*args, num_splits=cfg.num_splits or 2, min_split_tokens=cfg.min_split_tokens,
                           block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                           prefetch=cfg.prefetch, kv_heads_per_program=cfg.kv_pack,
                           merge_counts=torch.zeros(len(LENS) * 2, dtype=torch.int32, device="cuda")
                           if cfg.merge_in_kernel else None, **scales).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


@pytest.mark.parametrize("kv", ["model", "fp8"])
@pytest.mark.parametrize("kv_pack,splits", [(1, 2), (2, 4), (2, 8)])
def test_merge_in_kernel_matches_the_reference_in_a_replayed_graph(kv, kv_pack, splits):
    """Each group's last split program merges (acq_rel counter, partials read from L2): three
    replays of one captured launch match the reference and leave the counters at zero."""
    args, scales = _case(kv, seed=3)
    want = decode_attention_reference(*args, **scales).float()
    counts = torch.zeros(len(LENS) * 2, dtype=torch.int32, device="cuda")
    out = torch.empty_like(args[0])

    def launch():
        decode_attention(*args, out=out, num_splits=splits, min_split_tokens=128, block_n=128, num_warps=4,
                         num_stages=3, prefetch="pages", kv_heads_per_program=kv_pack, merge_counts=counts, **scales)

    launch()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not counts.any()
        assert ((out.float() - want).abs().max() / want.abs().max()).item() < 2e-2
