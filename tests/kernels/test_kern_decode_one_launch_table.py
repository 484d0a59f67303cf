"""The one-launch decode's config: tuning.ONE_LAUNCH_TABLE's measured entry per (head_dim, group,
rows bucket), the derived config where it has none (today's behaviour, pinned here), and a
table entry's variant carried through `TritonBackend.attend_one_launch` to the kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashlet.attention import triton_backend
from flashlet.attention.triton_backend import TritonBackend
from flashlet.kernels import tuning
from flashlet.kernels.decode_attention import decode_attention_reference
from flashlet.kvcache.kv_pool import KVPool


def _pool(kh, *, pages=64, page_size=8, num_kv_heads=2, head_dim=16, seed=0):
    pool = KVPool(2, pages, page_size, num_kv_heads, head_dim, torch.float32, kh.device)
    g = torch.Generator().manual_seed(seed)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    return pool


def spy_one_launch(monkeypatch) -> list[dict]:
    """The keyword arguments of every `decode_attention_one_launch` the backend makes from now on."""
    seen = []
    real = triton_backend.decode_attention_one_launch

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention_one_launch", spy)
    return seen


def attend_and_check(kh, backend, pool, q, meta):
    """The planned step's `attend_one_launch` against the reference; every counter back at zero."""
    out = backend.attend_one_launch(1, q)
    want = decode_attention_reference(q, pool.k_cache[1], pool.v_cache[1], meta.paged_kv_indptr,
                                      meta.paged_kv_indices, meta.kv_lens, backend.scale)
    assert kh.rel_err(out, want) < 1e-5
    assert not backend._merge_counts.any()
    return out


@pytest.fixture
def empty_table(monkeypatch):
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {})


# (head_dim, Hq, Hkv) -> rows -> splits the derived rule gives on 132 SMs with long sequences allowed.
DERIVED = {
    (64, 14, 2): ({1: 64, 4: 64, 8: 32, 16: 16}, dict(block_n=256, num_warps=8, num_stages=2, waves=2)),
    (128, 16, 8): ({1: 64, 4: 32, 8: 16, 16: 8}, dict(block_n=32, num_warps=4, num_stages=3, waves=4)),
}


@pytest.mark.parametrize("shape", list(DERIVED))
def test_without_an_entry_the_derived_config_holds(kh, empty_table, shape):
    """Qwen2.5-0.5B's and Qwen3-0.6B's shapes: whole-split 256-key blocks on 8 warps at head_dim
    64, the decode config's blocks at 128; 256-token smallest splits; splits from the rows alone."""
    head_dim, hq, hkv = shape
    backend = TritonBackend(_pool(kh, num_kv_heads=hkv, head_dim=head_dim), hq, num_sms=132,
                            max_pages_per_seq=4096)
    splits, tile = DERIVED[shape]
    want = tuning.OneLaunchConfig(min_split_tokens=256, **tile)
    for rows, s in splits.items():
        assert backend.one_launch_config(rows) == (want, s)
        assert backend.one_launch_config(rows)[0] == backend.derived_one_launch_config(rows)


def test_an_entry_serves_its_rows_bucket_only(kh, monkeypatch):
    entry = tuning.OneLaunchConfig(block_n=64, num_warps=4, num_stages=3, min_split_tokens=128, num_splits=8,
                                   kv_pack=2, long_from_tokens=4096, long_split_tokens=64)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {(64, 7, 4): entry})
    backend = TritonBackend(_pool(kh, head_dim=64), 14, num_sms=132, max_pages_per_seq=4096)
    for rows in (2, 3, 4):  # bucket 4
        assert backend.one_launch_config(rows) == (entry, 8)
    for rows in (1, 5, 16, 17, 64):  # other buckets, and more rows than the last bucket: derived
        assert backend.one_launch_config(rows)[0] == backend.derived_one_launch_config(rows)
    assert tuning.one_launch_table_config(64, 7, 4) == entry
    assert tuning.one_launch_table_config(64, 7, 17) is None
    assert tuning.one_launch_table_config(128, 2, 4) is None
    # The scratch holds the entry's splits for every batch it serves.
    assert backend._mid_o.shape[0] >= 4 * 8


