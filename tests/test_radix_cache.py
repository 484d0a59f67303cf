"""The radix prefix cache: matching, insertion, locks, LRU eviction, integrity."""

from flashlet.kvcache.kv_pool import PageAllocator
from flashlet.kvcache.radix_cache import PageHolder, RadixCache

PS = 4


def holder(pages, node, n_tree, rid=0):
    return PageHolder(node, pages[:n_tree], pages[n_tree:], f"holder {rid}")


def test_match_returns_longest_whole_page_prefix():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, PS)
    tokens = list(range(12))
    pages = alloc.allocate(3)
    assert cache.insert(tokens, pages) == 0
    got, node = cache.match_prefix(list(range(10)) + [99, 98])
    assert got == pages[:2]  # 8 tokens match in whole pages; the node was split there
    got, _ = cache.match_prefix(tokens + [1, 2, 3, 4])
    assert got == pages
    cache.check_integrity([])


def test_insert_reports_what_was_cached_and_keeps_tree_pages():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, PS)
    first = alloc.allocate(2)
    cache.insert(list(range(8)), first)
    second = alloc.allocate(3)
    already = cache.insert(list(range(8)) + [50, 51, 52, 53], second)
    assert already == 8
    got, _ = cache.match_prefix(list(range(8)) + [50, 51, 52, 53])
    assert got == first + second[2:]
    alloc.free(second[:2])  # the caller frees its duplicates
    cache.check_integrity([])


def test_locked_pages_are_not_evicted_and_lru_goes_first():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, PS)
    a, b = alloc.allocate(2), alloc.allocate(2)
    cache.insert([1] * 8, a)
    cache.insert([2] * 8, b)
    pages, node = cache.match_prefix([2] * 8)  # touches b: a is least recently used
    cache.lock(node)
    user = holder(list(pages), node, 2)
    assert cache.evict(1) == 2  # a leaf holds 2 pages
    assert alloc.num_free == 4 + 2
    assert cache.match_prefix([1] * 8)[0] == []
    assert cache.evict(10) == 0, "locked pages were evicted"
    cache.check_integrity([user])
    cache.unlock(node)
    assert cache.evict(10) == 2
    cache.check_integrity([])
    assert alloc.num_free == 8


def test_split_keeps_lock_counts():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, PS)
    pages = alloc.allocate(3)
    cache.insert(list(range(12)), pages)
    _, node = cache.match_prefix(list(range(12)))
    cache.lock(node)
    user = holder(list(pages), node, 3)
    cache.match_prefix(list(range(4)) + [7] * 4)  # splits the locked node after one page
    cache.check_integrity([user])
    assert cache.evict(8) == 0


def test_integrity_catches_a_leaked_page():
    alloc = PageAllocator(4)
    cache = RadixCache(alloc, PS)
    alloc.allocate(1)  # owned by nobody
    try:
        cache.check_integrity([])
    except AssertionError as e:
        assert "leak" in str(e)
    else:
        raise AssertionError("a leaked page went unnoticed")


def test_extend_locked_moves_the_lock_and_refuses_an_existing_child():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, PS)
    first = alloc.allocate(1)
    cache.insert([1] * 4, first)
    pages, node = cache.match_prefix([1] * 4)
    cache.lock(node)
    user = holder(list(pages), node, 1)
    mine = alloc.allocate(1)
    child = cache.extend_locked(node, [2] * 4, mine)
    assert child is not None and child.parent is node
    user = holder(first + mine, child, 2)
    cache.check_integrity([user])  # lock counts: the path through `child` holds one lock
    assert cache.match_prefix([1] * 4 + [2] * 4)[0] == first + mine
    other = alloc.allocate(1)
    assert cache.extend_locked(node, [2] * 4, other) is None, "a duplicate child was hung"
    alloc.free(other)
    cache.check_integrity([user])
    cache.unlock(child)
    assert cache.evict(10) == 2
    cache.check_integrity([])
