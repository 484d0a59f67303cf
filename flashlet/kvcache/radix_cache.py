"""Radix prefix cache over KV pages.

A radix tree keyed by token ids at page granularity: each node holds a run of whole pages
(`len(key) == len(pages) * page_size`) and the K/V of those tokens, computed after exactly the
tokens on the path from the root. A request that starts with a cached prefix adopts those pages
instead of recomputing them.

Ownership: every page of the pool is in exactly one place: the allocator's free list, one tree
node, or one request's private tail. Requests that use tree pages hold a lock on their deepest
node; `lock_ref` counts the requests whose locked path passes through a node. Only unlocked
leaves are evicted, least recently used first.

Interface: `match_prefix`, `insert`, `extend_locked`, `lock` / `unlock`, `evict`,
`check_integrity`.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple, Sequence

from flashlet.kvcache.kv_pool import PageAllocator


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: "RadixNode | None"):
        self.key = key  # token ids, a whole number of pages
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class PageHolder(NamedTuple):
    """What one user of the pool holds, as `check_integrity` needs it (a request, seen by the
    scheduler): the node it locks, the tree pages on that path, and its private pages."""

    locked_node: RadixNode | None
    tree_pages: list[int]
    private_pages: list[int]
    name: str = ""


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.root = RadixNode([], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages held by the tree
        self._leaves: set[RadixNode] = set()  # childless nodes other than the root
        # (last_access, id, node) for eviction. Every unlocked leaf has an entry whose time is
        # at most its last_access; entries of nodes that changed since are checked out lazily.
        self._evictable: list[tuple[int, int, RadixNode]] = []
        self.hit_tokens = 0  # statistics for the engine's hit rate
        self.queried_tokens = 0
        self.num_evicted_pages = 0

    # ---- lookup and insertion -------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> tuple[list[int], RadixNode]:
        """Longest cached prefix of `tokens` in whole pages -> (its pages, the node it ends at)."""
        return self._walk(self.root, tokens)

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Add `tokens` (whole pages) with their `pages`; returns how many tokens were cached
        already. Pages past that point now belong to the tree; the caller still owns (and must
        free) its pages for the part that was already cached."""
        assert len(tokens) == len(pages) * self.page_size
        prefix_pages, node = self.match_prefix(tokens)
        done = len(prefix_pages) * self.page_size
        if done < len(tokens):
            self._push(self._attach(node, tokens[done:], pages[len(prefix_pages):]))
        return done

    def extend_locked(self, node: RadixNode, tokens: list[int],
                      pages: list[int]) -> tuple[RadixNode, list[int]]:
        """Hang `tokens` (whole pages) with their `pages` below `node`, the end of a path that
        one request holds locked, and move that request's lock to the path's new end: the fast
        path of a request whose latest pages just filled (no walk from the root). Returns that
        end and the path's pages below `node`. Where the tree already holds a first part of
        `tokens` below `node` (an earlier request cached the same continuation: the same prompt
        again), a node no other request holds takes the caller's pages and frees its own (the
        same tokens' K/V), so the caller's page table stays as it is: a running row's pages do
        not change under it, and its next step needs no new page indices. A node another
        request holds keeps its pages, and the caller frees its own that the returned ones
        replace."""
        path, end = self._walk(node, tokens, lock=True, adopt=pages)
        done = len(path) * self.page_size
        if done < len(tokens):
            end = self._attach(end, tokens[done:], pages[len(path):])
            end.lock_ref = 1  # the request's lock now ends here
            path += end.pages
        return end, path

    # ---- locks and eviction ---------------------------------------------------------------
    def lock(self, node: RadixNode | None) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0 and node in self._leaves:
                self._push(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, LRU first; returns pages freed."""
        heap, leaves = self._evictable, self._leaves
        freed = 0
        while freed < num_pages and heap:
            access, _, leaf = heapq.heappop(heap)
            if leaf.lock_ref or leaf not in leaves:
                continue  # locked, or no longer a leaf: back in the heap when it can go again
            if access != leaf.last_access:  # used since the entry was made: its real place
                heapq.heappush(heap, (leaf.last_access, id(leaf), leaf))
                continue
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.num_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[self._page_key(leaf.key, 0)]
            self._leaves.discard(leaf)
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.num_evicted_pages += freed
        return freed

    def _push(self, node: RadixNode) -> None:
        """An entry for `node`, which is (or may soon be) an unlocked leaf. Stale entries are
        dropped by rebuilding the heap once they outnumber the leaves."""
        heap = self._evictable
        if len(heap) > 2 * len(self._leaves) + 64:
            heap[:] = [(n.last_access, id(n), n) for n in self._leaves if n.lock_ref == 0]
            heapq.heapify(heap)
            if node.lock_ref or node not in self._leaves:
                return
        heapq.heappush(heap, (node.last_access, id(node), node))

    def reset(self) -> int:
        """Drop every unlocked page (to release memory); returns how many were freed."""
        return self.evict(self.num_pages)

    # ---- checks ---------------------------------------------------------------------------
    def check_integrity(self, holders: Sequence[PageHolder]) -> None:
        """Assert the ownership and lock invariants against everything the pool's live users
        hold (`holders`)."""
        tree_pages, expected_locks = [], {id(self.root): 1}
        for h in holders:
            path_pages, node = [], h.locked_node
            while node is not None:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                path_pages = node.pages + path_pages
                node = node.parent
            assert h.tree_pages == path_pages, (
                f"{h.name}: tree pages do not match its locked path")
        for node in self._nodes():
            assert len(node.key) == len(node.pages) * self.page_size, "node key/page mismatch"
            assert node.lock_ref == expected_locks.get(id(node), 0), (
                f"node lock_ref {node.lock_ref} != {expected_locks.get(id(node), 0)} requests"
            )
            for k, child in node.children.items():
                assert child.parent is node and self._page_key(child.key, 0) == k
                assert child.pages, "empty non-root node"
            tree_pages += node.pages
        assert len(tree_pages) == self.num_pages, "tree page count drifted"
        leaves = {n for n in self._nodes() if n is not self.root and not n.children}
        assert leaves == self._leaves, "the leaf set drifted from the tree"
        entered = {}
        for access, _, node in self._evictable:
            entered[id(node)] = min(access, entered.get(id(node), access))
        for leaf in leaves:
            if leaf.lock_ref == 0:
                assert entered.get(id(leaf), leaf.last_access + 1) <= leaf.last_access, (
                    "an unlocked leaf is missing from the eviction heap")
        private = [p for h in holders for p in h.private_pages]
        owned = tree_pages + private
        assert len(owned) == len(set(owned)), "a page is owned twice"
        free = self.allocator.free_pages()
        assert not free & set(owned), "an owned page is on the free list"
        assert len(free) + len(owned) == self.allocator.num_pages, (
            f"page leak: {self.allocator.num_pages - len(free) - len(owned)} pages owned by nobody"
        )

    # ---- helpers --------------------------------------------------------------------------
    def _walk(self, node: RadixNode, tokens: list[int], lock: bool = False,
              adopt: list[int] | None = None) -> tuple[list[int], RadixNode]:
        """Follow `tokens` down from `node` as far as the tree holds them in whole pages,
        splitting the last node where they part from it -> (the pages passed, the node reached).
        Every node on the way is touched (LRU); with `lock`, each below `node` also counts one
        more lock (a request's lock moving down from `node` to the node reached). adopt: pages
        holding `tokens`' K/V (a request's own): a node passed that no request holds (lock_ref 0,
        before this walk's lock) takes them in place of its own, which go back to the pool."""
        pages, i, now = [], 0, next(self._clock)
        node.last_access = now
        while i + self.page_size <= len(tokens):
            child = node.children.get(self._page_key(tokens, i))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            if n < len(child.pages):
                child = self._split(child, n)
            if adopt is not None and child.lock_ref == 0:
                self.allocator.free(child.pages)
                child.pages = adopt[len(pages) : len(pages) + len(child.pages)]
            if lock:
                child.lock_ref += 1
            child.last_access = now
            pages += child.pages
            i += len(child.key)
            node = child
        return pages, node

    def _page_key(self, tokens, start) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _common_pages(self, key: list[int], tokens: list[int], start: int) -> int:
        """How many whole pages of `key` equal `tokens[start:]`. Whole runs of pages are compared
        at once (list equality runs in C): the full run first, the usual case on a cached
        prompt; where it differs, a binary search for the last equal page. (A Python loop a page made
        every request on a long cached prompt pay for each of its pages, three walks a request.)"""
        ps = self.page_size
        n = min(len(key), len(tokens) - start) // ps
        if (key if n * ps == len(key) else key[: n * ps]) == tokens[start : start + n * ps]:
            return n  # (the whole key compared as it is: one copy fewer on a long prompt)
        equal, differs = 0, n  # the first `equal` pages match; the first `differs` do not all match
        while differs - equal > 1:
            mid = (equal + differs) // 2
            if key[equal * ps : mid * ps] == tokens[start + equal * ps : start + mid * ps]:
                equal = mid
            else:
                differs = mid
        return equal

    def _attach(self, parent: RadixNode, tokens: list[int], pages: list[int],
                key: tuple[int, ...] | None = None) -> RadixNode:
        """A new leaf below `parent` holding `tokens` (whole pages) and their `pages`; key: its
        first page's tokens, where the caller has them."""
        child = RadixNode(list(tokens), list(pages), parent)
        child.last_access = next(self._clock)
        parent.children[self._page_key(tokens, 0) if key is None else key] = child
        self._leaves.discard(parent)
        self._leaves.add(child)
        self.num_pages += len(child.pages)
        return child

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Split `node` after `num_pages` pages; returns the new upper node."""
        cut = num_pages * self.page_size
        upper = RadixNode(node.key[:cut], node.pages[:num_pages], node.parent)
        upper.lock_ref = node.lock_ref  # every lock through `node` passes through `upper`
        upper.last_access = node.last_access
        node.parent.children[self._page_key(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
