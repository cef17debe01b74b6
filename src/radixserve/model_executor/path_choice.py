"""Per-machine choices of the linear path, measured at start-up on the model's own projection
shapes and cached per CPU, torch build, dtype and shapes: oneDNN-packed or dense ``F.linear``
(``choose_linear_path``), and up to how many rows radixserve's kernel over the packed weights
takes a call before oneDNN's GEMM does (``choose_kernel_rows``).

Why measure: packing wins at decode batch sizes on the machines measured so far (AVX2 float32
and AVX-512 BF16, docs/benchmarks.md), but by how much depends on the CPU, the dtype and the
shapes, and it costs a few % at prefill sizes; a CPU with other kernels (AMX, another oneDNN
build) may rank them the other way. The measurement takes well under a second and is made once
per machine and model: later starts read the cached verdict.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.cache_dir import cache_dir
from radixserve.model_executor.kernels.cpu import CpuKernels, cpu_signature
from radixserve.model_executor.layers.amx_linear import AmxLinear
from radixserve.model_executor.layers.bf16_weight_linear import Bf16WeightLinear
from radixserve.model_executor.layers.linear import dense_linear, packed_linear
from radixserve.model_executor.layers.packed_kernel import (
    MAX_ROWS,
    find_k_block,
    packed_kernel_linear,
)

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


def _time(fn: Callable[[Any], object], x: Any, reps: int) -> float:
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
    path = _cache_file("linear", cache_key, str(batch_hint))
    with _exclusive(path):
        cached = _read(path, "path", ("packed", "dense"))
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
        _write(path, {"path": best, "reason": reason, "seconds": secs})
        return LinearChoice(best, reason, secs)


def _cache_file(kind: str, *parts: str) -> Path:
    """The cache file of one measurement: ``parts`` plus this torch build and CPU, hashed."""
    key = hashlib.sha256("\n".join([*parts, torch.__version__, cpu_signature()]).encode()
                         ).hexdigest()[:16]
    return cache_dir("path_choice") / f"{kind}-{key}.json"


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock beside ``path`` while a verdict is read or measured, so processes
    starting together on one machine (a fleet's workers, a prefill and a decode instance) take
    one measurement and agree on it instead of each measuring and picking by noise."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:  # a read-only cache: measure unlocked
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(path: Path, verdict: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(verdict))
        tmp.replace(path)
    except OSError as e:  # a read-only cache only costs the measurement next time
        log.info("could not cache the path choice %s: %s", path.name, e)


def _read(path: Path, field: str, allowed: tuple) -> dict | None:
    """A cached verdict whose ``field`` is one of ``allowed``, with its reason and timings; None
    where the file is missing, unreadable or not such a verdict (then measured again)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(d, dict) or d.get(field) not in allowed
            or not isinstance(d.get("reason"), str) or not isinstance(d.get("seconds"), dict)):
        return None
    return d


#: row counts at which radixserve's packed linear kernel and oneDNN's GEMM are timed, in
#: order; the kernel's cap is the last of them before the first at which it is slower. Up to
#: 16 rows a decode step reads the weights from DRAM and the kernel measured ahead on every
#: machine (CHANGELOG.md, 2026-11-23 and 2026-11-24); the crossover lies above and moves with the
#: machine and the kernel: 256 rows for float32 held to AVX2, none up to 512 with AVX-512, on
#: the Zen 5 VM (CHANGELOG.md, 2026-11-24).
KERNEL_ROWS = (16, 32, 64, 128, 256, MAX_ROWS)


@dataclass
class KernelRowsChoice:
    """Verdict of ``choose_kernel_rows``.

    Attributes:
        max_rows: calls of up to this many rows take radixserve's kernel, longer ones oneDNN's
            GEMM (the same bits either way).
        reason: one line for the start-up log.
        seconds: "radixserve" and "onednn" -> seconds of one pass over the shapes at each of
            ``KERNEL_ROWS`` measured (the measurement stops at the first loss).
        cached: the verdict came from the cache file.
    """

    max_rows: int
    reason: str
    seconds: dict[str, list[float]]
    cached: bool = False


