"""Speculative decoding, engine side: the n-gram (prompt lookup) and draft-model proposers,
which requests may speculate, acceptance of a verified draft, and the acceptance counters.

A speculating request is scheduled with its last sampled token plus its k draft tokens as
k + 1 query tokens over its paged KV (a short prefill chunk whose k + 1 positions all give
logits: ``core/batch.py``); the target's pick at each position (the argmax, or for a sampled
request a draw that realises rejection sampling: ``model_executor/sampler.py``) verifies the
draft token that follows it (``StepResolver``), and the KV slots of rejected drafts are rolled
back (``Scheduler.roll_back``).

How many tokens a request drafts in a step is chosen per request (``choose_draft_length``):
the length that gives the most tokens per unit of step time, from the request's acceptance so
far and the step times the engine measures (``StepCosts``).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from radixserve.config import SPEC_BATCH_AUTO, SpeculativeConfig
from radixserve.core.request import DraftAcceptance, Request

_NONE = np.empty(0, dtype=np.int32)


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Prompt lookup: the tokens that followed the earliest earlier occurrence of the longest
    suffix n-gram of ``tokens`` (``min_n`` <= n <= ``max_n``), at most ``k`` of them.

    vLLM's ``NgramProposer`` semantics: the longest n wins; among the occurrences of that
    n-gram (which may overlap the suffix but not be it) the earliest one is used; fewer than
    ``k`` tokens are proposed when the occurrence is near the end.

    Args:
        tokens: int32 [L] the request's prompt and output so far.
        min_n, max_n: the n-gram lengths searched, in tokens.
        k: most draft tokens.

    Returns:
        int32 [<= k] draft tokens (empty: no n-gram of ``min_n`` tokens or more recurs).
    """
    total = tokens.shape[0]
    if total < min_n + 1 or k <= 0:
        return _NONE
    # ends[i]: where an occurrence ending on an earlier copy of the last token ends
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if not ends.size:
        return _NONE
    length = 1
    # extend every candidate leftwards while it keeps matching the suffix, up to max_n
    alive = ends
    best = ends if min_n <= 1 else _NONE
    best_len = 1 if min_n <= 1 else 0
    while length < max_n:
        alive = alive[alive >= length]
        if not alive.size:
            break
        alive = alive[tokens[alive - length] == tokens[total - 1 - length]]
        if not alive.size:
            break
        length += 1
        if length >= min_n:
            best, best_len = alive, length
    if best_len < min_n or not best.size:
        return _NONE
    start = int(best.min()) + 1  # the earliest occurrence; drafts follow its last token
    return tokens[start:start + k]


def may_speculate(req: Request) -> bool:
    """Whether ``req``'s next tokens may be drafted and verified: any request but one with a
    KV transfer or a grammar that already ended. Greedy rows accept drafts equal to their
    argmax; random rows are verified by rejection sampling (``sampler``: exact in
    distribution); penalties and ``min_tokens`` see each verify row's drafts before it as
    generated (``core.batch``); a constrained request's draft is cut to what its grammar
    allows (``grammar_prefix``) and each verify row is masked with the grammar state after
    the drafts before it (``structured.runtime``)."""
    return req.kv_transfer_params is None and (req.grammar is None or not req.grammar.done)


def grammar_prefix(req: Request, drafts: np.ndarray) -> np.ndarray:
    """``drafts`` (int32 [k]) cut before the first token ``req``'s grammar refuses from its
    current state (unchanged without a grammar). A verify row's pick is masked by the grammar,
    so a refused draft could never be accepted: verifying it and what follows would only
    take pages and budget. The matcher is left as it was."""
    if req.grammar is None or not drafts.shape[0]:
        return drafts
    return drafts[:req.grammar.valid_prefix(drafts)]


