"""``radixserve bench prefix``: time to first token of a request whose long prefix is in the
radix cache, against the same request with prefix caching off (same model, same weights,
same process)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np

from radixserve.core.engine_core import EngineCore
from radixserve.engine_types import EngineRequest
from radixserve.sampling_params import SamplingParams


def _ttft(core: EngineCore, rid: str, ids: list[int], eos: list[int]) -> tuple[float, int]:
    """Seconds from submitting ``ids`` to its first token; and its cached prompt tokens."""
    t0 = time.perf_counter()
    core.add_request(EngineRequest(
        request_id=rid, prompt_token_ids=np.asarray(ids, dtype=np.int32),
        sampling_params=SamplingParams(temperature=0, max_tokens=1), arrival_time=time.time(),
        eos_token_ids=eos))
    first, cached = None, 0
    while core.has_unfinished_requests():
        out = core.step()
        for o in out.outputs if out else []:
            if o.request_id == rid and first is None:
                first, cached = time.perf_counter() - t0, o.num_cached_tokens
    assert first is not None
    return first, cached


def run_prefix_ttft(engine_kwargs: dict[str, Any], prefix_len: int = 1000,
                    suffix_len: int = 32, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """TTFT (seconds, median over ``repeats``) of ``prefix + new suffix`` with the prefix cached
    (warmed by one earlier request) and with prefix caching off.

    Returns: a JSON-ready dict with both medians, every sample, cached tokens and the ratio.
    """
    from radixserve.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs)
    info = llm.model_info
    special = set(llm.get_tokenizer().all_special_ids)
    allowed = np.setdiff1d(np.arange(info.vocab_size), np.fromiter(special, dtype=np.int64))
    rng = np.random.default_rng(seed)
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    suffixes = [rng.choice(allowed, size=suffix_len).tolist() for _ in range(repeats + 1)]
    eos = list(info.eos_token_ids)
    cfg = llm.config
    on = EngineCore(dataclasses.replace(cfg, enable_prefix_caching=True), llm.engine.runner)
    off = EngineCore(dataclasses.replace(cfg, enable_prefix_caching=False), llm.engine.runner)
    _ttft(on, "warm", prefix + suffixes[0], eos)  # puts the prefix in the cache
    _ttft(off, "warm", prefix + suffixes[0], eos)  # same warm-up work for fairness
    cached, uncached, hits = [], [], []
    for i, suf in enumerate(suffixes[1:]):
        t, hit = _ttft(on, f"on-{i}", prefix + suf, eos)
        cached.append(t)
        hits.append(hit)
        uncached.append(_ttft(off, f"off-{i}", prefix + suf, eos)[0])
    on.shutdown()
    off.shutdown()
    med_on, med_off = statistics.median(cached), statistics.median(uncached)
    return {"prefix_len": prefix_len, "suffix_len": suffix_len, "repeats": repeats,
            "model": info.name, "dtype": info.dtype,
            "ttft_cached_s": med_on, "ttft_uncached_s": med_off,
            "speedup": med_off / med_on, "cached_tokens": hits,
            "samples_cached_s": cached, "samples_uncached_s": uncached}
