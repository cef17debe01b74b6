"""Unit tests of the KV page pool, the radix prefix cache and the KV cache manager (DESIGN §4):
match / insert / split at page boundaries (page sizes 1 and 16), lock/unlock reference counts,
LRU eviction through the heap, locked nodes never evicted, and ``check_integrity`` catching
corrupted states."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.kvcache.manager import KVCacheManager
from radixserve.kvcache.page_pool import PagePool
from radixserve.kvcache.radix_cache import RadixCache


def toks(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def pg(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


class Tree:
    """A RadixCache whose freed pages are recorded in order."""

    def __init__(self, page_size: int) -> None:
        self.freed: list[int] = []
        self.tree = RadixCache(page_size, lambda p: self.freed.extend(p.tolist()))
        self.ps = page_size

    def check(self, live=()) -> set[int]:
        return self.tree.check_integrity(list(live))


def _children(node):
    return list(node.children.values())


# ---------------------------------------------------------------------------- PagePool
def test_page_pool_alloc_free_and_null_page():
    pool = PagePool(6)
    assert pool.num_usable == 5 and pool.num_free == 5
    a = pool.alloc(3)
    assert a.dtype == np.int32 and len(set(a.tolist())) == 3 and 0 not in a.tolist()
    assert pool.num_free == 2
    assert pool.alloc(3) is None and pool.num_free == 2  # short: nothing taken
    assert pool.alloc(0).shape == (0,)
    b = pool.alloc(2)
    assert set(a.tolist()) | set(b.tolist()) == {1, 2, 3, 4, 5}
    assert pool.alloc(1) is None
    pool.free(a)
    assert pool.num_free == 3 and all(pool.is_free(p) for p in a.tolist())
    assert not pool.is_free(0)
    pool.free([])


def test_page_pool_rejects_double_free_and_bad_ids():
    pool = PagePool(5)
    a = pool.alloc(2)
    pool.free(a[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free([int(a[1]), int(a[1])])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([5])
    with pytest.raises(ValueError):
        PagePool(1)


def test_page_pool_places_requests_in_runs_with_room_to_grow():
    """A new request's pages open a run with ``room`` free ids ahead; its later pages continue
    the run; the next request starts past that room; a taken next id opens a new run."""
    pool = PagePool(64)
    a = pool.alloc(3, room=8)
    b = pool.alloc(2, room=8)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [9, 10]
    assert pool.alloc(2, after=int(a[-1]), room=6).tolist() == [4, 5]
    grown = pool.alloc_after(np.array([5, 10]), np.array([4, 6]))
    assert grown.dtype == np.int32 and grown.tolist() == [6, 11]
    assert pool.alloc(1, after=11).tolist() == [12]  # another caller takes 12
    # so b's next page opens a new run at the cursor, past b's room
    assert pool.alloc_after(np.array([11]), np.array([4])).tolist() == [17]
    assert pool.num_free == 63 - 11


def test_page_pool_alloc_after_shared_last_page_and_shortage():
    pool = PagePool(12)
    first = pool.alloc(2, room=2)  # [1, 2]
    # two requests both ending on the shared page 2: one gets 3, the other a new run
    ids = pool.alloc_after(np.array([2, 2, 0]), np.array([1, 1, 1]))
    assert ids[0] == 3 and len(set(ids.tolist())) == 3 and not set(ids.tolist()) & {1, 2}
    left = pool.num_free
    assert pool.alloc_after(np.arange(left + 1), np.ones(left + 1, np.int64)) is None
    assert pool.num_free == left  # short: nothing taken
    pool.alloc(left)
    pool.free(first)
    assert pool.alloc(2, room=2).tolist() == [1, 2]  # the search wraps to the freed run


@given(st.lists(st.tuples(st.sampled_from(["alloc", "after", "free"]),
                          st.integers(0, 6), st.integers(0, 12)), max_size=60))
def test_page_pool_never_hands_out_a_taken_page(ops):
    """Random alloc / alloc_after / free sequences: no id is handed out twice while taken,
    page 0 never, and the free count always equals the ids not held."""
    pool = PagePool(24)
    held: list[int] = []
    for op, n, room in ops:
        if op == "free":
            if held:
                give, held = held[:n], held[n:]
                pool.free(give)
            continue
        last = held[-1] if held else 0
        if op == "alloc":
            ids = pool.alloc(n, after=last, room=room)
        else:
            ids = pool.alloc_after(np.array([last] * n), np.full(n, room))
        if ids is None:
            assert n > pool.num_free
            continue
        got = ids.tolist()
        assert len(got) == n and len(set(got)) == n and 0 not in got
        assert not set(got) & set(held)
        held += got
        assert pool.num_free == 23 - len(held)
        assert pool.free_set() == set(range(1, 24)) - set(held)


# ---------------------------------------------------------------------------- match / insert
@pytest.mark.parametrize("ps", [1, 16])
def test_insert_and_match_whole_and_partial(ps):
    t = Tree(ps)
    key = toks(3 * ps)
    assert t.tree.insert(key, pg(7, 8, 9)) == 0
    assert t.tree.total_pages == 3 == t.tree.evictable_pages
    pages, node = t.tree.match_prefix(key)
    assert pages.tolist() == [7, 8, 9] and len(node.key) == 3 * ps
    # a longer query matches the whole edge
    pages, _ = t.tree.match_prefix(toks(5 * ps))
    assert pages.tolist() == [7, 8, 9]
    # a query diverging right after two pages splits the edge at the page boundary
    q = np.concatenate([toks(2 * ps), toks(ps, 1000)])
    pages, node = t.tree.match_prefix(q)
    assert pages.tolist() == [7, 8]
    assert len(node.key) == 2 * ps and node.value.tolist() == [7, 8]
    (tail,) = _children(node)
    assert tail.value.tolist() == [9] and len(tail.key) == ps
    assert _children(t.tree.root) == [node]
    # nothing cached for a different first page
    pages, node = t.tree.match_prefix(toks(2 * ps, 500))
    assert pages.size == 0 and node is t.tree.root
    # shorter than a page: nothing
    if ps > 1:
        pages, _ = t.tree.match_prefix(toks(ps - 1))
        assert pages.size == 0
    t.check()
    assert t.tree.total_pages == 3 and t.freed == []


def test_match_rounds_down_to_whole_pages():
    ps = 16
    t = Tree(ps)
    t.tree.insert(toks(3 * ps), pg(1, 2, 3))
    # 2.5 pages of the same tokens: the half page is not matched
    pages, node = t.tree.match_prefix(toks(2 * ps + ps // 2))
    assert pages.tolist() == [1, 2] and len(node.key) == 2 * ps
    # divergence in the middle of the second page: only the first page matches
    q = toks(3 * ps).copy()
    q[ps + 5] = 999
    pages, node = t.tree.match_prefix(q)
    assert pages.tolist() == [1] and len(node.key) == ps
    t.check()


@pytest.mark.parametrize("ps", [1, 16])
def test_insert_returns_cached_prefix_and_branches(ps):
    t = Tree(ps)
    a = toks(3 * ps)
    assert t.tree.insert(a, pg(1, 2, 3)) == 0
    # same first two pages, different third: 2 pages already there, one new leaf
    b = np.concatenate([toks(2 * ps), toks(ps, 700)])
    assert t.tree.insert(b, pg(4, 5, 6)) == 2 * ps
    assert t.tree.total_pages == 4  # 1, 2, 3 and 6; 4, 5 stay the caller's
    assert t.check() == {1, 2, 3, 6}
    (upper,) = _children(t.tree.root)
    assert upper.value.tolist() == [1, 2]
    assert sorted(c.value.tolist()[0] for c in _children(upper)) == [3, 6]
    # the very same key again: all of it cached
    assert t.tree.insert(a, pg(7, 8, 9)) == 3 * ps
    assert t.tree.total_pages == 4
    # a prefix of an edge: splits it, nothing new
    assert t.tree.insert(toks(ps), pg(10)) == ps
    assert t.tree.total_pages == 4
    pages, _ = t.tree.match_prefix(b)
    assert pages.tolist() == [1, 2, 6]
    pages, _ = t.tree.match_prefix(a)
    assert pages.tolist() == [1, 2, 3]
    t.check()
    assert t.freed == []


def test_insert_diverging_inside_a_page_keeps_whole_pages_only():
    ps = 16
    t = Tree(ps)
    t.tree.insert(toks(2 * ps), pg(1, 2))
    b = toks(2 * ps).copy()
    b[ps + 3] = 999  # second page differs at offset 3
    assert t.tree.insert(b, pg(3, 4)) == ps
    assert t.check() == {1, 2, 4}
    pages, _ = t.tree.match_prefix(b)
    assert pages.tolist() == [1, 4]


# ---------------------------------------------------------------------------- lock / unlock
@pytest.mark.parametrize("ps", [1, 16])
def test_lock_unlock_reference_counts(ps):
    t = Tree(ps)
    t.tree.insert(toks(3 * ps), pg(1, 2, 3))
    t.tree.insert(np.concatenate([toks(ps), toks(ps, 500)]), pg(9, 4))
    _, deep = t.tree.match_prefix(toks(3 * ps))  # path [1] -> [2, 3]
    _, other = t.tree.match_prefix(np.concatenate([toks(ps), toks(ps, 500)]))  # [1] -> [4]
    top = deep.parent
    assert top is other.parent and top.value.tolist() == [1]
    t.tree.lock(deep)
    assert (deep.lock_ref, top.lock_ref, other.lock_ref) == (1, 1, 0)
    assert t.tree.protected_pages == 3 and t.tree.evictable_pages == 1
    t.tree.lock(deep)
    t.tree.lock(other)
    assert (deep.lock_ref, top.lock_ref, other.lock_ref) == (2, 3, 1)
    assert t.tree.protected_pages == 4 and t.tree.evictable_pages == 0
    t.check([deep, deep, other])
    with pytest.raises(AssertionError, match="lock_ref"):
        t.check([deep, other])  # one reference unaccounted for
    t.tree.unlock(deep)
    t.tree.unlock(other)
    assert (deep.lock_ref, top.lock_ref, other.lock_ref) == (1, 1, 0)
    assert t.tree.protected_pages == 3 and t.tree.evictable_pages == 1
    t.check([deep])
    t.tree.unlock(deep)
    assert t.tree.protected_pages == 0 and t.tree.evictable_pages == 4
    t.check()
    with pytest.raises(AssertionError, match="unlock"):
        t.tree.unlock(deep)
    t.tree.lock(t.tree.root)  # the root is never counted
    t.tree.unlock(t.tree.root)
    t.check()


def test_split_of_a_locked_node_keeps_locks_on_the_path():
    ps = 4
    t = Tree(ps)
    t.tree.insert(toks(3 * ps), pg(1, 2, 3))
    _, node = t.tree.match_prefix(toks(3 * ps))
    t.tree.lock(node)
    # another key splits the locked edge after one page
    t.tree.insert(np.concatenate([toks(ps), toks(ps, 900)]), pg(5, 6))
    assert node.value.tolist() == [2, 3] and node.parent.value.tolist() == [1]
    assert node.parent.lock_ref == 1
    t.check([node])
    assert t.tree.evict(10) == 1  # only the new unlocked leaf
    assert t.freed == [6]
    t.tree.unlock(node)
    t.check()


# ---------------------------------------------------------------------------- eviction
@pytest.mark.parametrize("ps", [1, 16])
def test_evict_least_recently_matched_first(ps):
    t = Tree(ps)
    t.tree.insert(toks(ps, 0), pg(1))
    t.tree.insert(toks(ps, 100), pg(2))
    t.tree.insert(toks(ps, 200), pg(3))
    t.tree.insert(toks(ps, 300), pg(4))
    t.tree.match_prefix(toks(ps, 0))  # 1 becomes the most recent
    t.tree.match_prefix(toks(2 * ps, 200))  # then 3 (a longer query still touches it)
    assert t.tree.evict(1) == 1 and t.freed == [2]
    t.check()
    assert t.tree.evict(2) == 2 and t.freed == [2, 4, 1]
    t.check()
    assert t.tree.evict(5) == 1 and t.freed == [2, 4, 1, 3]
    assert t.tree.evict(1) == 0
    assert t.tree.total_pages == t.tree.evictable_pages == 0
    assert _children(t.tree.root) == []
    t.check()


@pytest.mark.parametrize("ps", [1, 16])
def test_evict_leaves_before_their_parents(ps):
    t = Tree(ps)
    t.tree.insert(toks(3 * ps), pg(1, 2, 3))
    t.tree.insert(np.concatenate([toks(ps), toks(ps, 900)]), pg(7, 4))  # splits after page 1
    t.tree.match_prefix(toks(3 * ps))  # [2, 3] more recent than [4]
    assert t.tree.evict(1) == 1 and t.freed == [4]
    # the [2, 3] leaf goes as a whole, then its parent [1] becomes an evictable leaf
    assert t.tree.evict(1) == 2 and t.freed == [4, 2, 3]
    t.check()
    assert t.tree.evict(1) == 1 and t.freed == [4, 2, 3, 1]
    assert t.tree.total_pages == 0
    t.check()


@pytest.mark.parametrize("ps", [1, 16])
def test_evict_never_touches_locked_nodes(ps):
    t = Tree(ps)
    t.tree.insert(toks(2 * ps), pg(1, 2))
    t.tree.insert(toks(2 * ps, 100), pg(3, 4))
    t.tree.insert(np.concatenate([toks(ps), toks(ps, 500)]), pg(8, 5))
    _, locked = t.tree.match_prefix(toks(2 * ps))  # [1] -> [2], locked
    t.tree.lock(locked)
    assert t.tree.evictable_pages == 3
    assert t.tree.evict(100) == 3
    assert sorted(t.freed) == [3, 4, 5]
    assert t.check([locked]) == {1, 2}
    pages, _ = t.tree.match_prefix(toks(2 * ps))
    assert pages.tolist() == [1, 2]
    # a re-lock after a stale heap entry: still protected
    t.tree.unlock(locked)
    t.tree.lock(locked)
    assert t.tree.evict(100) == 0
    t.tree.unlock(locked)
    assert t.tree.evict(100) == 2 and sorted(t.freed) == [1, 2, 3, 4, 5]
    t.check()


def test_evict_after_new_child_makes_a_leaf_internal():
    """A heap entry of a leaf that later got a child is stale: the child goes first."""
    ps = 4
    t = Tree(ps)
    t.tree.insert(toks(ps), pg(1))
    t.tree.insert(toks(2 * ps), pg(9, 2))  # extends the leaf: [1] -> [2]
    t.check()
    assert t.tree.evict(1) == 1 and t.freed == [2]
    assert t.tree.evict(1) == 1 and t.freed == [2, 1]
    t.check()


# ---------------------------------------------------------------------------- check_integrity
def _manager_with_state(ps: int = 4):
    """A manager with a cached prefix, one live request holding it, and free pages."""
    kv = KVCacheManager(20, ps, True)
    tokens = toks(3 * ps + 2)
    pages = kv.allocate(4)
    kv.release(tokens, pages, 3 * ps + 2, None)  # 3 full pages cached, partial one freed
    assert kv.num_cached_pages == 3 and kv.num_free_pages == 16
    matched, node = kv.match(toks(4 * ps))
    assert len(matched) == 3
    own = kv.allocate(2)
    live = [(np.concatenate([matched, own]), node, 3)]
    kv.check_integrity(live)
    return kv, live, matched, own, node


def test_check_integrity_catches_a_tree_page_on_the_free_list():
    kv, live, matched, _, _ = _manager_with_state()
    kv.pool.free(matched[:1])  # corrupt: a cached (and locked) page is also free
    with pytest.raises(AssertionError, match="both free and cached"):
        kv.check_integrity(live)


def test_check_integrity_catches_an_owned_page_on_the_free_list():
    kv, live, _, own, _ = _manager_with_state()
    kv.pool.free(own[1:])
    with pytest.raises(AssertionError, match="free list"):
        kv.check_integrity(live)


def test_check_integrity_catches_a_leaked_page():
    kv, live, _, _, _ = _manager_with_state()
    kv.pool.alloc(1)  # taken, owned by nobody
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_integrity(live)


def test_check_integrity_catches_a_page_owned_twice():
    kv, live, _, own, node = _manager_with_state()
    kv.tree.lock(node)
    with pytest.raises(AssertionError, match="owned by two"):
        kv.check_integrity(live + [(np.concatenate([live[0][0][:3], own[:1]]), node, 3)])


def test_check_integrity_catches_a_page_cached_and_owned():
    kv, live, matched, own, node = _manager_with_state()
    bad = [(np.concatenate([matched, own, matched[-1:]]), node, 3)]
    with pytest.raises(AssertionError, match="also in the tree"):
        kv.check_integrity(bad)


def test_check_integrity_catches_a_prefix_off_the_locked_path():
    kv, live, matched, own, node = _manager_with_state()
    bad = [(np.concatenate([matched[::-1], own]), node, 3)]
    with pytest.raises(AssertionError, match="locked tree path"):
        kv.check_integrity(bad)


def test_check_integrity_catches_bad_tree_bookkeeping():
    kv, live, _, _, node = _manager_with_state()
    kv.tree.evictable_pages += 1
    with pytest.raises(AssertionError, match="evictable"):
        kv.check_integrity(live)
    kv.tree.evictable_pages -= 1
    node.lock_ref += 1
    with pytest.raises(AssertionError, match="lock_ref"):
        kv.check_integrity(live)
    node.lock_ref -= 1
    kv.check_integrity(live)
    with pytest.raises(AssertionError, match="lock_ref"):
        kv.check_integrity([])  # a lock nobody holds


def test_check_integrity_catches_a_page_twice_in_the_tree_and_heap_loss():
    t = Tree(4)
    t.tree.insert(toks(8), pg(1, 2))
    t.tree.insert(toks(4, 100), pg(3))
    t.check()
    heap = list(t.tree._heap)
    t.tree._heap.clear()
    with pytest.raises(AssertionError, match="heap"):
        t.check()
    t.tree._heap[:] = heap
    (leaf,) = [n for n in t.tree.all_nodes() if n.value.tolist() == [3]]
    leaf.value = pg(1)
    with pytest.raises(AssertionError, match="twice"):
        t.check()


def test_check_integrity_catches_a_live_request_on_an_evicted_node():
    t = Tree(4)
    t.tree.insert(toks(8), pg(1, 2))
    _, node = t.tree.match_prefix(toks(8))
    assert t.tree.evict(2) == 2
    with pytest.raises(AssertionError, match="evicted"):
        t.check([node])


# ---------------------------------------------------------------------------- KVCacheManager
@pytest.mark.parametrize("ps", [1, 16])
def test_manager_match_leaves_one_token_to_compute(ps):
    kv = KVCacheManager(64, ps, True)
    tokens = toks(4 * ps)
    pages = kv.allocate(4)
    kv.release(tokens, pages, 4 * ps, None)
    assert kv.num_cached_pages == 4
    m, node = kv.match(tokens)  # the whole thing is cached, but one token must be computed
    assert len(m) == 3 and node.lock_ref == 1
    kv.release(tokens, m, 3 * ps, node)
    m, node = kv.match(toks(4 * ps + 1))
    assert len(m) == 4
    kv.release(tokens, m, 4 * ps, node)
    m, node = kv.match(toks(ps))
    assert len(m) == 0 and node is None
    kv.check_integrity([])
    assert kv.num_free_pages + kv.num_cached_pages == kv.num_usable_pages


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_manager_release_caches_only_computed_full_pages(ps):
    kv = KVCacheManager(40, ps, True)
    tokens = toks(5 * ps)
    pages = kv.allocate(5)
    n_computed = 3 * ps + (ps // 2 if ps > 1 else 0)
    kv.release(tokens, pages, n_computed, None)
    assert kv.num_cached_pages == 3
    assert kv.num_free_pages == kv.num_usable_pages - 3
    got, node = kv.match(tokens)
    assert got.tolist() == pages[:3].tolist()
    kv.check_integrity([(got, node, 3)])
    kv.release(tokens, got, 3 * ps, node)
    kv.check_integrity([])


@pytest.mark.parametrize("ps", [1, 16])
def test_manager_same_prefix_computed_twice_one_finishes_early(ps):
    """The mini-sglang #142 shape at manager level: two requests own separate copies of one
    prefix; the first's copy enters the tree, the second's pages stay owned (never freed while it
    runs), a third request locks the cached copy, then the second's duplicates are freed."""
    kv = KVCacheManager(40, ps, True)
    tokens = toks(4 * ps)
    a, _ = kv.match(tokens)
    b, _ = kv.match(tokens)
    assert len(a) == len(b) == 0
    pa, pb = kv.allocate(4), kv.allocate(4)
    kv.release(tokens, pa, 4 * ps, None)  # A finishes early
    kv.check_integrity([(pb, None, 0)])
    assert not any(kv.pool.is_free(p) for p in pb.tolist())
    pc, node = kv.match(toks(4 * ps + 1))  # C reuses A's copy
    assert pc.tolist() == pa.tolist()
    kv.check_integrity([(pb, None, 0), (pc, node, 4)])
    assert kv.allocate(kv.num_free_pages + 1) is None  # eviction cannot take locked pages
    kv.check_integrity([(pb, None, 0), (pc, node, 4)])
    kv.release(tokens, pb, 4 * ps, None)  # B finishes: its duplicates are freed
    assert all(kv.pool.is_free(p) for p in pb.tolist())
    kv.check_integrity([(pc, node, 4)])
    kv.release(toks(4 * ps + 1), pc, 4 * ps, node)
    kv.check_integrity([])
    assert kv.num_cached_pages == 4
    assert kv.num_free_pages + kv.num_cached_pages == kv.num_usable_pages


