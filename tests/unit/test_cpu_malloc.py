"""``--tune-malloc`` leaves the allocator alone where the user or another allocator decides
(its effect on a real engine: tests/integration/test_malloc_faults.py)."""

from __future__ import annotations

import pytest

from radixserve.model_executor.cpu_malloc import tune_malloc


def test_left_alone_when_disabled_or_decided_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    off = tune_malloc(False)
    assert not off.applied and off.reason == "--no-tune-malloc"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1000000")
    env = tune_malloc(True)
    assert not env.applied and "MALLOC_MMAP_THRESHOLD_" in env.reason
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    pre = tune_malloc(True)
    assert not pre.applied and "tcmalloc" in pre.reason
