"""The engine side of structured outputs: one xgrammar ``GrammarMatcher`` per constrained
request, and per step a ``GrammarStep`` that the sampler drives: tokens offered to the
matchers, token bitmasks filled for the constrained rows that need one, accepted tokens.

The sampler runs in the thread that runs steps (in order), so with overlap scheduling a step's
masks are always built after the previous step's tokens were accepted: no resolve has to wait.
A matcher has accepted exactly its request's generated tokens, which a preempted request keeps
(recompute re-runs the KV, never the sampling), so preemption needs no rollback.

Speculative decoding: a request's draft is cut at the first token its grammar refuses when it
is proposed (``RequestGrammar.valid_prefix``, which leaves the matcher as it was); in the
verify step each of its k + 1 rows gets the mask of the grammar state after the drafts before
it (``GrammarStep.fill_verify``: accept the drafts one by one, filling each row first, then
roll them back), and after the pick the matcher accepts the row tokens the request keeps: the
accepted drafts, then the target's token at the first mismatch or the bonus
(``GrammarStep.accept_verify``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from radixserve.sampling_params import StructuredOutputsParams
from radixserve.structured.compiler import GrammarCompiler

#: ``GrammarStep.status`` values per sampled row.
RUNNING, TERMINATED, REJECTED = 0, 1, 2


class RequestGrammar:
    """One request's matcher state.

    Attributes:
        matcher: the ``xgrammar.GrammarMatcher`` (touched only by the step thread).
        terminated: it accepted a stop token: the output is complete.
        rejected: it refused a sampled token (cannot happen while the mask is applied; kept so
            such a request ends instead of producing text outside the grammar).
    """

    __slots__ = ("matcher", "terminated", "rejected")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.terminated = False
        self.rejected = False

    @property
    def done(self) -> bool:
        return self.terminated or self.rejected

    def valid_prefix(self, tokens: np.ndarray) -> int:
        """How many leading ``tokens`` (int [k]) the grammar accepts from its current state
        (a stop token that completes it counts; nothing after it does). The matcher is left
        as it was (the accepted tokens are rolled back)."""
        m = self.matcher
        n = 0
        for tok in tokens.tolist():
            if m.is_terminated() or not m.accept_token(int(tok)):
                break
            n += 1
        if n:
            m.rollback(n)
        return n


class GrammarRuntime:
    """Matchers and token bitmasks for the engine core.

    Args:
        make_compiler: builds the ``GrammarCompiler`` (loads the tokenizer); called once, at
            the first constrained request, so an engine that never sees one never pays for it.
        vocab_size: logits width (bitmask bits per row).
        max_rows: most sampling rows per step (``max_num_seqs``).
    """

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], vocab_size: int,
                 max_rows: int) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self._bitmask: Any = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def new_grammar(self, spec: StructuredOutputsParams,
                    stop_token_ids: Sequence[int] | None = None) -> RequestGrammar:
        """A fresh matcher for ``spec`` (compiled grammar from the cache when seen before).

        Args:
            stop_token_ids: the request's own end ids when they differ from the model's.

        Raises:
            GrammarError: the constraint does not compile.
        """
        import xgrammar as xgr

        compiled = self.compiler.compile(spec)
        override = sorted(stop_token_ids) if stop_token_ids else None
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=override))

    def step(self, grammars: Sequence[RequestGrammar | None],
             draft_tokens: np.ndarray | None = None) -> GrammarStep:
        """The constraints of one step's sampling rows, for the sampler.

        Args:
            grammars: per sampling row its request's grammar or None.
            draft_tokens: int64 [S] per row the draft token it verifies, -1 for none
                (``SamplingBatch.draft_tokens``); None when no row verifies drafts.
        """
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < len(grammars):
            # a step verifying drafts has k + 1 rows per speculating request
            rows = max(self.max_rows, len(grammars))
            self._bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        return GrammarStep(grammars, self._bitmask, draft_tokens)


class GrammarStep:
    """One step's output constraints as the sampler uses them (the
    ``model_executor.forward_batch.StepConstraints`` protocol).

    The sampler first picks every row as if unconstrained and offers the constrained rows'
    tokens to their matchers (``accept``: a few microseconds a row, no state change on a
    refusal); only refused rows, and rows whose filters need masked probabilities, get their
    token bitmask filled (``fill``), applied and a new pick, which is accepted in turn. A
    grammar that follows the model's own preference costs no mask at all; the result equals
    masking first (see ``model_executor.sampler``). The same shape as llama.cpp's grammar
    sampling, over xgrammar's matchers and masks.

    The rows of a request verifying drafts (speculative decoding) are masked before the pick
    instead (``verify_rows``): row j's mask is the state after drafts 0..j-1, which only
    exists while the matcher walks the draft, so it is filled for every such row
    (``fill_verify``) and the matcher accepts the kept tokens afterwards (``accept_verify``).

    Args:
        grammars: per sampling row its grammar or None (unconstrained); a request verifying
            k drafts has k + 1 consecutive rows with the same grammar.
        bitmask: int32 [>= S, ceil(V / 32)] CPU buffer for the rows' masks (the runtime's).
        draft_tokens: int64 [S] per row the draft token it verifies, -1 for none (a verify
            request's last row, plain rows); None when no row verifies drafts.

    Attributes:
        rows: the constrained rows still generating (a finished matcher's row is left out:
            its request ended in an earlier step still being resolved; its token is dropped).
        verify: (first row, int64 [k] drafts) per constrained request verifying k >= 1 drafts;
            its rows are first .. first + k.
        verify_rows: every row of ``verify``, ascending (a subset of ``rows``).
        status: int8 [S] ``RUNNING``, ``TERMINATED`` (the token was a stop token completing
            the grammar) or ``REJECTED`` per row, for this step.
    """

    def __init__(self, grammars: Sequence[RequestGrammar | None], bitmask: Any,
                 draft_tokens: np.ndarray | None = None) -> None:
        self.grammars = grammars
        self.rows = [i for i, g in enumerate(grammars) if g is not None and not g.done]
        self.status = np.zeros(len(grammars), dtype=np.int8)
        self._bitmask = bitmask
        self.verify: list[tuple[int, np.ndarray]] = []
        self.verify_rows: list[int] = []
        if draft_tokens is not None:
            live = set(self.rows)
            i, n = 0, len(grammars)
            while i < n:
                if draft_tokens[i] < 0:
                    i += 1
                    continue
                end = i  # the group's last row: the first that verifies no draft
                while draft_tokens[end] >= 0:
                    end += 1
                if i in live:
                    self.verify.append((i, draft_tokens[i:end].copy()))
                    self.verify_rows.extend(range(i, end + 1))
                i = end + 1

    def accept(self, tokens: np.ndarray, rows: Sequence[int]) -> list[int]:
        """Advance the matchers of ``rows`` by their tokens; the rows whose token the grammar
        refuses (their matchers unchanged).

        Args:
            tokens: int64 [S] the step's picks.
        """
        refused = []
        for i in rows:
            g = self.grammars[i]
            assert g is not None
            m = g.matcher
            if not m.accept_token(int(tokens[i])):
                refused.append(i)
            elif m.is_terminated():
                g.terminated = True
                self.status[i] = TERMINATED
        return refused

    def fill(self, rows: Sequence[int]) -> Any:
        """The token bitmask with ``rows`` filled from their matchers' current state.

        Returns:
            int32 [S, ceil(V / 32)] CPU tensor; only ``rows`` are meaningful (bit j of row i
            set when token j is allowed, xgrammar's layout).
        """
        bitmask = self._bitmask
        for i in rows:
            g = self.grammars[i]
            assert g is not None
            if not g.matcher.fill_next_token_bitmask(bitmask, i):
                bitmask[i] = -1  # every token allowed here
        return bitmask[:len(self.grammars)]

    def fill_verify(self) -> Any:
        """The token bitmask with every row of ``verify`` filled: row first + j from the
        grammar state after drafts 0..j-1 (drafts were cut to their valid prefix when
        proposed; should one still be refused, the rows after it keep an all-allowed mask:
        the pick before it cannot be that draft, so their tokens are never used). Each
        matcher is rolled back to where it was.

        Returns:
            int32 [S, ceil(V / 32)] CPU tensor; only ``verify_rows`` are meaningful.
        """
        bitmask = self._bitmask
        for first, drafts in self.verify:
            g = self.grammars[first]
            assert g is not None
            m = g.matcher
            walked = 0
            for j in range(len(drafts) + 1):
                row = first + j
                if walked < j or m.is_terminated() or not m.fill_next_token_bitmask(bitmask, row):
                    bitmask[row] = -1
                if j < len(drafts) and walked == j and m.accept_token(int(drafts[j])):
                    walked += 1
            if walked:
                m.rollback(walked)
        return bitmask[:len(self.grammars)]

    def accept_verify(self, tokens: np.ndarray) -> None:
        """Advance each ``verify`` request's matcher by the tokens it keeps: its rows' picks
        while they equal their drafts (accepted drafts), then the first differing pick or the
        last row's (the bonus), the tokens ``core.resolver`` gives the request. A pick the
        grammar refuses (cannot happen under the mask) marks its row ``REJECTED``; a stop
        token completing the grammar marks it ``TERMINATED``; either ends the walk.

        Args:
            tokens: int64 [S] the step's picks.
        """
        for first, drafts in self.verify:
            g = self.grammars[first]
            assert g is not None
            m = g.matcher
            for j in range(len(drafts) + 1):
                row, tok = first + j, int(tokens[first + j])
                if not m.accept_token(tok):
                    g.rejected = True
                    self.status[row] = REJECTED
                    break
                if m.is_terminated():
                    g.terminated = True
                    self.status[row] = TERMINATED
                    break
                if j == len(drafts) or tok != int(drafts[j]):
                    break

    def reject(self, rows: Sequence[int]) -> None:
        """Mark ``rows`` as refused even after masking (cannot happen while the mask holds; the
        request is ended rather than left outside its grammar)."""
        for i in rows:
            g = self.grammars[i]
            assert g is not None
            g.rejected = True
            self.status[i] = REJECTED