def test_manager_release_with_a_longer_cached_copy_frees_duplicates_past_the_match():
    ps = 4
    kv = KVCacheManager(40, ps, True)
    tokens = toks(6 * ps)
    m, node = kv.match(tokens)  # request X: matches nothing yet...
    px = kv.allocate(6)
    py = kv.allocate(6)
    kv.release(tokens, py, 6 * ps, None)  # ...while Y caches the same tokens first
    kv.check_integrity([(px, node, 0)])
    kv.release(tokens, px, 6 * ps, node)
    assert all(kv.pool.is_free(p) for p in px.tolist())
    kv.check_integrity([])
    assert kv.num_cached_pages == 6


def test_manager_allocate_evicts_when_short():
    ps = 4
    kv = KVCacheManager(9, ps, True)  # 8 usable
    p = kv.allocate(6)
    kv.release(toks(6 * ps), p, 6 * ps, None)
    assert kv.num_free_pages == 2 and kv.num_available_pages == 8
    q = kv.allocate(5)
    assert q is not None and len(q) == 5
    assert kv.num_cached_pages + kv.num_free_pages == 3
    kv.check_integrity([(q, None, 0)])
    assert kv.allocate(4) is None
    kv.pool.free(q)
    kv.check_integrity([])


def test_manager_without_prefix_cache_frees_everything():
    kv = KVCacheManager(10, 4, False)
    p = kv.allocate(5)
    m, node = kv.match(toks(20))
    assert len(m) == 0 and node is None
    kv.check_integrity([(p, None, 0)])
    kv.release(toks(20), p, 20, None)
    assert kv.num_free_pages == kv.num_usable_pages == 9 and kv.num_cached_pages == 0
    assert kv.num_available_pages == 9
    kv.check_integrity([])


@pytest.mark.parametrize("ps", [1, 16])
def test_evict_all_frees_every_unlocked_page(ps: int) -> None:
    """``KVCacheManager.evict_all`` (FlushCache): unlocked branches go, a live request's
    locked prefix stays; the naive cache has nothing to flush."""
    kv = KVCacheManager(40, ps, True)
    a, b = toks(4 * ps), toks(3 * ps, start=1000)
    kv.release(a, kv.allocate(4), 4 * ps, None)
    kv.release(b, kv.allocate(3), 3 * ps, None)
    assert kv.num_cached_pages == 7
    held, node = kv.match(toks(4 * ps + 1))  # a live request on a's prefix
    assert len(held) == 4
    assert kv.evict_all() == 3
    assert kv.num_cached_pages == 4 and kv.num_free_pages == kv.num_usable_pages - 4
    kv.check_integrity([(held, node, 4)])
    kv.release(a, held, 4 * ps, node)
    assert kv.evict_all() == 4 and kv.num_cached_pages == 0
    assert kv.num_free_pages == kv.num_usable_pages
    assert KVCacheManager(8, ps, False).evict_all() == 0
