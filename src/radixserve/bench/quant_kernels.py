"""Microbenchmark of the GGUF-quantized linear kernels (``kernels/quant.py``) against torch's
int4 weight-only GEMM (``_weight_int4pack_mm_for_cpu``, group 32) and float32 ``F.linear``.

Weights are rotated over enough copies to exceed the last-level cache (``cold_bytes``), so
each call streams its weight from memory as a decode step does. The figure of merit at small M
is weight bytes read per second.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.kernels.quant import PACK16, SUPPORTED_TYPES, block_info, row_bytes

_BY_NAME = {v: k for k, v in SUPPORTED_TYPES.items()}


def _random_blocks(ggml_type: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes with small fp16 scales: valid blocks of any supported type."""
    w = torch.randint(0, 256, (n, row_bytes(ggml_type, k)), dtype=torch.uint8, generator=gen)
    block, nbytes = block_info(ggml_type)
    blocks = w.view(n, k // block, nbytes)
    scale = torch.full((n, k // block), 1e-3, dtype=torch.float16).view(torch.uint8)
    scale = scale.view(n, k // block, 2)
    if ggml_type == _BY_NAME["Q6_K"]:
        blocks[..., 208:210] = scale
    elif ggml_type == _BY_NAME["Q8_0"]:
        blocks[..., 0:2] = scale
    else:
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    return w


def _time(fn, min_time: float, clock=time.perf_counter) -> float:
    """Seconds per call: warm up, then the fastest of 5 batches of about min_time / 5 (the
    least disturbed by other processes)."""
    fn()
    t0 = clock()
    fn()
    one = max(clock() - t0, 1e-7)
    reps = max(1, int(min_time / 5 / one))
    runs = []
    for _ in range(5):
        t0 = clock()
        for _ in range(reps):
            fn()
        runs.append((clock() - t0) / reps)
    return min(runs)


def run_quant_bench(n: int = 8960, k: int = 1536, ms: tuple[int, ...] = (1, 4, 16, 64),
                    types: tuple[str, ...] = ("Q4_0", "Q4_K"), min_time: float = 0.5,
                    cold_bytes: int = 96 << 20, threads: int | None = None,
                    cpu_time: bool = False, yardsticks: bool = True) -> dict:
    """Time y[M, n] = x[M, k] @ W^T for each type and M, with the yardsticks.

    Args:
        n, k: the weight's output and input features (k a multiple of 256 for K-quants).
        ms: activation row counts M.
        types: ggml type names (``SUPPORTED_TYPES`` values).
        min_time: seconds of timing per configuration (about).
        cold_bytes: weight copies rotated per configuration cover at least this many bytes
            (0: one copy, cache-warm).
        threads: torch threads (default: as set).
        cpu_time: time with the process's CPU time instead of the wall clock (with
            ``threads=1``: a figure that other processes sharing the cores do not inflate).
        yardsticks: also time torch's int4 GEMM and float32 ``F.linear``.

    Returns:
        {"shape": [n, k], "threads", "isa", "amx_int8", "rows": [{"kernel", "m", "us",
        "weight_bytes", "gb_s"}]}: gb_s is weight bytes per second (1e9); where ``amx_int8``,
        each type also as "NAME (amx off)", its vpdpbusd tiles.
    """
    kern = CpuKernels.load()
    if kern is None:
        raise RuntimeError("the CPU kernels could not be built")
    q = kern.quant
    if threads:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    clock = time.process_time if cpu_time else time.perf_counter

    def rotate(make, nbytes):
        copies = [make() for _ in range(max(1, -(-cold_bytes // max(nbytes, 1))))]
        state = {"i": 0}

        def nxt():
            state["i"] = (state["i"] + 1) % len(copies)
            return copies[state["i"]]
        return nxt

    for name in types:
        t = _BY_NAME[name]
        nbytes = n * row_bytes(t, k)
        # the layout the server holds the type in (``layers.quantized``)
        packed = q.has_pack16(t)
        nxt = rotate(lambda t=t, packed=packed: q.pack16(t, _random_blocks(t, n, k, gen))
                     if packed else _random_blocks(t, n, k, gen), nbytes)
        t = t | PACK16 if packed else t
        # where AMX-INT8 runs, each M also on the vpdpbusd tiles (the A/B that sets
        # AMXQ_MIN_ROWS in quant_kernels.c)
        for amx in ("auto", "off") if q.amx_int8 else ("auto",):
            for m in ms:
                x = torch.randn(m, k, generator=gen)
                out = torch.empty(m, n)

                def call(x=x, out=out, t=t, m=m, nxt=nxt, amx=amx):
                    w = nxt()
                    q.linear_unchecked(t, w.data_ptr(), n, k, x.data_ptr(), x.dtype, m,
                                       out.data_ptr(), out.dtype, n, amx=amx)
                s = _time(call, min_time, clock)
                rows.append({"kernel": name if amx == "auto" else f"{name} (amx off)", "m": m,
                             "us": s * 1e6, "weight_bytes": nbytes, "gb_s": nbytes / s / 1e9,
                             "layout": "pack16" if packed else "rows"})

    if not yardsticks:
        return {"shape": [n, k], "threads": torch.get_num_threads(), "isa": q.isa,
                "amx_int8": q.amx_int8, "clock": "process" if cpu_time else "wall",
                "rows": rows}
    # torch's int4 weight-only GEMM (group 32, scales and zeros) with bfloat16 activations,
    # its vectorized path (float32 activations take a scalar path, ~10x slower)
    def make_int4():
        w = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
        sz = torch.rand(k // 32, n, 2, generator=gen).bfloat16()
        return packed, sz
    nbytes = n * k // 2 + (k // 32) * n * 2 * 2
    nxt4 = rotate(make_int4, nbytes)
    for m in ms:
        x = torch.randn(m, k, generator=gen).bfloat16()

        def call4(x=x):
            packed, sz = nxt4()
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        s = _time(call4, min_time, clock)
        rows.append({"kernel": "torch int4pack g32 bf16", "m": m, "us": s * 1e6,
                     "weight_bytes": nbytes, "gb_s": nbytes / s / 1e9})

    nbytes = n * k * 4
    nxtf = rotate(lambda: torch.randn(n, k, generator=gen), nbytes)
    for m in ms:
        x = torch.randn(m, k, generator=gen)
        s = _time(lambda x=x: F.linear(x, nxtf()), min_time, clock)
        rows.append({"kernel": "F.linear float32", "m": m, "us": s * 1e6,
                     "weight_bytes": nbytes, "gb_s": nbytes / s / 1e9})
    return {"shape": [n, k], "threads": torch.get_num_threads(), "isa": q.isa,
            "amx_int8": q.amx_int8, "clock": "process" if cpu_time else "wall", "rows": rows}


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=None,
                    help="NxK of the weight (repeatable; default 8960x1536)")
    ap.add_argument("--types", default="Q4_0,Q4_K", help="comma-separated ggml type names")
    ap.add_argument("--ms", default="1,4,16,64", help="comma-separated row counts M")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--no-yardsticks", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the raw result dicts")
    a = ap.parse_args()
    for shape in a.shape or ["8960x1536"]:
        n, k = (int(v) for v in shape.split("x"))
        res = run_quant_bench(n, k, ms=tuple(int(m) for m in a.ms.split(",")),
                              types=tuple(a.types.split(",")), min_time=a.min_time,
                              threads=a.threads, cpu_time=a.cpu_time,
                              yardsticks=not a.no_yardsticks)
        if a.json:
            print(json.dumps(res, indent=1))
            continue
        print(f"W [{n}, {k}], {res['threads']} threads, {res['isa']}, {res['clock']} clock")
        for row in res["rows"]:
            print(f"  {row['kernel']:24s} M={row['m']:<3d} {row['us']:10.1f} us "
                  f"{row['gb_s']:6.2f} GB/s")
