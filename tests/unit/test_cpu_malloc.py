"""``--tune-malloc``: glibc then serves activation-sized blocks from its heap (reused after a
free) instead of fresh mmaps; it leaves the allocator alone where the user or another allocator
decides. In an engine: tests/integration/test_malloc_tuning_engine.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

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


# a fresh process: bytes glibc mmapped for one 8 MiB block (mallinfo2's hblkhd)
_MMAPPED = """
import ctypes, sys
import torch
from radixserve.model_executor.cpu_malloc import tune_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]

print(tune_malloc(sys.argv[1] == "1").applied)
info = ctypes.CDLL(None).mallinfo2
info.restype = MallInfo2
before = info().hblkhd
block = torch.ones(2 * 1024 * 1024)
print(info().hblkhd - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.parametrize("tuned", [False, True])
def test_tuned_malloc_serves_large_blocks_from_the_heap(tuned: bool) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run([sys.executable, "-c", _MMAPPED, "1" if tuned else "0"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    applied, mmapped = out.stdout.split()
    assert applied == str(tuned)
    # glibc's default threshold (128 KiB) mmaps the block, freed back to the OS after use
    if tuned:
        assert int(mmapped) == 0
    else:
        assert int(mmapped) >= 8 * 1024**2
