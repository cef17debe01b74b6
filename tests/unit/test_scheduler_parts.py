"""The scheduler's small parts: the radix tree's read-only prefix peek (used to order the
waiting queue under ``lpm``), the row tables and the live-request index."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.core.live_index import LiveIndex
from radixserve.core.request import Request
from radixserve.core.row_tables import RowTables
from radixserve.kvcache.radix_cache import RadixCache
from radixserve.sampling_params import SamplingParams


def _snapshot(tree: RadixCache) -> list[tuple]:
    return sorted((n.key.tobytes(), n.value.tobytes(), n.last_access)
                  for n in tree.all_nodes())


@pytest.mark.parametrize("ps", [1, 4])
def test_peek_prefix_len_leaves_the_tree_unchanged(ps: int) -> None:
    tree = RadixCache(ps, lambda p: None)
    base = np.arange(8 * ps, dtype=np.int32)
    tree.insert(base, np.arange(1, 9, dtype=np.int32))
    before = _snapshot(tree)
    # a query that diverges in the middle of the only edge: match_prefix would split it
    q = base.copy()
    q[5 * ps:] += 1000
    assert tree.peek_prefix_len(q) == 5 * ps
    assert tree.peek_prefix_len(base) == 8 * ps
    assert tree.peek_prefix_len(base[:3 * ps + ps // 2]) == 3 * ps
    assert tree.peek_prefix_len(np.arange(100, 100 + 4 * ps, dtype=np.int32)) == 0
    assert _snapshot(tree) == before, "peek split a node or touched the LRU clock"
    pages, _ = tree.match_prefix(q)  # the taking path agrees on the length
    assert len(pages) * ps == 5 * ps


def _req(rid: str, **kw) -> Request:
    return Request(rid, np.arange(5, dtype=np.int32), SamplingParams(**kw), frozenset({2}), 8)


def test_live_index_counts_and_stop_ids() -> None:
    live = LiveIndex()
    a = _req("a", temperature=0, stop_token_ids=[7])
    b = _req("b", temperature=0.7, logprobs=2, presence_penalty=0.5, min_tokens=1)
    live.add(a)
    live.add(b)
    assert (live.random, live.logprobs, live.penalty, live.min_tokens) == (1, 1, 1, 1)
    toks = np.array([7, 2, 3], dtype=np.int64)
    assert live.stop_candidates(toks).tolist() == [True, True, False]
    live.remove(a)
    assert live.stop_candidates(toks).tolist() == [False, True, False]
    live.remove(b)
    assert (live.random, live.logprobs, live.penalty, live.min_tokens) == (0, 0, 0, 0)
    assert not live.stop_candidates(toks).any()
    assert b.min_tokens_blocked == [2]


def test_row_tables_acquire_release() -> None:
    t = RowTables(max_rows=2, max_model_len=16, page_size=4)
    sp = SamplingParams(temperature=0.5, top_k=3, logprobs=1)
    r = t.acquire(np.array([4, 5, 6], dtype=np.int32), 3, 10, sp, None)
    assert t.token_table[r, :3].tolist() == [4, 5, 6]
    assert (t.prompt_len[r], t.limit[r], t.top_k[r], t.logprobs[r]) == (3, 10, 3, 1)
    assert not t.greedy[r] and t.temperature[r] == pytest.approx(0.5)
    t.page_table[r, :2] = [7, 8]
    gen = t.generation[r]
    t.release(r, 2)
    assert t.num_free == 2 and t.generation[r] == gen + 1 and not t.page_table[r].any()
