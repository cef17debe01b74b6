"""glibc ``malloc`` settings for CPU inference (``--tune-malloc``, on by default on CPU).

Why: every step allocates and frees its activations (a batch-64 step of SmolLM2-135M: a few
hundred tensors of 70 KiB to 12 MiB). With glibc's defaults (a 128 KiB mmap threshold, raised
only as mmapped blocks are freed, and heap trimming) the freed memory kept going back to the OS
and the next step page-faulted and zero-filled it again. Measured on the Zen 5 VM (bf16,
docs/benchmarks.md): a cold batch of 64 prompts x 64 tokens took 16k-193k minor page faults
untuned and 0.2k-12k tuned; offline output tok/s (64 x 64 -> 128 tokens) +9% on average over
three alternating runs. vLLM's CPU backend gets the same effect by preloading tcmalloc; this
does it in-process with ``mallopt`` (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``: glibc's
``malloc.h``), so it needs no environment set-up. The cost: freed activation memory stays
in the process for reuse instead of going back to the OS.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from dataclasses import dataclass

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap (glibc's own ceiling for the dynamic threshold on
#: 64-bit: ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB)
MMAP_THRESHOLD_BYTES = 32 * 1024**2
#: free memory kept at the heap's top before trimming
TRIM_THRESHOLD_BYTES = 256 * 1024**2
#: the environment variables that already decide these settings (glibc tunables, or another
#: allocator preloaded): left to the user
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")


@dataclass(frozen=True)
class MallocTuning:
    """What ``tune_malloc`` did: ``applied`` and why (for the start-up log and ``/metrics``)."""

    applied: bool
    reason: str


def tune_malloc(enabled: bool = True) -> MallocTuning:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring).

    Leaves the allocator alone when ``enabled`` is False (``--no-tune-malloc``), when the C
    library is not glibc, when the user set glibc's malloc variables, or when another allocator
    is preloaded (``LD_PRELOAD`` naming tcmalloc, jemalloc or mimalloc). Never raises.
    """
    if not enabled:
        return MallocTuning(False, "--no-tune-malloc")
    if platform.libc_ver()[0] != "glibc":
        return MallocTuning(False, "the C library is not glibc")
    user = [v for v in _USER_ENV if v in os.environ]
    if user:
        return MallocTuning(False, f"left to the environment ({', '.join(user)})")
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((name for name in _PRELOADED if name in preload), None)
    if other is not None:
        return MallocTuning(False, f"{other} is preloaded")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as e:
        return MallocTuning(False, f"mallopt unavailable: {e}")
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return MallocTuning(False, "mallopt refused the thresholds")
    return MallocTuning(True, f"glibc mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim "
                              f"threshold {TRIM_THRESHOLD_BYTES >> 20} MiB: a step's "
                              "activations reuse heap memory instead of fresh pages")


def release_free_heap(collect: bool = True) -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``), once a one-off
    phase is over: reading a GGUF's metadata and building its tokenizer frees ~180 MiB of small
    Python objects, and loading frees each layer's dense weights as it packs them. The raised
    trim threshold (``tune_malloc``) would keep all of that as if it were a step's activations,
    so a served model's resident memory would carry its own loading. Returns False where the C
    library has no ``malloc_trim`` (not glibc); never raises. ``collect``: run Python's cycle
    collector first (tens of ms), for garbage that only it frees."""
    if collect:
        gc.collect()
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
