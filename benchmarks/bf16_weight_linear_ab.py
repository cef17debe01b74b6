"""Float32 linears over a bf16 checkpoint's weights: held as shipped (radixserve's
``rs_linear_f32_bf16w``) against widened at load (oneDNN's packed float32 GEMM, and radixserve's
float32 kernel over oneDNN's buffer), on a real model's projection shapes.

``--layers`` layers of distinct random bf16 weights of the shape's (qkv, o, gate_up, down) go
through each path at each row count; every result is first checked bit for bit against the
float32 kernel over the widened weights. Prints one JSON object: per row count the best and
median milliseconds over the layers and the GFLOP/s of the best.

    python benchmarks/bf16_weight_linear_ab.py --shape qwen2.5-0.5b --rows 1,16,64,256,2048

Run it on a quiet machine; name the CPU kind with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from radixserve.bench.make_model import resolve_shape
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.bf16_weight_linear import Bf16WeightLinear
from radixserve.model_executor.layers.packed_kernel import find_k_block, layout_matches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    kernels = CpuKernels.load()
    if kernels is None or kernels.f32_gemm_isa is None:
        print("no float32 GEMM in this build", file=sys.stderr)
        return 2
    s = resolve_shape(args.shape)
    d, h, it = s.dim_per_head, s.hidden_size, s.intermediate_size
    shapes = [((s.num_attention_heads + 2 * s.num_key_value_heads) * d, h),
              (h, s.num_attention_heads * d), (2 * it, h), (h, it)]
    mk = torch.ops.mkldnn
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in shapes]
               for _ in range(args.layers)]
    blocks = {sh: find_k_block(kernels, *sh, 64, torch.float32) for sh in shapes}
    kb = {sh: b or sh[1] for sh, b in blocks.items()}
    held = [[Bf16WeightLinear(kernels, w, None, kb[sh]) for w, sh in zip(layer, shapes,
                                                                         strict=True)]
            for layer in weights]
    packed = [[mk._reorder_linear_weight(w.float(), 64) for w in layer] for layer in weights]
    same_layout = all(layout_matches(p, *sh) for p, sh in zip(packed[0], shapes, strict=True))
    flop_per_row = 2 * args.layers * sum(n * k for n, k in shapes)
    result: dict = {"shape": args.shape, "layers": args.layers, "isa": kernels.f32_gemm_isa,
                    "shapes": shapes, "k_blocks": {f"{n}x{k}": b for (n, k), b in blocks.items()},
                    "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for _, k in shapes}
        for (n, k), lin, p in zip(shapes, held[0], packed[0], strict=True):
            if same_layout:
                want = torch.empty(m, n)
                kernels.linear_packed(xs[k], mk.data_ptr(p), want, kb[(n, k)])
                if not torch.equal(lin(xs[k]), want):
                    print(f"{m} rows, {n}x{k}: not the float32 kernel's bits", file=sys.stderr)
                    return 1

        def onednn(xs=xs) -> None:
            for layer in packed:
                for (_, k), p in zip(shapes, layer, strict=True):
                    mk._linear_pointwise(xs[k], p, None, "none", [], "")

        def f32_kernel(xs=xs, m=m) -> None:
            for layer in packed:
                for (n, k), p in zip(shapes, layer, strict=True):
                    out = torch.empty(m, n)
                    kernels.linear_packed(xs[k], mk.data_ptr(p), out, kb[(n, k)])

        def bf16_held(xs=xs) -> None:
            for layer in held:
                for (_, k), lin in zip(shapes, layer, strict=True):
                    lin(xs[k])

        row: dict[str, dict[str, float]] = {}
        paths = [("onednn_f32", onednn), ("bf16_weights", bf16_held)]
        if same_layout:
            paths.insert(1, ("f32_kernel", f32_kernel))
        for name, fn in paths:
            fn()
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best = min(times)
            row[name] = {"best_ms": round(best * 1e3, 2),
                         "median_ms": round(statistics.median(times) * 1e3, 2),
                         "gflops": round(flop_per_row * m / best / 1e9)}
        result["rows"][str(m)] = row
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
