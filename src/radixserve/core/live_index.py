"""What the live (waiting or running) requests need, kept as counts and a set of stop ids so
each step asks "does anyone need this?" in O(1) instead of visiting every request."""

from __future__ import annotations

import numpy as np

from radixserve.core.request import Request


class LiveIndex:
    """Counts of live requests per optional feature, and every live request's stop and EOS
    ids (reference-counted).

    Attributes:
        random / seeded / logprobs / penalty / min_tokens: live requests that sample at
            random, have their own seed, want logprobs, have a penalty, have ``min_tokens``.
        structured / logit_bias / prompt_logprobs: live requests with an output constraint,
            with a ``logit_bias``, asking for prompt logprobs.
    """

    def __init__(self) -> None:
        self.random = 0
        self.seeded = 0
        self.logprobs = 0
        self.penalty = 0
        self.min_tokens = 0
        self.structured = 0
        self.logit_bias = 0
        self.prompt_logprobs = 0
        self._stop_refs: dict[int, int] = {}
        self._stop_arr: np.ndarray | None = None

    def add(self, req: Request) -> None:
        """Count a request that became live."""
        self._count(req, 1)

    def remove(self, req: Request) -> None:
        """Forget a request that finished (call once per ``add``)."""
        self._count(req, -1)

    def _count(self, req: Request, delta: int) -> None:
        p = req.params
        self.random += delta * (not p.greedy)
        self.seeded += delta * (req.generator is not None)
        self.logprobs += delta * (p.logprobs is not None)
        self.penalty += delta * req.needs_penalty_tokens
        self.min_tokens += delta * bool(p.min_tokens)
        self.structured += delta * (req.grammar is not None)
        self.logit_bias += delta * (req.logit_bias is not None)
        self.prompt_logprobs += delta * (req.prompt_logprob_rows is not None)
        refs = self._stop_refs
        for t in req.stop_ids | req.eos_token_ids:
            n = refs.get(t, 0) + delta
            if n > 0:
                refs[t] = n
            else:
                refs.pop(t, None)
            if n <= 0 or (n == 1 and delta > 0):
                self._stop_arr = None  # the set changed

    def stop_candidates(self, tokens: np.ndarray) -> np.ndarray:
        """bool [N]: which of ``tokens`` (int64 [N]) may end a request (a live stop or EOS
        id)."""
        if self._stop_arr is None:
            self._stop_arr = np.array(sorted(self._stop_refs), dtype=np.int64)
        if not self._stop_arr.size:
            return np.zeros(tokens.shape, dtype=bool)
        return np.isin(tokens, self._stop_arr)
