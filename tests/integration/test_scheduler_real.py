"""The scheduler's fast paths against their reference paths on the real default model: greedy
outputs are identical with prefix caching on and off, overlap on and off, and in a pool small
enough to force preemption."""

from __future__ import annotations

import time

import numpy as np
import pytest

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.engine_types import EngineRequest

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Write a haiku about snow.",
             "Why do birds sing?", "Explain gravity in one sentence.", "Count from 1 to 5.",
             "What is a prime number?", "Describe the color blue."]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, **cfg) -> tuple[dict, EngineCore]:
    """All prompts through a fresh EngineCore sharing ``llm``'s model runner.

    The two cores share the runner's KV storage, each with its own page pool: the fresh core
    writes pages that ``llm``'s radix cache may still map to its own prompts. ``llm``'s cache is
    flushed first, so that no later test of the session reads a prefix hit out of pages this one
    overwrote (a structured-output test did: stale system-prompt K/V, garbage tokens).
    """
    assert not llm.engine.has_unfinished_requests()
    llm.engine.flush_cache()
    base = dict(page_size=llm.config.page_size, max_num_seqs=16, max_num_batched_tokens=256)
    base.update(cfg)
    core = EngineCore(EngineConfig(**base), llm.engine.runner)
    core.check_integrity_each_step = True
    got: dict[str, list[int]] = {}
    # the first request runs alone, the rest join after it finished (its prefix is cached)
    for group in (prompts[:1], prompts[1:]):
        for p in group:
            rid = str(len(got))
            core.add_request(EngineRequest(
                request_id=rid, prompt_token_ids=np.asarray(p, dtype=np.int32),
                sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True), arrival_time=time.time()))
            got[rid] = []
        while core.has_unfinished_requests():
            out = core.step()
            for o in out.all_outputs() if out else []:
                got[o.request_id] += o.new_token_ids
    core.shutdown()
    return got, core


def test_outputs_identical_across_cache_overlap_and_preemption(default_llm: LLM) -> None:
    tok = default_llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for q in QUESTIONS]
    n = 24
    ref, _ = run(default_llm, prompts, n, enable_prefix_caching=False, disable_overlap=True,
                 num_pages=4096)
    # admits two prompts (plus the one-page admission reserve); their decodes then outgrow it
    prompt_pages = max(-(-len(p) // 16) for p in prompts)
    tiny = 1 + 2 * prompt_pages + 1
    variants = {
        "radix+overlap": dict(num_pages=4096, disable_overlap=False),
        "radix, no overlap": dict(num_pages=4096, disable_overlap=True),
        "naive+overlap": dict(num_pages=4096, enable_prefix_caching=False,
                              disable_overlap=False),
        "lpm": dict(num_pages=4096, schedule_policy="lpm"),
        # the shared system-prompt page is counted once with the radix cache
        "tiny pool, radix+overlap": dict(num_pages=tiny - 1, disable_overlap=False),
        "tiny pool, naive, no overlap": dict(num_pages=tiny,
                                             enable_prefix_caching=False,
                                             disable_overlap=True),
    }
    for name, cfg in variants.items():
        got, core = run(default_llm, prompts, n, **cfg)
        assert got == ref, f"{name}: outputs differ from the reference path"
        # the log's prompt throughput counts the chunk tokens computed: a prompt less its
        # prefix hit, and again each context a preemption throws away
        computed = core.scheduler.prompt_tokens_local_compute
        if name.startswith("tiny"):
            assert core.scheduler.num_preemptions > 0, f"{name}: no preemption happened"
            assert core.prefill_tokens > computed, name
        else:
            assert core.prefill_tokens == computed, name
        if name.startswith("radix"):
            # the chat template's shared system prompt is served from the cache
            assert core.scheduler.prefix_hit_tokens > 0, f"{name}: no prefix hit"


def test_prefix_reuse_on_real_model(default_llm: LLM) -> None:
    """A follow-up sharing a 300-token prefix with a finished request computes only its
    suffix, and its greedy output equals the uncached one."""
    tok = default_llm.get_tokenizer()
    base = tok.encode("The quick brown fox jumps over the lazy dog. " * 40,
                      add_special_tokens=False)[:300]
    a = base + tok.encode(" Question one: what jumped?", add_special_tokens=False)
    b = base + tok.encode(" Question two: who was lazy?", add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    default_llm.generate({"prompt_token_ids": a}, sp, use_tqdm=False)
    engine = default_llm.engine
    before = (engine.scheduler.prefix_hit_tokens, engine.prompt_tokens, engine.prefill_tokens)
    cached = default_llm.generate({"prompt_token_ids": b}, sp, use_tqdm=False)[0]
    assert cached.num_cached_tokens >= 300 - default_llm.config.page_size
    assert engine.scheduler.prefix_hit_tokens - before[0] == cached.num_cached_tokens
    # every prompt token arrives; only the suffix past the hit is computed
    assert engine.prompt_tokens - before[1] == len(b)
    assert engine.prefill_tokens - before[2] == len(b) - cached.num_cached_tokens
    cold, _ = run(default_llm, [b], 8, enable_prefix_caching=False, num_pages=512)
    assert cached.outputs[0].token_ids == cold["0"]
