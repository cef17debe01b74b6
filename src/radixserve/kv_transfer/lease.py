"""Leases on a prefill instance's pages: a finished request's pages stay held until the decode
instance says it read them (or released them), or until the lease expires (vLLM's NIXL prefill
side frees blocks at the decode side's notification or after
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).

A decode instance first *claims* a lease (the deadline is renewed: the read has the whole
lease time to run), then reads, then reports *done*; "done" answers "ok" only if the lease was
still held, so a read that outlived an expired lease (whose pages may have been reused) is
discarded by the decode side. Used from the side-channel thread and the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Answers of ``claim`` / ``check_read`` / ``finish``.
OK, UNKNOWN, BAD_PAGES = "ok", "unknown", "bad_pages"


@dataclass
class _Lease:
    pages: frozenset[int]
    deadline: float
    claimed: bool = False


class LeaseTable:
    """The prefill side's leases, keyed by its request id.

    Args:
        lease_s: seconds a lease lasts after it is granted, and again after it is claimed.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._finished: set[str] = set()
        self.granted = self.released = self.expired = 0
        #: set whenever a lease ends, so an idle engine wakes up to free its pages
        self.changed = threading.Event()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def grant(self, request_id: str, pages: list[int]) -> None:
        """Hold ``pages`` (page ids) for ``request_id`` for ``lease_s`` seconds."""
        with self._lock:
            self._leases[request_id] = _Lease(frozenset(pages), self._clock() + self.lease_s)
            self.granted += 1

    def claim(self, request_id: str, pages: list[int]) -> str:
        """A decode instance is about to read ``pages`` of the lease: renew it. Returns OK,
        UNKNOWN (never granted, expired or finished) or BAD_PAGES (not all of its pages)."""
        with self._lock:
            self._expire_locked()
            lease = self._leases.get(request_id)
            if lease is None:
                return UNKNOWN
            if not lease.pages.issuperset(pages):
                return BAD_PAGES
            lease.claimed = True
            lease.deadline = self._clock() + self.lease_s
            return OK

    def check_read(self, request_id: str, pages: list[int]) -> str:
        """May a claimed lease's ``pages`` be read now? OK, UNKNOWN or BAD_PAGES."""
        with self._lock:
            self._expire_locked()
            lease = self._leases.get(request_id)
            if lease is None or not lease.claimed:
                return UNKNOWN
            return OK if lease.pages.issuperset(pages) else BAD_PAGES

    def finish(self, request_id: str) -> str:
        """The decode side is done with the lease (read or not): end it. OK if it was still
        held, UNKNOWN if it had expired (or never existed)."""
        with self._lock:
            self._expire_locked()
            if self._leases.pop(request_id, None) is None:
                return UNKNOWN
            self._finished.add(request_id)
            self.released += 1
        self.changed.set()
        return OK

    def take_finished(self) -> set[str]:
        """Requests whose lease ended (finished or expired) since the last call: their pages
        may be freed now."""
        with self._lock:
            self._expire_locked()
            out, self._finished = self._finished, set()
            return out

    def _expire_locked(self) -> None:
        now = self._clock()
        gone = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for rid in gone:
            del self._leases[rid]
            self._finished.add(rid)
        if gone:
            self.expired += len(gone)
            self.changed.set()

    def num_claimed(self) -> int:
        """Leases a decode instance is reading now (claimed, not finished or expired)."""
        with self._lock:
            self._expire_locked()
            return sum(lease.claimed for lease in self._leases.values())

    def next_deadline(self) -> float | None:
        """The earliest deadline (clock seconds), or None without leases."""
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)
