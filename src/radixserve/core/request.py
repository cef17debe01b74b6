"""Engine-side state of one request: its tokens, its place in the KV pool and the
scheduler's queues, and how it finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixserve.kvcache.radix_cache import RadixNode
from radixserve.sampling_params import SamplingParams
from radixserve.structured.runtime import RequestGrammar


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    #: holds a row and pages while a KV connector loads its prompt's KV from a remote
    #: (prefill) instance; in ``Scheduler.loading``, never scheduled until the load ended
    WAITING_FOR_REMOTE_KVS = 3


@dataclass(slots=True)
class DraftAcceptance:
    """A request's speculative-decoding record, from which its draft length is chosen
    (``core.spec_decode.choose_draft_length``). Counts of older verify steps are decayed
    (``core.spec_decode.record_verify``).

    Attributes:
        first_accepted / first_rejected: verify steps whose first draft token was accepted /
            rejected.
        accepted / rejected: draft tokens after the first accepted / rejected.
        skipped: decode steps in a row in which the rule chose no draft.
    """

    first_accepted: float = 0.0
    first_rejected: float = 0.0
    accepted: float = 0.0
    rejected: float = 0.0
    skipped: int = 0


@dataclass(eq=False, slots=True)
class Request:
    """A request inside the engine core.

    ``tokens`` holds prompt + generated ids (int32, grown in place); ``num_computed`` counts the
    leading tokens whose KV is written. A running request owns a ``row`` of the scheduler's
    page and token tables while it holds pages.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached_tokens: int = 0
    row: int = -1
    num_pages: int = 0
    num_matched_pages: int = 0
    node: RadixNode | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    stop_ids: frozenset[int] = frozenset()
    #: trailing entries of ``output_token_ids`` that are placeholders (-1) for tokens an
    #: in-flight step is still sampling (overlap scheduling); at most 2
    num_pending: int = 0

    #: prompt length in tokens (fixed)
    num_prompt_tokens: int = 0
    #: the sampler needs this request's generated ids (a penalty is set)
    needs_penalty_tokens: bool = False
    #: token ids masked while fewer than ``params.min_tokens`` are generated (stop ids, and
    #: EOS unless ``ignore_eos``); empty without ``min_tokens``
    min_tokens_blocked: list[int] = field(default_factory=list)
    #: the output constraint's matcher (``structured_outputs``); None when unconstrained
    grammar: RequestGrammar | None = None
    #: ``logit_bias`` as int64 ids and float32 values, for the sampler; None without
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None
    #: prompt logprob rows received so far (``params.prompt_logprobs``), one per prompt
    #: position from 1; None when not asked
    prompt_logprob_rows: list[list[list[float]]] | None = None
    #: next prompt position whose logprob row is still to be scheduled (a preempted request
    #: recomputes its prompt but asks no row twice)
    prompt_lp_next: int = 0
    #: the rows went out with the first token's output
    prompt_lp_sent: bool = False
    #: prefill/decode disaggregation: the request's parsed ``kv_transfer_params`` (the
    #: connector may update it), and the ones its final output reports
    kv_transfer_params: dict[str, Any] | None = None
    kv_transfer_params_out: dict[str, Any] | None = None
    #: speculative decoding: acceptance so far, which sets the request's draft length
    draft_acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)

    def __post_init__(self) -> None:
        # plain attributes: these are read for every running request in every step
        p = self.params
        self.stop_ids = frozenset(p.stop_token_ids or ())
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.needs_penalty_tokens = bool(p.repetition_penalty != 1.0 or p.presence_penalty
                                         or p.frequency_penalty)
        if p.min_tokens:
            blocked = self.stop_ids if p.ignore_eos else self.stop_ids | self.eos_token_ids
            self.min_tokens_blocked = sorted(blocked)
        if p.prompt_logprobs is not None:
            self.prompt_logprob_rows = []
        if p.logit_bias:
            self.logit_bias = (np.fromiter(p.logit_bias.keys(), dtype=np.int64),
                               np.fromiter(p.logit_bias.values(), dtype=np.float32))

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def all_token_ids(self) -> np.ndarray:
        """int32 [num_tokens]: prompt then output."""
        if not self.output_token_ids:
            return self.prompt_token_ids
        out = np.asarray(self.output_token_ids, dtype=np.int32)
        return np.concatenate([self.prompt_token_ids, out])
