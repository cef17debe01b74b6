"""Per-row tables of the running requests: pages, tokens, and the per-request values that the
step builder and ``StepResolver`` read with numpy instead of visiting requests.

A request takes a row when it is admitted and gives it back when it finishes or is preempted.
The shape follows mini-sglang's ``TableManager`` (a page table and a token table indexed by a
free-listed row) plus vLLM's ``InputBatch`` idea of per-row sampling parameter arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radixserve.sampling_params import SamplingParams


class RowTables:
    """Rows ``[0, max_rows)`` and their tables.

    Args:
        max_rows: most requests running at once (``max_num_seqs``).
        max_model_len: longest sequence in tokens.
        page_size: tokens per KV page.

    Attributes:
        page_table: int32 [rows, ceil(max_model_len / page_size)] KV pages per row.
        token_table: int32 [rows, max_model_len + 1] prompt + output ids per row (-1: a
            token an in-flight step is still sampling).
        generation: int64 [rows] bumped each time a row is released, so a step can tell that
            a row changed owner since it was scheduled.
        prompt_len: int64 [rows] prompt length of the row's request.
        limit: int64 [rows] output tokens after which the row's request stops for length.
        temperature, top_p, min_p: float32 [rows]; top_k, logprobs: int64 [rows] (-1: none);
        greedy: bool [rows]; repetition/presence/frequency_penalty: float32 [rows].
        generators: per row the request's own ``torch.Generator`` or None.
    """

    def __init__(self, max_rows: int, max_model_len: int, page_size: int) -> None:
        self.max_rows = max_rows
        max_pages = -(-max_model_len // page_size)
        self.page_table = np.zeros((max_rows, max_pages), dtype=np.int32)
        self.token_table = np.zeros((max_rows, max_model_len + 1), dtype=np.int32)
        self.generation = np.zeros(max_rows, dtype=np.int64)
        self.prompt_len = np.zeros(max_rows, dtype=np.int64)
        self.limit = np.zeros(max_rows, dtype=np.int64)
        self.temperature = np.zeros(max_rows, dtype=np.float32)
        self.top_k = np.full(max_rows, -1, dtype=np.int64)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.greedy = np.ones(max_rows, dtype=bool)
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.repetition_penalty = np.ones(max_rows, dtype=np.float32)
        self.presence_penalty = np.zeros(max_rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_rows, dtype=np.float32)
        self.generators: list[Any] = [None] * max_rows
        self._free = list(range(max_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, tokens: np.ndarray, prompt_len: int, limit: int, params: SamplingParams,
                generator: Any) -> int:
        """Take a free row for a request and fill it in.

        Args:
            tokens: int32 [n] the request's prompt + output ids so far.
            prompt_len: its prompt length in tokens.
            limit: output tokens at which it stops for length.
            params: its sampling parameters; generator: its own generator or None.

        Raises:
            IndexError: no free row (the scheduler admits at most ``max_rows`` requests).
        """
        row = self._free.pop()
        self.token_table[row, :len(tokens)] = tokens
        self.prompt_len[row] = prompt_len
        self.limit[row] = limit
        self.greedy[row] = params.greedy
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.generators[row] = generator
        return row

    def release(self, row: int, num_pages: int) -> None:
        """Give ``row`` back; its first ``num_pages`` page-table entries are cleared."""
        self.page_table[row, :num_pages] = 0
        self.generation[row] += 1
        self.generators[row] = None
        self._free.append(row)
