"""The radix prefix cache: matching, insertion, locks, LRU eviction, integrity."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from flashlet.kvcache.kv_pool import PageAllocator
from flashlet.kvcache.radix_cache import PageHolder, RadixCache, RadixNode

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


def test_extend_locked_moves_the_lock_and_takes_the_trees_pages_where_it_has_them():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, PS)
    first = alloc.allocate(1)
    cache.insert([1] * 4, first)
    pages, node = cache.match_prefix([1] * 4)
    cache.lock(node)
    user = holder(list(pages), node, 1)
    mine = alloc.allocate(1)
    child, path = cache.extend_locked(node, [2] * 4, mine)
    assert child.parent is node and path == mine
    user = holder(first + mine, child, 2)
    cache.check_integrity([user])  # lock counts: the path through `child` holds one lock
    assert cache.match_prefix([1] * 4 + [2] * 4)[0] == first + mine
    # A second request on the same first page extends by the same page and one more: the
    # first keeps the tree's page (its own is a duplicate to free), the second is hung below.
    cache.lock(node)
    other = alloc.allocate(2)
    end, path = cache.extend_locked(node, [2] * 4 + [3] * 4, other)
    assert path == mine + other[1:] and end.parent is child
    alloc.free(other[:1])
    second = holder(first + path, end, 3, rid=1)
    cache.check_integrity([user, second])
    cache.unlock(child)
    cache.check_integrity([second])
    assert cache.evict(10) == 0, "a locked path was evicted"
    cache.unlock(end)
    assert cache.evict(10) == 3
    cache.check_integrity([])


def three_pages_cached_and_the_first_locked():
    """A cache holding tokens 1 / 2 / 3 (a page each) and a request holding the first page
    locked -> (allocator, cache, [that page], [the other two], the first page's node)."""
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, PS)
    root_pages, tail = alloc.allocate(1), alloc.allocate(2)
    cache.insert([1] * 4 + [2] * 4 + [3] * 4, root_pages + tail)
    _, node = cache.match_prefix([1] * 4)  # splits after the first page
    cache.lock(node)
    return alloc, cache, root_pages, tail, node


def test_extend_locked_splits_a_node_it_shares_only_in_part():
    alloc, cache, root_pages, tail, node = three_pages_cached_and_the_first_locked()
    other_pages, other_node = cache.match_prefix([1] * 4 + [2] * 4)  # another request holds
    cache.lock(other_node)  # the shared page (split off its node)
    mine = alloc.allocate(2)
    end, path = cache.extend_locked(node, [2] * 4 + [9] * 4, mine)
    assert path == tail[:1] + mine[1:]  # the shared page is the tree's, the other is hung
    alloc.free(mine[:1])
    cache.check_integrity([holder(root_pages + path, end, 3), holder(other_pages, other_node, 2, 1)])
    assert cache.match_prefix([1] * 4 + [2] * 4 + [3] * 4)[0] == root_pages + tail
    cache.unlock(end)
    cache.unlock(other_node)
    cache.check_integrity([])


def test_extend_locked_gives_a_node_no_one_holds_the_callers_pages():
    """The same continuation again, with no other request on it (a repeated prompt decoding
    the tokens an earlier request cached): the tree takes the caller's pages and frees its own,
    so the caller's page table is unchanged; a part the tree does not hold is hung below."""
    alloc, cache, root_pages, tail, node = three_pages_cached_and_the_first_locked()
    mine = alloc.allocate(2)
    free_before = alloc.free_pages()
    end, path = cache.extend_locked(node, [2] * 4 + [9] * 4, mine)
    assert path == mine  # the caller keeps its pages: nothing of its own to free
    assert alloc.free_pages() - free_before == {tail[0]}  # the tree's copy went back
    cache.check_integrity([holder(root_pages + path, end, 3)])
    # the tree's other continuation still follows the shared page, now the caller's
    assert cache.match_prefix([1] * 4 + [2] * 4 + [3] * 4)[0] == root_pages + mine[:1] + tail[1:]
    cache.unlock(end)
    cache.check_integrity([])


