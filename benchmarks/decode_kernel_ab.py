"""A/B of the paged decode-attention kernel between a git revision and the working tree, both
builds loaded in one process and timed interleaved (best of N), because the shared VMs' speed
drifts by tens of percent between runs. Also checks the two outputs are bit-identical.

    .venv/bin/python benchmarks/decode_kernel_ab.py --base HEAD~1 [--lens 128,512]
    .venv/bin/python benchmarks/decode_kernel_ab.py --verify-run 5 --batch 1 --layers 30
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from radixserve.model_executor.kernels import cpu as kc


def build(sources: list[Path], out: Path, march: str) -> kc.CpuKernels:
    """Only the decode kernel is bound: an older source may lack the other symbols."""
    subprocess.run(["cc", *kc.CFLAGS, f"-march={march}", "-o", str(out), *map(str, sources),
                    "-lm"], check=True)
    fn = ctypes.CDLL(str(out)).rs_paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64,
                   i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib = object.__new__(kc.CpuKernels)
    lib._attn = fn
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the A build")
    ap.add_argument("--lens", default="128,512", help="keys per sequence")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--march", default="native",
                    help="GCC -march of both builds (haswell: the AVX2 kind's code on an "
                         "AVX-512 machine)")
    ap.add_argument("--layers", type=int, default=1,
                    help="KV pools called in turn (30: a step of SmolLM2-135M, whose K/V do "
                         "not fit in cache; 1: the kernel's compute alone)")
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="pages in the KV pool, the sequences' pages drawn at random from it "
                         "(0: just enough, in order; a large pool is what a server has: "
                         "K/V come from DRAM, not cache)")
    ap.add_argument("--verify-run", type=int, default=1,
                    help="rows per sequence: a speculating request's k + 1 verify rows, one "
                         "key longer each over the sequence's pages (batch sequences of them)")
    ns = ap.parse_args()
    torch.get_num_threads()  # torch's libgomp first: the kernels share its thread pool
    tmp = Path(tempfile.mkdtemp())
    # every kernel source at the base revision (the decode kernel's file calls into the others;
    # a file the base lacks is left out)
    root = Path(kc.__file__).parents[4]
    base = []
    for src in kc.SOURCES:
        got = subprocess.run(["git", "show", f"{ns.base}:{src.relative_to(root).as_posix()}"],
                             capture_output=True, text=True)
        if got.returncode == 0:
            (tmp / src.name).write_text(got.stdout)
            base.append(tmp / src.name)
    a = build(base, tmp / "a.so", ns.march)
    b = build(list(kc.SOURCES), tmp / "b.so", ns.march)
    heads, kv_heads, d, page = 9, 3, 64, 16  # SmolLM2-135M's attention
    for dtype in (torch.bfloat16, torch.float32):
        for length in (int(x) for x in ns.lens.split(",")):
            n_pages = -(-length // page)
            pool = max(ns.pool_pages, ns.batch * n_pages + 1)
            kvs = [torch.randn(2, pool, page, kv_heads, d, dtype=dtype)
                   for _ in range(ns.layers)]
            if ns.pool_pages:
                g = torch.Generator().manual_seed(0)
                table = (torch.randperm(pool - 1, generator=g)[:ns.batch * n_pages] + 1
                         ).view(ns.batch, n_pages)
            else:
                table = torch.arange(1, ns.batch * n_pages + 1).view(ns.batch, n_pages)
            run = ns.verify_run
            table = table.repeat_interleave(run, dim=0)
            lens = torch.full((ns.batch,), length).repeat_interleave(run) + torch.arange(
                run).repeat(ns.batch)
            table = torch.cat([table, table[:, -1:]], dim=1) if run > 1 else table
            q = torch.randn(ns.batch * run, heads, d, dtype=dtype)
            outs = {"A": torch.empty_like(q), "B": torch.empty_like(q)}
            best = {"A": 1e9, "B": 1e9}
            for _ in range(ns.reps):
                for name, lib in (("A", a), ("B", b)):
                    calls = max(20, ns.layers)
                    t = time.perf_counter()
                    for i in range(calls):
                        kv = kvs[i % ns.layers]
                        lib.paged_decode_attention(q, kv[0], kv[1], table, lens, outs[name],
                                                   d ** -0.5)
                    best[name] = min(best[name], (time.perf_counter() - t) / calls * 1e3)
            same = torch.equal(outs["A"], outs["B"])
            print(f"{str(dtype).removeprefix('torch.')} batch {ns.batch} x {run} rows x "
                  f"{length} keys: "
                  f"{ns.base} {best['A']:.3f} ms, working tree {best['B']:.3f} ms per layer "
                  f"({best['A'] / best['B']:.2f}x), bit-identical: {same}")


if __name__ == "__main__":
    main()