def test_an_entry_is_clamped_to_what_the_pool_can_use(kh, monkeypatch):
    """Splits past ceil(longest sequence / shortest split) are empty: the cap follows the long
    rule's shorter split; a measured cap is rounded down to a power of two; the entry's KV heads a
    program are lowered to divide the model's; the constructor's fixed block_n wins."""
    entry = tuning.OneLaunchConfig(block_n=32, num_warps=4, min_split_tokens=256, num_splits=48, kv_pack=4,
                                   long_from_tokens=512, long_split_tokens=32)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {(64, 7, 1): entry})
    pool = _pool(kh, head_dim=64)
    short = TritonBackend(pool, 14, num_sms=132, max_pages_per_seq=32)  # 256 tokens: at most 8 splits of 32
    cfg, splits = short.one_launch_config(1)
    assert (cfg.kv_pack, splits) == (2, 8)
    long = TritonBackend(pool, 14, num_sms=132, max_pages_per_seq=4096)
    assert long.one_launch_config(1)[1] == 32
    fixed = TritonBackend(pool, 14, num_sms=132, max_pages_per_seq=4096, decode_block_n=16)
    assert fixed.one_launch_config(1)[0] == dataclasses.replace(entry, kv_pack=2, block_n=16)
    waves = dataclasses.replace(entry, num_splits=None, waves=2)  # no measured cap: from the waves
    monkeypatch.setitem(tuning.ONE_LAUNCH_TABLE, (64, 7, 1), waves)
    assert long.one_launch_config(1)[1] == tuning.num_splits(1, 1, 132, 2, 64)


@pytest.mark.parametrize("prefetch_pages", [False, True])
def test_attend_one_launch_runs_the_entrys_variant(kh, monkeypatch, prefetch_pages):
    """An entry with both KV heads a program, the long-row rule, a one-partial merge and the
    page ids carried ahead or not reaches the kernel as given, and the step's output is the
    reference's (interpreter on the CPU)."""
    entry = tuning.OneLaunchConfig(block_n=16, num_warps=2, num_stages=1, min_split_tokens=64, num_splits=8,
                                   kv_pack=2, long_from_tokens=100, long_split_tokens=16, merge_splits=1,
                                   prefetch_pages=prefetch_pages)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {(16, 7, 4): entry})
    seen = spy_one_launch(monkeypatch)
    pool = _pool(kh)
    backend = TritonBackend(pool, 14, num_sms=4)
    meta, _ = kh.make_step(pool, [(120, 1), (30, 1), (65, 1)])
    backend.plan(meta)
    q = torch.randn(3, 14, 16, generator=torch.Generator().manual_seed(2)).to(kh.device)
    for layer in range(pool.num_layers):
        out = backend.attend_one_launch(layer, q)
        want = decode_attention_reference(q, pool.k_cache[layer], pool.v_cache[layer], meta.paged_kv_indptr,
                                          meta.paged_kv_indices, meta.kv_lens, backend.scale)
        assert kh.rel_err(out, want) < 1e-5
        assert not backend._merge_counts.any()
    got = seen[-1]
    assert (got["kv_heads_per_program"], got["long_from_tokens"], got["long_split_tokens"], got["merge_splits"],
            got["num_splits"], got["block_n"], got["prefetch_pages"]) == (2, 100, 16, 1, 8, 16, prefetch_pages)