def crossover_batch_size(device_type: str, num_speculative_tokens: int) -> int:
    """``disable_by_batch_size`` when the configuration leaves it out: the most running
    requests at which a step still drafts on ``device_type`` ("cpu", "cuda").

    CPU: 1, measured. On Zen 3 (2 cores, the default model, n-gram k = 4; docs/benchmarks.md,
    2026-11-26) speculation on / off in output tok/s at c = 1/2/4/16/64 was
    2.01/1.57/1.07/0.97/0.87 on a copy-heavy set and 1.09/0.86/0.64/0.83/0.77 on chat: with
    two cores already busy at two requests, the verify step's k + 1 rows per request cost
    more than the drafts save from two running requests on chat, so only single-stream steps
    gain whatever the acceptance. A smaller k costs fewer rows but also gains fewer tokens;
    unmeasured, so it stays 1. A CPU kind measured otherwise belongs here.

    CUDA: 1, measured. Decode steps replay CUDA graphs and verify steps run eagerly, so a
    speculating step pays the eager forward's kernel launches: on an H200 at Qwen2.5-0.5B's
    shapes (k = 4, a one-layer draft; ``benchmarks/gpu/decode_bench.py --spec-draft-k 4``,
    docs/benchmarks.md) it took 14.4 / 18.7 / 20.5 / 33.5 ms at 1 / 16 / 64 / 256 requests
    against 1.9 / 2.1 / 2.1 / 3.3 ms for a graphed decode step: 7.7x to 10x, more than the
    k + 1 = 5 tokens a step can gain, at every batch size and growing with it. Only a model
    whose GPU time per step dwarfs the launches (several billion parameters) can gain, and
    then at a single request first.
    """
    del device_type, num_speculative_tokens  # both devices measured the same rule
    return 1


def effective_disable_by_batch_size(config: SpeculativeConfig, device_type: str
                                    ) -> int | None:
    """``config.disable_by_batch_size`` as the engine applies it on ``device_type``: the
    device's crossover when left out ("auto"), else as given (None: never disabled)."""
    v = config.disable_by_batch_size
    if v == SPEC_BATCH_AUTO:
        return crossover_batch_size(device_type, int(config.num_speculative_tokens or 1))
    assert v is None or isinstance(v, int)
    return v


#: weight an earlier verify step's outcome keeps for each later verify step of the request: a
#: request's acceptance follows what it is writing now (a copied passage, then free text)
ACCEPT_DECAY = 0.8
#: pseudo-counts before a request's first verify step, (accepted, rejected): of a draft's first
#: token (a prior rate of 1/2), and of the tokens after an accepted one (2/3). The first token
#: is kept apart because it decides whether a proposal continues the text at all (an n-gram
#: found in the wrong place); once one is accepted the next ones usually are (the copy set:
#: 87% of first tokens accepted, 94-97% of the following; chat: 41%, then 62-82%)
PRIOR_FIRST = (1.0, 1.0)
PRIOR_NEXT = (2.0, 1.0)
#: a request whose rule chose no draft this many decode steps in a row drafts one token, so a
#: request that starts copying (acceptance rising) is noticed
PROBE_EVERY = 8
#: a verify row's cost relative to a one-row step until the engine has measured both: a
#: five-row verify of the default model costs 1.6-2.1 one-row steps on two CPU cores
#: (docs/benchmarks.md); a model whose step reads its weights from DRAM costs less per row
DEFAULT_ROW_COST = 0.25
#: steps of each kind ``StepCosts`` keeps
COST_WINDOW = 64


def record_verify(rec: DraftAcceptance, num_draft: int, num_accepted: int) -> None:
    """Add a verify step of ``num_draft`` (>= 1) draft tokens with ``num_accepted`` accepted
    to the request's record: whether the first was accepted, then the later ones accepted and
    the rejection that ended them, if any (drafts that ran out before a rejection say nothing
    about the next token)."""
    d = ACCEPT_DECAY
    rec.first_accepted = rec.first_accepted * d + (num_accepted > 0)
    rec.first_rejected = rec.first_rejected * d + (num_accepted == 0)
    if num_accepted:
        rec.accepted = rec.accepted * d + num_accepted - 1
        rec.rejected = rec.rejected * d + (num_accepted < num_draft)


@dataclass
class StepCosts:
    """What a step costs by the number of query rows of the one request it runs, measured by
    the engine: medians over the last ``COST_WINDOW`` one-row steps' wall times and over what
    each further row added in as many verify steps, in seconds (medians, so a step that met a
    garbage collection or another process does not move them). Only steps of a single running
    request with no prefill are measured, where the rows alone set the work.

    Attributes:
        one_row_s: a decode step's seconds; None before one is measured.
        per_row_s: seconds each row past the first adds; None before a verify step is
            measured after a decode step.
    """

    one_row_s: float | None = None
    per_row_s: float | None = None
    _one_row: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW),
                                   repr=False)
    _per_row: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW),
                                   repr=False)

    def observe(self, rows: int, seconds: float) -> None:
        """Add a measured step of ``rows`` query rows (>= 1) that took ``seconds``."""
        if rows == 1:
            self._one_row.append(seconds)
            self.one_row_s = statistics.median(self._one_row)
        elif self.one_row_s is not None:
            self._per_row.append(max(0.0, (seconds - self.one_row_s) / (rows - 1)))
            self.per_row_s = statistics.median(self._per_row)

    def measured_row_cost(self) -> float | None:
        """A verify row's cost in one-row steps as measured; None before it is."""
        if self.one_row_s and self.per_row_s is not None:
            return self.per_row_s / self.one_row_s
        return None

    def relative(self, rows: int) -> float:
        """A step of ``rows`` query rows in one-row steps: 1 + (rows - 1) * the measured cost
        of a row relative to a one-row step (``DEFAULT_ROW_COST`` until measured)."""
        row = self.measured_row_cost()
        return 1.0 + (rows - 1) * (DEFAULT_ROW_COST if row is None else row)


