"""radixserve's linear kernel against oneDNN's GEMM on SmolLM2-135M's projection shapes.

30 layers of distinct random weights (212 MB in bf16, 425 MB in float32, more than the L3 of
the machines here),
packed by oneDNN as the engine packs them, go through both paths at each row count; every
result is checked bit for bit against oneDNN first. Prints one JSON object: per row count the
best and median milliseconds for the 30 layers and the GFLOP/s of the best.

    python benchmarks/linear_kernel_ab.py --dtype bfloat16 --rows 1,2,8,16,32,64,128,256,512

bfloat16 needs AVX512-BF16, float32 AVX2 + FMA (the kernel is not built elsewhere).
``ONEDNN_MAX_CPU_ISA=AVX2`` with a kernel build for ``-march=haswell`` measures the AVX2 kind's
float32 paths on an AVX-512 machine. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.packed_kernel import find_k_block

#: (N, K) of qkv, o, gate_up and down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,8,16,32,64,128,256,512")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels = CpuKernels.load()
    if kernels is None or not kernels.has_linear_kernel(dtype):
        print(f"no {args.dtype} linear kernel in this build", file=sys.stderr)
        return 2
    mk = torch.ops.mkldnn
    g = torch.Generator().manual_seed(0)
    packed = [[mk._reorder_linear_weight((torch.randn(n, k, generator=g) * 0.05)
                                         .to(dtype), 64) for n, k in SHAPES]
              for _ in range(LAYERS)]
    blocks = {s: find_k_block(kernels, *s, 64, dtype) for s in SHAPES}
    ptrs = [[mk.data_ptr(p) for p in layer] for layer in packed]
    flop_per_row = 2 * LAYERS * sum(n * k for n, k in SHAPES)
    result: dict[str, object] = {"dtype": args.dtype, "shapes": SHAPES, "layers": LAYERS,
                                 "k_blocks": {f"{n}x{k}": b for (n, k), b in blocks.items()},
                                 "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for _, k in SHAPES}
        ys = {n: torch.empty(m, n, dtype=dtype) for n, _ in SHAPES}
        for (n, k), p, ptr in zip(SHAPES, packed[0], ptrs[0], strict=True):
            kernels.linear_packed(xs[k], ptr, ys[n], blocks[(n, k)])
            if m > 1 and not torch.equal(ys[n], mk._linear_pointwise(xs[k], p, None, "none",
                                                                        [], "")):
                print(f"{m} rows, {n}x{k}: not oneDNN's bits", file=sys.stderr)
                return 1

        def onednn(xs=xs) -> None:
            for layer in packed:
                for (_, k), p in zip(SHAPES, layer, strict=True):
                    mk._linear_pointwise(xs[k], p, None, "none", [], "")

        def ours(xs=xs, ys=ys, m=m) -> None:
            for layer in ptrs:
                for (n, k), ptr in zip(SHAPES, layer, strict=True):
                    kernels.linear_packed_unchecked(dtype, xs[k].data_ptr(), ptr,
                                                         ys[n].data_ptr(), m, n, k,
                                                         blocks[(n, k)])

        row: dict[str, dict[str, float]] = {}
        for name, fn in (("onednn", onednn), ("radixserve", ours)):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best = min(times)
            row[name] = {"best_ms": round(best * 1e3, 2),
                         "median_ms": round(statistics.median(times) * 1e3, 2),
                         "gflops": round(flop_per_row * m / best / 1e9)}
        result["rows"][str(m)] = row  # type: ignore[index]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
