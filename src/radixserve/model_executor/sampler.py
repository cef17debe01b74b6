"""Batched per-request sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds,
repetition/presence/frequency penalties, ``logit_bias``, ``min_tokens``, output constraints
(xgrammar token bitmasks), logprobs.

Logits are processed in this order: penalties, ``logit_bias``, ``min_tokens`` blocking, then the
grammar bitmask (so a constrained row can only pick a token its grammar allows), then
temperature and the top-k / top-p / min-p filters. Logprobs are those of the raw logits (vLLM's
default ``raw_logprobs``).

Sampling draws ``argmax(probs / q)`` with ``q ~ Exp(1)`` (the exponential race, equivalent to
sampling from ``probs``; vLLM's and SGLang's samplers use it too). A seeded request draws its
``q`` row from its own ``torch.Generator``, so its tokens do not depend on the batch around it.

Speculative decoding (``SamplingBatch.draft_tokens``): a request verifying k draft tokens has
k + 1 rows, row j giving the target's distribution p_j after drafts 0..j-1; the engine accepts
the leading drafts equal to their rows' picks, then takes the first differing pick (or the
last row's, the bonus). For a random row this is rejection sampling (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", Algorithm 1; vLLM's
``RejectionSampler``) with the n-gram proposer's draft distribution, a point mass q on the
draft x: accepting x with probability min(1, p(x) / q(x)) = p(x), else drawing from
norm(max(p - q, 0)) = p without x, is the same as drawing y ~ p and accepting iff y == x
(P(y == x) = p(x); given y != x, y ~ p restricted to the other tokens). So each row picks
as an ordinary decode row does, and every output token, accepted or not, is one draw from the
target's processed distribution at its position. A seeded row draws only while the rows before
it matched (a rejected row ends its request's draws), so a seeded request uses one draw per
output token, in order: its tokens are the ones it gets without speculation. A constrained
request's verify rows are masked before the pick, each with its grammar state after the drafts
before it (``StepConstraints.verify_rows``), so every row picks from what its grammar allows
there, as the request's decode row would.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from radixserve.model_executor.forward_batch import (
    PromptLogprobsBatch,
    SampleResult,
    SamplingBatch,
)

#: Prompt positions whose logits are materialised at once (float32 [512, V]: ~100 MB for a
#: 49k vocabulary), so a long prompt chunk never holds all its logits.
PROMPT_LOGPROBS_SLICE = 512


def _apply_penalties(logits: torch.Tensor, sp: SamplingBatch) -> None:
    """In place on float32 logits [S, V], for the rows with a penalty."""
    assert sp.penalty_outputs is not None
    rep, pres, freq = sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty
    assert rep is not None and pres is not None and freq is not None
    prompts = sp.penalty_prompts or {}
    for i, generated in sp.penalty_outputs.items():
        r = float(rep[i])
        if r != 1.0:
            # CTRL (Keskar et al. 2019) as in HF's RepetitionPenaltyLogitsProcessor: over prompt
            # and output, divide positive logits and multiply negative ones.
            seen = np.unique(np.concatenate([prompts[i],
                                             np.asarray(generated, dtype=np.int32)]))
            ids = torch.from_numpy(seen.astype(np.int64)).to(logits.device)
            sel = logits[i, ids]
            logits[i, ids] = torch.where(sel > 0, sel / r, sel * r)
        p, f = float(pres[i]), float(freq[i])
        if (p or f) and generated:
            # OpenAI's definition: over generated tokens only.
            out = torch.tensor(generated, dtype=torch.int64, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device)
            counts.index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
            logits[i] -= f * counts + p * (counts > 0)


def _block_tokens(logits: torch.Tensor, blocked: dict[int, list[int]]) -> None:
    """Below ``min_tokens`` a row may not stop: its EOS and stop ids get -inf."""
    vocab = logits.shape[1]
    for i, ids in blocked.items():
        ids = [t for t in ids if t < vocab]
        if ids:
            logits[i, ids] = float("-inf")
def _add_logit_bias(logits: torch.Tensor, bias: dict[int, tuple[np.ndarray, np.ndarray]]
                    ) -> None:
    """In place: ``logits[i, ids] += values`` per row (ids checked below the vocab size by the
    engine core)."""
    dev = logits.device
    for i, (ids, vals) in bias.items():
        logits[i, torch.from_numpy(ids).to(dev)] += torch.from_numpy(vals).to(dev)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                   unblocked: dict[int, torch.Tensor] | None, rows: list[int]) -> None:
    """In place, for ``rows``: -inf for every token the row's grammar forbids (xgrammar's CPU
    or CUDA kernel). ``unblocked`` holds rows as they were before ``min_tokens`` blocking: a row
    whose grammar allows only tokens that blocking removed (its grammar is complete and only
    EOS may follow) takes the grammar-only mask instead, so the grammar wins over
    ``min_tokens``."""
    import xgrammar as xgr

    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
    if unblocked:
        for i, before in unblocked.items():
            if i not in rows:
                continue
            if bool(torch.isneginf(logits[i]).all()):
                logits[i] = before
                xgr.apply_token_bitmask_inplace(logits[i:i + 1], bitmask[i:i + 1],
                                                vocab_size=logits.shape[1])


#: Candidates a top-p row's nucleus is first looked for among: the most likely tokens by
#: ``torch.topk``, which costs far less than sorting the vocabulary (on an H200, a full sort
#: of [256, 151936] probabilities made a sampled decode step 3x a greedy one). A batch whose
#: nucleus is not inside them, a flat distribution, sorts the whole vocabulary instead.
TOP_P_CANDIDATES = 1024


def _filter(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray,
            min_p: np.ndarray) -> torch.Tensor:
    """Probabilities [R, V] after top-k, top-p (nucleus, Holtzman et al. 2019) and min-p.

    ``top_k`` int64 [R] (<= 0: none), ``top_p`` and ``min_p`` float32 [R] stay on the host:
    which filters run is decided there, so a GPU step never waits on a device-to-host copy
    of a flag before it can queue the sampler's kernels.

    The kept tokens are the largest ``top_k``, then of those the ones whose higher-ranked
    mass is below ``top_p`` of the row's total (the top token always stays). They are found
    among the ``m`` most likely tokens, ``m`` the largest ``top_k`` when every cut row has
    one, else at least ``TOP_P_CANDIDATES``: a row without a ``top_k`` keeps only tokens
    inside the first ``top_p`` of its mass, so when the candidates hold that much mass in
    every such row no token outside them is kept; else the whole vocabulary is ranked. Rows
    with neither filter keep every token."""
    dev = logits.device
    probs = torch.softmax(logits, dim=-1)
    if bool((min_p > 0).any()):
        min_p_t = torch.from_numpy(min_p).to(dev)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p_t[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    cut = np.flatnonzero((top_k > 0) | (top_p < 1.0))
    if len(cut) == 0:
        return probs
    if len(cut) == len(top_k):
        return _top_k_top_p(probs, top_k, top_p)
    rows = torch.from_numpy(cut).to(dev)
    out = probs.clone()
    out[rows] = _top_k_top_p(probs[rows], top_k[cut], top_p[cut])
    return out


def _top_k_top_p(probs: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """``probs`` [R, V] with all but each row's top-k / top-p tokens zeroed; every row has a
    ``top_k`` > 0 or a ``top_p`` < 1 (see ``_filter``)."""
    dev = probs.device
    vocab = probs.shape[1]
    k_rows = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    unbounded = k_rows == vocab  # rows only their top-p cuts
    m = int(k_rows[~unbounded].max()) if not unbounded.all() else 0
    if unbounded.any():
        m = max(m, TOP_P_CANDIDATES)
    m = min(m, vocab)
    need_p = bool((top_p < 1.0).any())
    top_p_t = None
    if need_p:
        total = probs.sum(dim=-1, keepdim=True)
        top_p_t = torch.from_numpy(top_p).to(dev)[:, None] * total
    if m < vocab:
        cand_p, idx = probs.topk(m, dim=-1)
        csum = cand_p.cumsum(dim=-1) if need_p else None
        if unbounded.any():
            assert csum is not None and top_p_t is not None
            rows = torch.from_numpy(np.flatnonzero(unbounded)).to(dev)
            if not bool((csum[rows, -1:] >= top_p_t[rows]).all()):
                m = vocab  # a nucleus reaches past the candidates
    if m == vocab:
        cand_p, idx = probs.sort(dim=-1, descending=True)
        csum = cand_p.cumsum(dim=-1) if need_p else None
    keep = (torch.arange(m, device=dev)[None, :]
            < torch.from_numpy(np.minimum(k_rows, m)).to(dev)[:, None])
    if need_p:
        assert csum is not None and top_p_t is not None
        # keep a token if the mass before it is below top_p (the top token always stays)
        keep &= (csum - cand_p) < top_p_t
    return torch.zeros_like(probs).scatter_(1, idx, cand_p.masked_fill(~keep, 0.0))


def sample(logits: torch.Tensor, sp: SamplingBatch, generator: torch.Generator | None,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SampleResult:
    """Pick one token per row.

    Everything here comes from ``sp``, a snapshot taken when the step was scheduled: with
    overlap scheduling the engine mutates its requests while this runs.

    Args:
        logits: float32 [S, V], one row per sampling request; ``logit_bias`` and the grammar
            bitmask are applied to it in place (no copy of a [S, V] tensor per step: the
            runner's logits are not used after sampling, and logprobs are taken before).
        sp: the rows' sampling parameters (``SamplingBatch``).
        generator: engine-wide generator for unseeded random rows.
        argmax: ``logits [S, V] -> int64 [S]`` with ``Tensor.argmax(dim=-1)``'s result (the
            C kernel's ``argmax_rows`` on CPU); None: torch's.

    Returns:
        int64 [S] tokens, and logprob rows for the rows that asked (``top_logprobs`` ordered
        by value, the sampled token first among equal values: bf16 logits tie often).
    """
    raw_logprobs = torch.log_softmax(logits, dim=-1) if sp.logprobs is not None else None
    if sp.penalty_outputs:
        logits = logits.clone()
        _apply_penalties(logits, sp)
    if sp.logit_bias:
        _add_logit_bias(logits, sp.logit_bias)
    cons = sp.constraints if sp.constraints is not None and sp.constraints.rows else None
    unblocked = None
    if sp.blocked_tokens:
        if cons is not None:
            rows = set(cons.rows)
            unblocked = {i: logits[i].clone() for i in sp.blocked_tokens if i in rows}
        logits = logits.clone()
        _block_tokens(logits, sp.blocked_tokens)
    verify = cons.verify_rows if cons is not None else []
    if verify:
        # A constrained request verifying drafts: row j's grammar state is the one after
        # drafts 0..j-1, so its mask is filled and applied before the pick (the rejection
        # sampling of a random row then draws from the masked distribution, as its plain
        # decode row would); its matcher takes the kept tokens after the pick.
        assert cons is not None
        _apply_bitmask(logits, cons.fill_verify(), unblocked, verify)
    tokens, race = _pick(logits, sp, generator, argmax)
    if cons is not None:
        # Constrained rows offer their unmasked pick to their grammar first; only refused
        # rows (and random rows with a top-k/top-p/min-p filter, which must see masked
        # probabilities) get a token bitmask, applied, and a new pick. For a greedy or
        # plain-temperature row whose unmasked winner is allowed, the masked pick is the
        # same token (the argmax, or the exponential race's winner with the same draws, is
        # also the winner among the allowed tokens): exact, and a model that follows its
        # schema costs no [V]-wide mask fill or apply for most rows.
        masked = set(verify)
        lazy = [r for r in cons.rows if r not in masked] if masked else cons.rows
        forced = _filtered_rows(sp, lazy)
        picks = tokens.cpu().numpy()
        if verify:
            cons.accept_verify(picks)
        redo = cons.accept(picks, [r for r in lazy if r not in forced]) + forced
        if redo:
            redo.sort()
            _apply_bitmask(logits, cons.fill(redo), unblocked, redo)
            _repick(logits, sp, tokens, race, redo)
            bad = cons.accept(tokens.cpu().numpy(), redo)
            if bad:
                cons.reject(bad)
    token_ids = tokens.cpu().numpy().astype(np.int64)
    if raw_logprobs is None:
        return SampleResult(token_ids, None)
    assert sp.logprobs is not None
    return SampleResult(token_ids, logprob_rows(raw_logprobs, tokens, token_ids, sp.logprobs))


def exponential_draws(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill float32 ``out`` with Exp(1) draws from ``generator`` in place.

    On CPU: ``-log1p(-u)`` of uniform ``u`` in [0, 1) (inverse transform), at least the
    smallest normal float (a draw of 0 would divide a zero probability by zero); four times
    faster than ``Tensor.exponential_`` there (a [64, 49152] fill: 17 against 69 ms on the
    Zen 5 kind), whose draws were most of a sampled step's sampler time. Exact up to float32
    uniforms' 2^-24 granularity, as torch's own. On a GPU: ``Tensor.exponential_``, one
    kernel where the inverse transform takes five (a seeded row is filled alone: 256 seeded
    rows cost 5.6 ms with it on an H200, 15.6 ms with the transform).
    """
    if out.device.type != "cpu":
        return out.exponential_(generator=generator)
    out.uniform_(generator=generator)
    return out.neg_().log1p_().neg_().clamp_(min=torch.finfo(out.dtype).tiny)


def _pick(logits: torch.Tensor, sp: SamplingBatch, generator: torch.Generator | None,
          argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
          ) -> tuple[torch.Tensor, tuple[np.ndarray, torch.Tensor] | None]:
    """int64 [S] tokens: the argmax for greedy rows, the exponential race over the filtered
    probabilities for random rows. Also returns the random rows and their draws ``q`` [R, V]
    (None without random rows), so a row can be re-picked with the same draws."""
    tokens = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    if sp.greedy is None:
        return tokens, None
    rand = np.flatnonzero(~sp.greedy)
    dev = logits.device
    ridx = torch.from_numpy(rand).to(dev)
    probs = _filtered(logits, sp, rand)
    q = torch.empty_like(probs)
    gens = sp.generators
    drafts = sp.draft_tokens
    unseeded = []
    # a seeded row after a draft row draws only if that row drew and picked its draft: the
    # request's output ends at the first mismatch, so a later row's draw would be wasted and
    # shift the seeded stream (unseeded rows draw all at once: their stream is shared anyway)
    matched = True
    for j, i in enumerate(rand.tolist()):
        g = None if gens is None else gens[i]
        if g is None:
            unseeded.append(j)
            continue
        follows_draft = drafts is not None and i > 0 and drafts[i - 1] >= 0
        if follows_draft and not matched:
            q[j].fill_(1.0)  # never drawn: its pick is not used
            continue
        exponential_draws(q[j], g)
        if drafts is not None and drafts[i] >= 0:
            matched = int((probs[j] / q[j]).argmax()) == int(drafts[i])
    if unseeded:
        u = torch.tensor(unseeded, dtype=torch.int64, device=dev)
        q[u] = exponential_draws(torch.empty(len(unseeded), probs.shape[1], device=dev),
                                 generator)
    tokens[ridx] = (probs / q).argmax(dim=-1)
    return tokens, (rand, q)


def _filtered(logits: torch.Tensor, sp: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    """Probabilities [len(rows), V] of random ``rows`` after temperature and the filters."""
    assert sp.temperature is not None and sp.top_k is not None
    assert sp.top_p is not None and sp.min_p is not None
    dev = logits.device
    idx = torch.from_numpy(rows).to(dev)
    temp = torch.from_numpy(sp.temperature[rows]).to(dev)
    return _filter(logits[idx] / temp[:, None], sp.top_k[rows], sp.top_p[rows], sp.min_p[rows])


def _filtered_rows(sp: SamplingBatch, rows: list[int]) -> list[int]:
    """The random ``rows`` with a top-k, top-p or min-p filter (their pick needs the masked
    probabilities: the filter renormalises over the allowed tokens)."""
    if sp.greedy is None or not rows:
        return []
    assert sp.top_k is not None and sp.top_p is not None and sp.min_p is not None
    idx = np.asarray(rows)
    filtered = ~sp.greedy[idx] & ((sp.top_k[idx] > 0) | (sp.top_p[idx] < 1.0)
                                  | (sp.min_p[idx] > 0))
    return idx[filtered].tolist()


def _repick(logits: torch.Tensor, sp: SamplingBatch, tokens: torch.Tensor,
            race: tuple[np.ndarray, torch.Tensor] | None, rows: list[int]) -> None:
    """Pick ``rows`` again from their masked logits, random rows with their original draws."""
    rand_pos = {} if race is None else {int(i): j for j, i in enumerate(race[0].tolist())}
    greedy = [r for r in rows if r not in rand_pos]
    dev = logits.device
    if greedy:
        g = torch.tensor(greedy, dtype=torch.int64, device=dev)
        tokens[g] = logits[g].argmax(dim=-1)
    rand = [r for r in rows if r in rand_pos]
    if rand:
        assert race is not None
        q = race[1][torch.tensor([rand_pos[r] for r in rand], device=dev)]
        probs = _filtered(logits, sp, np.asarray(rand))
        tokens[torch.tensor(rand, dtype=torch.int64, device=dev)] = (probs / q).argmax(dim=-1)


def logprob_rows(logprobs: torch.Tensor, tokens: torch.Tensor, token_ids: np.ndarray,
                 want: np.ndarray) -> list[list[list[float]] | None]:
    """Per row ``[[sampled, its logprob, its rank], [top1, lp], ...]`` with ``want[i]`` top
    entries (None where ``want[i] < 0``); the rank is 1-based over the whole vocabulary (1 +
    tokens with a strictly higher logprob), as vLLM reports it (``sampled_token_ranks``).

    Among top entries of equal value the sampled token comes first, and when it ties with
    the last kept value it is kept: a client reading ``top_logprobs[0]`` after a greedy step
    sees the token it got, whatever order ``topk`` returned ties in.

    Args:
        logprobs: float32 [S, V] log-softmax of the raw logits.
        tokens: int64 [S] sampled tokens (device tensor); token_ids: the same, numpy.
        want: int64 [S] top logprobs per row, -1 for none.
    """
    max_n = int(want.max())
    chosen_t = logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = ((logprobs > chosen_t[:, None]).sum(dim=-1) + 1).cpu().tolist()
    chosen = chosen_t.cpu().tolist()
    top_v_l = top_i_l = None
    if max_n > 0:
        top_v, top_i = logprobs.topk(max_n, dim=-1)
        top_v_l, top_i_l = top_v.cpu().tolist(), top_i.cpu().tolist()
    out: list[list[list[float]] | None] = []
    for i, n in enumerate(want.tolist()):
        if n < 0:
            out.append(None)
            continue
        tok, lp = int(token_ids[i]), chosen[i]
        row = [[float(tok), lp, float(ranks[i])]]
        if n and top_i_l is not None and top_v_l is not None:
            ids, vals = top_i_l[i][:n], top_v_l[i][:n]
            if tok in ids:
                j = ids.index(tok)
                first = vals.index(vals[j])  # first entry of the run equal to its value
                ids.insert(first, ids.pop(j))
                vals.insert(first, vals.pop(j))
            elif lp >= vals[-1]:
                first = vals.index(vals[-1]) if lp == vals[-1] else len(vals) - 1
                ids.insert(first, tok)
                vals.insert(first, lp)
                ids.pop()
                vals.pop()
            row += [[float(t), v] for t, v in zip(ids, vals, strict=True)]
        out.append(row)
    return out


def prompt_logprob_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                        hidden: torch.Tensor, plp: PromptLogprobsBatch
                        ) -> list[list[list[float]]]:
    """Logprob rows of prompt positions: per position the prompt's next token, its logprob
    and rank, then the top ``want`` tokens.

    Args:
        compute_logits: hidden [k, H] -> float32 logits [k, V] (the model's LM head).
        hidden: the step's final hidden states [T, H].
        plp: which positions, their target tokens and top counts.

    Returns:
        K rows ``[[target, logprob, rank], [top1, logprob], ...]``: the log-softmax of the raw
        logits (no sampling parameters apply to the prompt), rank 1-based over the whole
        vocabulary (1 + tokens with a strictly higher logprob), as vLLM reports it.
    """
    dev = hidden.device
    idx = torch.from_numpy(plp.indices).to(dev)
    targets = torch.from_numpy(plp.targets).to(dev)
    want = plp.want
    rows: list[list[list[float]]] = []
    for lo in range(0, len(idx), PROMPT_LOGPROBS_SLICE):
        hi = min(lo + PROMPT_LOGPROBS_SLICE, len(idx))
        lp = torch.log_softmax(compute_logits(hidden[idx[lo:hi]]).float(), dim=-1)
        tgt = targets[lo:hi]
        chosen = lp.gather(1, tgt[:, None]).squeeze(1)
        rank = ((lp > chosen[:, None]).sum(dim=-1) + 1).tolist()
        n = int(want[lo:hi].max())
        top_v = top_i = None
        if n > 0:
            v, i = lp.topk(n, dim=-1)
            top_v, top_i = v.tolist(), i.tolist()
        for j, (t, c, r) in enumerate(zip(tgt.tolist(), chosen.tolist(), rank, strict=True)):
            row = [[float(t), c, float(r)]]
            k = int(want[lo + j])
            if k and top_v is not None and top_i is not None:
                row += [[float(a), b] for a, b in zip(top_i[j][:k], top_v[j][:k], strict=True)]
            rows.append(row)
    return rows