def choose_draft_length(rec: DraftAcceptance, k: int, costs: StepCosts) -> int:
    """How many tokens a request drafts this step, 0 to ``k``: the length whose expected
    tokens per step time beats a plain decode by the most.

    A draft's first token is accepted with the request's rate a0 and each later one, after an
    accepted one, with rate a (``record_verify``'s counts with the priors ``PRIOR_FIRST`` and
    ``PRIOR_NEXT``), so a j-token draft gives 1 + a0 (1 + a + ... + a^(j-1)) tokens in one
    step of j + 1 rows, which costs ``costs.relative(j + 1)`` one-row steps. This is the
    model of Leviathan et al. 2023, section 3 (the expected tokens of one run, 1 + a + ... +
    a^j, and choosing the draft length from them and a cost ratio) with the first token's rate
    apart and the cost per verify row measured. The j with the highest ratio above 1 (a plain
    decode's) wins; none above 1 gives 0, and after ``PROBE_EVERY`` such steps in a row one
    token is drafted to keep the rates current.
    """
    fa, fr = rec.first_accepted + PRIOR_FIRST[0], rec.first_rejected + PRIOR_FIRST[1]
    na, nr = rec.accepted + PRIOR_NEXT[0], rec.rejected + PRIOR_NEXT[1]
    a0, a = fa / (fa + fr), na / (na + nr)
    best_j, best, tokens, p = 0, 1.0, 1.0, a0
    for j in range(1, k + 1):
        tokens += p
        p *= a
        ratio = tokens / costs.relative(j + 1)
        if ratio > best:
            best_j, best = j, ratio
    if best_j:
        rec.skipped = 0
        return best_j
    rec.skipped += 1
    if rec.skipped >= PROBE_EVERY:
        rec.skipped = 0
        return min(1, k)
    return 0


class ProposerBase:
    """What every proposer has: its k and when a step drafts at all.

    Args:
        config: the speculative configuration.
        device_type: the target's device ("cpu", "cuda"): it picks the default
            ``disable_by_batch_size`` (``crossover_batch_size``).

    Attributes:
        k: most draft tokens per request and step (``num_speculative_tokens``).
        disable_by_batch_size: the effective cap (``effective_disable_by_batch_size``; None:
            drafts at every batch size).
        adaptive: ``adaptive_draft_length``: each request's draft length is chosen by
            ``choose_draft_length``; False: always up to ``k``.
        costs: the measured step costs the choice uses (the engine adds to them).
    """

    def __init__(self, config: SpeculativeConfig, device_type: str) -> None:
        self.k = int(config.num_speculative_tokens or 0)
        self.disable_by_batch_size = effective_disable_by_batch_size(config, device_type)
        self.adaptive = bool(config.adaptive_draft_length)
        self.costs = StepCosts()

    def draft_length(self, req: Request) -> int:
        """Most draft tokens for ``req`` this step, 0 to ``k`` (0: a plain decode)."""
        if not self.adaptive:
            return self.k
        return choose_draft_length(req.draft_acceptance, self.k, self.costs)

    def active(self, batch_size: int) -> bool:
        """Whether a step with ``batch_size`` running requests drafts at all
        (``SpeculativeConfig.disable_by_batch_size``)."""
        cap = self.disable_by_batch_size
        return cap is None or batch_size <= cap


class NgramProposer(ProposerBase):
    """Drafts for the requests of a step (``SpeculativeConfig`` with method "ngram"), one
    request at a time, before pages are taken for them (a request without a recurring n-gram
    takes none)."""

    def __init__(self, config: SpeculativeConfig, device_type: str) -> None:
        super().__init__(config, device_type)
        self.min_n = int(config.prompt_lookup_min or 1)
        self.max_n = int(config.prompt_lookup_max or self.min_n)

    def propose(self, tokens: np.ndarray, most: int) -> np.ndarray:
        """int32 [<= min(k, most)] draft tokens to follow ``tokens`` (int32 [L])."""
        return propose_ngram(tokens, self.min_n, self.max_n, min(self.k, most))


