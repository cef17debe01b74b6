"""Decode-step figures of radixserve's offline ``LLM`` on a GPU, on a random-weight model with
Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads, 2 KV heads of 64, intermediate 4864,
vocabulary 151936, tied embeddings, Q/K/V bias), in bfloat16; ``--shape`` picks another real
model's shapes (``smollm2-135m``, the default model, or any ``bench make-model`` shape).

For each attention backend and each mode (CUDA graphs on, the default; ``enforce_eager=True``):

* decode step time at batch 1, 16, 64, 256: B requests with random 128-token prompts brought to
  steady decode (every step B decodes, no prefill: asserted), a few warm-up steps, then
  ``--steps`` engine steps timed (``EngineCore.step``, as ``LLM._run`` drives it);
* the floor: weight bytes ÷ HBM bandwidth (3.35e12 B/s H100 SXM, 4.8e12 H200, or
  ``--hbm-bw``), and the same with the KV bytes the step must read added;
* GPU time per step: CUDA events around ``ModelRunner.forward_logits`` (the forward's span on
  the GPU, idle gaps between launches included), and the union of the kernels' and copies' busy
  intervals from a torch profiler window of ``--profile-steps`` further steps (the GPU's real
  busy time); busy % = each ÷ wall time per step;
* CPU time per step: the engine's thread (schedule + outputs), the thread that runs the forward
  (``forward_logits``: launches or graph replay, input copies; spin-waits on syncs count), and
  the whole process;
* offline output tok/s: 16 and 64 prompts of 128 random tokens, 256 output tokens each
  (greedy, ``ignore_eos``), through ``LLM.generate``.

Writes one JSON (``--out``; default ``$OUT/decode_bench.json``), rewritten after each
configuration, and prints a table. ``--device cpu --tiny`` runs the same code on tiny shapes
(a check of this script, not a figure).

    python3 benchmarks/gpu/decode_bench.py --out /tmp/decode_bench.json
    python benchmarks/gpu/decode_bench.py --device cpu --tiny --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: SmolLM2-135M-Instruct's shapes (the default model's config.json), for ``--shape smollm2-135m``
SMOLLM2_135M = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2)


def shape_config(name: str) -> dict[str, Any]:
    """transformers config values (plus ``architecture``) of the real model ``name``: a key of
    ``radixserve.bench.make_model.SHAPES`` (the Qwen2.5 and Llama 3 shapes ``bench make-model``
    builds) or ``smollm2-135m``. Raises ValueError naming the known shapes."""
    from radixserve.bench.make_model import SHAPES

    if name == "smollm2-135m":
        return dict(SMOLLM2_135M)
    s = SHAPES.get(name)
    if s is None:
        raise ValueError(f"unknown --shape {name!r}; known: smollm2-135m, {', '.join(SHAPES)}")
    cfg = dict(architecture=s.architecture, vocab_size=s.vocab_size, hidden_size=s.hidden_size,
               intermediate_size=s.intermediate_size, num_hidden_layers=s.num_hidden_layers,
               num_attention_heads=s.num_attention_heads,
               num_key_value_heads=s.num_key_value_heads, head_dim=s.dim_per_head,
               max_position_embeddings=s.max_position_embeddings, rope_theta=s.rope_theta,
               rms_norm_eps=s.rms_norm_eps, tie_word_embeddings=s.tie_word_embeddings,
               bos_token_id=0, eos_token_id=1)
    if s.rope_scaling:
        cfg["rope_scaling"] = dict(s.rope_scaling)
    return cfg


#: Qwen2.5-0.5B's shapes (its config.json), random weights: the default ``--shape``
QWEN25_05B = shape_config("qwen2.5-0.5b")
#: --tiny: the same architecture, small enough for a CPU check in seconds
TINY = dict(QWEN25_05B, vocab_size=512, hidden_size=64, intermediate_size=160,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
#: HBM bandwidth by device name (B/s): H100 SXM5 HBM3, H200 HBM3e
HBM_BW = (("H200", 4.8e12), ("H100", 3.35e12))


# ---------------------------------------------------------------------------- the model
def draft_shape(shape: dict[str, Any]) -> dict[str, Any]:
    """A one-layer model of ``shape``'s vocabulary and tokenizer (hidden 128): the cheapest
    draft that shares the target's tokenizer, for ``--spec-draft-k``."""
    return dict(shape, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def build_model(shape: dict[str, Any], folder: Path, device: str) -> Path:
    """A random-weight Qwen2 or Llama checkpoint of ``shape`` in bfloat16 plus a stub word-level
    tokenizer of its vocabulary (``t0`` .. ``t{V-1}``; prompts go in as token ids). Reused
    when ``folder`` already holds this shape."""
    import transformers

    marker = folder / "bench_shape.json"
    if marker.exists() and json.loads(marker.read_text()) == shape:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    values = {k: v for k, v in shape.items() if k != "architecture"}
    arch = shape["architecture"]
    if arch == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(**values, use_sliding_window=False)
    else:
        cfg = transformers.LlamaConfig(**values)
    cfg.architectures = [arch]
    torch.manual_seed(0)
    # initialise where it is fast (a 7B model is drawn in seconds on the GPU), in bfloat16:
    # a float32 copy of an 8B model would need 32 GB first
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = getattr(transformers, arch)(cfg)
    finally:
        torch.set_default_dtype(old)
    for layer in model.model.layers:  # non-zero Q/K/V biases, as the real model has
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            if proj.bias is not None:
                proj.bias.data.normal_(0, 0.02)
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    write_tokenizer_stub(folder, shape["vocab_size"], shape["bos_token_id"],
                         shape["eos_token_id"])
    marker.write_text(json.dumps(shape))
    return folder


def write_tokenizer_stub(folder: Path, vocab: int, bos: int, eos: int) -> None:
    """tiny_models.write_tokenizer_stub with a vocabulary of ``vocab`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token=f"t{eos}", bos_token=f"t{bos}",
                            unk_token="t2").save_pretrained(str(folder))


# ---------------------------------------------------------------------------- probes
class ForwardProbe:
    """Wraps ``runner.forward_logits`` (an instance attribute shadowing the method): per step,
    whether the CUDA graph path ran, the calling thread's CPU time, CUDA events around it and
    the KV tokens the step reads (sum of context lengths)."""

    def __init__(self, runner: Any, cuda: bool) -> None:
        self.runner = runner
        self.orig = runner.forward_logits
        self.cuda = cuda
        self.active = False
        self.records: list[tuple[bool, float, Any, Any, int]] = []
        runner.forward_logits = self

    def __call__(self, batch: Any) -> Any:
        if not self.active:
            return self.orig(batch)
        graphs = self.runner.graphs
        graphed = graphs is not None and graphs.can_run(batch)
        ev0 = ev1 = None
        c0 = time.thread_time()
        if self.cuda:
            ev0 = torch.cuda.Event(enable_timing=True)
            ev1 = torch.cuda.Event(enable_timing=True)
            ev0.record()
        out = self.orig(batch)
        if self.cuda:
            ev1.record()
        cpu = time.thread_time() - c0
        self.records.append((graphed, cpu, ev0, ev1, int(batch.seq_lens.sum())))
        return out

    def take(self) -> list[tuple[bool, float, Any, Any, int]]:
        out, self.records = self.records, []
        return out


def gpu_busy_from_trace(path: Path) -> tuple[float, float, int]:
    """(union of the GPU's kernel/memcpy/memset intervals, their plain sum, event count), in
    ms, from a torch profiler chrome trace."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                for e in events if e.get("ph") == "X"
                and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    union = total = 0.0
    cur_s = cur_e = None
    for s, e in iv:
        total += e - s
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                union += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        union += cur_e - cur_s
    return union / 1e3, total / 1e3, len(iv)


# ---------------------------------------------------------------------------- measurements
def copy_bandwidth(device: str, nbytes: int = 2**30, reps: int = 10) -> float:
    """Device-to-device copy rate in B/s, bytes read and written counted (a reference beside
    the spec-sheet bandwidth the floor uses)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(reps):
        dst.copy_(src)
    ev1.record()
    torch.cuda.synchronize()
    bw = 2 * nbytes * reps / (ev0.elapsed_time(ev1) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def step_params(ns: argparse.Namespace, max_tokens: int) -> Any:
    """The requests' ``SamplingParams``: greedy, or (``--sampling random``) temperature 0.8,
    top-k 50, top-p 0.95, the sampler's costliest common setting."""
    from radixserve.sampling_params import SamplingParams

    if ns.sampling == "random":
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=max_tokens,
                              ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def decode_window(llm: Any, probe: ForwardProbe, batch: int, ns: argparse.Namespace,
                  rng: np.random.Generator, cuda: bool, weight_bytes: int,
                  kv_bytes_per_token: int, hbm_bw: float) -> dict[str, Any]:
    """Steady-state decode at ``batch``: B requests prefilled, ``ns.warmup`` steps, then
    ``ns.steps`` timed steps, then ``ns.profile_steps`` under the torch profiler (CUDA)."""
    from radixserve.engine_types import EngineRequest

    eng = llm.engine
    budget = llm.config.max_num_batched_tokens
    # decodes run beside the prefill chunks of later prompts: leave them room
    mixed = 2 * math.ceil(batch * ns.prompt_len / budget) + 4
    max_tokens = (mixed + ns.warmup + ns.steps + ns.profile_steps + 4) * (ns.spec_draft_k + 1)
    if ns.prompt_len + max_tokens > llm.engine.max_model_len:
        raise ValueError(f"batch {batch}: {ns.prompt_len} prompt + {max_tokens} tokens do not "
                         f"fit max_model_len {llm.engine.max_model_len}: raise --max-model-len")
    sp = step_params(ns, max_tokens)
    now = time.time()
    for i in range(batch):
        ids = rng.integers(3, llm.model_info.vocab_size, size=ns.prompt_len).astype(np.int32)
        eng.add_request(EngineRequest(request_id=f"bench-{batch}-{i}", prompt_token_ids=ids,
                                      sampling_params=sp, arrival_time=now))

    k = ns.spec_draft_k

    def pure_decode() -> bool:  # with --spec-draft-k: every request verifies k drafts
        if k:
            return eng.last_num_decodes == 0 and eng.last_num_prefill_tokens == batch * (k + 1)
        return eng.last_num_decodes == batch and eng.last_num_prefill_tokens == 0

    for _ in range(100_000):
        eng.step()
        if pure_decode():
            break
    else:
        raise RuntimeError(f"batch {batch} never reached {batch} decodes per step")
    for _ in range(ns.warmup):
        eng.step()
        assert pure_decode(), (eng.last_num_decodes, eng.last_num_prefill_tokens)
    # no synchronize around the window: with overlap one step is in flight at its start and
    # one at its end, so N calls of step() are N steps of the steady pipeline
    probe.take()
    probe.active = True
    walls = []
    w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(ns.steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
        assert pure_decode(), (eng.last_num_decodes, eng.last_num_prefill_tokens)
    wall = time.perf_counter() - w0
    engine_cpu, process_cpu = time.thread_time() - c0, time.process_time() - p0
    probe.active = False
    if cuda:
        torch.cuda.synchronize()  # the events of the window's forwards have completed
    recs = probe.take()
    n = ns.steps
    res: dict[str, Any] = {
        "batch": batch, "steps": n, "forwards_seen": len(recs),
        "graphed_steps": sum(r[0] for r in recs),
        "mean_context": round(float(np.mean([r[4] for r in recs])) / batch, 1) if recs else None,
        "wall_ms": 1e3 * wall / n,
        "wall_ms_median": 1e3 * float(np.median(walls)),
        "wall_ms_p90": 1e3 * float(np.percentile(walls, 90)),
        "engine_cpu_ms": 1e3 * engine_cpu / n,
        "forward_cpu_ms": 1e3 * sum(r[1] for r in recs) / max(len(recs), 1),
        "process_cpu_ms": 1e3 * process_cpu / n,
        "output_tok_s": batch * n / wall,
    }
    kv_tokens = float(np.mean([r[4] for r in recs])) if recs else 0.0
    res["kv_bytes_read"] = kv_tokens * kv_bytes_per_token
    floor_w = floor_kv = None
    if cuda:  # an HBM floor means nothing on CPU
        floor_w = 1e3 * weight_bytes / hbm_bw
        floor_kv = 1e3 * (weight_bytes + res["kv_bytes_read"]) / hbm_bw
    res["floor_weights_ms"], res["floor_weights_kv_ms"] = floor_w, floor_kv
    res["x_floor_weights"] = None if floor_w is None else res["wall_ms"] / floor_w
    res["x_floor_weights_kv"] = None if floor_kv is None else res["wall_ms"] / floor_kv
    if cuda and recs:
        span = float(np.mean([r[2].elapsed_time(r[3]) for r in recs]))
        res["gpu_span_ms"] = span
        res["gpu_span_pct"] = 100 * span / res["wall_ms"]
        res.update(profile_window(eng, ns.profile_steps, pure_decode, res["wall_ms"]))
    # the rest of the requests' tokens, so the next window starts from an empty engine
    while eng.has_unfinished_requests():
        eng.step()
    return res


def profile_window(eng: Any, steps: int, pure_decode: Any, wall_ms: float) -> dict[str, Any]:
    """GPU busy time per step from a torch profiler window (CUDA activity only)."""
    if steps <= 0:
        return {}
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
                assert pure_decode()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            union, total, count = gpu_busy_from_trace(trace)
    except Exception as e:  # report, keep the other figures
        return {"gpu_busy_error": f"{type(e).__name__}: {e}"}
    if count == 0:
        return {"gpu_busy_error": "the profiler recorded no GPU activity"}
    busy = union / steps
    return {"gpu_busy_ms": busy, "gpu_busy_pct": 100 * busy / wall_ms,
            "gpu_kernel_sum_ms": total / steps, "gpu_events_per_step": count / steps}


def offline_run(llm: Any, n: int, ns: argparse.Namespace, rng: np.random.Generator,
                cuda: bool) -> dict[str, Any]:
    """``n`` prompts of ``ns.prompt_len`` random tokens, ``ns.output_len`` tokens each, all
    submitted at once to ``LLM.generate`` (wall time, model already loaded and warm)."""

    vocab = llm.model_info.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, size=ns.prompt_len).tolist()}
               for _ in range(n)]
    sp = step_params(ns, ns.output_len)
    steps0 = llm.engine.step_count
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == n * ns.output_len, out_tokens
    return {"prompts": n, "prompt_len": ns.prompt_len, "output_len": ns.output_len,
            "wall_s": wall, "output_tok_s": out_tokens / wall,
            "total_tok_s": (out_tokens + n * ns.prompt_len) / wall,
            "engine_steps": llm.engine.step_count - steps0}


