"""The engine side of structured outputs: one xgrammar ``GrammarMatcher`` per constrained
request, the step's token bitmask filled for the constrained rows only, and each sampled token
accepted into its matcher.

``EngineCore`` calls ``fill`` just before a step's forward and ``accept`` right after its
sampling, both in the thread that runs steps (in order), so with overlap scheduling a step's
mask is always filled after the previous step's tokens were accepted: no resolve has to wait.
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

    def fill(self, grammars: Sequence[RequestGrammar | None]) -> tuple[Any, list[int]] | None:
        """The step's token bitmask for its sampling rows.

        Args:
            grammars: per sampling row its grammar or None (unconstrained).

        Returns:
            (int32 [S, ceil(V / 32)] bitmask on CPU, the rows whose mask must be applied), or
            None when no row is constrained now. A finished matcher's row is left out (its
            request ended in an earlier step still being resolved; its token is dropped).
        """
        import xgrammar as xgr

        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self.max_rows, self.vocab_size)
        bitmask = self._bitmask
        rows = []
        for i, g in enumerate(grammars):
            if g is None or g.done:
                continue
            # False: every token is allowed here, nothing to apply
            if g.matcher.fill_next_token_bitmask(bitmask, i):
                rows.append(i)
        if not rows:
            return None
        return bitmask[:len(grammars)], rows

    def accept(self, grammars: Sequence[RequestGrammar | None],
               tokens: np.ndarray) -> np.ndarray:
        """Advance each constrained row's matcher by its sampled token.

        Args:
            tokens: int64 [S] the step's sampled tokens.

        Returns:
            int8 [S]: ``RUNNING`` (0), ``TERMINATED`` (1: the token was a stop token that
            completed the grammar) or ``REJECTED`` (2) per row, for this step.
        """
        status = np.zeros(len(grammars), dtype=np.int8)
        for i, (g, tok) in enumerate(zip(grammars, tokens.tolist(), strict=True)):
            if g is None or g.done:
                continue
            m = g.matcher
            if not m.accept_token(tok):
                g.rejected = True
                status[i] = REJECTED
            elif m.is_terminated():
                g.terminated = True
                status[i] = TERMINATED
        return status
