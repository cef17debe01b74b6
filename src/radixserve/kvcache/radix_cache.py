"""Radix tree over token ids mapping cached prefixes to KV page ids (DESIGN §4).

Edges are page-aligned: every node's key holds a whole number of pages of tokens, and its value
holds one page id per ``page_size`` tokens. Nodes are reference-counted while live requests use
them (``lock``/``unlock`` walk to the root) and unlocked leaves are evicted LRU-first through a
heap maintained on every state change, so an eviction never walks the tree (SGLang PR #20125).
Stale heap entries are skipped or re-pushed lazily when popped.

Algorithm after SGLang's ``RadixCache`` (Zheng et al., "SGLang: Efficient Execution of Structured
Language Model Programs", 2024), reimplemented with numpy keys.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import numpy as np


class RadixNode:
    """One edge of the tree: ``key`` tokens [len] int32 and their ``value`` pages [len/page]."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "id")

    _ids = itertools.count()

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: RadixNode | None) -> None:
        self.key = key
        self.value = value
        self.children: dict[object, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(RadixNode._ids)

    def __lt__(self, other: RadixNode) -> bool:  # heap tie-break
        return self.id < other.id


class RadixCache:
    """Prefix cache over a page pool.

    Args:
        page_size: tokens per page; keys are matched and stored in whole pages.
        free_pages: callback receiving int32 page ids the tree gives back (evictions).

    All token arguments are int32 numpy arrays of shape [n]; page arguments are int32 arrays of
    shape [n // page_size].
    """

    def __init__(self, page_size: int, free_pages: Callable[[np.ndarray], None]) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self.root = RadixNode(np.empty(0, np.int32), np.empty(0, np.int32), None)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, RadixNode]] = []
        self.evictable_pages = 0
        self.protected_pages = 0
        self.total_pages = 0

    # ------------------------------------------------------------------ helpers
    def _child_key(self, tokens: np.ndarray, pos: int) -> object:
        if self.page_size == 1:
            return int(tokens[pos])
        return tokens[pos:pos + self.page_size].tobytes()

    def _match_len(self, key: np.ndarray, tokens: np.ndarray, pos: int) -> int:
        """Tokens of ``key`` matching ``tokens[pos:]``, rounded down to whole pages."""
        n = min(len(key), len(tokens) - pos)
        diff = np.flatnonzero(key[:n] != tokens[pos:pos + n])
        m = int(diff[0]) if diff.size else n
        return m - m % self.page_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Split ``node`` after ``at`` tokens; returns the new upper node. ``node`` keeps the
        tail, so references held by requests stay on the deepest node."""
        pages_at = at // self.page_size
        upper = RadixNode(node.key[:at], node.value[:pages_at], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        parent = node.parent
        assert parent is not None
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[at:]
        node.value = node.value[pages_at:]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        t = next(self._clock)
        while node is not None:
            node.last_access = t
            node = node.parent  # type: ignore[assignment]

    def _push_if_evictable(self, node: RadixNode) -> None:
        if node is not self.root and node.lock_ref == 0 and not node.children:
            heapq.heappush(self._heap, (node.last_access, node))

    # ------------------------------------------------------------------ API
    def match_prefix(self, tokens: np.ndarray) -> tuple[np.ndarray, RadixNode]:
        """Longest cached page-aligned prefix of ``tokens``.

        Returns:
            (pages int32 [m // page_size], deepest matched node). Splits a node on a partial
            match so the returned node covers exactly the match. Marks the path recently used.
        """
        node, pos = self.root, 0
        parts: list[np.ndarray] = []
        while len(tokens) - pos >= self.page_size:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos)
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            parts.append(child.value)
            pos += m
            node = child
            if m < len(child.key):
                break
        self._touch(node)
        pages = np.concatenate(parts) if parts else np.empty(0, np.int32)
        return pages, node

    def peek_prefix_len(self, tokens: np.ndarray) -> int:
        """Tokens of the longest cached page-aligned prefix of ``tokens`` [n] int32, without
        changing the tree: no split, no LRU touch (for ordering a queue; ``match_prefix`` is
        for taking the prefix)."""
        node, pos = self.root, 0
        while len(tokens) - pos >= self.page_size:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: np.ndarray, pages: np.ndarray) -> int:
        """Insert a page-aligned ``tokens`` [n] with its ``pages`` [n // page_size].

        Returns:
            how many leading tokens were already in the tree; the caller's pages for that range
            are then duplicates (or the very pages it matched) and stay the caller's to free.
            Pages past that range now belong to the tree.
        """
        assert len(tokens) % self.page_size == 0 and len(pages) * self.page_size == len(tokens)
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                new = RadixNode(tokens[pos:].copy(), pages[pos // self.page_size:].copy(), node)
                node.children[self._child_key(tokens, pos)] = new
                n_new = len(new.value)
                self.total_pages += n_new
                self.evictable_pages += n_new
                self._touch(new)
                self._push_if_evictable(new)
                return pos
            m = self._match_len(child.key, tokens, pos)
            if m < len(child.key):
                child = self._split(child, m)
            pos += m
            node = child
        self._touch(node)
        return pos

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one reference per live request)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.value)
                self.protected_pages += len(node.value)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        """Drop one reference taken by ``lock``; nodes reaching zero become evictable."""
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked radix node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.value)
                self.protected_pages -= len(node.value)
                self._push_if_evictable(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, n_pages: int) -> int:
        """Free at least ``n_pages`` pages from unlocked leaves, least recently used first.

        Returns:
            pages actually freed (less than asked only when nothing more is evictable).
        """
        freed = 0
        while freed < n_pages and self._heap:
            t, node = heapq.heappop(self._heap)
            if node.parent is None or node.lock_ref > 0 or node.children:
                continue  # stale: evicted, locked again, or no longer a leaf
            if t != node.last_access:
                heapq.heappush(self._heap, (node.last_access, node))
                continue
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            self._free_pages(node.value)
            freed += len(node.value)
            self.total_pages -= len(node.value)
            self.evictable_pages -= len(node.value)
            self._push_if_evictable(parent)
        return freed

    # ------------------------------------------------------------------ checks
    def all_nodes(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check_integrity(self, live_nodes: list[RadixNode]) -> set[int]:
        """Assert the tree's invariants; returns the set of page ids the tree holds.

        Args:
            live_nodes: the node each live request has locked (one entry per lock).

        Raises:
            AssertionError: naming the broken invariant.
        """
        expected: dict[int, int] = {}
        for node in live_nodes:
            n = node
            while n is not self.root:
                assert n.parent is not None, "a live request holds an evicted radix node"
                expected[n.id] = expected.get(n.id, 0) + 1
                n = n.parent
        pages: set[int] = set()
        evictable = protected = 0
        in_heap = {id(node) for _, node in self._heap}
        for node in self.all_nodes():
            if node is self.root:
                continue
            assert len(node.key) == len(node.value) * self.page_size > 0, "key/value size"
            assert node.parent is not None
            assert node.parent.children.get(self._child_key(node.key, 0)) is node, "child key"
            assert node.lock_ref == expected.get(node.id, 0), (
                f"node lock_ref {node.lock_ref} != live requests under it "
                f"{expected.get(node.id, 0)}")
            for p in node.value.tolist():
                assert p not in pages, f"page {p} appears twice in the radix tree"
                pages.add(p)
            if node.lock_ref == 0:
                evictable += len(node.value)
                if not node.children:
                    assert id(node) in in_heap, "evictable leaf missing from the LRU heap"
            else:
                protected += len(node.value)
        assert evictable == self.evictable_pages, (
            f"evictable pages {self.evictable_pages} != tree {evictable}")
        assert protected == self.protected_pages, "protected pages bookkeeping"
        assert len(pages) == self.total_pages, "total pages bookkeeping"
        return pages