class DraftModel(Protocol):
    """What the draft-model proposer drives (``model_executor.draft.DraftRunner``)."""

    def greedy_step(self, tokens: np.ndarray, positions: np.ndarray,
                    page_table: np.ndarray) -> np.ndarray:
        """int64 [B] the draft's argmax after writing the KV of ``tokens`` (int [B]) at
        ``positions`` (int [B]) through ``page_table`` (int32 [B, P])."""
        ...


class DraftModelProposer(ProposerBase):
    """Drafts by a draft model (``SpeculativeConfig`` with method "draft_model"): k greedy
    decode steps of the draft for all the step's speculating requests together, after their
    pages are taken (the draft writes its KV for the drafted positions there).

    The draft's pool shares the target's page ids and has seen every token the target
    computed (``DraftRunner.mirror``), so a request's draft KV is valid below its
    ``num_computed``; the first step feeds its last sampled token, each next step the draft's
    previous token. Proposals are greedy: a point-mass proposal, which the verify step's
    acceptance (argmax, or rejection sampling for sampled requests) handles exactly.

    Args:
        config: the speculative configuration (``num_speculative_tokens``,
            ``disable_by_batch_size``).
        draft: the draft model.
        page_size: tokens per KV page.
        device_type: the target's device ("cpu", "cuda").
    """

    def __init__(self, config: SpeculativeConfig, draft: DraftModel, page_size: int,
                 device_type: str) -> None:
        super().__init__(config, device_type)
        self.draft = draft
        self.page_size = page_size

    def propose_batch(self, token_table: np.ndarray, page_table: np.ndarray,
                      rows: list[int], num_tokens: list[int], counts: list[int]
                      ) -> list[np.ndarray]:
        """Draft ``counts[i]`` tokens for each request of the step.

        Args:
            token_table: int32 [R, L] the tables' token ids (a request's row holds its
                ``num_tokens[i]`` tokens).
            page_table: int32 [R, P] the tables' pages; request i holds pages for
                ``num_tokens[i] + counts[i]`` tokens.
            rows: the requests' rows; num_tokens: their token counts (the last one not yet
                computed); counts: drafts wanted, each >= 1.

        Returns:
            per request int32 [counts[i]] draft tokens.
        """
        n = np.asarray(num_tokens, dtype=np.int64)
        want = np.asarray(counts, dtype=np.int64)
        r = np.asarray(rows, dtype=np.int64)
        out = np.zeros((len(rows), int(want.max())), dtype=np.int32)
        cur = token_table[r, n - 1].astype(np.int64)
        width = -(-int((n + want).max()) // self.page_size)  # pages of the longest
        for j in range(out.shape[1]):
            live = np.flatnonzero(want > j)  # requests still drafting, in order
            nxt = self.draft.greedy_step(cur[live], n[live] - 1 + j,
                                         page_table[r[live], :width])
            out[live, j] = nxt
            cur[live] = nxt
        return [out[i, :want[i]] for i in range(len(rows))]


#: a proposer of either method
Proposer = NgramProposer | DraftModelProposer


def accepted_length(drafts: np.ndarray, targets: np.ndarray) -> int:
    """Acceptance: how many leading drafts equal the target's pick at the position before
    them (its argmax for a greedy request; for a sampled one the sampler's rejection-sampling
    pick, which equals the draft exactly when the draft is accepted).

    Args:
        drafts: int [k] the draft tokens verified.
        targets: int [k + 1] the target's token at the last sampled token's position and at
            each draft's position.

    Returns:
        a in [0, k]: the request gets ``targets[:a + 1]`` (the accepted drafts, then the
        target's token at the first mismatch, or the bonus token when a == k).
    """
    k = drafts.shape[0]
    miss = np.flatnonzero(drafts != targets[:k])
    return int(miss[0]) if miss.size else k


@dataclass
class SpecDecodeStats:
    """Cumulative speculation counters (vLLM's ``spec_decode_*`` metrics).

    Attributes:
        num_drafts: verify steps of a request (a request with at least one draft token).
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        accepted_per_pos: accepted draft tokens by position in the draft (0-based), length
            ``num_speculative_tokens``.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Count one request's verify step."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per = self.accepted_per_pos
        if len(per) < num_draft:
            per.extend([0] * (num_draft - len(per)))
        for i in range(num_accepted):
            per[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step gives a request on average: 1 + accepted drafts per draft
        (vLLM's "mean acceptance length"); 0 before any."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
