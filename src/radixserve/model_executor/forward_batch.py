"""What the model runner gets for one step: token arrays, KV addressing and per-row sampling
parameters, all as numpy arrays.

Defined here, below the engine core, so the runner and the sampler never see a scheduler
``Request`` (whose state the engine mutates while an overlapped step runs): the core builds a
``ForwardBatch`` from its tables when it schedules the step and hands it over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class StepConstraints(Protocol):
    """A step's output constraints as the sampler drives them (implemented engine-side by
    ``structured.runtime.GrammarStep``).

    Attributes:
        rows: sampling rows that are constrained this step.
        verify_rows: the rows of ``rows`` that belong to a request verifying drafts
            (speculative decoding), ascending: masked before the pick (``fill_verify``) and
            accepted by ``accept_verify``, never by ``accept``.
    """

    rows: list[int]
    verify_rows: list[int]

    def fill_verify(self) -> Any:
        """int32 [S, ceil(V / 32)] CPU token bitmask with ``verify_rows`` filled, each from its
        grammar state after its request's drafts before it."""
        ...

    def accept_verify(self, tokens: np.ndarray) -> None:
        """Advance the constraints of verifying requests by the tokens they keep (``tokens``
        int64 [S]: picks equal to their drafts, then the first other pick or the bonus)."""
        ...

    def accept(self, tokens: np.ndarray, rows: Sequence[int]) -> list[int]:
        """Advance the constraints of ``rows`` by ``tokens[row]`` (int64 [S]); returns the rows
        whose token is refused (left unchanged)."""
        ...

    def fill(self, rows: Sequence[int]) -> Any:
        """int32 [S, ceil(V / 32)] CPU token bitmask with ``rows`` filled (bit j of row i set
        when token j is allowed)."""
        ...

    def reject(self, rows: Sequence[int]) -> None:
        """``rows`` got a token their constraint refuses even after masking."""
        ...


@dataclass
class SamplingBatch:
    """Sampling parameters of the step's S sampling rows (requests that reach their last
    token this step), in row order. Optional parts are None when no row needs them, so an
    all-greedy step pays for nothing.

    Attributes:
        temperature: float32 [S]; 0 for greedy rows.
        top_k: int64 [S]; -1 or 0 disables.
        top_p: float32 [S] in (0, 1].
        min_p: float32 [S] in [0, 1].
        greedy: bool [S]; None when every row is greedy.
        generators: per row its own ``torch.Generator`` (seeded requests) or None; None
            when no row is seeded.
        logprobs: int64 [S] top logprobs wanted per row, -1 for none; None when no row
            wants logprobs.
        repetition_penalty / presence_penalty / frequency_penalty: float32 [S]; None when
            no row has a penalty.
        penalty_prompts: row -> int32 prompt ids, for rows with a repetition penalty.
        penalty_outputs: row -> the request's generated ids when the step was scheduled; a
            trailing -1 is a token the previous (overlapped) step is still sampling, filled in
            by the engine before the forward runs.
        blocked_tokens: row -> token ids that may not be sampled this step (EOS and stop ids
            below ``min_tokens``); None when no row is below its ``min_tokens``.
        logit_bias: row -> (int64 token ids, float32 values) added to those logits; None
            when no row has a ``logit_bias``.
        grammars: per row its output constraint's matcher state or None; None when no row is
            constrained. The sampler never reads it: the engine turns it into ``constraints``
            right before the forward (they depend on the previous step's tokens).
        constraints: the step's output constraints, which the sampler offers its picks to
            and masks refused rows with; None when no row is constrained.
        draft_tokens: int64 [S] speculative decoding: per row the draft token its pick is
            checked against (row j of a request verifying k drafts checks draft j; the
            request's rows are consecutive, its last row, the bonus, and every plain row
            hold -1); None when no random or constrained row verifies drafts. The sampler
            draws a seeded row only while the rows before it in its request matched their
            drafts (see ``sampler.sample``); the engine hands it to the step's constraints.
    """

    temperature: np.ndarray | None = None
    top_k: np.ndarray | None = None
    top_p: np.ndarray | None = None
    min_p: np.ndarray | None = None
    greedy: np.ndarray | None = None
    generators: list[Any] | None = None
    logprobs: np.ndarray | None = None
    repetition_penalty: np.ndarray | None = None
    presence_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    penalty_prompts: dict[int, np.ndarray] | None = None
    penalty_outputs: dict[int, list[int]] | None = None
    blocked_tokens: dict[int, list[int]] | None = None
    logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
    grammars: list[Any] | None = None
    constraints: StepConstraints | None = None
    draft_tokens: np.ndarray | None = None