def kernel_max_rows(secs: dict[str, list[float]]) -> int:
    """The cap a measurement gives: the last of ``KERNEL_ROWS`` before the first row count at
    which the kernel took longer than oneDNN (at least ``KERNEL_ROWS[0]``)."""
    cap = KERNEL_ROWS[0]
    for rows, ours, onednn in zip(KERNEL_ROWS, secs["radixserve"], secs["onednn"],
                                  strict=False):
        if ours > onednn:
            break
        cap = rows
    return cap


def measure_kernel_rows(kernels: CpuKernels, dtype: torch.dtype,
                        shapes: list[tuple[int, int] | torch.Tensor], batch_hint: int,
                        k_blocks: dict[tuple[int, int], int | None]
                        ) -> dict[str, list[float]] | None:
    """Seconds of one pass over ``shapes`` (one layer's projections: [N, K] shapes, or the
    layer's own dense [N, K] weights of ``dtype``) through radixserve's kernel and through
    oneDNN's GEMM at each of ``KERNEL_ROWS``, stopping after the first row count at which the
    kernel is slower; None where the kernel reproduces none of the shapes (``find_k_block``,
    whose results go into ``k_blocks``).

    The weights (random ones for bare shapes; speed does not depend on the values) are packed
    as the model's are; with the model's own weights no random copy of a layer is made, which
    at a 7B model's shapes is a GB of transient memory. Each pass is timed interleaved, best
    of three, so a busy neighbour slows both.
    """
    mk = torch.ops.mkldnn
    g = torch.Generator().manual_seed(0)
    used = []
    for item in shapes:
        if isinstance(item, torch.Tensor):
            w = item.detach()
        else:
            w = (torch.randn(*item, generator=g) * 0.05).to(dtype)
        n, k = w.shape
        packed = mk._reorder_linear_weight(w, batch_hint)
        if (n, k) not in k_blocks:
            k_blocks[(n, k)] = find_k_block(kernels, n, k, batch_hint, dtype, packed=packed)
        if k_blocks[(n, k)] is not None:
            used.append((n, k, k_blocks[(n, k)], packed, mk.data_ptr(packed)))
    if not used:
        return None
    out: dict[str, list[float]] = {"radixserve": [], "onednn": []}
    with torch.inference_mode():
        for rows in KERNEL_ROWS:
            xs = {k: torch.randn(rows, k, generator=g).to(dtype) for _, k, *_ in used}
            ys = {n: torch.empty(rows, n, dtype=dtype) for n, *_ in used}

            def ours(xs: dict[int, torch.Tensor], ys=ys, rows=rows) -> None:
                for n, k, kb, _, ptr in used:
                    kernels.linear_packed_unchecked(dtype, xs[k].data_ptr(), ptr,
                                                    ys[n].data_ptr(), rows, n, k, kb)

            def onednn(xs: dict[int, torch.Tensor]) -> None:
                for _, k, _, packed, _ in used:
                    mk._linear_pointwise(xs[k], packed, None, "none", [], "")

            reps = 8 if rows <= 64 else 2
            best = {"radixserve": math.inf, "onednn": math.inf}
            for _ in range(3):
                for name, fn in (("radixserve", ours), ("onednn", onednn)):
                    best[name] = min(best[name], _time(fn, xs, reps))
            for name, t in best.items():
                out[name].append(t)
            if best["radixserve"] > best["onednn"]:
                break
    return out


