"""Where a decode or prefill step's time goes on a GPU: torch profiler tables (CPU and CUDA
activity) of radixserve's engine steps, for the kit's follow-up calls.

For each mode (CUDA graphs; ``enforce_eager``) on a random-weight model of ``--shape``
(decode_bench.py's checkpoint): ``--steps`` steady decode steps at each ``--batch-sizes``, and
one step prefilling ``--prefill-len`` tokens of a single prompt, each under the profiler. Prints
per window: wall ms per step, the top ops by self CPU time and by CUDA time, the number of
kernels per step, and the GPU's idle gaps longer than ``--gap-us`` with the CPU op that ran
meanwhile. Writes the gzipped chrome traces to ``$OUT/profile/`` (at most 8 files come back).

    python3 benchmarks/gpu/profile_step.py --shape qwen2.5-0.5b
    python benchmarks/gpu/profile_step.py --device cpu --tiny   # a check of this script
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_bench as db  # noqa: E402


def gaps(trace: dict[str, Any], min_us: float) -> list[tuple[float, float, str]]:
    """GPU idle gaps over ``min_us`` (start µs from the first kernel, length µs, the innermost
    CPU op spanning the gap's middle)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in ev
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "python_function",
                                               "cuda_runtime", "cuda_driver")]
    out = []
    for (_, e0), (s1, _) in zip(gpu, gpu[1:], strict=False):
        if s1 - e0 < min_us:
            continue
        mid = (e0 + s1) / 2
        inner = [c for c in cpu if float(c["ts"]) <= mid <= float(c["ts"]) + float(c["dur"])]
        name = min(inner, key=lambda c: float(c["dur"]))["name"] if inner else "?"
        out.append((e0 - gpu[0][0], s1 - e0, name[:70]))
    return out


def window(name: str, llm: Any, run: Any, steps: int, ns: argparse.Namespace,
           out_dir: Path, cuda: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts, record_shapes=False, with_stack=False) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    print(f"\n===== {name}: {wall:.3f} ms per step under the profiler ({steps} steps)",
          flush=True)
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=ns.rows, max_name_column_width=60))
    if cuda:
        print(ka.table(sort_by="self_device_time_total", row_limit=ns.rows,
                       max_name_column_width=60))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        with open(path, "rb") as f, gzip.open(out_dir / f"{name}.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    print(f"kernels per step: {len(kernels) / steps:.0f}")
    if cuda:
        g = gaps(trace, ns.gap_us)
        total = sum(x[1] for x in g)
        print(f"GPU gaps > {ns.gap_us} µs: {len(g)}, {total / steps / 1e3:.3f} ms per step; "
              "largest:")
        for start, length, op in sorted(g, key=lambda x: -x[1])[:ns.rows]:
            print(f"  at {start / 1e3:8.3f} ms  {length:8.1f} µs  during {op}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--modes", default="graphs,eager")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=160)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--model-dir", default=None)
    ns = ap.parse_args()
    cuda = ns.device.startswith("cuda")
    shape = db.TINY if ns.tiny else db.shape_config(ns.shape)
    out_dir = Path(os.environ.get("OUT", "/tmp")) / "profile"
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = Path(ns.model_dir or Path(tempfile.gettempdir())
                  / f"rs-{ns.shape}{'-tiny' if ns.tiny else ''}")
    path = db.build_model(shape, folder, ns.device if cuda else "cpu")

    from radixserve import LLM
    from radixserve.engine_types import EngineRequest
    from radixserve.sampling_params import SamplingParams

    batches = [int(x) for x in ns.batch_sizes.split(",")]
    for mode in ns.modes.split(","):
        llm = LLM(model=str(path), device=ns.device, dtype="bfloat16",
                  attention_backend=ns.attention_backend, enforce_eager=mode == "eager",
                  max_num_seqs=max(batches), max_model_len=1024, seed=0,
                  **({} if cuda else {"pack_weights": False}))
        eng = llm.engine
        runner = eng.runner
        print(f"\n##### mode {mode}: paths {dict(runner.paths.paths)}", flush=True)
        rng = np.random.default_rng(0)
        vocab = shape["vocab_size"]
        llm.generate({"prompt_token_ids": [5] * 32},
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ids = rng.integers(3, vocab, size=ns.prefill_len).astype(np.int32)

        def prefill(ids: np.ndarray = ids, sp: SamplingParams = sp, eng: Any = eng) -> None:
            eng.add_request(EngineRequest(request_id=f"p{time.monotonic_ns()}",
                                          prompt_token_ids=ids, sampling_params=sp,
                                          arrival_time=time.time()))
            while eng.has_unfinished_requests():
                eng.step()

        prefill(rng.integers(3, vocab, size=ns.prefill_len).astype(np.int32))  # warm
        window(f"{mode}-prefill{ns.prefill_len}", llm, prefill, 1, ns, out_dir, cuda)
        for b in batches:
            spd = SamplingParams(temperature=0.0, max_tokens=ns.steps + 40, ignore_eos=True)
            for i in range(b):
                eng.add_request(EngineRequest(
                    request_id=f"d{b}-{i}", sampling_params=spd, arrival_time=time.time(),
                    prompt_token_ids=rng.integers(3, vocab, size=64).astype(np.int32)))
            for _ in range(200):
                eng.step()
                if eng.last_num_decodes == b and eng.last_num_prefill_tokens == 0:
                    break
            for _ in range(4):
                eng.step()

            def decode(n: int = ns.steps, eng: Any = eng) -> None:
                for _ in range(n):
                    eng.step()

            window(f"{mode}-decode-b{b}", llm, decode, ns.steps, ns, out_dir, cuda)
            while eng.has_unfinished_requests():
                eng.step()
        eng.shutdown()
        del llm, eng, runner
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
