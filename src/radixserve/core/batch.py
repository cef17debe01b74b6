"""What one engine step computes, and its per-step metadata built with numpy (no per-token
Python loops)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from radixserve.core.request import Request


@dataclass
class ScheduledBatch:
    """One step's work.

    Requests are ordered decodes first, then prefill chunks. For request i the step computes
    ``num_new[i]`` tokens at positions ``[start[i], start[i] + num_new[i])``.

    Attributes:
        requests: scheduled requests, length B.
        num_decodes: the first ``num_decodes`` requests compute exactly one token each.
        rows: int64 [B] rows of the page/token tables.
        start: int64 [B] tokens already computed per request.
        num_new: int64 [B] tokens computed this step.
        sample: bool [B] whether the request reaches its last token this step (samples).
        input_ids: int64 [T] token ids, T = num_new.sum().
        positions: int64 [T].
        slot_mapping: int64 [T] KV slot (page * page_size + offset) written per token.
        seq_lens: int64 [B] context length after this step (start + num_new).
        page_table: int32 [B, P] pages of each request, P = max pages among them; padded with
            the null page 0.
        logits_indices: int64 [S] token index whose hidden state gives each sample's logits.
        num_outputs: sample row -> tokens that request had generated before this one, only
            for requests with ``min_tokens``; taken when the step was scheduled.
        penalty_tokens: sample row -> snapshot of that request's output ids, only for requests
            with penalties; a trailing -1 is a token the previous step is still sampling.
        epochs: int64 [B - num_decodes] each prefill request's preemption count when
            scheduled; a request preempted
            since holds other pages, so the step's results must not touch its page table.
        samplers: the requests with ``sample`` set, in order (length S).
        row_gens: int64 [S] the scheduler's generation of each sampler's row when scheduled
            (a row's generation changes whenever it is released, so a request whose row still
            has it has neither finished nor been preempted since); set by the scheduler.
    """

    requests: list[Request]
    num_decodes: int
    rows: np.ndarray
    start: np.ndarray
    num_new: np.ndarray
    sample: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    page_table: np.ndarray
    logits_indices: np.ndarray
    num_outputs: dict[int, int] | None = None
    penalty_tokens: dict[int, list[int]] | None = None
    epochs: np.ndarray | None = None
    samplers: list[Request] | None = None
    row_gens: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes


def build_batch(requests: list[Request], num_decodes: int, num_new: list[int],
                token_table: np.ndarray, page_table: np.ndarray, page_size: int,
                any_min_tokens: bool = True, any_penalty: bool = True) -> ScheduledBatch:
    """Per-step metadata for ``requests`` from the scheduler's tables.

    Args:
        token_table: int32 [rows, max_model_len] token ids per row.
        page_table: int32 [rows, max_pages] page ids per row.
        any_min_tokens / any_penalty: False when no request can have ``min_tokens`` / a
            penalty (skips looking for them).
    """
    rows = np.fromiter((r.row for r in requests), dtype=np.int64, count=len(requests))
    start = np.fromiter((r.num_computed for r in requests), dtype=np.int64,
                        count=len(requests))
    n = np.asarray(num_new, dtype=np.int64)
    seq_lens = start + n
    total = int(n.sum())
    ends = np.cumsum(n)
    offsets = ends - n
    tok_rows = np.repeat(rows, n)
    positions = np.arange(total, dtype=np.int64) + np.repeat(start - offsets, n)
    input_ids = token_table[tok_rows, positions].astype(np.int64)
    slot_mapping = (page_table[tok_rows, positions // page_size].astype(np.int64) * page_size
                    + positions % page_size)
    # a decode always reaches its last token; only prefill chunks may stop short of it
    sample = np.ones(len(requests), dtype=bool)
    for i in range(num_decodes, len(requests)):
        sample[i] = seq_lens[i] == requests[i].num_tokens
    max_pages = int((seq_lens.max() + page_size - 1) // page_size) if len(requests) else 0
    pt = page_table[rows, :max_pages]
    samplers = (requests if num_decodes == len(requests) or sample.all()
                else list(itertools.compress(requests, sample.tolist())))
    min_tok = ({i: len(r.output_token_ids) for i, r in enumerate(samplers)
                if r.params.min_tokens} if any_min_tokens else None)
    penalty = ({i: list(r.output_token_ids) for i, r in enumerate(samplers)
                if r.needs_penalty_tokens} if any_penalty else None)
    return ScheduledBatch(
        requests=requests, num_decodes=num_decodes, rows=rows, start=start, num_new=n,
        sample=sample, input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
        seq_lens=seq_lens, page_table=pt, logits_indices=(ends - 1)[sample],
        num_outputs=min_tok or None, penalty_tokens=penalty or None,
        epochs=np.fromiter((r.num_preemptions for r in requests[num_decodes:]),
                           dtype=np.int64, count=len(requests) - num_decodes),
        samplers=samplers)
