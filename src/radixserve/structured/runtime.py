"""The engine side of structured outputs: one xgrammar ``GrammarMatcher`` per constrained
request, and per step a ``GrammarStep`` that the sampler drives: tokens offered to the
matchers, token bitmasks filled for the constrained rows that need one, accepted tokens.

The sampler runs in the thread that runs steps (in order), so with overlap scheduling a step's
masks are always built after the previous step's tokens were accepted: no resolve has to wait.
A matcher has accepted exactly its request's generated tokens, which a preempted request keeps
(recompute re-runs the KV, never the sampling), so preemption needs no rollback.
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

    def step(self, grammars: Sequence[RequestGrammar | None]) -> GrammarStep:
        """The constraints of one step's sampling rows, for the sampler."""
        import xgrammar as xgr

        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self.max_rows, self.vocab_size)
        return GrammarStep(grammars, self._bitmask)


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

    Args:
        grammars: per sampling row its grammar or None (unconstrained).
        bitmask: int32 [>= S, ceil(V / 32)] CPU buffer for the rows' masks (the runtime's).

    Attributes:
        rows: the constrained rows still generating (a finished matcher's row is left out:
            its request ended in an earlier step still being resolved; its token is dropped).
        status: int8 [S] ``RUNNING``, ``TERMINATED`` (the token was a stop token completing
            the grammar) or ``REJECTED`` per row, for this step.
    """

    def __init__(self, grammars: Sequence[RequestGrammar | None], bitmask: Any) -> None:
        self.grammars = grammars
        self.rows = [i for i, g in enumerate(grammars) if g is not None and not g.done]
        self.status = np.zeros(len(grammars), dtype=np.int8)
        self._bitmask = bitmask

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

    def reject(self, rows: Sequence[int]) -> None:
        """Mark ``rows`` as refused even after masking (cannot happen while the mask holds; the
        request is ended rather than left outside its grammar)."""
        for i in rows:
            g = self.grammars[i]
            assert g is not None
            g.rejected = True
            self.status[i] = REJECTED
