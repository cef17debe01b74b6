"""KV page ownership for the scheduler: the page pool plus the radix (or naive) prefix cache.

A live request's page table is ``[prefix pages matched in the tree] + [pages it owns]``. Its
matched prefix is locked in the tree; pages it owns are in neither the tree nor the free list.
When the request finishes or is preempted its computed full pages are inserted into the tree
(the tree takes the ones it did not have; duplicates and the partial last page are freed) and
its lock is dropped. Pages a live request reads are therefore always locked or owned, never
free, even when an identical prefix was prefilled twice in one step and one copy finishes early
(the mini-sglang #142 bug).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixserve.kvcache.page_pool import PagePool
from radixserve.kvcache.radix_cache import RadixCache, RadixNode


@dataclass
class HeldPages:
    """Pages kept after their request finished, until a KV transfer no longer needs them (a
    prefill instance's lease, or a decode instance's aborted load still writing them).

    They count as a live request in ``check_integrity``: ``pages[:num_matched]`` are locked in
    the radix tree through ``node`` (so they also serve local prefix hits), the rest are owned.

    Attributes:
        pages: int32 [k] page ids, in prompt order.
        node: the tree node holding the lock, or None.
        num_matched: leading pages that are tree pages.
    """

    pages: np.ndarray
    node: RadixNode | None
    num_matched: int


class KVCacheManager:
    """Allocation, prefix matching and release of KV pages.

    Args:
        num_pages: pages in the pool including the null page 0.
        page_size: tokens per page.
        enable_prefix_caching: radix cache if True; otherwise every page is freed on release.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.tree: RadixCache | None = (
            RadixCache(page_size, self.pool.free) if enable_prefix_caching else None)

    # ------------------------------------------------------------------ sizes
    @property
    def num_usable_pages(self) -> int:
        return self.pool.num_usable

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_pages(self) -> int:
        """Pages held by the radix tree (locked or not)."""
        return self.tree.total_pages if self.tree else 0

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no request holds: eviction could free them now."""
        return self.tree.evictable_pages if self.tree else 0

    @property
    def num_available_pages(self) -> int:
        """Free pages plus pages that eviction could free now."""
        return self.pool.num_free + (self.tree.evictable_pages if self.tree else 0)

    # ------------------------------------------------------------------ ops
    def match(self, tokens: np.ndarray) -> tuple[np.ndarray, RadixNode | None]:
        """Cached prefix pages for ``tokens`` [n] int32, locked for the caller.

        The match is capped below ``n`` so at least one token is left to compute (its logits
        pick the next token). Returns (pages int32 [k], node to pass to ``release``).
        """
        if self.tree is None or len(tokens) <= self.page_size:
            return np.empty(0, np.int32), None
        limit = (len(tokens) - 1) // self.page_size * self.page_size
        pages, node = self.tree.match_prefix(tokens[:limit])
        self.tree.lock(node)
        return pages, node

    def allocate(self, n: int, after: int = 0, room: int = 0) -> np.ndarray | None:
        """``n`` pages as int32 [n], evicting unlocked cached pages if needed; None if short.
        ``after`` (the caller's last page, 0: none) and ``room`` (pages it expects to need) as
        in ``PagePool.alloc``: they place the pages, never change how many."""
        self._make_free(n)
        return self.pool.alloc(n, after, room)

    def allocate_after(self, lasts: np.ndarray, rooms: np.ndarray) -> np.ndarray | None:
        """One page per caller (``PagePool.alloc_after``), evicting if needed; None if short."""
        self._make_free(len(lasts))
        return self.pool.alloc_after(lasts, rooms)

    def free_owned(self, pages: np.ndarray) -> None:
        """Give pages a live request owns (none in the tree) back to the free list: the
        pages a speculative verify step took for drafts that were rejected."""
        if len(pages):
            self.pool.free(pages)

    def _make_free(self, n: int) -> None:
        if n > self.pool.num_free and self.tree is not None:
            self.tree.evict(n - self.pool.num_free)

    def evict_all(self) -> int:
        """Free every cached page no live request holds (``FlushCache``, ``POST /flush_cache``).

        Locked prefixes (a live request's matched pages) stay; the pages freed go back to the
        free list. Returns the number of pages freed (0 with the naive cache).
        """
        if self.tree is None:
            return 0
        return self.tree.evict(self.tree.evictable_pages)

    def cache_prefix(self, tokens: np.ndarray, pages: np.ndarray, num_matched: int,
                     node: RadixNode | None, num_tokens: int
                     ) -> tuple[np.ndarray, RadixNode] | None:
        """Share a live request's computed prompt pages through the tree (SGLang caches each
        prefill chunk the same way), so requests arriving while it runs reuse them.

        Args:
            tokens: the request's tokens, int32 [>= num_tokens].
            pages: its page table, int32 [k]; ``pages[:num_matched]`` is its locked prefix.
            node: the node it holds locked (None: nothing matched yet).
            num_tokens: leading tokens whose KV is written; whole pages of them are inserted.

        Returns:
            None if nothing new, else (tree pages int32 [n] for the first n pages, the new
            node to hold locked). The caller swaps those into its page table: pages another
            request inserted first replace its own copies, which are freed here; its own
            pages past them now belong to the tree. The old lock is dropped.
        """
        if self.tree is None:
            return None
        n_full = min(num_tokens // self.page_size, len(pages))
        if n_full <= num_matched:
            return None
        n_tok = n_full * self.page_size
        already = self.tree.insert(tokens[:n_tok], pages[:n_full])
        tree_pages, new_node = self.tree.match_prefix(tokens[:n_tok])
        assert len(tree_pages) == n_full
        self.tree.lock(new_node)
        if node is not None:
            self.tree.unlock(node)
        dup = pages[num_matched:already // self.page_size]
        if len(dup):
            self.pool.free(dup)
        return tree_pages, new_node

    def release(self, tokens: np.ndarray, pages: np.ndarray, num_computed: int,
                node: RadixNode | None) -> None:
        """Give back a finished or preempted request's pages.

        Args:
            tokens: the request's tokens, int32 [>= num_computed].
            pages: its page table, int32 [num pages it holds], matched prefix first.
            num_computed: tokens whose KV is written (only these may enter the tree).
            node: the node ``match`` locked, or None.
        """
        if self.tree is None:
            if len(pages):
                self.pool.free(pages)
            return
        n_full = min(num_computed // self.page_size, len(pages))
        n_tok = n_full * self.page_size
        if n_full:
            already = self.tree.insert(tokens[:n_tok], pages[:n_full])
            n_matched = 0 if node is None else _depth_pages(node, self.tree.root)
            dup = pages[n_matched:already // self.page_size]
            if len(dup):
                self.pool.free(dup)
        if len(pages) > n_full:
            self.pool.free(pages[n_full:])
        if node is not None:
            self.tree.unlock(node)

    def hold(self, tokens: np.ndarray, pages: np.ndarray, num_computed: int,
             node: RadixNode | None, num_matched: int, cache: bool = True) -> HeldPages:
        """Keep a finished request's pages instead of releasing them.

        Args:
            tokens: the request's tokens, int32 [>= num_computed].
            pages: its page table, int32 [k]; ``pages[:num_matched]`` its locked prefix.
            num_computed: tokens whose KV is written.
            node: the node it holds locked (None: nothing matched).
            cache: True: its computed full pages enter the tree (locked by the hold: other
                requests hit them) and pages past the computed tokens are freed; the partial
                last page stays owned. False: every page is kept as it is (their contents are
                still being written: an aborted load).

        Returns:
            the hold; give it back with ``release_held``.
        """
        pages = np.asarray(pages, dtype=np.int32).copy()
        if not cache:
            return HeldPages(pages, node, num_matched)
        n_pages = min(-(-num_computed // self.page_size), len(pages))
        if len(pages) > n_pages:
            self.pool.free(pages[n_pages:])
            pages = pages[:n_pages]
        res = self.cache_prefix(tokens, pages, num_matched, node, num_computed)
        if res is not None:
            tree_pages, node = res
            pages[:len(tree_pages)] = tree_pages
            num_matched = len(tree_pages)
        return HeldPages(pages, node, num_matched)

    def release_held(self, held: HeldPages) -> None:
        """End a hold: the tree lock is dropped (its pages stay cached), owned pages freed."""
        owned = held.pages[held.num_matched:]
        if len(owned):
            self.pool.free(owned)
        if held.node is not None and self.tree is not None:
            self.tree.unlock(held.node)

    def check_integrity(self, live: list[tuple[np.ndarray, RadixNode | None, int]]) -> None:
        """Assert DESIGN §4's invariants.

        Args:
            live: per live request (page table int32 [k], locked node or None, matched pages).

        Raises:
            AssertionError: naming the broken invariant.
        """
        free = self.pool.free_set()
        assert len(free) == self.pool.num_free, "duplicate ids on the free list"
        tree_pages = self.tree.check_integrity(
            [n for _, n, _ in live if n is not None]) if self.tree else set()
        assert not (free & tree_pages), f"pages both free and cached: {free & tree_pages}"
        owned: set[int] = set()
        for pages, node, n_matched in live:
            prefix = pages[:n_matched].tolist()
            if node is not None and self.tree is not None:
                assert prefix == _path_pages(node, self.tree.root).tolist(), (
                    "matched prefix pages differ from the locked tree path")
            for p in prefix:
                assert p in tree_pages, f"locked prefix page {p} is not in the tree"
            for p in pages[n_matched:].tolist():
                assert p not in free, f"page {p} of a live request is on the free list"
                assert p not in tree_pages, f"owned page {p} is also in the tree"
                assert p not in owned, f"page {p} owned by two live requests"
                owned.add(p)
        total = len(free) + len(tree_pages) + len(owned)
        assert total == self.pool.num_usable, (
            f"leaked pages: free {len(free)} + cached {len(tree_pages)} + owned {len(owned)}"
            f" != {self.pool.num_usable}")


def _path_pages(node: RadixNode, root: RadixNode) -> np.ndarray:
    parts = []
    while node is not root:
        parts.append(node.value)
        node = node.parent  # type: ignore[assignment]
    return np.concatenate(parts[::-1]) if parts else np.empty(0, np.int32)


def _depth_pages(node: RadixNode, root: RadixNode) -> int:
    n = 0
    while node is not root:
        n += len(node.value)
        node = node.parent  # type: ignore[assignment]
    return n
