"""Speculative decoding for constrained requests (structured outputs) through the real engine:
drafts are cut to what the grammar allows, each verify row is masked with the grammar state
after the drafts before it, and the matcher advances by the kept tokens only.

- Tiny random Llama, a regex over its word-level vocabulary (t4..t9, t40..t99: prompts mix
  allowed and refused tokens, so n-gram drafts get cut) with the n-gram and the draft-model
  methods: greedy and seeded sampled constrained output, beside unconstrained requests in the
  same steps, is token for token the output without speculation, matches the regex, and
  ``check_integrity`` holds after every step.
- The default model asked to repeat a JSON object under its JSON schema: drafts copied from
  the prompt are accepted, the answer is the one it gives without speculation, and it
  validates against the schema.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from tiny_models import tiny_model

from radixserve import LLM, SamplingParams
from radixserve.sampling_params import StructuredOutputsParams

#: tokens t4..t9 and t40..t99 (no allowed token's text is a proper prefix of another's that
#: the grammar could not finish: "t4" is complete, "t40" too), then EOS (t1)
REGEX = "(t[4-9]|t[4-9][0-9])+"
#: null ``disable_by_batch_size``: batched verify steps, which the CPU default leaves out;
#: fixed draft lengths, so every step with a proposal verifies it
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None, "adaptive_draft_length": False}


def _llm(path: str, spec: dict | None) -> LLM:
    llm = LLM(model=path, speculative_config=spec, seed=0, num_pages=256, page_size=4,
              max_num_batched_tokens=24, max_num_seqs=16,
              pack_weights=True)  # the batch-invariant linears: verify rows equal decode rows
    llm.engine.check_integrity_each_step = True
    return llm


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny Llama target and a draft of the same shapes at another init scale (picks that
    agree now and then)."""
    root = Path(tmp_path_factory.mktemp("spec_structured"))
    return tiny_model(root / "target", "llama", 0.2), tiny_model(root / "draft", "llama", 0.15)


@pytest.fixture(scope="module")
def want(models: tuple[str, str]) -> list[tuple[list[int], str | None]]:
    """The outputs without speculation."""
    return _run(_llm(models[0], None))


def _prompts() -> list[list[int]]:
    """Repeated phrases (prompt lookup finds them): odd ones of allowed tokens only, even ones
    with refused tokens (t30..t39) among them."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(6):
        phrase = rng.integers(40 if i % 2 else 30, 100, int(rng.integers(2, 6))).tolist()
        out.append((phrase * 10)[:int(rng.integers(8, 40))])
    return out


def _params() -> list[SamplingParams]:
    cons = StructuredOutputsParams(regex=REGEX)
    out = []
    for i in range(6):
        kw: dict = {"max_tokens": 24, "structured_outputs": cons}
        if i == 3:
            kw.update(temperature=1.0, seed=5)  # seeded: exact under speculation too
        elif i == 4:
            kw = {"max_tokens": 20, "temperature": 0}  # unconstrained, in the same steps
        else:
            kw["temperature"] = 0
        out.append(SamplingParams(**kw))
    return out


def _run(llm: LLM) -> list[tuple[list[int], str | None]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def _check(llm: LLM, want: list[tuple[list[int], str | None]]) -> None:
    got = _run(llm)
    assert got == want
    for i, (toks, reason) in enumerate(got):
        if i == 4:
            continue
        assert reason in ("stop", "length"), (i, reason)
        body = toks[:-1] if reason == "stop" else toks
        assert reason != "stop" or toks[-1] == 1  # EOS ends a complete match
        assert re.fullmatch(REGEX, "".join(f"t{t}" for t in body)), (i, toks)
    counts = llm.engine.get_stats().spec_decode
    assert counts is not None
    assert counts.num_drafts > 10 and counts.num_accepted_tokens > 0, counts


def test_ngram_constrained_output_equals_without_speculation(models, want) -> None:
    _check(_llm(models[0], NGRAM), want)


def test_draft_model_constrained_output_equals_without_speculation(models, want) -> None:
    _check(_llm(models[0], {"method": "draft_model", "model": models[1],
                            "num_speculative_tokens": 3, "disable_by_batch_size": None,
                            "adaptive_draft_length": False}), want)


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "population": {"type": "integer"},
    "rivers": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "population", "rivers"]}
RECORD = {"city": "Lyon", "population": 522250, "rivers": ["Rhone", "Saone"]}


@pytest.mark.slow
def test_default_model_repeats_json_under_its_schema() -> None:
    # the reference: the default model without speculation on the linears a speculating
    # engine picks (packed, batch invariant; dense may be measured faster on a machine)
    spec = LLM(dtype="float32", seed=0, quantization="none",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    spec.engine.check_integrity_each_step = True
    assert spec.engine.runner.paths.paths["linear"] == "packed"
    default_llm = LLM(dtype="float32", seed=0, quantization="none", pack_weights=True)
    msgs = [[{"role": "user", "content": f"Repeat this JSON exactly:\n{json.dumps(RECORD)}"}]]
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    want = default_llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    got = spec.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), SCHEMA)
    counts = spec.engine.get_stats().spec_decode
    assert counts is not None and counts.num_accepted_tokens > 0.5 * counts.num_draft_tokens, (
        counts)
    spec.engine.shutdown()
    default_llm.engine.shutdown()