def test_a_long_context_entry_serves_long_steps_in_a_graph_of_their_own(kh, monkeypatch):
    """ONE_LAUNCH_LONG_TABLE's entry serves the one-launch steps whose longest row holds more than
    ONE_LAUNCH_LONG_CONTEXT tokens: they are keyed "long" (a graph of their own), the kernel gets
    the long entry's variant, and the output is still the reference's; shorter steps, steps of
    another rows bucket and steps that attend in two launches keep what they had."""
    short_entry = tuning.OneLaunchConfig(block_n=16, num_warps=2, num_stages=1, min_split_tokens=64, num_splits=4)
    long_entry = tuning.OneLaunchConfig(block_n=16, num_warps=2, num_stages=2, min_split_tokens=32, num_splits=8,
                                        prefetch_pages=True)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_TABLE", {(16, 7, 1): short_entry})
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {(16, 7, 1): long_entry})
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_CONTEXT", 200)
    seen = spy_one_launch(monkeypatch)
    pool = _pool(kh, pages=96)
    backend = TritonBackend(pool, 14, num_sms=4)
    assert backend.decode_warm_contexts(1) == (0,)  # two launches: no long entry applies
    backend.fused_rows = 16  # the fused path's attention: its steps attend in one launch
    assert backend.decode_warm_contexts(1) == (0, 200) and backend.decode_warm_contexts(2) == (0,)
    assert backend._mid_o.shape[0] >= 8  # the scratch holds the long entry's splits
    q = torch.randn(1, 14, 16, generator=torch.Generator().manual_seed(3)).to(kh.device)
    for kv_len, key, block in ((200, (), (16, 1, 4)), (201, ("long",), (16, 2, 8)), (600, ("long",), (16, 2, 8))):
        meta, pages = kh.make_step(pool, [(kv_len, 1)])
        backend.plan(meta)
        assert backend.graph_key(meta) == key
        out = backend.attend_one_launch(1, q)
        got = seen[-1]
        assert (got["block_n"], got["num_stages"], got["num_splits"]) == block
        assert got["prefetch_pages"] == (key == ("long",))
        want = decode_attention_reference(q, pool.k_cache[1], pool.v_cache[1], meta.paged_kv_indptr,
                                          meta.paged_kv_indices, meta.kv_lens, backend.scale)
        assert kh.rel_err(out, want) < 1e-5
        pool.allocator.free(pages[0])
    meta, pages = kh.make_step(pool, [(300, 1), (20, 1)])  # rows bucket 4: no long entry
    backend.plan(meta)
    assert backend.graph_key(meta) == ()
    pool.allocator.free(pages[0] + pages[1])
    backend.fused_rows = 0
    meta, pages = kh.make_step(pool, [(300, 1)])  # the per-op path's two launches
    backend.plan(meta)
    assert backend.graph_key(meta) == ()


def test_a_long_entry_that_merges_in_two_levels_sizes_its_counters(kh, monkeypatch):
    """A long entry with merge_group: the backend's merge counters hold the groups' too (sized at
    construction for every rows count), the kernel gets the group, the output is the reference's
    and every counter is back at zero after each step."""
    from flashlet.kernels.decode_attention import one_launch_counters

    long_entry = tuning.OneLaunchConfig(block_n=16, num_warps=2, num_stages=2, min_split_tokens=32, num_splits=8,
                                        merge_group=2)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {(16, 7, 1): long_entry})
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_CONTEXT", 200)
    seen = spy_one_launch(monkeypatch)
    pool = _pool(kh, pages=96)
    backend = TritonBackend(pool, 14, num_sms=4)
    backend.fused_rows = 16
    assert backend._merge_counts.numel() >= one_launch_counters(1, 2, 8, 2)
    q = torch.randn(1, 14, 16, generator=torch.Generator().manual_seed(4)).to(kh.device)
    for kv_len in (201, 250, 600):  # 7, 8 and 8 splits of 32 or more: ragged and full groups
        meta, pages = kh.make_step(pool, [(kv_len, 1)])
        backend.plan(meta)
        attend_and_check(kh, backend, pool, q, meta)
        assert (seen[-1]["merge_group"], seen[-1]["num_splits"]) == (2, 8)
        pool.allocator.free(pages[0])


