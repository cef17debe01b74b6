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


def _sorted_filter(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """The reference: rank the whole vocabulary of every row, cut by top-k, then top-p."""
    probs = torch.softmax(logits, dim=-1)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    k = torch.from_numpy(np.where(top_k > 0, top_k, probs.shape[1]))
    keep = torch.arange(probs.shape[1])[None, :] < k[:, None]
    csum = sorted_p.cumsum(dim=-1)
    keep &= (csum - sorted_p) < torch.from_numpy(top_p)[:, None] * csum[:, -1:]
    return torch.zeros_like(probs).scatter_(1, idx, sorted_p.masked_fill(~keep, 0.0))


def test_top_k_top_p_among_candidates_keeps_what_a_full_sort_keeps(monkeypatch) -> None:
    """Rows with a top-k, peaked and flat top-p rows, both, and none: the kept tokens and
    their probabilities are those of ranking the whole vocabulary; a batch whose nucleus
    fits the candidates ranks only them, one whose nucleus does not sorts the vocabulary."""
    from radixserve.model_executor import sampler

    vocab = 4000
    gen = torch.Generator().manual_seed(3)
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort",
                        lambda t, *a, **kw: (sorts.append(t.shape), real_sort(t, *a, **kw))[1])
    cases = {  # name: (scale of the logits per row, top_k, top_p, a full sort expected)
        "top-k": ([1.0, 3.0], [50, 7], [1.0, 1.0], False),
        "peaked top-p": ([12.0, 9.0], [-1, 0], [0.9, 0.5], False),
        "top-k and top-p": ([2.0, 1.0, 12.0], [20, 3000, -1], [0.5, 0.95, 0.8], False),
        "flat top-p": ([0.5, 12.0], [-1, 10], [0.95, 0.9], True),
        "some rows unfiltered": ([1.0, 12.0, 1.0], [-1, -1, 30], [1.0, 0.7, 1.0], False),
        "top-k past the vocabulary": ([1.0], [vocab + 5], [0.9], True),
    }
    for name, (scale, top_k, top_p, full_sort) in cases.items():
        logits = torch.randn(len(scale), vocab, generator=gen) * torch.tensor(scale)[:, None]
        k, p = np.array(top_k, np.int64), np.array(top_p, np.float32)
        sorts.clear()
        got = sampler._filter(logits, k, p, np.zeros(len(scale), np.float32))
        assert bool(sorts) == full_sort, (name, sorts)
        cut = np.flatnonzero((k > 0) | (p < 1.0))
        want = torch.softmax(logits, dim=-1)
        want[cut] = _sorted_filter(logits[cut], k[cut], p[cut])
        assert torch.equal(got > 0, want > 0), name
        assert torch.equal(got, want), name
        assert 0 < int((got[0] > 0).sum()) <= vocab
