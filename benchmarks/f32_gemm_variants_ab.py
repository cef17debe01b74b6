"""Builds of the float32 GEMM over bf16 weights (``rs_linear_f32_bf16w``) that differ in one
compile-time constant, timed alternately in one process, so a machine whose speed drifts (a
shared VM: read bandwidth 25-37 GB/s over a day on the Zen 3 kind) moves every variant alike.

Each ``--variants`` value is passed as ``-D<MACRO>=value`` to the kernel build
(``kernels.cpu.CFLAGS``, ``-march`` from ``--march``), with any further ``:MACRO=value``
entries of the same value as more ``-D`` flags; every variant's outputs must equal the first's
bit for bit. ``--layers`` layers (default 2) of a real shape's four projections (qkv, o,
gate_up, down) with random bf16 weights: 12 layers of Qwen2.5-0.5B (350 MB) are read from
memory past a 260 MB L3. Prints per row count the best and median ms per variant and the
GFLOP/s of the best.

    python benchmarks/f32_gemm_variants_ab.py --macro F32_DIRECT_TILES --variants 0,4 \\
        --rows 2,5,8,16,24
    python benchmarks/f32_gemm_variants_ab.py --macro F32_MC --variants 192,48 --rows 1024,2048
    python benchmarks/f32_gemm_variants_ab.py --shape qwen2.5-0.5b --layers 12 \\
        --macro DIRECT_WIDEN_TILES --variants 1000:PF_AHEAD=1,3 --rows 7,12,16,24

Run it on a quiet machine; name the CPU kind with the figures.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from radixserve.bench.make_model import resolve_shape
from radixserve.model_executor.kernels import cpu
from radixserve.model_executor.layers.bf16_weight_linear import Bf16WeightLinear


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--macro", default="F32_DIRECT_TILES")
    ap.add_argument("--variants", default="0,4")
    ap.add_argument("--rows", default="2,5,8,16,24")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--k-block", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--march", default="native", help="gcc -march (haswell: the AVX2 build)")
    args = ap.parse_args()
    torch.get_num_threads()  # torch's libgomp first, as CpuKernels.load does
    tmp = Path(tempfile.mkdtemp(prefix="rs-gemm-ab-"))
    kernels = {}
    for v in args.variants.split(","):
        lib = tmp / f"variant-{v}.so"
        value, *more = v.split(":")
        defines = [f"-D{args.macro}={value}", *(f"-D{m}" for m in more)]
        subprocess.run(["gcc", *cpu.CFLAGS, f"-march={args.march}", *defines, "-o",
                        str(lib), *map(str, cpu.SOURCES), "-lm"], check=True)
        kernels[v] = cpu.CpuKernels(ctypes.CDLL(str(lib)))
    s = resolve_shape(args.shape)
    d, h, it = s.dim_per_head, s.hidden_size, s.intermediate_size
    shapes = [((s.num_attention_heads + 2 * s.num_key_value_heads) * d, h),
              (h, s.num_attention_heads * d), (2 * it, h), (h, it)]
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in shapes]
               for _ in range(args.layers)]
    held = {v: [[Bf16WeightLinear(kern, w, None, args.k_block) for w in layer]
                for layer in weights] for v, kern in kernels.items()}
    flop_per_row = 2 * args.layers * sum(n * k for n, k in shapes)
    result: dict = {"shape": args.shape, "macro": args.macro, "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for _, k in shapes}
        ref: list[torch.Tensor] | None = None
        times: dict[str, list[float]] = {v: [] for v in held}
        for _ in range(args.repeats):
            for v, layers in held.items():
                t = time.perf_counter()
                outs = [lin(xs[k]) for layer in layers
                        for (_, k), lin in zip(shapes, layer, strict=True)]
                times[v].append(time.perf_counter() - t)
                if ref is None:
                    ref = outs
                elif not all(torch.equal(a, b) for a, b in zip(ref, outs, strict=True)):
                    print(f"{m} rows: variant {v} changed the bits", file=sys.stderr)
                    return 1
        result["rows"][str(m)] = {
            v: {"best_ms": round(min(t) * 1e3, 2), "median_ms": round(statistics.median(t) * 1e3, 2),
                "gflops": round(flop_per_row * m / min(t) / 1e9)} for v, t in times.items()}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
