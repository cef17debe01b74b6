"""Free list of KV page ids.

Page 0 is reserved as the null page: padded page-table entries point at it, so a gather over a
padded table reads finite zeros instead of another request's KV. It is never handed out.
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
        # A stack: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = np.ones(num_pages, dtype=bool)
        self._is_free[0] = False

    @property
    def num_usable(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        """Take ``n`` pages; returns int32 ids of shape [n], or None (nothing taken) if short."""
        if n > len(self._free):
            return None
        if n == 0:
            return np.empty(0, dtype=np.int32)
        pages = self._free[-n:]
        del self._free[-n:]
        ids = np.asarray(pages, dtype=np.int32)
        self._is_free[ids] = False
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
        self._free.extend(ids.tolist())

    def free_set(self) -> set[int]:
        """Ids on the free list (for integrity checks)."""
        return set(self._free)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])
