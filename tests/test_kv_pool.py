"""The page allocator and the pool's NHD layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlet.kvcache.kv_pool import KVPool, OutOfPages, PageAllocator


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 64), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10),
                                                            st.randoms()), max_size=60))
def test_pages_never_double_allocate_and_all_return(num_pages, ops):
    alloc = PageAllocator(num_pages)
    held: list[int] = []
    for is_alloc, n, rnd in ops:
        if is_alloc:
            if n > alloc.num_free:
                with pytest.raises(OutOfPages):
                    alloc.allocate(n)
                continue
            got = alloc.allocate(n)
            assert not set(got) & set(held), "a held page was handed out again"
            held += got
        elif held:
            rnd.shuffle(held)
            k = min(n, len(held))
            alloc.free(held[:k])
            held = held[k:]
        assert alloc.num_free + len(held) == num_pages
        assert len(set(held)) == len(held)
    alloc.free(held)
    assert alloc.num_free == num_pages and alloc.free_pages() == set(range(num_pages))


def test_double_free_and_foreign_page_are_errors():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError, match="outside the pool"):
        alloc.free([7])


def test_write_lands_in_nhd_slots():
    pool = KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=3,
                  dtype=torch.float32, device="cpu")
    k = torch.randn(3, 2, 3)
    v = torch.randn(3, 2, 3)
    slots = torch.tensor([5, 6, 13])  # page 1 offsets 1-2, page 3 offset 1
    pool.write(1, k, v, slots)
    assert torch.equal(pool.k_cache[1, 1, 1], k[0]) and torch.equal(pool.k_cache[1, 1, 2], k[1])
    assert torch.equal(pool.v_cache[1, 3, 1], v[2])
    assert pool.k_cache[0].abs().sum() == 0, "another layer was written"


def test_page_size_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        KVPool(1, 4, 12, 1, 8, torch.float32, "cpu")