def choose_kernel_rows(kernels: CpuKernels, dtype: torch.dtype,
                       shapes: list[tuple[int, int] | torch.Tensor], batch_hint: int,
                       k_blocks: dict[tuple[int, int], int | None],
                       cache_key: str) -> KernelRowsChoice | None:
    """Up to how many rows radixserve's packed linear kernel runs on this machine: the cached
    verdict for ``cache_key`` (the model's shapes and dtype) with this kernel build, CPU and
    torch, or a fresh ``measure_kernel_rows`` (then cached). None where the kernel reproduces
    none of ``shapes``.

    Args:
        kernels: the loaded C kernels, with a linear kernel for ``dtype``.
        dtype: torch.bfloat16 or torch.float32.
        shapes: one layer's projections: [N, K] shapes, or the layer's dense weights (then
            measured on them, without a random copy).
        batch_hint: the hint the model's weights are packed with.
        k_blocks: the model's per-shape K blockings (filled where measured).
        cache_key: identifies the model's shapes and dtype.
    """
    path = _cache_file("kernel-rows", cache_key, str(batch_hint), kernels.build_id)
    with _exclusive(path):
        d = _read(path, "max_rows", KERNEL_ROWS)
        if d is not None:
            return KernelRowsChoice(d["max_rows"], f"measured before on this machine "
                                    f"({path.name}): " + d["reason"], d["seconds"], cached=True)
        secs = measure_kernel_rows(kernels, dtype, shapes, batch_hint, k_blocks)
        if secs is None:
            return None
        cap = kernel_max_rows(secs)
        ms = " ".join(f"{r}: {a * 1e3:.2f}/{b * 1e3:.2f}"
                      for r, a, b in zip(KERNEL_ROWS, secs["radixserve"], secs["onednn"],
                                         strict=False))
        reason = (f"up to {cap} rows, measured on this model's shapes, radixserve/oneDNN ms per "
                  f"layer at rows {ms}")
        _write(path, {"max_rows": cap, "reason": reason, "seconds": secs})
        return KernelRowsChoice(cap, reason, secs)


#: token counts a GGUF's two forms are timed at (decode sizes, and a prefill chunk at half
#: weight, as in ``_WEIGHTS``)
FORM_M = (1, 16, 64, 256)


#: how much faster the blocks must measure to be served instead of the dequantized weights:
#: the dense form computes the checkpoint's own arithmetic (no activation rounding), runs the
#: fused decode stack the per-layer measurement does not see, and a near-tie must not flip
#: with the noise of one start-up's timing
GGUF_FORM_MARGIN = 1.15


@dataclass
class GgufFormChoice:
    """Verdict of ``choose_gguf_form``.

    Attributes:
        form: "gguf" (served in its blocks) or "none" (dequantized into the serving dtype).
        reason: one line for the start-up log.
        seconds: form -> seconds of one pass over a layer's projections and the LM head at
            each of ``FORM_M`` (empty if not measured).
        cached: the verdict came from the cache file.
    """

    form: str
    reason: str
    seconds: dict[str, list[float]]
    cached: bool = False


