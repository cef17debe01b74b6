"""Structured outputs without the model: constraint fields -> ``StructuredOutputsParams``, the
xgrammar compiler (real, over the default tokenizer) and its cache, the engine's matchers and
bitmasks, and the sampler applying a bitmask (with ``min_tokens`` and ``logit_bias``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from radixserve.entrypoints.openai.constraints import (
    required_tools_schema,
    structured_outputs_for,
)
from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.model_executor.forward_batch import SamplingBatch
from radixserve.model_executor.sampler import sample
from radixserve.sampling_params import SamplingParams, StructuredOutputsParams
from radixserve.structured.compiler import GrammarCompiler, GrammarError
from radixserve.structured.runtime import REJECTED, RUNNING, TERMINATED, GrammarRuntime

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b", "a"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
         {"type": "function", "function": {"name": "g"}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


# -- request fields -> constraint -------------------------------------------------------------


def test_params_need_exactly_one_constraint_and_keep_schema_order():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    sp = StructuredOutputsParams(json=SCHEMA)
    assert list(json.loads(sp.json)["properties"]) == ["b", "a"]  # generation order kept
    assert sp.kind == "json" and StructuredOutputsParams(json_object=True).kind == "json_object"
    assert sp.cache_key() == StructuredOutputsParams(json=json.dumps(SCHEMA)).cache_key()


@pytest.mark.parametrize("body,field,kind", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                                 "strict": True}}},
     "response_format", "json"),
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", "json"),
    ({"guided_json": SCHEMA}, "guided_json", "json"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "json"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "json"),
])
def test_constraint_fields(body, field, kind):
    spec, where = structured_outputs_for(chat(**body))
    assert spec is not None and where == field and spec.kind == kind
    if "tools" not in body:  # completions take the same constraint fields
        spec2, _ = structured_outputs_for(CompletionRequest.model_validate({"prompt": "x",
                                                                            **body}))
        assert spec2 == spec


def test_no_constraint_for_text_auto_and_none():
    for body in ({}, {"response_format": {"type": "text"}}, {"tools": TOOLS},
                 {"tools": TOOLS, "tool_choice": "none"}):
        assert structured_outputs_for(chat(**body)) == (None, None)


def test_two_constraints_and_malformed_ones_are_400s():
    with pytest.raises(OpenAIError) as e:
        structured_outputs_for(chat(response_format={"type": "json_object"},
                                    structured_outputs={"regex": "a"}))
    assert e.value.param == "structured_outputs"
    with pytest.raises(OpenAIError) as e:
        structured_outputs_for(chat(structured_outputs={"regex": "a", "choice": ["b"]}))
    assert e.value.param == "structured_outputs" and "exactly one" in e.value.message
    with pytest.raises(Exception, match="schema"):
        chat(response_format={"type": "json_schema", "json_schema": {"name": "n"}})


def test_required_tools_schema_shape():
    req = chat(tools=TOOLS)
    schema = required_tools_schema(req.tools, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [it["properties"]["name"]["enum"] for it in schema["items"]["anyOf"]]
    assert names == [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object",
                                                                       "properties": {}}
    assert required_tools_schema(req.tools, parallel=False)["maxItems"] == 1


# -- compiling (real xgrammar, the default tokenizer) -----------------------------------------


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])


@pytest.mark.parametrize("spec,words", [
    (StructuredOutputsParams(json={"type": "objec"}), "JSON schema"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(regex="a(b"), "regex"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "EBNF grammar"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "EBNF grammar"),
])
def test_invalid_constraints_name_the_problem(compiler, spec, words):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    assert words in str(e.value) and ".cc:" not in str(e.value)


def test_compiled_grammars_are_cached(compiler):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    hits = compiler.hits
    first = compiler.compile(spec)
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA),
                                                     disable_any_whitespace=True))
    assert again is first and compiler.hits == hits + 1
    other = compiler.compile(StructuredOutputsParams(json=SCHEMA))  # whitespace differs
    assert other is not first


def _allowed(row: torch.Tensor, vocab: int) -> set[int]:
    bits = ((row[:, None].to(torch.int64) >> torch.arange(32)) & 1).flatten()[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def _tokens(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_grammar_step_accepts_masks_and_terminates(compiler, tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rt = GrammarRuntime(lambda: compiler, len(tok), max_rows=4)
    g = rt.new_grammar(StructuredOutputsParams(choice=["yes", "no"]))
    step = rt.step([None, g])
    assert step.rows == [1]
    yes = _tokens(tok, "yes")
    maybe = _tokens(tok, "maybe")[0]
    picks = np.array([maybe, maybe])
    assert step.accept(picks, [1]) == [1]  # refused, matcher unchanged
    allowed = _allowed(step.fill([1])[1], len(tok))
    assert yes[0] in allowed and maybe not in allowed
    for t in yes:
        assert rt.step([g]).accept(np.array([t]), [0]) == []
    done = rt.step([g])
    assert _allowed(done.fill([0])[0], len(tok)) == {eos}  # complete: only EOS may follow
    assert done.accept(np.array([eos]), [0]) == [] and done.status.tolist() == [TERMINATED]
    assert rt.step([g]).rows == []  # a finished matcher is left out
    bad = rt.new_grammar(StructuredOutputsParams(choice=["yes", "no"]))
    s = rt.step([bad])
    s.reject([0])
    assert s.status.tolist() == [REJECTED] and bad.done and RUNNING == 0


# -- the sampler applies the mask ----------------------------------------------------------------


def _mask(vocab: int, allowed: list[int]) -> torch.Tensor:
    words = -(-vocab // 32)
    m = torch.zeros((1, words), dtype=torch.int32)
    for t in allowed:
        m[0, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return m


class Allowed:
    """``StepConstraints`` over fixed allowed-token sets per row (a stand-in for the engine's
    ``GrammarStep`` on a synthetic vocabulary); records what the sampler asked."""

    def __init__(self, vocab: int, allowed: dict[int, set[int]]) -> None:
        self.vocab, self.allowed = vocab, allowed
        self.rows = sorted(allowed)
        self.verify_rows: list[int] = []  # no row verifies drafts here
        self.accepted: dict[int, int] = {}
        self.filled: list[int] = []
        self.rejected: list[int] = []

    def accept(self, tokens, rows):
        refused = [r for r in rows if int(tokens[r]) not in self.allowed[r]]
        self.accepted.update({r: int(tokens[r]) for r in rows if r not in refused})
        return refused

    def fill(self, rows):
        self.filled += list(rows)
        n = max(self.rows) + 1
        return torch.cat([_mask(self.vocab, sorted(self.allowed.get(i, range(self.vocab))))
                          for i in range(n)])

    def reject(self, rows):
        self.rejected += list(rows)


def test_sampler_picks_only_allowed_tokens_greedy_and_random():
    vocab = 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    for seed in range(20):
        cons = Allowed(vocab, {0: {5, 77}, 1: {5, 77}})
        sp = SamplingBatch(constraints=cons, greedy=np.array([True, False]),
                           temperature=np.array([0.0, 1.5], np.float32),
                           top_k=np.array([-1, -1]), top_p=np.ones(2, np.float32),
                           min_p=np.zeros(2, np.float32), logprobs=np.array([1, -1]))
        res = sample(logits.clone(), sp, torch.Generator().manual_seed(seed))
        assert set(res.token_ids.tolist()) <= {5, 77}
        assert cons.accepted == {0: res.token_ids[0], 1: res.token_ids[1]}
        assert not cons.rejected
    want = torch.log_softmax(logits, -1)[0, res.token_ids[0]]
    assert res.logprobs[0][0][1] == pytest.approx(float(want))  # logprobs stay raw


def test_no_mask_is_filled_when_the_pick_is_allowed():
    logits = torch.zeros(1, 50)
    logits[0, 9] = 5.0
    cons = Allowed(50, {0: {9, 10}})
    assert sample(logits, SamplingBatch(constraints=cons), None).token_ids.tolist() == [9]
    assert cons.filled == [] and cons.accepted == {0: 9}


def test_grammar_wins_over_min_tokens_when_only_eos_is_allowed():
    vocab, eos = 50, 2
    logits = torch.zeros(1, vocab)
    sp = SamplingBatch(constraints=Allowed(vocab, {0: {eos}}), blocked_tokens={0: [eos]})
    assert sample(logits, sp, None).token_ids.tolist() == [eos]
    sp = SamplingBatch(constraints=Allowed(vocab, {0: {eos, 9}}), blocked_tokens={0: [eos]})
    assert sample(logits, sp, None).token_ids.tolist() == [9]  # min_tokens still holds


def test_logit_bias_changes_greedy_choice():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0
    sp = SamplingBatch(logit_bias={0: (np.array([7]), np.array([100.0], np.float32))})
    assert sample(logits, sp, None).token_ids.tolist() == [7]
    sp = SamplingBatch(logit_bias={0: (np.array([3]), np.array([-100.0], np.float32))})
    assert sample(logits, sp, None).token_ids.tolist() != [3]


@pytest.mark.parametrize("bias,ok", [({5: 100.0}, True), ({5: -100.0}, True), ({5: 101.0}, False),
                                     ({-1: 1.0}, False), ({5: float("nan")}, False)])
def test_logit_bias_bounds(bias, ok):
    if ok:
        assert SamplingParams(logit_bias=bias).logit_bias == bias
    else:
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bias)


def test_masking_only_refused_rows_equals_masking_every_row():
    """The sampler masks only rows whose unmasked pick the grammar refuses (and filtered random
    rows); the tokens equal masking every constrained row first, greedy or seeded-random."""
    vocab, rows = 300, 12
    gen = torch.Generator().manual_seed(1)
    greedy = np.array([i % 3 == 0 for i in range(rows)])
    top_k = np.array([5 if i % 5 == 1 else -1 for i in range(rows)])
    top_p = np.array([0.8 if i % 5 == 2 else 1.0 for i in range(rows)], np.float32)

    def params(seed: int, cons) -> SamplingBatch:
        return SamplingBatch(
            greedy=greedy, temperature=np.where(greedy, 0.0, 0.9).astype(np.float32),
            top_k=top_k, top_p=top_p, min_p=np.zeros(rows, np.float32),
            generators=[torch.Generator().manual_seed(seed + i) for i in range(rows)],
            constraints=cons)

    skipped = 0
    for trial in range(30):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        allowed = {}
        for i in range(rows):
            k = [1, 3, 40, vocab][i % 4]  # from one token up to everything
            ids = torch.randperm(vocab, generator=gen)[:k].tolist()
            if trial % 2 and i % 3 == 0:
                ids.append(int(logits[i].argmax()))  # the unmasked winner allowed
            allowed[i] = set(ids)
        cons = Allowed(vocab, allowed)
        got = sample(logits.clone(), params(trial, cons), None).token_ids
        skipped += rows - len(set(cons.filled))
        ref_logits = logits.clone()
        for i in range(rows):
            forbid = torch.ones(vocab, dtype=torch.bool)
            forbid[list(allowed[i])] = False
            ref_logits[i, forbid] = float("-inf")
        want = sample(ref_logits, params(trial, None), None).token_ids
        assert got.tolist() == want.tolist(), trial
        assert all(int(t) in allowed[i] for i, t in enumerate(got.tolist()))
        assert cons.accepted == dict(enumerate(got.tolist())) and not cons.rejected
    assert skipped > 0  # some rows really skipped the mask
