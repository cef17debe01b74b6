"""``radixserve bench offline``: prompts through the offline ``LLM`` (like ``vllm bench
throughput``), optionally against Hugging Face ``transformers`` batched ``generate`` on the same
prompts, same weights and dtype, in the same run."""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from radixserve.bench.datasets import BenchPrompt
from radixserve.engine_types import SpecDecodeCounts


@dataclass
class OfflineResult:
    """Throughput of one engine over a prompt set. Rates are per second of wall time."""

    engine: str
    num_requests: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    prompt_tokens: int
    output_tokens: int
    load_s: float = 0.0
    extra: dict[str, Any] | None = None


def _result(engine: str, prompts: list[BenchPrompt], out_tokens: int, wall: float,
            load: float, extra: dict[str, Any] | None = None) -> OfflineResult:
    p_tok = sum(len(p.token_ids) for p in prompts)
    return OfflineResult(engine, len(prompts), wall, len(prompts) / wall, out_tokens / wall,
                         (p_tok + out_tokens) / wall, p_tok, out_tokens, load, extra)


def spec_decode_summary(before: SpecDecodeCounts, after: SpecDecodeCounts) -> dict[str, Any]:
    """Speculative decoding over a run, from two snapshots of the engine's counters (vLLM's
    figures): drafts, draft and accepted tokens, acceptance rate, mean accepted length (tokens
    a verify step gives a request, bonus token included) and acceptance rate per position."""
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
           for i, a in enumerate(after.accepted_per_pos)]
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "acceptance_rate_per_pos": [a / drafts if drafts else 0.0 for a in per]}


def run_radixserve(prompts: list[BenchPrompt], engine_kwargs: dict[str, Any],
                   ignore_eos: bool = True, temperature: float = 0.0, warmup: bool = True
                   ) -> OfflineResult:
    """All prompts submitted at once to ``LLM.generate``; wall time excludes model load."""
    from radixserve.entrypoints.llm import LLM
    from radixserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    load = time.perf_counter() - t0
    if warmup:
        llm.generate({"prompt_token_ids": prompts[0].token_ids[:16]},
                     SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    params = [SamplingParams(max_tokens=p.output_len, temperature=temperature,
                             ignore_eos=ignore_eos) for p in prompts]
    if llm.engine.timers is not None:
        llm.engine.timers.drain()
    spec0 = llm.engine.get_stats().spec_decode
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params,
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    extra: dict[str, Any] = {"dtype": llm.model_info.dtype,
                             "num_steps": llm.engine.step_count}
    if llm.engine.timers is not None:
        t = llm.engine.timers.drain()
        extra["step_timers_ms"] = {k: 1e3 * sum(v) / max(len(v), 1) for k, v in t.items()}
    spec1 = llm.engine.get_stats().spec_decode
    if spec0 is not None and spec1 is not None:
        extra["spec_decode"] = spec_decode_summary(spec0, spec1)
    del llm
    gc.collect()
    return _result("radixserve", prompts, n_out, wall, load, extra)


def run_transformers(prompts: list[BenchPrompt], model: str | None, dtype: str,
                     batch_size: int | None = None) -> OfflineResult:
    """Hugging Face ``generate`` with left padding, greedy, every prompt forced to its output
    length (``min_new_tokens``), in batches of ``batch_size`` (default: all at once). Loads the
    same weights radixserve loads (a GGUF's dequantized into a cached safetensors folder)."""
    from transformers import AutoModelForCausalLM

    from radixserve.model_executor.device_policy import resolve_device, resolve_dtype
    from radixserve.model_executor.loader import export_hf_weights, resolve_model

    device = resolve_device("auto")
    tdtype = resolve_dtype(dtype, device)
    t0 = time.perf_counter()
    files = resolve_model(model)
    # a GGUF's weights as a safetensors folder, the only form transformers loads as a plain
    # float model (written once, cached)
    folder = files.folder if files.gguf is None else export_hf_weights(files.gguf, "float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=tdtype).to(device).eval()
    load = time.perf_counter() - t0
    bs = batch_size or len(prompts)
    out_len = max(p.output_len for p in prompts)
    n_out = 0
    pad = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(prompts), bs):
            chunk = prompts[s:s + bs]
            width = max(len(p.token_ids) for p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, width - len(p.token_ids):] = torch.tensor(p.token_ids)
                mask[i, width - len(p.token_ids):] = 1
            gen = hf.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=pad)
            n_out += (gen.shape[1] - width) * len(chunk)
    wall = time.perf_counter() - t0
    del hf
    gc.collect()
    return _result("transformers", prompts, n_out, wall, load,
                   {"dtype": str(tdtype).removeprefix("torch."), "batch_size": bs})


def as_dict(r: OfflineResult) -> dict[str, Any]:
    return asdict(r)