def scan_evict_order(cache, num_pages):
    """The obvious eviction, for comparison: each time, of every unlocked leaf the one least
    recently used (ties by node id), its parent a candidate once childless. Runs on a copy;
    returns the pages it would free, in order."""
    import copy
    memo = {}
    twin = copy.deepcopy(cache, memo)
    original_id = {id(v): k for k, v in memo.items() if isinstance(v, RadixNode)}
    candidates = {n for n in twin._leaves if n.lock_ref == 0}
    freed = []
    while len(freed) < num_pages and candidates:
        leaf = min(candidates, key=lambda n: (n.last_access, original_id[id(n)]))
        candidates.discard(leaf)
        freed += leaf.pages
        parent = leaf.parent
        del parent.children[twin._page_key(leaf.key, 0)]
        if parent is not twin.root and not parent.children and parent.lock_ref == 0:
            candidates.add(parent)
    return freed


def test_eviction_matches_a_full_scan_through_random_use():
    """Requests come, grow page by page, finish (their pages cached), look up prefixes and
    evict, in any order: each eviction frees exactly what a scan over every leaf picks, and
    the ownership invariants hold after every step. (Seeded sequences rather than hypothesis:
    an order that only a lookup between two insertions and an eviction shows comes up in
    about one sequence in seventy, more often than hypothesis's short lists reach it.)"""
    rng = random.Random(0)
    for _ in range(1500):
        run_cache_ops([(rng.choice("aefmu"), rng.randrange(6), rng.randint(1, 6))
                       for _ in range(rng.randint(1, 60))])


def run_cache_ops(ops):
    """ops: (a = admit / e = extend / f = finish / m = match / u = evict, slot, pages)."""
    alloc = PageAllocator(64)
    cache = RadixCache(alloc, PS)
    live = {}  # slot -> [tokens, pages, node, tree page count]

    def tokens_of(slot, pages):  # prompts of one stream share their start; streams share a
        stream = slot % 4  # page; slots 4 and 5 run streams 0 and 1 again (live at once: the
        # same continuation extended by two requests, the second taking the tree's pages)
        return ([0] * PS + [stream] * PS + list(range(100 * stream, 100 * stream + PS * pages)))[: PS * pages]

    for op, slot, n in ops:
        if op == "a" and slot not in live:  # admit: adopt the cached prefix, own the rest
            tokens = tokens_of(slot, n)
            pages, node = cache.match_prefix(tokens)
            cache.lock(node)
            need = n - len(pages)
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            if alloc.num_free < need:
                cache.unlock(node)
                continue
            live[slot] = [tokens, list(pages) + alloc.allocate(need), node, len(pages)]
        elif op == "e" and slot in live:  # extend: a decode filled its pages; hang them below
            tokens, pages, node, n_tree = live[slot]
            if len(pages) > n_tree:
                mine = pages[n_tree:]
                child, tree = cache.extend_locked(node, tokens[n_tree * PS:], mine)
                alloc.free([p for p, q in zip(mine, tree) if p != q])  # the tree held these
                live[slot] = [tokens, pages[:n_tree] + tree, child, len(pages)]
        elif op == "f" and slot in live:  # finish: insert everything, free duplicates, unlock
            tokens, pages, node, n_tree = live.pop(slot)
            already = cache.insert(tokens, pages) // PS
            alloc.free(pages[n_tree:max(already, n_tree)])
            cache.unlock(node)
        elif op == "m":  # a lookup touches a path (LRU order changes)
            cache.match_prefix(tokens_of(slot, n))
        elif op == "u":
            want = scan_evict_order(cache, n)
            free_before = alloc.free_pages()
            assert cache.evict(n) == len(want)
            assert alloc.free_pages() - free_before == set(want)
        cache.check_integrity([holder(p, node, k, s) for s, (_, p, node, k) in live.items()])



@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(0, 3), max_size=60), st.integers(0, 60),
       st.lists(st.integers(0, 3), max_size=12), st.integers(0, 6))
def test_common_pages_matches_a_page_at_a_time(page_size, key, cut, tail, start):
    """`_common_pages` compares runs of pages at once (a binary search where they differ); a page
    at a time is the reference. `tokens` repeats key[:cut] after `start` others, then `tail`."""
    cache = RadixCache(PageAllocator(4), page_size)
    tokens = [9] * start + key[:cut] + tail
    n = 0
    while ((n + 1) * page_size <= len(key) and start + (n + 1) * page_size <= len(tokens)
           and key[n * page_size:(n + 1) * page_size] == tokens[start + n * page_size:start + (n + 1) * page_size]):
        n += 1
    assert cache._common_pages(key, tokens, start) == n
