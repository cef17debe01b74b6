"""A null model: returns one token per sampling request instantly, touching no tensors.

It isolates the engine core's own CPU cost (scheduling, metadata, output processing,
transport) from the model, for ``radixserve bench overhead`` and for tests of the server
plumbing.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from radixserve.config import EngineConfig
from radixserve.kvcache.sizing import plan_kv_pool
from radixserve.kvcache.storage import KVStorage
from radixserve.model_executor.forward_batch import ForwardBatch, SampleResult
from radixserve.model_executor.step_runner import ModelInfo


class NullRunner:
    """A ``StepRunner`` that "samples" a fixed token for every row with ``batch.sample`` set.

    Args:
        num_pages: KV pages to report (including the null page 0); no memory is allocated.
        max_model_len: longest sequence in tokens.
        vocab_size: the token ids it may return are below it.
        step_s: seconds each step sleeps (emulates a forward of that length; 0 = instant).
        info: the model facts to report (default: an anonymous model).
    """

    def __init__(self, num_pages: int, max_model_len: int, vocab_size: int,
                 step_s: float = 0.0, info: ModelInfo | None = None) -> None:
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.device = "cpu"
        self.info = info or ModelInfo(name="null", folder="", max_model_len=max_model_len,
                                      vocab_size=vocab_size, eos_token_ids=[], dtype="null",
                                      device="cpu")
        # an ordinary token (not 0..2, usually special), the same every step
        self.token_id = min(1000, vocab_size - 1)

    @classmethod
    def for_model(cls, config: EngineConfig, step_s: float = 0.0) -> NullRunner:
        """A null runner with ``config.model``'s vocabulary, EOS ids and context length,
        its pool sized by the same rule as the real runner's (as if float32).

        Raises:
            ValueError: unreadable model or bad sizes.
        """
        from radixserve.model_executor.loader import (
            eos_token_ids,
            load_hf_config,
            read_config,
            resolve_model,
        )

        files = resolve_model(config.model)
        hf = read_config(files.folder)
        if not hasattr(hf, "max_position_embeddings"):  # the context: its class default
            hf = load_hf_config(files.folder)
        heads = int(hf.num_attention_heads)
        kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
        per_page = KVStorage.bytes_per_page(int(hf.num_hidden_layers), config.page_size,
                                            kv_heads, head_dim, torch.float32)
        plan = plan_kv_pool(page_size=config.page_size, num_pages=config.num_pages,
                            kv_cache_memory=config.kv_cache_memory, bytes_per_page=per_page,
                            max_num_seqs=config.max_num_seqs,
                            model_max_len=int(getattr(hf, "max_position_embeddings", 8192)),
                            max_model_len=config.max_model_len)
        vocab = int(hf.vocab_size)
        info = ModelInfo(name=files.name, folder=str(files.folder),
                         max_model_len=plan.max_model_len, vocab_size=vocab,
                         eos_token_ids=eos_token_ids(files.folder, hf), dtype="null",
                         device="cpu")
        return cls(plan.num_pages, plan.max_model_len, vocab, step_s, info)

    def execute(self, batch: ForwardBatch) -> SampleResult:
        if self.step_s > 0:
            time.sleep(self.step_s)
        n = int(batch.logits_indices.shape[0])
        return SampleResult(np.full(n, self.token_id, dtype=np.int64), None)
