"""Structured outputs while speculating, without the model: a draft cut at the first token the
grammar refuses (the matcher left as it was), each verify row's token bitmask being the
grammar's after the drafts before it, the matcher advanced by exactly the kept tokens, and the
sampler picking each verify row among what its own grammar state allows. Real xgrammar over
the default tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model_executor.forward_batch import SamplingBatch
from radixserve.model_executor.sampler import sample
from radixserve.sampling_params import StructuredOutputsParams
from radixserve.structured.compiler import GrammarCompiler
from radixserve.structured.runtime import RUNNING, TERMINATED, GrammarRuntime, RequestGrammar

CHOICES = StructuredOutputsParams(choice=["alpha beta gamma", "alpha delta"])


@pytest.fixture(scope="module")
def runtime(tok) -> GrammarRuntime:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tok, len(tok), [eos])
    return GrammarRuntime(lambda: compiler, len(tok), max_rows=2)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _mask_after(runtime: GrammarRuntime, prefix: list[int]) -> torch.Tensor:
    """int32 [ceil(V / 32)] the token bitmask of a fresh matcher that accepted ``prefix``."""
    import xgrammar as xgr

    g = runtime.new_grammar(CHOICES)
    for t in prefix:
        assert g.matcher.accept_token(t)
    out = xgr.allocate_token_bitmask(1, runtime.vocab_size)
    if not g.matcher.fill_next_token_bitmask(out, 0):
        out[0] = -1
    return out[0]


def _mask_now(g: RequestGrammar, vocab: int) -> torch.Tensor:
    import xgrammar as xgr

    out = xgr.allocate_token_bitmask(1, vocab)
    if not g.matcher.fill_next_token_bitmask(out, 0):
        out[0] = -1
    return out[0]


def test_valid_prefix_cuts_at_the_first_refused_token_and_leaves_the_matcher(tok, runtime):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    full = _ids(tok, "alpha beta gamma")
    g = runtime.new_grammar(CHOICES)
    start = _mask_now(g, runtime.vocab_size)
    # the whole choice, its stop token, then nothing: a terminated grammar accepts no more
    assert g.valid_prefix(np.array(full + [eos, full[0]])) == len(full) + 1
    other = _ids(tok, "alpha delta gamma")
    keep = len(_ids(tok, "alpha delta"))
    assert other[:keep] == _ids(tok, "alpha delta")  # the cut falls between tokens
    assert g.valid_prefix(np.array(other)) == keep
    assert g.valid_prefix(np.array(_ids(tok, "omega"))) == 0
    assert g.valid_prefix(np.array([], dtype=np.int32)) == 0
    assert torch.equal(_mask_now(g, runtime.vocab_size), start)  # rolled back every time
    assert not g.matcher.is_terminated()


def test_verify_rows_get_the_mask_after_their_drafts_and_keep_only_accepted_tokens(
        tok, runtime):
    full = _ids(tok, "alpha beta gamma")
    assert len(full) >= 3
    d = full[:2]
    g = runtime.new_grammar(CHOICES)
    plain = runtime.new_grammar(CHOICES)
    # rows: a plain constrained row, an unconstrained verify request (2 drafts), then the
    # constrained verify request with drafts d (3 rows, the last one the bonus)
    grammars = [plain, None, None, None, g, g, g]
    drafts = np.array([-1, 7, 8, -1, d[0], d[1], -1], dtype=np.int64)
    step = runtime.step(grammars, drafts)  # more rows than max_rows: the buffer grows
    assert step.rows == [0, 4, 5, 6] and step.verify_rows == [4, 5, 6]
    assert [(f, x.tolist()) for f, x in step.verify] == [(4, d)]
    masks = step.fill_verify()
    for j in range(3):
        assert torch.equal(masks[4 + j], _mask_after(runtime, d[:j])), j
    assert torch.equal(_mask_now(g, runtime.vocab_size), _mask_after(runtime, []))
    # draft 0 accepted, draft 1 not: the matcher keeps d[0] and the target's token at row 5
    # ("alpha delta" branches off after "alpha"); the bonus row's pick is not taken
    delta = _ids(tok, "alpha delta")
    assert delta[0] == d[0] and delta[1] != d[1]
    picks = np.array([0, 0, 0, 0, d[0], delta[1], full[2]], dtype=np.int64)
    step.accept_verify(picks)
    assert step.status.tolist() == [RUNNING] * 7
    assert torch.equal(_mask_now(g, runtime.vocab_size), _mask_after(runtime, delta[:2]))
    # a verify step whose drafts are all accepted keeps the bonus too, and a stop token that
    # completes the grammar marks its row
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    g2 = runtime.new_grammar(CHOICES)
    step = runtime.step([g2] * 3, np.array([full[0], full[1], -1]))
    step.fill_verify()
    step.accept_verify(np.array(full[:3]))
    assert torch.equal(_mask_now(g2, runtime.vocab_size), _mask_after(runtime, full[:3]))
    rest = full[3:]
    step = runtime.step([g2] * (len(rest) + 2), np.array(rest + [eos, -1]))
    step.fill_verify()
    step.accept_verify(np.array(rest + [eos, 0]))
    assert step.status.tolist() == [RUNNING] * len(rest) + [TERMINATED, RUNNING]
    assert g2.terminated and g2.matcher.is_terminated()


def test_sampler_masks_each_verify_row_with_its_own_grammar_state(tok, runtime):
    """Every row's unmasked favourite is a token no grammar state here allows; the next best is
    the token each row's own state allows (the drafts): the picks are the drafts, so the
    masks were those after the drafts before each row, not the matcher's current one."""
    full = _ids(tok, "alpha beta gamma")
    vocab = runtime.vocab_size
    junk = _ids(tok, " omega")[0]
    g = runtime.new_grammar(CHOICES)
    step = runtime.step([g] * 3, np.array([full[0], full[1], -1]))
    logits = torch.zeros(3, vocab)
    logits[:, junk] = 10.0
    for j in range(3):
        logits[:, full[j]] = 5.0 - j  # every row prefers the earliest choice token
        logits[j, full[j]] = 8.0 - j
    res = sample(logits, SamplingBatch(constraints=step, draft_tokens=np.array(
        [full[0], full[1], -1])), None)
    assert res.token_ids.tolist() == full[:3]
    assert torch.equal(_mask_now(g, vocab), _mask_after(runtime, full[:3]))
