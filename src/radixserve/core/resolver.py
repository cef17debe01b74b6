"""Applying a step's sampled tokens to its requests: ``commit`` (placeholders, before the step
runs, so the next step can be scheduled meanwhile: overlap scheduling) and ``resolve`` (the real
tokens, stop and length checks, after it ran).

Requests that can only have got an ordinary token are applied with numpy and one short loop;
the rest (first tokens, stop/EOS candidates, length limits, rows that changed owner) one by one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from radixserve.core.batch import ScheduledBatch
from radixserve.core.live_index import LiveIndex
from radixserve.core.request import Request, Status
from radixserve.core.row_tables import RowTables
from radixserve.core.spec_decode import SpecDecodeStats, accepted_length, record_verify
from radixserve.engine_types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from radixserve.structured.runtime import REJECTED, TERMINATED


@dataclass
class Resolved:
    """The tokens one step sampled, applied.

    Attributes:
        full: (request, token, sample row) for each request whose output needs more than its
            token: its first token, a finish (``finish_reason`` set), or every request when
            ``resolve`` was asked for no plain outputs.
        plain: requests that got one ordinary token: still running, not their first.
        plain_tokens: int64 [len(plain)] their tokens, in order.
        finished: the requests of ``full`` and ``verified`` that finished this step; the
            caller hands them to ``Scheduler.finish``.
        verified: (request, its tokens, its first row of logits) for each request that
            verified draft tokens: the accepted drafts then the target's token, cut after a
            stop; the caller rolls back the pages of those still running.
    """

    full: list[tuple[Request, int, int]]
    plain: list[Request]
    plain_tokens: np.ndarray
    finished: list[Request] = field(default_factory=list)
    verified: list[tuple[Request, list[int], int]] = field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        return len(self.full) + len(self.plain) + len(self.verified)

    @property
    def num_tokens(self) -> int:
        """Tokens generated (a verify request may get several)."""
        return len(self.full) + len(self.plain) + sum(len(v[1]) for v in self.verified)


class StepResolver:
    """Commits and resolves steps against the row tables.

    Args:
        tables: the scheduler's row tables.
        live: the live-request index (which token ids may stop someone).
        max_model_len: longest sequence in tokens.

    Attributes:
        spec_stats: speculative decoding's acceptance counters (cumulative).
    """

    def __init__(self, tables: RowTables, live: LiveIndex, max_model_len: int) -> None:
        self.tables = tables
        self.live = live
        self.max_model_len = max_model_len
        self.spec_stats = SpecDecodeStats()

    def commit(self, batch: ScheduledBatch) -> None:
        """Advance requests as if ``batch`` already ran: KV counted as computed, a placeholder
        token (-1) for each sampling request, which ``resolve`` fills in."""
        fb = batch.forward
        d = fb.num_decodes
        for req in batch.requests[:d]:  # one token each, always sampling
            req.num_computed += 1
            req.output_token_ids.append(-1)
            req.num_pending += 1
        for req, n, smp in zip(batch.requests[d:], fb.num_new[d:].tolist(),
                               fb.sample[d:].tolist(), strict=True):
            req.num_computed += n
            if smp:
                req.output_token_ids.append(-1)
                req.num_pending += 1
        # the placeholder sits right after the step's last position
        self.tables.token_table[fb.rows[fb.sample], fb.seq_lens[fb.sample]] = -1

    def resolve(self, batch: ScheduledBatch, sampled: np.ndarray, plain: bool = True,
                grammar_status: np.ndarray | None = None) -> Resolved:
        """Fill in the tokens ``batch`` sampled and apply stop conditions.

        Args:
            sampled: int64 [S] one token per row of logits, in order: one per sampling
                request, k + 1 for a request verifying k draft tokens.
            plain: False puts every request in ``Resolved.full`` (outputs with logprobs).
            grammar_status: int8 [S] what each row's output constraint made of its token
                (``structured.runtime``): a grammar that terminated finishes its request with
                "stop" (even with ``ignore_eos``: the output is complete), one that rejected
                the token aborts it. None: no row is constrained.

        Returns:
            the requests that got tokens. A request that finished or was aborted meanwhile
            gets nothing: no extra token, no output.
        """
        fb = batch.forward
        sampled = np.asarray(sampled, dtype=np.int64)
        rows = fb.rows[fb.sample]
        at = fb.seq_lens[fb.sample]  # where each sampled token goes in its sequence
        if batch.drafts is None:
            return self._resolve_rows(batch.samplers, rows, at, batch.row_gens, sampled, plain,
                                      grammar_status)
        return self._resolve_verify(batch, rows, at, sampled, plain, grammar_status)

    def _resolve_verify(self, batch: ScheduledBatch, rows: np.ndarray, at: np.ndarray,
                        sampled: np.ndarray, plain: bool,
                        grammar_status: np.ndarray | None) -> Resolved:
        """``resolve`` for a step where some requests verify draft tokens: the others as
        usual, each verify request by greedy acceptance (the drafts equal to the target's
        argmax, then the target's own token) with stop checks token by token (its grammar's
        status on each row too), and its computed length cut back to the tokens whose KV is
        its own (rollback; the scheduler releases the pages past it)."""
        drafts = batch.drafts
        assert drafts is not None
        samplers = batch.samplers
        nd = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        first = np.cumsum(nd + 1) - (nd + 1)  # each sampler's first row of logits
        one = nd == 0
        idx = np.flatnonzero(one)
        res = self._resolve_rows(
            [samplers[i] for i in idx.tolist()], rows[one], at[one], batch.row_gens[one],
            sampled[first[one]], plain,
            None if grammar_status is None else grammar_status[first[one]])
        # rows of ``full`` index the whole step's logits rows (logprobs are read by them)
        res.full = [(r, tok, int(first[idx[k]])) for r, tok, k in res.full]
        t = self.tables
        for i in np.flatnonzero(~one).tolist():
            req, d, f, k = samplers[i], drafts[i], int(first[i]), int(nd[i])
            if t.generation[rows[i]] != batch.row_gens[i] or req.status == Status.FINISHED:
                continue
            targets = sampled[f:f + k + 1]
            a = accepted_length(d, targets)
            self.spec_stats.observe(k, a)
            record_verify(req.draft_acceptance, k, a)
            # the one placeholder ``commit`` appended becomes the a + 1 tokens
            del req.output_token_ids[len(req.output_token_ids) - req.num_pending:]
            req.num_pending = 0
            got: list[int] = []
            reason = None
            for j, tok in enumerate(targets[:a + 1].tolist()):
                req.output_token_ids.append(tok)
                n_out = len(req.output_token_ids)
                t.token_table[req.row, req.num_prompt_tokens + n_out - 1] = tok
                got.append(tok)
                reason = self._stop_reason(req, tok, n_out)
                gs = 0 if grammar_status is None else int(grammar_status[f + j])
                if gs == TERMINATED:  # the grammar is complete: as for a plain row
                    reason = FINISH_STOP
                elif gs == REJECTED:
                    reason = FINISH_ABORT
                if reason is not None:
                    break
            # KV was written for the last sampled token and all k drafts; it is the
            # sequence's own through the accepted ones only
            req.num_computed -= k - a
            if reason is not None:
                req.finish_reason = reason
                req.num_computed = min(req.num_computed, req.num_tokens)
                res.finished.append(req)
            res.verified.append((req, got, f))
        return res

    def _resolve_rows(self, samplers: list[Request], rows: np.ndarray, at: np.ndarray,
                      row_gens: np.ndarray, sampled: np.ndarray, plain: bool,
                      grammar_status: np.ndarray | None) -> Resolved:
        """``resolve`` for requests that sampled one token each: ``samplers`` with their
        rows, the positions their tokens go to, their rows' generations when scheduled and
        their tokens (int64 [S'])."""
        t = self.tables
        n_out = at - t.prompt_len[rows] + 1
        special = ((t.generation[rows] != row_gens) | (n_out <= 1)
                   | (n_out >= t.limit[rows]) | self.live.stop_candidates(sampled))
        if not plain:
            special[:] = True
        if grammar_status is not None:
            special |= grammar_status != 0
        full: list[tuple[Request, int, int]] = []
        finished: list[Request] = []
        if special.any():
            for k in np.flatnonzero(special).tolist():
                req, tok = samplers[k], int(sampled[k])
                gs = 0 if grammar_status is None else int(grammar_status[k])
                if self._resolve_one(req, tok, gs):
                    full.append((req, tok, k))
                    if req.finish_reason is not None:
                        finished.append(req)
            keep = ~special
            reqs = list(itertools.compress(samplers, keep.tolist()))
            rows, at, toks = rows[keep], at[keep], sampled[keep]
        else:
            reqs, toks = samplers, sampled
        # plain tokens: their requests still hold the rows they were scheduled with
        t.token_table[rows, at] = toks
        for req, tok in zip(reqs, toks.tolist(), strict=True):
            req.output_token_ids[-req.num_pending] = tok
            req.num_pending -= 1
        return Resolved(full, reqs, toks, finished)

    def add_prompt_logprobs(self, batch: ScheduledBatch,
                            rows: list[list[list[float]]] | None) -> None:
        """Hand a step's prompt logprob rows to their requests (in position order: steps are
        resolved in the order they ran). A runner that computes none (the null model) leaves
        the requests without rows.

        Args:
            rows: ``SampleResult.prompt_logprobs``, split by
                ``batch.forward.prompt_logprobs.counts``.
        """
        plp = batch.forward.prompt_logprobs
        if plp is None or rows is None:
            return
        at = 0
        for req, n in zip(batch.requests, plp.counts.tolist(), strict=True):
            if n and req.prompt_logprob_rows is not None:
                req.prompt_logprob_rows.extend(rows[at:at + n])
            at += n

    def _resolve_one(self, req: Request, tok: int, grammar_status: int = 0) -> bool:
        """Apply one sampled token to ``req`` (any case); False if it gets no output."""
        if req.status == Status.FINISHED:
            return False
        idx = len(req.output_token_ids) - req.num_pending
        req.output_token_ids[idx] = tok
        req.num_pending -= 1
        if req.row >= 0:
            self.tables.token_table[req.row, req.num_prompt_tokens + idx] = tok
        reason = self._stop_reason(req, tok, idx + 1)
        if grammar_status == TERMINATED:
            reason = FINISH_STOP
        elif grammar_status == REJECTED:
            reason = FINISH_ABORT
        if reason is not None:
            req.finish_reason = reason
            # drop the placeholder of a step scheduled before we knew it would stop
            del req.output_token_ids[idx + 1:]
            req.num_pending = 0
            req.num_computed = min(req.num_computed, req.num_tokens)
        return True

    def _stop_reason(self, req: Request, tok: int, n_out: int) -> str | None:
        """Why the ``n_out``-th generated token ``tok`` ends ``req`` (None: it goes on)."""
        if n_out >= req.params.min_tokens:
            if tok in req.stop_ids:
                req.stop_reason = tok
                return FINISH_STOP
            if tok in req.eos_token_ids and not req.params.ignore_eos:
                return FINISH_STOP
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return FINISH_LENGTH
        return None
