"""Per-machine choice of the linear path (oneDNN-packed or dense ``F.linear``), measured at
start-up on the model's own projection shapes and cached per CPU, torch build, dtype and shapes.

Why measure: packing wins at decode batch sizes on the machines measured so far (AVX2 float32
and AVX-512 BF16, docs/benchmarks.md), but by how much depends on the CPU, the dtype and the
shapes, and it costs a few % at prefill sizes; a CPU with other kernels (AMX, another oneDNN
build) may rank them the other way. The measurement takes well under a second and is made once
per machine and model: later starts read the cached verdict.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.cache_dir import cache_dir
from radixserve.model_executor.kernels.cpu import cpu_signature
from radixserve.model_executor.layers.linear import LinearFn, dense_linear, packed_linear

log = logging.getLogger(__name__)

#: token counts the two paths are timed at: a lone decode, a decode batch, a prefill chunk
MEASURE_M = (1, 16, 64, 256)
#: weight of each M's speed ratio in the verdict: decode-sized calls run every step, prefill
#: chunks less often (and their larger time would otherwise drown the decode sizes)
_WEIGHTS = {1: 1.0, 16: 1.0, 64: 1.0, 256: 0.5}


@dataclass
class LinearChoice:
    """Verdict of ``choose_linear_path``.

    Attributes:
        path: "packed" or "dense".
        reason: one line for the start-up log (timings, or why nothing was measured).
        seconds: path -> seconds of one pass over the shapes at each of ``MEASURE_M`` (empty
            if not measured).
        cached: the verdict came from the cache file.
    """

    path: str
    reason: str
    seconds: dict[str, list[float]]
    cached: bool = False


def _time(fn: LinearFn, x: torch.Tensor, reps: int) -> float:
    fn(x)
    t = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - t) / reps


def measure(weights: list[torch.Tensor], batch_hint: int) -> dict[str, list[float]] | None:
    """Seconds per pass over ``weights`` ([N, K] each, CPU: one layer's projections and the LM
    head) at each of ``MEASURE_M`` tokens, for "packed" and "dense"; None when packing is
    unavailable here."""
    packed = [packed_linear(w, None, batch_hint) for w in weights]
    if any(p is None for p in packed):
        return None
    dense = [dense_linear(w) for w in weights]
    out: dict[str, list[float]] = {"packed": [], "dense": []}
    with torch.inference_mode():
        for m in MEASURE_M:
            reps = 10 if m <= 64 else 2
            tp = td = 0.0
            for w, p, d in zip(weights, packed, dense, strict=True):
                x = torch.randn(m, w.shape[1], dtype=w.dtype)
                # interleaved, best of two: a busy neighbour slows both alike
                tp += min(_time(p, x, reps), _time(p, x, reps))
                td += min(_time(d, x, reps), _time(d, x, reps))
            out["packed"].append(tp)
            out["dense"].append(td)
    return out


def packed_speedup(secs: dict[str, list[float]]) -> float:
    """Weighted geometric mean over ``MEASURE_M`` of dense time / packed time (> 1: packed
    is faster). Ratios, not sums: a large M's larger time must not decide alone."""
    logs = [_WEIGHTS[m] * math.log(d / p)
            for m, p, d in zip(MEASURE_M, secs["packed"], secs["dense"], strict=True)]
    return math.exp(sum(logs) / sum(_WEIGHTS[m] for m in MEASURE_M))


def choose_linear_path(weights: list[torch.Tensor], batch_hint: int,
                       cache_key: str) -> LinearChoice:
    """Packed or dense for this machine and model: the cached verdict for ``cache_key`` (the
    model's shapes and dtype) on this CPU and torch build, or a fresh measurement (then cached).

    Args:
        weights: CPU [N, K] tensors in the model's dtype: one layer's projections and the LM
            head.
        batch_hint: M the packed layout is tuned for.
        cache_key: identifies the model's shapes and dtype.
    """
    key = hashlib.sha256("\n".join([cache_key, str(batch_hint), torch.__version__,
                                    cpu_signature()]).encode()).hexdigest()[:16]
    path = cache_dir("path_choice") / f"linear-{key}.json"
    cached = _read(path)
    if cached is not None:
        return LinearChoice(cached["path"], f"measured before on this machine ({path.name}): "
                            + cached["reason"], cached["seconds"], cached=True)
    secs = measure(weights, batch_hint)
    if secs is None:
        return LinearChoice("dense", "oneDNN packing unavailable in this torch build", {})
    speedup = packed_speedup(secs)
    best = "packed" if speedup > 1.0 else "dense"
    ms = " ".join(f"M={m}: {p * 1e3:.2f}/{d * 1e3:.2f}"
                  for m, p, d in zip(MEASURE_M, secs["packed"], secs["dense"], strict=True))
    reason = (f"measured on this model's shapes, packed/dense ms per layer + LM head {ms}; "
              f"packed {speedup:.2f}x")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"path": best, "reason": reason, "seconds": secs}))
        tmp.replace(path)
    except OSError as e:  # a read-only cache only costs the measurement next time
        log.info("could not cache the linear path choice: %s", e)
    return LinearChoice(best, reason, secs)


def _read(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if d.get("path") not in ("packed", "dense") or not isinstance(d.get("seconds"), dict):
        return None
    return d
