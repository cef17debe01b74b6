"""Free pages of the KV pool, handed out in runs of consecutive ids.

Page 0 is reserved as the null page: padded page-table entries point at it, so a gather over a
padded table reads finite zeros instead of another request's KV. It is never handed out.

Why runs: the CPU decode attention kernel reads a sequence's K and V page after page. With its
pages at consecutive ids the reads are one ascending stream the hardware prefetcher follows; with
pages scattered over the pool every page (6 KiB of K per layer for SmolLM2 in bf16) starts with
cache misses. ``benchmarks/decode_kernel_ab.py`` measured 0.23 ms per layer with pages in order
against 0.37 ms scattered (batch 64, 128 keys); ``radixserve bench offline`` went from
1,263-1,292 to 1,350-1,376 output tok/s with runs (Zen 5, bf16; docs/benchmarks.md, "Findings").
So a request's first pages open a run where ``room`` pages are free (its expected length), and
its later pages continue the run while the next ids are free. New runs are placed next-fit from
a cursor that moves past each run's room, so requests admitted together grow without running
into each other. The layout is only a preference: when no run is free, any free pages serve.
"""

from __future__ import annotations

import numpy as np


class PagePool:
    """Hands out and takes back page ids in ``[1, num_pages)``.

    Args:
        num_pages: pages in the KV tensors, including the reserved null page 0.

    Raises:
        ValueError: on a double free or an out-of-range id (both are engine bugs, so fail loudly).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self._is_free = np.ones(num_pages, dtype=bool)
        self._is_free[0] = False
        self._num_free = num_pages - 1
        #: where the next run is searched from (next-fit)
        self._cursor = 1
        #: the smallest room no free run had since the last free (skips hopeless searches)
        self._no_run_from = num_pages

    @property
    def num_usable(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int, after: int = 0, room: int = 0) -> np.ndarray | None:
        """Take ``n`` pages; returns int32 ids of shape [n], or None (nothing taken) if short.

        Args:
            n: pages wanted.
            after: the caller's last page (0: none): ``after + 1 ...`` are taken when all free.
            room: pages the caller expects to need from here on (>= n; tokens to come / page
                size): a new run starts where that many are free.
        """
        if n > self._num_free:
            return None
        if n == 0:
            return np.empty(0, dtype=np.int32)
        nxt = slice(after + 1, after + 1 + n)
        if after > 0 and after + n < self.num_pages and self._is_free[nxt].all():
            ids = np.arange(nxt.start, nxt.stop, dtype=np.int32)
        else:
            ids = self._new_run(n, max(room, n))
        self._take(ids)
        return ids

    def alloc_after(self, lasts: np.ndarray, rooms: np.ndarray) -> np.ndarray | None:
        """One page for each of several callers (a step's decodes starting a page): the page
        after its last one where free, else a new run as in ``alloc``.

        Args:
            lasts: int [k] each caller's last page (0: none).
            rooms: int [k] each caller's expected pages from here on.
        Returns: int32 [k] page ids, or None (nothing taken) if fewer than k are free.
        """
        k = len(lasts)
        if k > self._num_free:
            return None
        nxt = np.asarray(lasts, dtype=np.int64) + 1
        ok = (nxt > 1) & (nxt < self.num_pages)
        ok[ok] = self._is_free[nxt[ok]]
        # two callers after one shared (cached prefix) page: the first keeps the next id
        _, first = np.unique(np.where(ok, nxt, -1 - np.arange(k)), return_index=True)
        dup = np.ones(k, dtype=bool)
        dup[first] = False
        ok &= ~dup
        ids = nxt.astype(np.int32)
        self._take(ids[ok])
        for i in np.flatnonzero(~ok):
            ids[i:i + 1] = self._new_run(1, max(int(rooms[i]), 1))
            self._take(ids[i:i + 1])
        return ids

    def free(self, pages: np.ndarray | list[int]) -> None:
        """Return pages to the pool."""
        ids = np.asarray(pages, dtype=np.int64)
        if ids.size == 0:
            return
        if ids.min() < 1 or ids.max() >= self.num_pages:
            raise ValueError(f"page id out of range [1, {self.num_pages}): {ids.tolist()}")
        if self._is_free[ids].any() or len(np.unique(ids)) != ids.size:
            raise ValueError(f"double free of KV pages {ids[self._is_free[ids]].tolist()}")
        self._is_free[ids] = True
        self._num_free += ids.size
        self._no_run_from = self.num_pages

    def free_set(self) -> set[int]:
        """Ids of the free pages (for integrity checks)."""
        return set(np.flatnonzero(self._is_free).tolist())

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    # ------------------------------------------------------------------ internals
    def _take(self, ids: np.ndarray) -> None:
        self._is_free[ids] = False
        self._num_free -= ids.size

    def _new_run(self, n: int, room: int) -> np.ndarray:
        """int32 [n] free ids (not yet taken): the first ``n`` of the first ``room`` free
        consecutive ids from the cursor on (wrapping), else the first ``n`` free ids from it.
        The caller checked that ``n`` are free."""
        start = self._find_run(room) if room < self._no_run_from else None
        if start is None:
            self._no_run_from = min(self._no_run_from, room)
            c = self._cursor
            ids = np.flatnonzero(self._is_free[c:])[:n] + c
            if ids.size < n:
                ids = np.concatenate((ids, np.flatnonzero(self._is_free[:c])[:n - ids.size]))
            self._cursor = int(ids[-1]) + 1
        else:
            ids = np.arange(start, start + n)
            self._cursor = start + room
        if self._cursor >= self.num_pages:
            self._cursor = 1
        return ids.astype(np.int32)

    def _find_run(self, room: int) -> int | None:
        """The first id from the cursor on (then from 1) that starts ``room`` free ids."""
        c = self._cursor
        for lo, hi in ((c, self.num_pages), (1, c + room - 1)):
            seg = self._is_free[lo:min(hi, self.num_pages)]
            if seg.size < room:
                continue
            sums = np.concatenate(([0], np.cumsum(seg, dtype=np.int64)))
            hit = np.flatnonzero(sums[room:] - sums[:-room] == room)
            if hit.size:
                return lo + int(hit[0])
        return None