#: The sampling parameters of a step whose rows are all greedy and plain.
ALL_GREEDY = SamplingBatch()


@dataclass
class PromptLogprobsBatch:
    """Prompt positions of the step that need logprobs (requests with ``prompt_logprobs``):
    the logits at a position score the prompt's next token.

    Attributes:
        indices: int64 [K] rows of the step's hidden states (token indices in the batch).
        targets: int64 [K] the prompt token following each such position.
        want: int64 [K] top logprobs wanted at each position.
        counts: int64 [B] positions per request of the batch (0 for most), in order, so the
            K rows split back per request.
    """

    indices: np.ndarray
    targets: np.ndarray
    want: np.ndarray
    counts: np.ndarray


@dataclass
class ForwardBatch:
    """One step's model inputs. Requests are ordered decodes first, then prefill chunks; for
    request i the step computes ``num_new[i]`` tokens at positions
    ``[seq_lens[i] - num_new[i], seq_lens[i])``.

    Attributes:
        num_decodes: the first ``num_decodes`` requests compute exactly one token each.
        rows: int64 [B] the requests' rows in the engine's tables (the overlap token buffer
            is indexed by row).
        num_new: int64 [B] tokens computed this step per request.
        seq_lens: int64 [B] context length after this step.
        sample: bool [B] whether the request reaches its last token (and samples).
        input_ids: int64 [T] token ids, T = num_new.sum(); a decode's id is -1 while the
            previous (overlapped) step is still sampling it.
        positions: int64 [T].
        slot_mapping: int64 [T] KV slot written per token (page * page_size + offset).
        page_table: int32 [B, P] pages per request, P = the most pages among them, padded
            with the null page 0.
        logits_indices: int64 [S] index of the token whose hidden state gives each sampling
            row's logits: one per sampling request, or k + 1 for a request verifying k draft
            tokens (``num_draft``), in order.
        sampling: the S sampling rows' parameters.
        prompt_logprobs: prompt positions that need logprobs, or None (almost every step).
        num_draft: int64 [B] draft tokens each request verifies this step (speculative
            decoding: its ``num_new`` tokens are its last sampled token and the drafts, and
            all of them give logits); None when no request does.
    """

    num_decodes: int
    rows: np.ndarray
    num_new: np.ndarray
    seq_lens: np.ndarray
    sample: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    page_table: np.ndarray
    logits_indices: np.ndarray
    sampling: SamplingBatch
    prompt_logprobs: PromptLogprobsBatch | None = None
    num_draft: np.ndarray | None = None

    @property
    def num_requests(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    @property
    def num_chunk_tokens(self) -> int:
        """Tokens of the step's prefill chunks (a prompt, or a preempted request's context
        recomputed): ``num_prefill_tokens`` less the rows verifying drafts."""
        new = self.num_new[self.num_decodes:]
        if self.num_draft is not None:
            new = new[self.num_draft[self.num_decodes:] == 0]
        return int(new.sum())


@dataclass
class SampleResult:
    """What a step sampled.

    Attributes:
        token_ids: int64 [S] one token per sampling row.
        logprobs: per row a ``LogprobRow`` (``[[token, logprob], ...]``, the sampled token
            first, then the top N) or None for rows that did not ask; None when no row asked.
        grammar_status: int8 [S] per row what its output constraint made of the token
            (``structured.runtime``: 0 running, 1 terminated, 2 rejected); None when no row is
            constrained. Set by the engine after the step.
        prompt_logprobs: K rows for ``ForwardBatch.prompt_logprobs``, in its order, each
            ``[[target, logprob, rank], [top1, logprob], ...]`` (rank 1-based among the whole
            vocabulary, vLLM's); None when the step asked for none.
    """

    token_ids: np.ndarray
    logprobs: list[list[list[float]] | None] | None = None
    grammar_status: np.ndarray | None = None
    prompt_logprobs: list[list[list[float]]] | None = None
