"""Where the sampler measures best beside the CUDA graphs: the engine's sampler
(``radixserve.model_executor.sampler.sample``) timed on the GPU after the forward, as it runs
today, against the alternatives, on float32 logits [B, V] (V = Qwen2.5's 151,936 by default):

* ``gpu``: ``sample`` on the device, tokens copied to the host (what a step pays now);
* ``gpu-graph-argmax``: greedy only, the argmax captured in a CUDA graph (what putting it
  inside the decode graph would save: launches, not GPU work);
* ``host``: the logits copied to the host, then ``sample`` there (sampling on the CPU side).

Parameter sets: ``greedy``; ``greedy+logprobs5``; ``temperature`` (0.8, no filter);
``top-k/top-p`` (0.8, 50, 0.95); ``seeded`` (top-k/top-p with a ``torch.Generator`` per
row). Each figure: the median wall time of ``--iters`` calls, synchronised before each call,
in microseconds (host wall clock: the sampler ends in a device-to-host copy of the tokens, so
the call's wall time is its cost to a step). Writes one JSON (``--out``) and prints a table.

    python3 benchmarks/gpu/sampler_bench.py --out $OUT/sampler_bench.json
    python benchmarks/gpu/sampler_bench.py --device cpu --vocab 4096 --batches 1,4  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixserve.model_executor.forward_batch import ALL_GREEDY, SamplingBatch
from radixserve.model_executor.sampler import sample


def params(kind: str, b: int, device: str) -> SamplingBatch:
    """The ``SamplingBatch`` of ``b`` rows of one parameter set."""
    if kind == "greedy":
        return ALL_GREEDY
    if kind == "greedy+logprobs5":
        return SamplingBatch(logprobs=np.full(b, 5, dtype=np.int64))
    top_k, top_p = (-1, 1.0) if kind == "temperature" else (50, 0.95)
    gens = None
    if kind == "seeded":
        gens = [torch.Generator(device=device).manual_seed(i) for i in range(b)]
    return SamplingBatch(temperature=np.full(b, 0.8, dtype=np.float32),
                         top_k=np.full(b, top_k, dtype=np.int64),
                         top_p=np.full(b, top_p, dtype=np.float32),
                         min_p=np.zeros(b, dtype=np.float32),
                         greedy=np.zeros(b, dtype=bool), generators=gens)


def timed(fn: Callable[[], Any], iters: int, sync: Callable[[], None]) -> float:
    """Median µs of ``iters`` calls of ``fn`` after 3 warm-up calls, synchronised before each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def bench_batch(b: int, ns: argparse.Namespace, dev: torch.device, gen: torch.Generator,
                sync: Callable[[], None]) -> list[dict[str, Any]]:
    """Every parameter set's figures at batch ``b`` (one JSON row each)."""
    cuda = dev.type == "cuda"
    kinds = ("greedy", "greedy+logprobs5", "temperature", "top-k/top-p", "seeded")
    rows: list[dict[str, Any]] = []
    logits = torch.randn(b, ns.vocab, device=dev, dtype=torch.float32) * 4
    work = torch.empty_like(logits)
    host = torch.empty(b, ns.vocab, dtype=torch.float32, pin_memory=cuda)
    for kind in kinds:
        sp = params(kind, b, ns.device)
        host_sp = params(kind, b, "cpu")
        host_gen = torch.Generator().manual_seed(0)

        def on_gpu(sp: SamplingBatch = sp) -> None:
            work.copy_(logits)  # the sampler writes biases and masks in place
            sample(work, sp, gen)

        def on_host(sp: SamplingBatch = host_sp, g: torch.Generator = host_gen) -> None:
            host.copy_(logits)
            sample(host, sp, g)

        row = {"batch": b, "params": kind, "gpu_us": timed(on_gpu, ns.iters, sync)}
        if cuda and not ns.skip_host:  # host is the same as gpu when the device is the CPU
            row["host_us"] = timed(on_host, max(5, ns.iters // 5), sync)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if cuda:
        out = torch.empty(b, dtype=torch.int64, device=dev)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out.copy_(logits.argmax(dim=-1))
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            out.copy_(logits.argmax(dim=-1))
        row = {"batch": b, "params": "greedy", "graph_argmax_us": timed(
            lambda: (graph.replay(), out.cpu()), ns.iters, sync),
            "copy_only_us": timed(lambda: work.copy_(logits), ns.iters, sync)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--skip-host", action="store_true", help="no host-side figures (slow)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = torch.device(ns.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for b in [int(x) for x in ns.batches.split(",")]:
        rows += bench_batch(b, ns, dev, gen, sync)
    report = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu",
              "torch": torch.__version__, "vocab": ns.vocab, "iters": ns.iters, "rows": rows,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out_path = ns.out or os.path.join(os.environ.get("OUT", "/tmp"), "sampler_bench.json")
    Path(out_path).write_text(json.dumps(report, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
