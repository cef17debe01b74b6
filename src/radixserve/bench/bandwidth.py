"""The machine's memory read bandwidth, and a decode step's floor from it.

Once a model's weights no longer fit in the last-level cache, a batch-1 decode step reads every
weight once, so it cannot take less than ``weight bytes / read bandwidth`` (the roofline's
memory bound). ``bench compare`` reports single-stream TPOT as a multiple of that floor.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Bandwidth:
    """Read bandwidth measured by summing a buffer far larger than any cache.

    Attributes:
        gb_per_s: best of the runs of either reader, in 10^9 bytes per second.
        buffer_bytes: the buffer read each run.
        threads: torch threads used (the engines' thread count).
        runs_gb_per_s: every run's figure with torch's ``sum``.
        stream_runs_gb_per_s: every run's figure with radixserve's streaming read
            (``CpuKernels.stream_read``: four independent vector sums per thread); empty where
            the C kernels are not built. On the Zen 3 kind torch's sum read 14-28 GB/s where
            a 7B decode step streamed its weights at 33 GB/s, so the floor takes the faster.
    """

    gb_per_s: float
    buffer_bytes: int
    threads: int
    runs_gb_per_s: list[float]
    stream_runs_gb_per_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_read_bandwidth(buffer_bytes: int = 1 << 30, runs: int = 7,
                           threads: int | None = None) -> Bandwidth:
    """Sum a float32 buffer of ``buffer_bytes`` (default 1 GiB, beyond every L3 we are given)
    ``runs`` times on ``threads`` torch threads, with torch and with radixserve's streaming
    read; the best run of either is the figure (a neighbour can
    only slow a run down).

    Raises:
        ValueError: ``buffer_bytes`` under 64 MiB (it would measure a cache) or ``runs`` < 1.
    """
    if buffer_bytes < 64 << 20 or runs < 1:
        raise ValueError("need buffer_bytes >= 64 MiB and runs >= 1")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        buf = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        buf.sum()  # fault the pages in
        figures = []
        for _ in range(runs):
            t0 = time.perf_counter()
            buf.sum()
            figures.append(buffer_bytes / (time.perf_counter() - t0) / 1e9)
        stream = []
        from radixserve.model_executor.kernels.cpu import CpuKernels

        kernels = CpuKernels.load()
        for _ in range(runs if kernels is not None else 0):
            t0 = time.perf_counter()
            kernels.stream_read(buf)
            stream.append(buffer_bytes / (time.perf_counter() - t0) / 1e9)
        return Bandwidth(max(figures + stream), buffer_bytes, torch.get_num_threads(),
                         [round(f, 2) for f in figures], [round(f, 2) for f in stream])
    finally:
        torch.set_num_threads(before)


def decode_floor_ms(weight_bytes: int, gb_per_s: float) -> float:
    """The least time one decode step can take when every weight is read once: milliseconds
    for ``weight_bytes`` at ``gb_per_s`` (10^9 bytes per second)."""
    return weight_bytes / (gb_per_s * 1e9) * 1e3
