"""Batched per-request sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds,
repetition/presence/frequency penalties, logprobs.

Sampling draws ``argmax(probs / q)`` with ``q ~ Exp(1)`` (the exponential race, equivalent to
sampling from ``probs``; vLLM's and SGLang's samplers use it too). A seeded request draws its
``q`` row from its own ``torch.Generator``, so its tokens do not depend on the batch around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.core.request import Request


@dataclass
class SampleResult:
    """token_ids int64 [S]; logprobs per row (``[[token, logprob], ...]``, chosen first) or
    None for rows that did not ask."""

    token_ids: np.ndarray
    logprobs: list[list[list[float]] | None] | None


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[Request],
                     outputs: dict[int, list[int]]) -> None:
    """In place on float32 logits [S, V]; ``outputs[i]`` is row i's generated ids."""
    for i, r in enumerate(reqs):
        p = r.params
        if not r.needs_penalty_tokens:
            continue
        generated = outputs[i]
        if p.repetition_penalty != 1.0:
            # CTRL (Keskar et al. 2019) as in HF's RepetitionPenaltyLogitsProcessor: over prompt
            # and output, divide positive logits and multiply negative ones.
            seen = np.unique(np.concatenate([r.prompt_token_ids,
                                             np.asarray(generated, dtype=np.int32)]))
            ids = torch.from_numpy(seen.astype(np.int64)).to(logits.device)
            sel = logits[i, ids]
            logits[i, ids] = torch.where(sel > 0, sel / p.repetition_penalty,
                                         sel * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and generated:
            # OpenAI's definition: over generated tokens only.
            out = torch.tensor(generated, dtype=torch.int64, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device)
            counts.index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _block_stops(logits: torch.Tensor, reqs: Sequence[Request],
                 num_outputs: dict[int, int]) -> None:
    """Below ``min_tokens`` the request may not stop: mask EOS and stop token ids."""
    for i, n in num_outputs.items():
        r = reqs[i]
        if n < r.params.min_tokens:
            ids = set(r.stop_ids)
            if not r.params.ignore_eos:
                ids |= r.eos_token_ids
            ids = [t for t in ids if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [R, V] after top-k, top-p (nucleus, Holtzman et al. 2019) and min-p."""
    probs = torch.softmax(logits, dim=-1)
    if bool((min_p > 0).any()):
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if need_k:
            k = torch.where(top_k > 0, top_k, probs.shape[1])
            keep &= torch.arange(probs.shape[1], device=probs.device)[None, :] < k[:, None]
        if need_p:
            csum = sorted_p.cumsum(dim=-1)
            total = csum[:, -1:]
            # keep a token if the mass before it is below top_p (the top token always stays)
            keep &= (csum - sorted_p) < top_p[:, None] * total
        sorted_p = sorted_p.masked_fill(~keep, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    return probs


def sample(logits: torch.Tensor, reqs: Sequence[Request], generator: torch.Generator | None,
           num_outputs: dict[int, int] | None = None,
           penalty_tokens: dict[int, list[int]] | None = None) -> SampleResult:
    """Pick one token per row.

    Request state is read only where it is immutable (params, prompt, generator): what changes
    between steps comes as snapshots taken when the step was scheduled, because with overlap
    scheduling the engine mutates requests while this runs.

    Args:
        logits: float32 [S, V], one row per sampling request (in ``reqs`` order).
        reqs: the requests, for their ``SamplingParams``, prompt and generators.
        generator: engine-wide generator for unseeded random rows.
        num_outputs: row -> tokens it had generated before this one, for rows with
            ``min_tokens``.
        penalty_tokens: row -> generated ids, for rows with penalties.
    """
    want_lp = [r.params.logprobs for r in reqs]
    any_lp = any(n is not None for n in want_lp)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any_lp else None
    if penalty_tokens:
        logits = logits.clone()
        _apply_penalties(logits, reqs, penalty_tokens)
    if num_outputs and any(n < reqs[i].params.min_tokens for i, n in num_outputs.items()):
        logits = logits.clone()
        _block_stops(logits, reqs, num_outputs)
    tokens = logits.argmax(dim=-1)
    rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if rand:
        ridx = torch.tensor(rand, dtype=torch.int64, device=logits.device)
        ps = [reqs[i].params for i in rand]
        temp = torch.tensor([p.temperature for p in ps], device=logits.device)
        top_k = torch.tensor([p.top_k for p in ps], device=logits.device)
        top_p = torch.tensor([p.top_p for p in ps], device=logits.device)
        min_p = torch.tensor([p.min_p for p in ps], device=logits.device)
        probs = _filter(logits[ridx] / temp[:, None], top_k, top_p, min_p)
        q = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(rand):
            g = reqs[i].generator
            if g is not None:
                q[j].exponential_(generator=g)
            else:
                unseeded.append(j)
        if unseeded:
            u = torch.tensor(unseeded, dtype=torch.int64, device=logits.device)
            q[u] = torch.empty(len(unseeded), probs.shape[1], device=logits.device
                               ).exponential_(generator=generator)
        tokens[ridx] = (probs / q).argmax(dim=-1)
    token_ids = tokens.cpu().numpy().astype(np.int64)
    if not any_lp:
        return SampleResult(token_ids, None)
    assert raw_logprobs is not None
    max_n = max(n or 0 for n in want_lp)
    top_v, top_i = raw_logprobs.topk(max_n, dim=-1) if max_n else (None, None)
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).cpu().tolist()
    top_v_l = top_v.cpu().tolist() if top_v is not None else None
    top_i_l = top_i.cpu().tolist() if top_i is not None else None
    out: list[list[list[float]] | None] = []
    for i, n in enumerate(want_lp):
        if n is None:
            out.append(None)
            continue
        row = [[float(token_ids[i]), chosen[i]]]
        if n and top_i_l is not None and top_v_l is not None:
            row += [[float(t), v] for t, v in zip(top_i_l[i][:n], top_v_l[i][:n], strict=True)]
        out.append(row)
    return SampleResult(token_ids, out)
