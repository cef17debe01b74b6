"""A null model: returns one token per sampling request instantly, touching no tensors.

It isolates the engine core's own CPU cost (scheduling, metadata, output processing,
transport) from the model, for ``radixserve bench overhead`` and for tests of the server
plumbing.
"""

from __future__ import annotations

import numpy as np

from radixserve.core.batch import ScheduledBatch
from radixserve.model_executor.sampler import SampleResult


class NullRunner:
    """A ``StepRunner`` that "samples" a fixed token for every request with ``batch.sample``
    set.

    Args:
        num_pages: KV pages to report (including the null page 0); no memory is allocated.
        max_model_len: longest sequence in tokens.
        vocab_size: the token ids it may return are below it.
    """

    def __init__(self, num_pages: int, max_model_len: int, vocab_size: int) -> None:
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = "cpu"
        # an ordinary token (not 0..2, usually special), the same every step
        self.token_id = min(1000, vocab_size - 1)

    def execute(self, batch: ScheduledBatch) -> SampleResult:
        n = int(batch.logits_indices.shape[0])
        return SampleResult(np.full(n, self.token_id, dtype=np.int64), None)
