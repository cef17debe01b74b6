"""Structured outputs and prompt logprobs in the engine core, offline, float32: with overlap
scheduling, chunked prefill, a pool small enough to preempt and the radix cache, a constrained
seeded request gets exactly the tokens it gets in a plain engine; prompt logprobs equal a
direct log-softmax over transformers' float32 logits."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
CHATS = [[{"role": "user", "content": f"Give me person number {i} as JSON."}]
         for i in range(6)]


@pytest.fixture(scope="module")
def busy_llm() -> LLM:
    """Everything that could break a matcher or a logprob row at once: overlap on, prefill in
    32-token chunks, 24 KV pages of 16 tokens for up to 16 requests (preemptions)."""
    return LLM(dtype="float32", seed=0, num_pages=24, page_size=16, max_num_seqs=16,
               quantization="none",
               max_num_batched_tokens=32, disable_overlap=False)


def _texts(outs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


@pytest.mark.timeout(600)
def test_constrained_outputs_identical_under_overlap_chunking_preemption(busy_llm,
                                                                          default_llm) -> None:
    assert busy_llm.engine.overlap and not default_llm.engine.overlap
    sp = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=100,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    before = busy_llm.engine.scheduler.num_preemptions
    busy_llm.engine.check_integrity_each_step = True
    try:
        busy = busy_llm.chat(CHATS, sp, use_tqdm=False)
    finally:
        busy_llm.engine.check_integrity_each_step = False
    assert busy_llm.engine.scheduler.num_preemptions > before  # really preempted
    plain = default_llm.chat(CHATS, sp, use_tqdm=False)
    assert _texts(busy) == _texts(plain)
    for o in busy:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    # the same requests again: prompt prefixes come from the radix cache, tokens do not change
    again = default_llm.chat(CHATS, sp, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert _texts(again) == _texts(plain)


@pytest.mark.timeout(300)
def test_grammar_terminates_with_stop_even_with_ignore_eos(default_llm) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, min_tokens=10,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = default_llm.chat(CHATS[:2], sp, use_tqdm=False)
    for o in out:
        assert o.outputs[0].text in ("yes", "no") and o.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="regex"):
        default_llm.generate(["x"], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a(b")), use_tqdm=False)


def _reference(hf_reference, ids: list[int]) -> torch.Tensor:
    model, _ = hf_reference
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.timeout(600)
def test_prompt_logprobs_equal_transformers(busy_llm, default_llm, hf_reference) -> None:
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
    ids = default_llm.get_tokenizer().encode(text, add_special_tokens=False)
    ref = _reference(hf_reference, ids)
    # a cached prefix first: a prompt_logprobs request must recompute it anyway
    default_llm.generate([text], SamplingParams(max_tokens=1), use_tqdm=False)
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    for llm in (default_llm, busy_llm):  # busy: 32-token chunks, overlap
        out = llm.generate([text, text[:50]], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        plp = out.prompt_logprobs
        assert plp is not None and plp[0] is None and len(plp) == len(ids)
        for p in range(1, len(ids)):
            row = plp[p]
            assert abs(row[ids[p]] - float(ref[p - 1, ids[p]])) < 1e-3, p
            top = torch.topk(ref[p - 1], 3)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                if t in row:
                    assert abs(row[t] - v) < 1e-3
            assert len(row) in (3, 4)  # the top 3, plus the prompt's token when not among them


@pytest.mark.timeout(600)
def test_prompt_logprobs_survive_preemption(busy_llm, default_llm) -> None:
    """Many long prompts with prompt logprobs in a 24-page pool: preempted requests recompute
    their prompt and still report each row once, equal to an unpreempted run."""
    prompts = [f"Story {i}: " + "once upon a time there was a small village. " * 5
               for i in range(6)]
    sp = SamplingParams(max_tokens=40, temperature=0, prompt_logprobs=0, ignore_eos=True)
    before = busy_llm.engine.scheduler.num_preemptions
    busy = busy_llm.generate(prompts, sp, use_tqdm=False)
    assert busy_llm.engine.scheduler.num_preemptions > before
    plain = default_llm.generate(prompts, sp, use_tqdm=False)
    for b, p in zip(busy, plain, strict=True):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert b.outputs[0].token_ids == p.outputs[0].token_ids
        for rb, rp in zip(b.prompt_logprobs[1:], p.prompt_logprobs[1:], strict=True):
            assert rb.keys() == rp.keys()
            assert all(abs(rb[k] - rp[k]) < 1e-4 for k in rb)