def test_a_measured_entry_may_split_past_the_default_cap(kh, monkeypatch):
    """A table entry's num_splits of 128 passes the backend's default cap of 64 (up to
    tuning.MEASURED_SPLIT_CAP; the scratch sized for it, the output the reference's); the derived
    config and a backend given max_kv_splits keep their cap; a short pool still bounds it."""
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_CONTEXT", 200)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {(16, 7, 1): tuning.OneLaunchConfig(
        block_n=16, num_warps=1, num_stages=2, min_split_tokens=16, num_splits=128, merge_group=8)})
    pool = _pool(kh, pages=300)
    backend = TritonBackend(pool, 14, num_sms=132)
    backend.fused_rows = 16
    assert backend.one_launch_config(1, long=True)[1] == 128
    derived = TritonBackend(_pool(kh, pages=2100), 14, num_sms=132)  # 16,800 tokens: 65 splits of 256
    assert derived.one_launch_config(1, table=False)[1] == triton_backend.DEFAULT_SPLIT_CAP
    assert backend._mid_o.shape[0] >= 128
    assert TritonBackend(pool, 14, num_sms=132, max_kv_splits=64).one_launch_config(1, long=True)[1] == 64
    assert TritonBackend(pool, 14, num_sms=132, max_pages_per_seq=100).one_launch_config(1, long=True)[1] == 32
    q = torch.randn(1, 14, 16, generator=torch.Generator().manual_seed(6)).to(kh.device)
    meta, pages = kh.make_step(pool, [(2100, 1)])  # 2,100 tokens at 16 a split: 128 splits, 16 groups
    backend.plan(meta)
    attend_and_check(kh, backend, pool, q, meta)
    pool.allocator.free(pages[0])


@pytest.mark.parametrize("rope", [False, True], ids=["rows-written", "rope-in"])
def test_long_steps_in_two_launches_give_the_one_launch_output(kh, monkeypatch, rope):
    """$FLASHLET_LONG_DECODE=two-launch: long one-launch steps (keyed "long" with no table entry)
    attend through the two-launch decode; with `rope_in` the pool's RoPE + K/V write makes this
    step's rows first. Output and pool as the one-launch form leaves them (interpreter)."""
    from flashlet.kernels.decode_attention import RopeIn

    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_CONTEXT", 200)
    monkeypatch.setattr(tuning, "ONE_LAUNCH_LONG_TABLE", {})
    seen = spy_one_launch(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 14, 16, generator=g).to(kh.device)
    k_new, v_new = (torch.randn(2, 2, 16, generator=g).to(kh.device) for _ in range(2))
    cos_sin = kh.cos_sin_cache(1024, 16)
    outs, pools = [], []
    for form in ("table", "two-launch", "table-entry"):
        monkeypatch.setenv(triton_backend.LONG_DECODE_ENV, "table" if form == "table-entry" else form)
        if form == "table-entry":  # the same through the table's TWO_LAUNCH entry
            monkeypatch.setitem(tuning.ONE_LAUNCH_LONG_TABLE, (16, 7, 4), tuning.TWO_LAUNCH)
        pool = _pool(kh, pages=96)
        backend = TritonBackend(pool, 14, num_sms=4)
        backend.fused_rows = 16
        meta, _ = kh.make_step(pool, [(300, 1), (40, 1)])
        backend.plan(meta)
        assert backend.graph_key(meta) == (() if form == "table" else ("long",))
        rope_in = RopeIn(k_new, v_new, meta.positions, cos_sin) if rope else None
        if not rope:
            pool.write(1, k_new, v_new, meta.slot_mapping)
        calls = len(seen)
        outs.append(backend.attend_one_launch(1, q, rope_in=rope_in))
        assert (len(seen) > calls) == (form == "table")
        pools.append(pool)
    for i in (1, 2):
        assert kh.rel_err(outs[i], outs[0]) < 1e-5
        for cache in ("k_cache", "v_cache"):
            assert kh.rel_err(getattr(pools[i], cache), getattr(pools[0], cache)) < 1e-6
    assert backend._mid_o.shape[0] >= backend._splits_for(1)  # the scratch sized without a one-launch entry
    # =one-launch ignores the TWO_LAUNCH entry: one graph, one launch, as before it.
    monkeypatch.setenv(triton_backend.LONG_DECODE_ENV, "one-launch")
    backend = TritonBackend(pools[2], 14, num_sms=4)
    backend.fused_rows = 16
    backend.plan(meta)
    assert backend.graph_key(meta) == () and backend.decode_warm_contexts(2) == (0,)
    monkeypatch.setenv(triton_backend.LONG_DECODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="FLASHLET_LONG_DECODE"):
        TritonBackend(_pool(kh), 14, num_sms=4)