def dense_form_linear(kernels: CpuKernels, weight: torch.Tensor, batch_hint: int,
                      k_blocks: dict[tuple[int, int], int | None]) -> Callable[
                          [torch.Tensor], torch.Tensor]:
    """The linear a dense model's ``weight [N, K]`` (bfloat16 or float32) is served through
    here, as ``ModelRunner`` picks it when packing: radixserve's AMX GEMM where it runs, else
    oneDNN's packed GEMM with radixserve's kernel for decode-sized calls (its default row
    cap; ``k_blocks`` shared between calls as in ``packed_kernel_linear``), else
    ``F.linear``. Timing the dense form through oneDNN alone would charge it oneDNN's
    matrix-vector speed at one row, which the served model never pays."""
    if weight.dtype == torch.bfloat16 and kernels.amx.available and kernels.amx.self_check()[0]:
        return AmxLinear(kernels.amx, weight)

    def kernel(packed: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        return packed_kernel_linear(kernels, packed, w, b, batch_hint, k_blocks)

    factory = kernel if kernels.has_linear_kernel(weight.dtype) else None
    return packed_linear(weight, None, batch_hint, factory) or dense_linear(weight)


def measure_gguf_forms(blocks: list[tuple[int, torch.Tensor, torch.Tensor]],
                       kernels: CpuKernels, dtype: torch.dtype, batch_hint: int
                       ) -> dict[str, list[float]]:
    """Seconds of one pass over ``blocks`` (``(ggml type, uint8 [N, row bytes] blocks, the
    same weight dequantized [N, K] in ``dtype``)``: a layer's projections and the LM head) at
    each of ``FORM_M`` rows, through the quantized kernels ("gguf") and through the linear
    the dense model would run (``dense_form_linear``, "none"); interleaved, best of two."""
    from radixserve.model_executor.kernels.quant import PACK16

    quant = kernels.quant
    k_blocks: dict[tuple[int, int], int | None] = {}
    packed = [dense_form_linear(kernels, d, batch_hint, k_blocks) for _, _, d in blocks]
    # the blocks as the server holds them (``layers.quantized``: packed where the build can)
    served = [(t | PACK16, quant.pack16(t, b)) if quant.has_pack16(t) else (t, b)
              for t, b, d in blocks]
    out: dict[str, list[float]] = {"gguf": [], "none": []}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in FORM_M:
            xs = [torch.randn(m, d.shape[1], generator=g).to(dtype) for _, _, d in blocks]
            ys = [torch.empty(m, d.shape[0], dtype=dtype) for _, _, d in blocks]

            def quantized(_: object, xs=xs, ys=ys) -> None:
                for (t, b), (_, _, d), x, y in zip(served, blocks, xs, ys, strict=True):
                    quant.linear_unchecked(t, b.data_ptr(), d.shape[0], d.shape[1],
                                           x.data_ptr(), x.dtype, x.shape[0], y.data_ptr(),
                                           y.dtype, d.shape[0])

            def dense(_: object, xs=xs) -> None:
                for p, x in zip(packed, xs, strict=True):
                    p(x)

            reps = 5 if m <= 64 else 1
            tq = min(_time(quantized, None, reps), _time(quantized, None, reps))
            td = min(_time(dense, None, reps), _time(dense, None, reps))
            out["gguf"].append(tq)
            out["none"].append(td)
    return out


def choose_gguf_form(blocks: Callable[[], list[tuple[int, torch.Tensor, torch.Tensor]]],
                     kernels: CpuKernels, dtype: torch.dtype, batch_hint: int,
                     cache_key: str) -> GgufFormChoice:
    """Serve a GGUF in its blocks or dequantized, whichever is faster on this machine: the
    cached verdict for ``cache_key`` (the file's shapes, types and the dtype) with this kernel
    build, CPU and torch, or a fresh ``measure_gguf_forms`` (then cached).

    Args:
        blocks: makes the measured weights (called only when nothing is cached).
        kernels: the C kernels (their quantized ones and the dense form's).
        dtype: the serving dtype of the dense form and of activations.
        batch_hint: the hint dense weights are packed with.
        cache_key: identifies the file's shapes and types, the dtype and the kernels' build.
    """
    # "dense-as-served": verdicts from when the dense form was timed through oneDNN alone
    # are not reused
    path = _cache_file("gguf-form", cache_key, str(batch_hint), "dense-as-served")
    with _exclusive(path):
        d = _read(path, "form", ("gguf", "none"))
        if d is not None:
            return GgufFormChoice(d["form"], f"measured before on this machine ({path.name}): "
                                  + d["reason"], d["seconds"], cached=True)
        secs = measure_gguf_forms(blocks(), kernels, dtype, batch_hint)
        logs = [_WEIGHTS[m] * math.log(d / q)
                for m, q, d in zip(FORM_M, secs["gguf"], secs["none"], strict=True)]
        speedup = math.exp(sum(logs) / sum(_WEIGHTS[m] for m in FORM_M))
        form = "gguf" if speedup > GGUF_FORM_MARGIN else "none"
        ms = " ".join(f"M={m}: {q * 1e3:.2f}/{d * 1e3:.2f}"
                      for m, q, d in zip(FORM_M, secs["gguf"], secs["none"], strict=True))
        reason = (f"measured on a layer and the LM head, blocks/dequantized ms {ms}; blocks "
                  f"{speedup:.2f}x (taken above {GGUF_FORM_MARGIN}x)")
        _write(path, {"form": form, "reason": reason, "seconds": secs})
        return GgufFormChoice(form, reason, secs)


#: how much faster the float32 GEMM must measure for a bfloat16 model to take it: it costs a
#: widening and a rounding per call and rows some 5-10% more at one row on the machines
#: measured (its single-row path streams bf16 weights a little slower than the bf16 GEMV),
#: so a near-tie stays on the bf16 dot products
BF16_GEMM_MARGIN = 1.05


@dataclass
class Bf16GemmChoice:
    """Verdict of ``choose_bf16_gemm``.

    Attributes:
        path: "bf16" (bf16 pair dot products: radixserve's packed kernel and oneDNN) or
            "float32" (radixserve's float32 GEMM over the bf16 weights).
        reason: one line for the start-up log.
        seconds: path -> seconds of one pass over a layer's projections and the LM head at
            each of ``FORM_M`` (empty if not measured).
        cached: the verdict came from the cache file.
    """

    path: str
    reason: str
    seconds: dict[str, list[float]]
    cached: bool = False


def last_level_cache_bytes() -> int | None:
    """Bytes of this CPU's largest cache level (Linux sysfs, cpu0's view), None where sysfs
    does not say."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best or 0, int(digits) * unit)
    return best


def weight_spans(fn: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[int, int]]:
    """(address, bytes) of the weight buffers a linear form reads per call, for
    ``CpuKernels.evict_from_cache``: the packed layouts of ``Bf16WeightLinear``, ``AmxLinear``
    and radixserve's kernel over oneDNN's packing (the bytes of its [N, K] values, at most the
    buffer: the blocked layout only pads); empty for oneDNN's GEMM alone or ``F.linear``, whose
    buffers are not reachable from here (those are then timed with warm caches)."""
    if isinstance(fn, (Bf16WeightLinear, AmxLinear)):
        return [(fn.packed.data_ptr(), fn.packed.nbytes)]
    kernel = getattr(fn, "kernel", None)
    if kernel is not None and hasattr(kernel, "ptr"):
        return [(kernel.ptr, kernel.n * kernel.k * kernel.dtype.itemsize)]
    return []


def measure_bf16_gemms(kernels: CpuKernels, weights: list[torch.Tensor], num_layers: int,
                       batch_hint: int, k_blocks: dict[tuple[int, int], int],
                       cold: bool = False) -> dict[str, list[float]]:
    """Seconds of one forward's linears at each of ``FORM_M`` bf16 rows: ``weights`` are a
    layer's projections then the LM head (bfloat16 [N, K] each), timed apart and added as
    ``num_layers`` x the layer + the head, through the linear a bf16 model is served with
    ("bf16", ``dense_form_linear``) and through the float32 GEMM over the same weights with the
    rows widened and the sums rounded back ("float32", ``Bf16WeightLinear``; ``k_blocks``
    gives each [N, K]'s K blocking); best of two rounds, in each of which the forms of each
    part are packed, timed at every row count and freed in turn. One layer beside the head
    would let the head decide: a 152k-row head is 28 layers' worth of Qwen2.5-1.5B's weights
    at one row, and the two GEMMs rank the shapes differently.

    ``cold``: drop the timed weights from every cache level before each timed call, as for a
    model larger than the last-level cache, whose forward reads each layer from memory. Timed
    warm, one row of Qwen2.5-1.5B's layer cost the float32 GEMM 1.34-1.65x the bf16 path's
    time on the avx512_bf16 VM, against ~1.07x streamed: the widening hides behind the reads
    of a memory-bound call and not behind those of a cached one."""
    shared: dict[tuple[int, int], int | None] = {}
    forms: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
        "bf16": lambda w: dense_form_linear(kernels, w, batch_hint, shared),
        "float32": lambda w: Bf16WeightLinear(kernels, w, None, k_blocks[tuple(w.shape)],
                                              torch.bfloat16)}
    g = torch.Generator().manual_seed(0)
    xs = {m: [torch.randn(m, w.shape[1], generator=g).bfloat16() for w in weights]
          for m in FORM_M}
    parts = (slice(0, -1), slice(-1, None))  # the layer's projections, the LM head
    best: dict[tuple[str, int, int], float] = {}

    llc = last_level_cache_bytes()

    def timed(fns: list, xs: list[torch.Tensor], reps: int) -> float:
        spans = [s for f in fns for s in weight_spans(f)] if cold else []
        if llc is not None and sum(n for _, n in spans) > llc:
            spans = []  # a part larger than the cache streams by itself: flushing costs seconds
        total = 0.0
        for i in range(reps + 1):
            for address, nbytes in spans:
                kernels.evict_from_cache(address, nbytes)
            t = time.perf_counter()
            for f, x in zip(fns, xs, strict=True):
                f(x)
            if i:  # the first call warms up everything but the weights
                total += time.perf_counter() - t
        return total / reps

    # One form of one part is held at a time, packed afresh each round: holding both forms of
    # the layer and the head at once had added their packed bytes to the start-up peak (~73 MiB
    # on a 300 MB model, over a memory bound's margin); the rounds alternate the forms.
    with torch.inference_mode():
        for _round in range(2):
            for p, part in enumerate(parts):
                for name, make in forms.items():
                    fns = [make(w) for w in weights[part]]
                    for i, m in enumerate(FORM_M):
                        t = timed(fns, xs[m][part], 5 if m <= 64 else 1)
                        best[name, p, i] = min(best.get((name, p, i), math.inf), t)
                    del fns
    out: dict[str, list[float]] = {
        name: [num_layers * best[name, 0, i] + best[name, 1, i] for i in range(len(FORM_M))]
        for name in forms}
    return out


def choose_bf16_gemm(kernels: CpuKernels, weights: Callable[[], list[torch.Tensor]],
                     num_layers: int, batch_hint: int, k_blocks: dict[tuple[int, int], int],
                     cache_key: str) -> Bf16GemmChoice:
    """The arithmetic of a bfloat16 model's linears on this CPU (``cpu_bf16_gemm="auto"``):
    bf16 pair dot products, or float32 FMAs over the widened bf16 weights where they measure
    ``BF16_GEMM_MARGIN`` faster (weighted as ``_WEIGHTS``). The cached verdict for
    ``cache_key`` (the model's shapes) on this CPU, torch build and kernel build, or a fresh
    ``measure_bf16_gemms`` (then cached).

    Why: on the avx512_bf16 VM measured (Intel, AMX hidden) ``vdpbf16ps`` ran ~44 GMAC/s per
    core against ~85 for float32 FMAs; over Qwen2.5-1.5B's shapes (28 layers and the LM head)
    the float32 GEMM took 0.92 / 0.72 / 0.69 of the bf16 path's time at 16 / 64 / 256 rows;
    at one row 1.34-1.43x with the weights in cache, where the widening is what costs, and
    0.93-1.16x read from memory, as that model's forward reads them. So a model larger than
    the last-level cache is timed ``cold`` (``measure_bf16_gemms``); a CPU with full-rate
    bf16 dot products ranks the two the other way.

    Args:
        weights: makes the measured bfloat16 weights, a layer's projections then the LM head
            (called only when nothing is cached).
        num_layers: the model's layers (the layer's weight in the total).
        k_blocks: the float32 GEMM's K blocking per [N, K].
    """
    path = _cache_file("bf16-gemm", cache_key, str(batch_hint), "layers-weighted", "cold-ok",
                       kernels.build_id)
    with _exclusive(path):
        d = _read(path, "path", ("bf16", "float32"))
        if d is not None:
            return Bf16GemmChoice(d["path"], f"measured before on this machine ({path.name}): "
                                  + d["reason"], d["seconds"], cached=True)
        ws = weights()
        model_bytes = (num_layers * sum(w.nbytes for w in ws[:-1]) + ws[-1].nbytes)
        llc = last_level_cache_bytes()
        cold = llc is None or model_bytes > llc
        secs = measure_bf16_gemms(kernels, ws, num_layers, batch_hint, k_blocks, cold=cold)
        del ws
        logs = [_WEIGHTS[m] * math.log(b / f)
                for m, b, f in zip(FORM_M, secs["bf16"], secs["float32"], strict=True)]
        speedup = math.exp(sum(logs) / sum(_WEIGHTS[m] for m in FORM_M))
        best = "float32" if speedup > BF16_GEMM_MARGIN else "bf16"
        ms = " ".join(f"M={m}: {b * 1e3:.2f}/{f * 1e3:.2f}"
                      for m, b, f in zip(FORM_M, secs["bf16"], secs["float32"], strict=True))
        reason = (f"measured on a layer (x {num_layers}) and the LM head "
                  f"({'read from memory' if cold else 'in cache'}: {model_bytes >> 20} MiB of "
                  f"linears, last-level cache {'unknown' if llc is None else llc >> 20} MiB), "
                  f"bf16 dot products/"
                  f"float32 FMAs ms per forward {ms}; "
                  f"float32 {speedup:.2f}x (taken above {BF16_GEMM_MARGIN}x)")
        _write(path, {"path": best, "reason": reason, "seconds": secs})
        return Bf16GemmChoice(best, reason, secs)
