"""The draft model of speculative decoding's "draft_model" method: a second ``ModelRunner``
whose KV pool has the target's page ids, so one page table addresses both pools.

The draft runs every forward the target runs, on the same ``ForwardBatch`` (``mirror``): every
slot the target writes, the draft writes from the same token at the same position. Its KV is
therefore valid exactly where the target's is, and the target's bookkeeping (radix-cache
prefix hits, preemption, roll-back of rejected drafts, freeing) covers both pools with no
second set of tables. To propose, it runs greedy decode steps over the same page tables
(``greedy_step``), writing its KV past the request's computed tokens into pages the scheduler
took for the drafts; the verify step rewrites those slots in both pools.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from radixserve.config import EngineConfig
from radixserve.model_executor.forward_batch import ALL_GREEDY, ForwardBatch
from radixserve.model_executor.step_runner import ModelInfo

log = logging.getLogger(__name__)

_NO_ROWS = np.empty(0, dtype=np.int64)


def check_same_tokenizer(target_folder: str, draft_folder: str) -> None:
    """Refuse a draft model whose tokenizer is not the target's: token ids mean the same
    text in both, or drafts would be verified against other tokens.

    Compared: the vocabulary size (``len(tokenizer)``, added tokens included), every token's
    id, and the special tokens. The embedding rows (``config.json``'s ``vocab_size``) may
    differ: checkpoints of one family pad them differently (Qwen2.5 0.5B and 7B), and the
    draft proposes only ids below the target's (``DraftRunner.greedy_step``).

    Args:
        target_folder / draft_folder: Hugging Face folders holding the tokenizers.

    Raises:
        ValueError: either tokenizer cannot be loaded, or they differ; the message names the
            first difference found.
    """
    from radixserve.model_executor.loader import load_tokenizer

    if not target_folder or not draft_folder:
        raise ValueError("speculative_config: the draft_model method needs the target's and "
                         "the draft's tokenizers to compare, and a model here has none")
    target, draft = load_tokenizer(target_folder), load_tokenizer(draft_folder)

    def refuse(why: str) -> ValueError:
        return ValueError(f"speculative_config.model={draft_folder!r} does not share the "
                          f"target's tokenizer ({target_folder}): {why}")

    if len(target) != len(draft):
        raise refuse(f"the target's vocabulary has {len(target)} tokens, the draft's "
                     f"{len(draft)}")
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        for tok, i in sorted(tv.items(), key=lambda kv: kv[1]):
            if dv.get(tok) != i:
                raise refuse(f"token {tok!r} is id {i} in the target's vocabulary and "
                             f"{dv.get(tok)} in the draft's")
        raise refuse("the draft's vocabulary has tokens the target's lacks")
    ts, ds = target.special_tokens_map, draft.special_tokens_map
    if ts != ds:
        key = next(k for k in sorted(set(ts) | set(ds)) if ts.get(k) != ds.get(k))
        raise refuse(f"special token {key} is {ts.get(key)!r} in the target's tokenizer and "
                     f"{ds.get(key)!r} in the draft's")


class DraftRunner:
    """The draft model and its KV pool, addressed by the target's page ids.

    Args:
        config: the target's engine configuration; the draft loads
            ``config.speculative_config.model`` with its dtype, device, threads and kernel
            choices, and no KV transfer, shadow checks or speculation of its own.
        target: the target runner's model facts (its folder for the tokenizer check, its
            vocabulary size and ``max_model_len``).
        num_pages: pages of the target's pool in use (the engine's), the null page 0
            included: the draft's pool holds as many, each of its page size. Its bytes come on
            top of the target's (``kv_cache_memory`` sizes the target's pool only).

    Raises:
        ValueError: the tokenizers differ (``check_same_tokenizer``, before the draft's
            weights load), or the draft cannot be loaded (unreadable, unsupported, or its
            context shorter than the target's ``max_model_len``).

    Attributes:
        runner: the draft's ``ModelRunner``.
        vocab_size: ids the draft may propose (below the target's and the draft's vocabulary
            sizes).
    """

    def __init__(self, config: EngineConfig, target: ModelInfo, num_pages: int) -> None:
        from radixserve.model_executor.loader import resolve_model
        from radixserve.model_executor.runner import ModelRunner

        spec = config.speculative_config
        assert spec is not None and spec.model
        check_same_tokenizer(target.folder, str(resolve_model(spec.model).folder))
        draft_config = dataclasses.replace(
            config, model=spec.model, num_pages=num_pages, max_model_len=target.max_model_len,
            kv_transfer_config=None, shadow_rate=0.0, speculative_config=None,
            tensor_parallel_size=1)
        self.runner = ModelRunner(draft_config)
        if self.runner.num_pages != num_pages:
            raise ValueError(f"speculative_config.model: the draft's KV pool has "
                             f"{self.runner.num_pages} pages, the target's {num_pages}")
        self.page_size = self.runner.page_size
        self.vocab_size = min(target.vocab_size, self.runner.info.vocab_size)
        log.info("draft model %s: KV pool of %d pages x %d tokens beside the target's, same "
                 "page ids", self.runner.info.name, num_pages, self.page_size)

    def embeddable(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` (int [N]) with those past the draft's embedding rows replaced by 0.

        A target may have more embedding rows than its draft while their tokenizers are the
        same (padding: Qwen2.5-7B has 152,064 rows, Qwen2.5-0.5B 151,936), and it may emit,
        or be sent, an id in that padding. No token of the shared tokenizer has such an id;
        the draft reads token 0 there, so its KV at that position is not the target's token's.
        That can only lower acceptance: the target verifies every draft."""
        rows = self.runner.info.vocab_size
        if ids.size and int(ids.max()) >= rows:
            return np.where(ids < rows, ids, 0)
        return ids

    def mirror(self, batch: ForwardBatch) -> None:
        """Run the target's step through the draft, writing its KV at the same slots from the
        same tokens (no logits: nothing is sampled from it); ids the draft has no row for
        as in ``embeddable``."""
        self.runner.forward_logits(dataclasses.replace(
            batch, input_ids=self.embeddable(batch.input_ids), logits_indices=_NO_ROWS,
            prompt_logprobs=None, sampling=ALL_GREEDY))

    @torch.inference_mode()
    def greedy_step(self, tokens: np.ndarray, positions: np.ndarray,
                    page_table: np.ndarray) -> np.ndarray:
        """One decode step of the draft for B sequences: each token's KV is written at its
        position's slot and the draft's argmax over the ids the target knows comes back.

        Args:
            tokens: int [B] input token ids (the target's: any past the draft's embedding
                rows read as in ``embeddable``).
            positions: int [B] their positions; the KV of positions before each is the
                draft's (the pages below ``page_table``).
            page_table: int32 [B, P] each sequence's pages, holding ``positions + 1`` tokens.

        Returns:
            int64 [B] the draft's greedy next tokens, each below ``vocab_size``.
        """
        b = tokens.shape[0]
        ps = self.page_size
        pos = positions.astype(np.int64)
        pages = page_table[np.arange(b), pos // ps].astype(np.int64)
        fb = ForwardBatch(
            num_decodes=b, rows=np.arange(b, dtype=np.int64), num_new=np.ones(b, np.int64),
            seq_lens=pos + 1, sample=np.ones(b, dtype=bool),
            input_ids=self.embeddable(tokens.astype(np.int64)), positions=pos,
            slot_mapping=pages * ps + pos % ps, page_table=np.ascontiguousarray(page_table),
            logits_indices=np.arange(b, dtype=np.int64), sampling=ALL_GREEDY)
        logits, _ = self.runner.forward_logits(fb)
        assert logits is not None
        return logits[:, :self.vocab_size].argmax(dim=-1).cpu().numpy()
