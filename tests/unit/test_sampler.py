"""The sampler over ``SamplingBatch`` arrays: logprob rows list the sampled token first among
equal values (bf16 logits tie often), greedy rows take the argmax, seeded rows are
reproducible whatever the batch around them."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.model_executor.forward_batch import SamplingBatch
from radixserve.model_executor.sampler import logprob_rows, sample


def _ties() -> torch.Tensor:
    # token 7 and token 3 tie for the top value; 5 and 9 tie further down
    logits = torch.full((1, 12), -5.0)
    logits[0, 7] = logits[0, 3] = 2.0
    logits[0, 5] = logits[0, 9] = 1.0
    return logits


def test_sampled_token_first_among_equal_top_logprobs() -> None:
    logits = _ties()
    lp = torch.log_softmax(logits, dim=-1)
    for chosen in (3, 7):
        tokens = torch.tensor([chosen])
        row = logprob_rows(lp, tokens, tokens.numpy(), np.array([4]))[0]
        assert row is not None
        assert int(row[0][0]) == chosen
        top = [(int(t), v) for t, v in row[1:]]
        assert top[0][0] == chosen, top
        assert {t for t, _ in top[:2]} == {3, 7}
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_sampled_token_kept_when_it_ties_with_the_last_kept_value() -> None:
    lp = torch.log_softmax(_ties(), dim=-1)
    for chosen in (5, 9):  # tied at rank 3/4: with top 3 only one of them fits
        tokens = torch.tensor([chosen])
        row = logprob_rows(lp, tokens, tokens.numpy(), np.array([3]))[0]
        assert row is not None
        ids = [int(t) for t, _ in row[1:]]
        assert len(ids) == 3 and ids[2] == chosen and set(ids[:2]) == {3, 7}


def test_greedy_argmax_and_logprobs_in_one_call() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sp = SamplingBatch(logprobs=np.array([-1, 0, 2, 5]))
    res = sample(logits, sp, None)
    assert res.token_ids.tolist() == logits.argmax(-1).tolist()
    assert res.logprobs is not None and res.logprobs[0] is None
    assert len(res.logprobs[1]) == 1 and len(res.logprobs[2]) == 3 and len(res.logprobs[3]) == 6
    want = torch.log_softmax(logits, -1)
    for i in (1, 2, 3):
        tok, val, rank = res.logprobs[i][0]
        assert int(tok) == res.token_ids[i] and rank == 1  # greedy: the top token
        assert abs(val - float(want[i, int(tok)])) < 1e-6


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 100)

    def run(rows: list[int], seed_row: int) -> int:
        n = len(rows)
        gens = [None] * n
        g = torch.Generator().manual_seed(1234)
        gens[seed_row] = g
        sp = SamplingBatch(temperature=np.ones(n, np.float32), top_k=np.full(n, -1),
                           top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                           greedy=np.zeros(n, bool), generators=gens)
        return int(sample(logits[rows], sp, torch.Generator().manual_seed(9)).token_ids[seed_row])

    alone = run([1], 0)
    assert run([0, 1, 2], 1) == alone
    assert run([2, 0, 1], 2) == alone


def test_sampled_token_rank_over_the_whole_vocabulary() -> None:
    # the rank vLLM reports (sampled_token_ranks): 1 + tokens with a strictly higher logprob,
    # whether or not the token is among the top entries returned
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    lp = torch.log_softmax(logits, dim=-1)
    order = lp.argsort(dim=-1, descending=True)
    tokens = torch.stack([order[0, 0], order[1, 4], order[2, 17]])
    rows = logprob_rows(lp, tokens, tokens.numpy(), np.array([0, 2, 3]))
    assert [int(r[0][2]) for r in rows] == [1, 5, 18]
