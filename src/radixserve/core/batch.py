"""One scheduled step: the engine's view (which requests, in which state) and the
``ForwardBatch`` the runner gets, built with numpy from the row tables (no per-token Python
loops)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from radixserve.core.live_index import LiveIndex
from radixserve.core.request import Request
from radixserve.core.row_tables import RowTables
from radixserve.model_executor.forward_batch import (
    ALL_GREEDY,
    ForwardBatch,
    PromptLogprobsBatch,
    SamplingBatch,
)


@dataclass
class ScheduledBatch:
    """One step's work as the engine tracks it.

    Attributes:
        requests: scheduled requests, length B, decodes first (``forward.num_decodes``).
        forward: what the runner computes.
        epochs: int64 [B - num_decodes] each prefill request's preemption count when
            scheduled: a request preempted since holds other pages, so the step's results
            must not touch its page table.
        samplers: the requests with ``forward.sample`` set, in order (length S).
        row_gens: int64 [S] the generation of each sampler's row when scheduled (a row whose
            generation changed was released: its request finished or was preempted).
        drafts: per sampler the int32 draft tokens it verifies this step (empty for most);
            None when no request verifies drafts (speculative decoding). A sampler with k
            drafts has k + 1 rows of logits (``forward.logits_indices``), in order.
    """

    requests: list[Request]
    forward: ForwardBatch
    epochs: np.ndarray
    samplers: list[Request]
    row_gens: np.ndarray
    drafts: list[np.ndarray] | None = None

    @property
    def num_decodes(self) -> int:
        return self.forward.num_decodes


def build_batch(requests: list[Request], num_decodes: int, num_new: list[int],
                tables: RowTables, page_size: int, live: LiveIndex,
                num_draft: list[int] | None = None) -> ScheduledBatch:
    """The step's metadata for ``requests`` from the row tables.

    Args:
        requests: decodes first, then verify requests and prefill chunks.
        num_decodes: leading requests computing one token each.
        num_new: tokens each request computes this step.
        tables: the row tables (pages, tokens, sampling parameters).
        page_size: tokens per KV page.
        live: which optional sampling features any live request uses.
        num_draft: draft tokens each request verifies (speculative decoding: its last
            sampled token and k drafts, already in the token table, are its k + 1 new tokens,
            and each gives a row of logits); None when none does.
    """
    b = len(requests)
    rows = np.fromiter((r.row for r in requests), dtype=np.int64, count=b)
    start = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=b)
    n = np.asarray(num_new, dtype=np.int64)
    seq_lens = start + n
    total = int(n.sum())
    ends = np.cumsum(n)
    tok_rows = np.repeat(rows, n)
    positions = np.arange(total, dtype=np.int64) + np.repeat(start - (ends - n), n)
    input_ids = tables.token_table[tok_rows, positions].astype(np.int64)
    page_table = tables.page_table
    slot_mapping = (page_table[tok_rows, positions // page_size].astype(np.int64) * page_size
                    + positions % page_size)
    nd = None if num_draft is None else np.asarray(num_draft, dtype=np.int64)
    # a decode always reaches its last token; only prefill chunks may stop short of it
    sample = np.ones(b, dtype=bool)
    for i in range(num_decodes, b):
        sample[i] = seq_lens[i] == requests[i].num_tokens + (0 if nd is None else nd[i])
    max_pages = int((seq_lens.max() + page_size - 1) // page_size) if b else 0
    samplers = (requests if num_decodes == b or sample.all()
                else list(itertools.compress(requests, sample.tolist())))
    srows = rows if samplers is requests else rows[sample]
    drafts = None
    row_drafts = None
    if nd is None:
        logits_indices = (ends - 1)[sample]
        lrows, lsamplers = srows, samplers
    else:
        # k + 1 rows of logits per verify request: its last sampled token's and each draft's
        per = np.where(sample, nd + 1, 0)
        m = int(per.sum())
        first = np.cumsum(per) - per
        logits_indices = (np.repeat(ends - per, per)
                          + np.arange(m, dtype=np.int64) - np.repeat(first, per))
        sper = per[sample]
        lrows = np.repeat(srows, sper)
        # the sampling parameters of a verify request's rows are its own, repeated
        lsamplers = [r for r, c in zip(samplers, sper.tolist(), strict=True) for _ in range(c)]
        drafts = [input_ids[e - k:e].astype(np.int32)
                  for e, k in zip(ends[sample].tolist(), nd[sample].tolist(), strict=True)]
        # per row of logits the draft token it verifies: row j of a verify request checks
        # its draft j; the request's last row (the bonus) and plain rows check none (-1)
        row_drafts = np.full(m, -1, dtype=np.int64)
        for f, d in zip((first[sample]).tolist(), drafts, strict=True):
            row_drafts[f:f + len(d)] = d
    forward = ForwardBatch(
        num_decodes=num_decodes, rows=rows, num_new=n, seq_lens=seq_lens, sample=sample,
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
        page_table=page_table[rows, :max_pages], logits_indices=logits_indices,
        sampling=_sampling_batch(lsamplers, lrows, tables, live, row_drafts),
        prompt_logprobs=(_prompt_logprobs(requests, num_decodes, start, seq_lens, ends, tables)
                         if live.prompt_logprobs else None),
        num_draft=nd)
    return ScheduledBatch(
        requests=requests, forward=forward,
        epochs=np.fromiter((r.num_preemptions for r in requests[num_decodes:]),
                           dtype=np.int64, count=b - num_decodes),
        samplers=samplers, row_gens=tables.generation[srows], drafts=drafts)


def _prompt_logprobs(requests: list[Request], num_decodes: int, start: np.ndarray,
                     seq_lens: np.ndarray, ends: np.ndarray,
                     tables: RowTables) -> PromptLogprobsBatch | None:
    """The prompt positions of this step's prefill chunks whose logprobs are still owed: those
    from ``Request.prompt_lp_next`` up to the last prompt position but one (the last one's
    logits sample the first output token). Advances ``prompt_lp_next``, so a chunk recomputed
    after a preemption asks for no row twice."""
    idx: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    want: list[np.ndarray] = []
    counts = np.zeros(len(requests), dtype=np.int64)
    for i in range(num_decodes, len(requests)):
        req = requests[i]
        if req.prompt_logprob_rows is None:
            continue
        lo = max(int(start[i]), req.prompt_lp_next)
        hi = min(int(seq_lens[i]), req.num_prompt_tokens - 1)
        if hi <= lo:
            continue
        first = int(ends[i]) - (int(seq_lens[i]) - lo)  # batch index of position lo
        idx.append(np.arange(first, first + hi - lo, dtype=np.int64))
        targets.append(tables.token_table[req.row, lo + 1:hi + 1].astype(np.int64))
        want.append(np.full(hi - lo, req.params.prompt_logprobs, dtype=np.int64))
        counts[i] = hi - lo
        req.prompt_lp_next = hi
    if not idx:
        return None
    return PromptLogprobsBatch(np.concatenate(idx), np.concatenate(targets),
                               np.concatenate(want), counts)


def _sampling_batch(samplers: list[Request], rows: np.ndarray, t: RowTables,
                    live: LiveIndex, row_drafts: np.ndarray | None = None) -> SamplingBatch:
    """The sampling rows' parameters: gathered from the row tables, only the parts some live
    request needs; snapshots of request state (outputs for penalties, counts for
    ``min_tokens``) are taken now, when the step is scheduled.

    ``row_drafts`` (int64 [S], speculative decoding: the draft token each row verifies, -1
    for none) gives a verify request's row j the state it has once its drafts 0..j-1 are
    accepted, which is the only case in which row j's token is used: those drafts count as
    generated for its penalties and ``min_tokens``."""
    if not (live.random or live.logprobs or live.penalty or live.min_tokens or live.structured
            or live.logit_bias):
        return ALL_GREEDY
    sp = SamplingBatch()
    # prior[i]: the drafts before row i in its verify request (0 for plain rows)
    prior = None if row_drafts is None else _draft_offsets(row_drafts)
    if live.random:
        greedy = t.greedy[rows]
        if not greedy.all():
            sp.greedy = greedy
            sp.temperature, sp.top_k = t.temperature[rows], t.top_k[rows]
            sp.top_p, sp.min_p = t.top_p[rows], t.min_p[rows]
            if live.seeded:
                sp.generators = [t.generators[r] for r in rows.tolist()]
            sp.draft_tokens = row_drafts
    if live.logprobs:
        lp = t.logprobs[rows]
        if (lp >= 0).any():
            sp.logprobs = lp
    if live.penalty:
        outs = {i: list(r.output_token_ids) for i, r in enumerate(samplers)
                if r.needs_penalty_tokens}
        if prior is not None and row_drafts is not None:
            for i, out in outs.items():
                out.extend(row_drafts[i - int(prior[i]):i].tolist())
        if outs:
            sp.penalty_outputs = outs
            sp.penalty_prompts = {i: samplers[i].prompt_token_ids for i in outs}
            sp.repetition_penalty = t.repetition_penalty[rows]
            sp.presence_penalty = t.presence_penalty[rows]
            sp.frequency_penalty = t.frequency_penalty[rows]
    if live.min_tokens:
        blocked = {i: r.min_tokens_blocked for i, r in enumerate(samplers)
                   if r.min_tokens_blocked and len(r.output_token_ids)
                   + (0 if prior is None else int(prior[i])) < r.params.min_tokens}
        if blocked:
            sp.blocked_tokens = blocked
    if live.logit_bias:
        bias = {i: r.logit_bias for i, r in enumerate(samplers) if r.logit_bias is not None}
        if bias:
            sp.logit_bias = bias
    if live.structured:
        grammars = [r.grammar for r in samplers]
        if any(g is not None for g in grammars):
            # the masks are filled by the engine right before the forward (see
            # ``EngineCore._run``): they depend on the previous step's tokens, and a verify
            # request's rows on its drafts
            sp.grammars = grammars
            if row_drafts is not None:
                sp.draft_tokens = row_drafts
    return sp


def _draft_offsets(row_drafts: np.ndarray) -> np.ndarray:
    """int64 [S] per row of logits how many rows of its verify request precede it (its
    position in the draft; 0 for plain rows and first rows), from ``row_drafts`` (int64 [S],
    -1 on rows that verify no draft: each request's last row)."""
    idx = np.arange(row_drafts.shape[0], dtype=np.int64)
    starts = np.concatenate([[True], row_drafts[:-1] < 0])  # rows that follow no draft row
    return idx - np.maximum.accumulate(np.where(starts, idx, 0))
