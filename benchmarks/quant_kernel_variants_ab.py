"""Builds of the GGUF-block linear kernels (``rs_quant_linear``) that differ in compile-time
defines, timed alternately in one process (a shared VM's speed drifts: every variant moves
alike), every variant's outputs checked bit for bit against the first's.

Each ``--variants`` entry is a ``+``-joined list of ``NAME`` or ``NAME=VALUE`` passed as
``-D`` to the kernel build (``kernels.cpu.CFLAGS``, ``-march=native`` unless ``--march``); an empty entry is the default build.
Weights are random valid blocks (``bench.quant_kernels``) rotated over copies past the last-
level cache, as a decode step streams them. Prints per type and row count the best and median
microseconds per call per variant.

    python benchmarks/quant_kernel_variants_ab.py --variants ,TILE_M=4+QPF=2048 \\
        --types Q4_K,Q6_K --rows 1,4,8,16,64

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

from radixserve.bench.quant_kernels import _BY_NAME, _random_blocks
from radixserve.model_executor.kernels import cpu
from radixserve.model_executor.kernels.quant import PACK16, row_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",TILE_M=4")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--rows", default="1,4,8,16,64")
    ap.add_argument("--n", type=int, default=8960)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--cold-bytes", type=int, default=96 << 20)
    ap.add_argument("--packed", action="store_true",
                    help="weights in the 16-row packed layout (pack16), as served")
    ap.add_argument("--x-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--march", default="native",
                    help="gcc -march for every variant (haswell: the AVX2 kind's build; run "
                         "under benchmarks/avx2_emulation/run.sh so torch is held to AVX2 too)")
    args = ap.parse_args()
    torch.get_num_threads()  # torch's libgomp first, as CpuKernels.load does
    tmp = Path(tempfile.mkdtemp(prefix="rs-quant-ab-"))
    kernels = {}
    for i, v in enumerate(args.variants.split(",")):
        lib = tmp / f"variant-{i}.so"
        defines = [f"-D{d}" for d in v.split("+") if d]
        subprocess.run(["gcc", *cpu.CFLAGS, f"-march={args.march}", *defines, "-o", str(lib),
                        *map(str, cpu.SOURCES), "-lm"], check=True)
        kernels[v or "default"] = cpu.CpuKernels(ctypes.CDLL(str(lib))).quant
    print("isa per variant:", {v: q.isa for v, q in kernels.items()}, file=sys.stderr)
    gen = torch.Generator().manual_seed(0)
    n, k = args.n, args.k
    result: dict = {"shape": [n, k], "variants": list(kernels), "types": {}}
    for name in args.types.split(","):
        t = _BY_NAME[name]
        nbytes = n * row_bytes(t, k)
        copies = [_random_blocks(t, n, k, gen) for _ in range(max(1, -(-args.cold_bytes
                                                                     // nbytes)))]
        if args.packed:
            first = next(iter(kernels.values()))
            copies = [first.pack16(t, w) for w in copies]
            t |= PACK16
        result["types"][name] = {}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen).to(getattr(torch, args.x_dtype))
            outs = {v: torch.empty(m, n) for v in kernels}
            times: dict[str, list[float]] = {v: [] for v in kernels}
            nxt = 0
            for _ in range(args.repeats):
                for v, q in kernels.items():
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        w = copies[nxt]
                        nxt = (nxt + 1) % len(copies)
                        q.linear_unchecked(t, w.data_ptr(), n, k, x.data_ptr(), x.dtype, m,
                                           outs[v].data_ptr(), outs[v].dtype, n)
                    times[v].append((time.perf_counter() - t0) / args.calls)
            # same weights, every variant: outputs compared bit for bit
            w = copies[0]
            ref = None
            for v, q in kernels.items():
                q.linear_unchecked(t, w.data_ptr(), n, k, x.data_ptr(), x.dtype, m,
                                   outs[v].data_ptr(), outs[v].dtype, n)
                if ref is None:
                    ref = outs[v].clone()
                elif not torch.equal(ref, outs[v]):
                    print(f"{name} {m} rows: variant {v!r} changed the bits", file=sys.stderr)
                    return 1
            result["types"][name][str(m)] = {
                v: {"best_us": round(min(ts) * 1e6, 1),
                    "median_us": round(statistics.median(ts) * 1e6, 1),
                    "gb_s": round(nbytes / min(ts) / 1e9, 1)} for v, ts in times.items()}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