def run_config(path: Path, backend: str, mode: str, ns: argparse.Namespace,
               shape: dict[str, Any], hbm_bw: float) -> dict[str, Any]:
    """Load the model once for (backend, mode), then every decode batch and offline run."""
    from radixserve import LLM, SamplingParams

    cuda = ns.device.startswith("cuda")
    batches = [int(x) for x in ns.batch_sizes.split(",")]
    offline = [int(x) for x in ns.offline_prompts.split(",") if x]
    max_seqs = max(batches + offline)
    pages_per_seq = -(-ns.max_model_len // ns.page_size)
    kw: dict[str, Any] = dict(
        model=str(path), device=ns.device, dtype=ns.dtype, attention_backend=backend,
        enforce_eager=mode == "eager", tensor_parallel_size=1, max_num_seqs=max_seqs,
        max_model_len=ns.max_model_len, page_size=ns.page_size,
        num_pages=max_seqs * pages_per_seq + 16, seed=0)
    if ns.spec_draft_k:
        # a one-layer random draft of the same vocabulary: it always proposes k tokens, so
        # every step verifies k drafts per request (acceptance means nothing on random
        # weights; the figures are the verify step's cost against a decode step's)
        draft = build_model(draft_shape(shape), path.parent / (path.name + "-draft"),
                            ns.device if cuda else "cpu")
        kw["speculative_config"] = {"method": "draft_model", "model": str(draft),
                                    "num_speculative_tokens": ns.spec_draft_k,
                                    "disable_by_batch_size": None,
                                    "adaptive_draft_length": False}
        offline = []
        max_seqs = max(batches)
        kw["max_num_seqs"] = max_seqs
        kw["num_pages"] = max_seqs * pages_per_seq + 16
    if not cuda:
        kw["pack_weights"] = False  # dense weights: the parameters are what the step reads
        if ns.num_threads:
            kw["num_threads"] = ns.num_threads
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    runner = llm.engine.runner
    res: dict[str, Any] = {
        "attention_backend": backend, "mode": mode, "enforce_eager": mode == "eager",
        "resolved_attention_backend": runner.attention_backend, "load_s": load_s,
        "overlap": llm.engine.overlap, "paths": dict(runner.paths.paths),
        "path_reasons": dict(runner.paths.reasons), "fallbacks": dict(runner.paths.fallbacks),
        "graph_buckets": None if runner.graphs is None else list(runner.graphs.buckets),
        "engine_kwargs": {k: v for k, v in kw.items() if k != "model"},
        "decode": [], "offline": []}
    try:
        params = {id(p): p for p in runner.model.parameters()}.values()
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        elem = torch.empty(0, dtype=runner.dtype).element_size()
        kv_per_token = (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"]
                        * shape["head_dim"] * elem)
        res["weight_bytes"], res["kv_bytes_per_token"] = weight_bytes, kv_per_token
        rng = np.random.default_rng(0)
        # warm-up: first prefill and decode shapes (allocator, autotuning) outside the figures
        llm.generate({"prompt_token_ids": [5] * ns.prompt_len},
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        probe = ForwardProbe(runner, cuda)
        for b in batches:
            res["decode"].append(decode_window(llm, probe, b, ns, rng, cuda, weight_bytes,
                                               kv_per_token, hbm_bw))
            print_row(res, res["decode"][-1], flush=True)
        for n in offline:
            res["offline"].append(offline_run(llm, n, ns, rng, cuda))
            o = res["offline"][-1]
            print(f"  offline {n} prompts x {ns.output_len} tokens: "
                  f"{o['output_tok_s']:.0f} output tok/s ({o['wall_s']:.2f} s, "
                  f"{o['engine_steps']} steps)", flush=True)
    finally:
        llm.engine.shutdown()
        del llm, runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------- report
COLS = ("batch", "step ms", "median", "floor W", "floor W+KV", "x floor W+KV", "GPU busy ms",
        "busy %", "span %", "engine CPU", "fwd CPU", "graphed")


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_row(run: dict[str, Any], d: dict[str, Any], flush: bool = False) -> None:
    print(f"  {run['attention_backend']:>6} {run['mode']:>6} " + " | ".join([
        f"{d['batch']:>4}", _f(d["wall_ms"]), _f(d["wall_ms_median"]),
        _f(d["floor_weights_ms"]), _f(d["floor_weights_kv_ms"]),
        _f(d["x_floor_weights_kv"], "{:.1f}"), _f(d.get("gpu_busy_ms")),
        _f(d.get("gpu_busy_pct"), "{:.0f}"), _f(d.get("gpu_span_pct"), "{:.0f}"),
        _f(d["engine_cpu_ms"]), _f(d["forward_cpu_ms"]),
        f"{d['graphed_steps']}/{d['forwards_seen']}"]), flush=flush)


def print_table(report: dict[str, Any]) -> None:
    hbm = report["hbm_bytes_per_s"]
    print(f"\n{report['device']['name']} {report['dtype']}, "
          f"{report['model']['params'] / 1e6:.1f}M parameters, "
          + (f"HBM {hbm / 1e12:.2f} TB/s" if hbm else "no HBM floor")
          + "; times in ms per decode step")
    print("  backend   mode " + " | ".join(COLS))
    for run in report["runs"]:
        if run.get("error") or run.get("skipped"):
            print(f"  {run['attention_backend']:>6} {run['mode']:>6} "
                  f"{run.get('skipped') or run['error'].splitlines()[-1]}")
            continue
        for d in run["decode"]:
            print_row(run, d)
    print("\n  offline (LLM.generate), output tok/s:")
    for run in report["runs"]:
        for o in run.get("offline", []):
            print(f"  {run['attention_backend']:>6} {run['mode']:>6} {o['prompts']:>3} prompts "
                  f"x {o['output_len']}: {o['output_tok_s']:.0f} ({o['wall_s']:.2f} s)")


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables for docs/benchmarks.md."""
    dev, env, m = report["device"], report["env"], report["model"]
    hbm = report.get("hbm_bytes_per_s")
    copy = report.get("measured_copy_bytes_per_s")
    lines = [
        f"{dev['name']}, {report['dtype']}, random-weight model of "
        + ("tiny shapes (--tiny, a smoke check)" if report.get("tiny")
           else f"{m.get('shape', 'qwen2.5-0.5b')}'s shapes")
        + f" ({m['params'] / 1e6:.1f}M parameters), torch {env['torch']}, triton "
        f"{env.get('triton')}, commit {env.get('git_head') or '?'}, {report['created']}. "
        + (f"Floor: bytes ÷ {hbm / 1e12:.2f} TB/s"
           + (f" (a device-to-device copy measured {copy / 1e12:.2f} TB/s, read + write)"
              if copy else "") + "." if hbm else "No floor (not a GPU)."),
        "",
        "| attention | mode | batch | step ms | floor ms (weights / +KV) | × floor (+KV) "
        "| GPU busy ms | GPU busy % | engine CPU ms | forward CPU ms | graphed steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        if run.get("error") or run.get("skipped"):
            why = run.get("skipped") or run["error"].strip().splitlines()[-1]
            lines.append(f"| {run['attention_backend']} | {run['mode']} | | {why} |||||||")
            continue
        for d in run["decode"]:
            lines.append(
                f"| {run['resolved_attention_backend']} | {run['mode']} | {d['batch']} "
                f"| {d['wall_ms']:.3f} | {_f(d['floor_weights_ms'])} / "
                f"{_f(d['floor_weights_kv_ms'])} | {_f(d['x_floor_weights_kv'], '{:.1f}')} "
                f"| {_f(d.get('gpu_busy_ms'))} | {_f(d.get('gpu_busy_pct'), '{:.0f}')} "
                f"| {d['engine_cpu_ms']:.3f} | {d['forward_cpu_ms']:.3f} "
                f"| {d['graphed_steps']}/{d['forwards_seen']} |")
    lines += ["", "| attention | mode | prompts × (in + out) | output tok/s | total tok/s "
              "| wall s |", "|---|---|---|---:|---:|---:|"]
    for run in report["runs"]:
        for o in run.get("offline", []):
            lines.append(f"| {run['resolved_attention_backend']} | {run['mode']} "
                         f"| {o['prompts']} × ({o['prompt_len']} + {o['output_len']}) "
                         f"| {o['output_tok_s']:.0f} | {o['total_tok_s']:.0f} "
                         f"| {o['wall_s']:.2f} |")
    return "\n".join(lines)


def environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "host": platform.node(),
                            "cpus": os.cpu_count()}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # report only
            info[mod] = f"unavailable: {e}"
    root = Path(__file__).resolve().parents[2]
    try:
        info["git_head"] = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                          capture_output=True, text=True,
                                          timeout=10).stdout.strip() or None
    except Exception:
        info["git_head"] = None
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        dev = {"name": p.name, "total_memory_gib": p.total_memory / 2**30,
               "sms": p.multi_processor_count,
               "capability": list(torch.cuda.get_device_capability(torch.device(device)))}
    else:
        dev = {"name": f"CPU ({platform.processor() or platform.machine()})"}
    return {"env": info, "device": dev}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the figures) or cpu (a smoke check)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and short runs (smoke)")
    ap.add_argument("--shape", default="qwen2.5-0.5b",
                    help="the real model whose shapes the random checkpoint copies: "
                         "smollm2-135m, or a `radixserve bench make-model` shape "
                         "(qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, llama-3.2-1b, llama-3.1-8b)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--spec-draft-k", type=int, default=0,
                    help="speculative decoding with a one-layer random draft proposing K "
                         "tokens: every timed step verifies K drafts per request (no offline)")
    ap.add_argument("--sampling", choices=("greedy", "random"), default="greedy",
                    help="random: temperature 0.8, top-k 50, top-p 0.95 (the sampler's cost)")
    ap.add_argument("--attention-backends", default=None,
                    help="comma-separated (default: torch,triton on CUDA, auto on CPU); one "
                         "not in this tree's ATTENTION_BACKENDS is recorded as skipped")
    ap.add_argument("--modes", default="graphs,eager",
                    help="graphs (CUDA graphs, the default) and/or eager (enforce_eager)")
    ap.add_argument("--batch-sizes", default=None, help="default 1,16,64,256 (tiny: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 16)")
    ap.add_argument("--output-len", type=int, default=None,
                    help="offline output tokens per prompt, default 256 (tiny: 8)")
    ap.add_argument("--offline-prompts", default=None, help="default 16,64 (tiny: 4)")
    ap.add_argument("--warmup", type=int, default=None, help="default 8 (tiny: 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps, default 64 (tiny: 6)")
    ap.add_argument("--profile-steps", type=int, default=8,
                    help="steps under the torch profiler for GPU busy time (CUDA; 0: none)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default 1024 (tiny: 128): also the page-table width CUDA graphs "
                         "capture (the torch backend's graphed attention spans it)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--hbm-bw", type=float, default=None,
                    help="B/s for the floor (default by device name: H100 3.35e12, H200 4.8e12)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    ap.add_argument("--model-dir", default=None,
                    help="where the random checkpoint is written (reused if the same shape)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default $OUT/decode_bench.json, else ./decode_bench.json)")
    ap.add_argument("--markdown", metavar="JSON", default=None,
                    help="print an earlier run's JSON as Markdown tables and exit")
    ns = ap.parse_args()
    if ns.markdown:
        print(markdown(json.loads(Path(ns.markdown).read_text())))
        return
    tiny = ns.tiny
    defaults = dict(batch_sizes="1,4" if tiny else "1,16,64,256",
                    prompt_len=16 if tiny else 128, output_len=8 if tiny else 256,
                    offline_prompts="4" if tiny else "16,64", warmup=2 if tiny else 8,
                    steps=6 if tiny else 64, max_model_len=128 if tiny else 1024)
    for k, v in defaults.items():
        if getattr(ns, k) is None:
            setattr(ns, k, v)
    cuda = ns.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("CUDA is not available (use --device cpu --tiny for a smoke check)")
    if not cuda:
        ns.profile_steps = 0
    out = Path(ns.out or Path(os.environ.get("OUT", ".")) / "decode_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    backends = (ns.attention_backends or ("torch,triton" if cuda else "auto")).split(",")
    modes = ns.modes.split(",")
    shape = TINY if tiny else shape_config(ns.shape)
    if ns.prompt_len + ns.output_len > ns.max_model_len:
        sys.exit("--prompt-len + --output-len must fit --max-model-len")

    from radixserve.config import ATTENTION_BACKENDS

    report: dict[str, Any] = {
        "kind": "radixserve GPU decode bench (benchmarks/gpu/decode_bench.py)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:], "tiny": tiny, "dtype": ns.dtype,
        "sampling": ns.sampling, "spec_draft_k": ns.spec_draft_k, **environment(ns.device)}
    name = report["device"]["name"]
    hbm = ns.hbm_bw or next((bw for key, bw in HBM_BW if key in name), 3.35e12)
    report["hbm_bytes_per_s"] = hbm if cuda else None
    report["hbm_source"] = ("--hbm-bw" if ns.hbm_bw else f"by device name ({name})") if cuda \
        else "none: no floor on CPU"
    if cuda:
        report["measured_copy_bytes_per_s"] = copy_bandwidth(ns.device)
        print(f"device-to-device copy: {report['measured_copy_bytes_per_s'] / 1e12:.2f} TB/s "
              f"(read + write); the floor uses {hbm / 1e12:.2f} TB/s", flush=True)
    report["notes"] = {
        "wall_ms": "mean wall time of one EngineCore.step() over the timed window (steady "
                   "decode, overlap as configured)",
        "engine_cpu_ms": "CPU time of the thread calling step(): schedule + outputs, and the "
                         "forward too when overlap is off (CPU)",
        "forward_cpu_ms": "CPU time inside ModelRunner.forward_logits (the forward thread): "
                          "kernel launches or graph replay, input copies, spin-waits on syncs",
        "process_cpu_ms": "CPU time of the whole process per step (all threads)",
        "gpu_span_ms": "CUDA events around forward_logits: the forward's span on the GPU "
                       "stream, gaps between launches included",
        "gpu_busy_ms": "union of kernel/memcpy/memset intervals per step, torch profiler "
                       "window of --profile-steps further steps (CUDA activity only)",
        "floor_weights_ms": "weight bytes / HBM bandwidth; floor_weights_kv_ms adds the KV "
                            "bytes of the window's mean context",
    }
    folder = Path(ns.model_dir or Path(tempfile.gettempdir()) /
                  (f"radixserve-bench-{ns.shape}-shape" + ("-tiny" if tiny else "")))
    t0 = time.perf_counter()
    path = build_model(shape, folder, ns.device if cuda else "cpu")
    n_params = sum(_safetensors_numels(path).values())
    report["model"] = {"shape": "tiny" if tiny else ns.shape, **shape,
                       "params": n_params, "folder": str(path),
                       "build_s": time.perf_counter() - t0}
    report["runs"] = []
    print(f"model: {n_params / 1e6:.1f}M parameters at {path} "
          f"({report['model']['build_s']:.1f} s); device {name}", flush=True)
    print("  backend   mode " + " | ".join(COLS), flush=True)
    for backend in backends:
        for mode in modes:
            if backend not in ATTENTION_BACKENDS:
                run = {"attention_backend": backend, "mode": mode,
                       "skipped": f"not in this tree's ATTENTION_BACKENDS {ATTENTION_BACKENDS}"}
            else:
                try:
                    run = run_config(path, backend, mode, ns, shape, hbm)
                except Exception:
                    run = {"attention_backend": backend, "mode": mode,
                           "error": traceback.format_exc()}
                    print(run["error"], flush=True)
            report["runs"].append(run)
            out.write_text(json.dumps(report, indent=1))
    print_table(report)
    print("\n" + markdown(report))
    print(f"\nwrote {out}")
    if any(r.get("error") for r in report["runs"]):
        sys.exit(1)


def _safetensors_numels(folder: Path) -> dict[str, int]:
    """Parameter counts per tensor from the checkpoint's safetensors headers."""
    from safetensors import safe_open

    counts = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                counts[k] = math.prod(st.get_slice(k).get_shape())
    return counts


if __name__ == "__main__":
    main()
