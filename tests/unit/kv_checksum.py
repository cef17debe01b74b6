"""The KV-checksum model: a test-only ``StepRunner`` that proves the scheduler and the KV cache
never corrupt KV.

Its "KV pool" is an int64 array ``[num_pages, page_size]``. ``execute`` writes each input token id
into its KV slot (``batch.slot_mapping``), then, for every request that samples, reads the
request's WHOLE sequence back through its page table and returns a hash of it as the next token.
A wrong page-table entry, a page shared by two owners, a reused page or a stale slot changes what
is read back, so the token differs from ``expected_output``, which computes the same hash straight
from the token sequence without any engine.

With ``attach(engine)`` the runner also poisons every page on the free list before each step
(reading a freed page then yields garbage even before the page is reused) and asserts that a step
never writes into the null page, into a free page or into a page the radix tree holds (tree pages
are immutable: a shared prefix must never be overwritten).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from radixserve.core.batch import ScheduledBatch
from radixserve.model_executor.forward_batch import ForwardBatch, SampleResult
from radixserve.model_executor.step_runner import ModelInfo

VOCAB = 1000
#: The hash is a polynomial over [1] + tokens modulo a Mersenne prime (the leading 1 makes the
#: length count: [0, 5] and [5] differ).
_P = 2**31 - 1
_B = 1_000_003
UNWRITTEN = -1
POISON = -7


def seq_hash(tokens: list[int] | np.ndarray) -> int:
    """Hash of a whole token sequence (reference implementation, one token at a time)."""
    h = 1
    for t in np.asarray(tokens, dtype=np.int64).tolist():
        h = (h * _B + t) % _P
    return h


def next_token(tokens: list[int] | np.ndarray, vocab: int = VOCAB) -> int:
    """The token the checksum model emits after ``tokens``."""
    return seq_hash(tokens) % vocab


def expected_output(prompt: list[int] | np.ndarray, max_tokens: int, *,
                    eos_ids: frozenset[int] | set[int] | list[int] = (),
                    stop_ids: frozenset[int] | set[int] | list[int] = (),
                    ignore_eos: bool = False, max_model_len: int | None = None,
                    vocab: int = VOCAB) -> tuple[list[int], str, int | None]:
    """What a correct engine returns for ``prompt`` under the checksum model.

    Mirrors the engine's stop rules (min_tokens 0): a stop token id ends the output with
    ``stop_reason`` set; an EOS id ends it unless ``ignore_eos``; otherwise ``max_tokens`` (capped
    by ``max_model_len``) ends it with "length".

    Returns:
        (output tokens, finish reason "stop" or "length", stop_reason).
    """
    eos, stops = frozenset(eos_ids), frozenset(stop_ids)
    prompt = [int(t) for t in prompt]
    limit = max_tokens
    if max_model_len is not None:
        limit = min(limit, max_model_len - len(prompt))
    h = seq_hash(prompt)
    out: list[int] = []
    while True:
        tok = h % vocab
        out.append(tok)
        if tok in stops:
            return out, "stop", tok
        if tok in eos and not ignore_eos:
            return out, "stop", None
        if len(out) >= limit:
            return out, "length", None
        h = (h * _B + tok) % _P


@dataclass
class BatchRecord:
    """What one step computed (kept when ``record`` is on)."""

    request_ids: list[str]
    num_decodes: int
    start: np.ndarray
    num_new: np.ndarray
    sample: np.ndarray


class KVChecksumRunner:
    """Test-only ``StepRunner``: next token = hash of the sequence read back from the KV pool.

    Args:
        num_pages: pages in the pool, including the reserved null page 0.
        page_size: tokens per page (must equal the engine's).
        max_model_len: longest sequence the engine may build.
        vocab_size: tokens are ``hash % vocab_size``.
        record: keep a ``BatchRecord`` per step in ``batches``.
    """

    def __init__(self, num_pages: int, page_size: int, max_model_len: int,
                 vocab_size: int = VOCAB, record: bool = False) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv = np.full((num_pages, page_size), UNWRITTEN, dtype=np.int64)
        self._pow = np.ones(max_model_len + 2, dtype=np.int64)
        for i in range(1, len(self._pow)):
            self._pow[i] = self._pow[i - 1] * _B % _P
        self.record = record
        self.batches: list[BatchRecord] = []
        #: request id -> list of (start, num_new) per step it was in
        self.computed: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.num_steps = 0
        self._engine = None
        # With overlap scheduling ``execute`` runs in a worker thread while the engine mutates
        # requests and pages; checks that read that live state only run without overlap.
        self._overlap = False
        self.device = "cpu"
        self.info = ModelInfo(name="kv-checksum", folder="", max_model_len=max_model_len,
                              vocab_size=vocab_size, eos_token_ids=[], dtype="int64",
                              device="cpu")
        #: id(ForwardBatch) -> the engine's ScheduledBatch of that step (see ``attach``)
        self._scheduled: dict[int, ScheduledBatch] = {}

    def attach(self, engine) -> KVChecksumRunner:
        """Enable free-page poisoning and write-target checks against ``engine``'s KV manager.

        The runner sees only ``ForwardBatch``es; to check them against the requests it wraps
        the engine's ``schedule`` (test-only) to remember each step's ``ScheduledBatch``."""
        self._engine = engine
        self._overlap = bool(getattr(engine, "overlap", False))
        schedule = engine.scheduler.schedule

        def remembering_schedule():
            batch = schedule()
            if batch is not None:
                self._scheduled[id(batch.forward)] = batch
            return batch

        engine.scheduler.schedule = remembering_schedule
        return self

    # ------------------------------------------------------------------ checks
    def _check_metadata(self, batch: ForwardBatch, requests: list) -> None:
        ps = self.page_size
        n = batch.num_new
        b = len(requests)
        start = batch.seq_lens - n
        assert batch.rows.shape == (b,) and start.shape == (b,) and n.shape == (b,)
        assert (n >= 1).all(), "a scheduled request computes no token"
        assert (n[:batch.num_decodes] == 1).all(), "a decode computes more than one token"
        assert len({id(r) for r in requests}) == b, "a request is scheduled twice"
        total = int(n.sum())
        assert batch.input_ids.shape == (total,) == batch.positions.shape
        assert batch.slot_mapping.shape == (total,)
        req_idx = np.repeat(np.arange(b), n)
        offsets = np.cumsum(n) - n
        want_pos = np.arange(total) - np.repeat(offsets, n) + np.repeat(start, n)
        assert (batch.positions == want_pos).all(), "positions"
        want_slot = (batch.page_table[req_idx, batch.positions // ps].astype(np.int64) * ps
                     + batch.positions % ps)
        assert (batch.slot_mapping == want_slot).all(), "slot_mapping disagrees with page_table"
        if total:
            assert batch.slot_mapping.min() >= ps, "a token is written into the null page 0"
            assert np.unique(batch.slot_mapping).size == total, "two tokens share a KV slot"
            assert batch.slot_mapping.max() < self.num_pages * ps
        assert (batch.logits_indices == (np.cumsum(n) - 1)[batch.sample]).all()
        if self._overlap:
            return
        # the engine commits a step (placeholder for each token it samples) before running it
        num_tok = np.array([r.num_tokens - r.num_pending for r in requests],
                           dtype=np.int64)
        assert (batch.seq_lens <= num_tok).all()
        # committed before it runs: each request counts this step's tokens as computed
        assert (batch.seq_lens == np.array([r.num_computed for r in requests])).all()
        assert (batch.sample == (batch.seq_lens == num_tok)).all()

    def _poison_and_check_targets(self, batch: ForwardBatch) -> None:
        kvm = self._engine.kv
        free = np.fromiter(kvm.pool.free_set(), dtype=np.int64)
        if self._overlap:
            # Pages of this batch may be released by the engine while it runs (a request that
            # finished or was preempted meanwhile); steps run in order, so their reuse is only
            # written by a later step. Poison every other free page; the checksum does the rest.
            free = np.setdiff1d(free, batch.page_table.reshape(-1))
            if free.size:
                self.kv[free] = POISON
            return
        if free.size:
            self.kv[free] = POISON
        written = np.unique(batch.slot_mapping // self.page_size)
        for p in written.tolist():
            assert not kvm.pool.is_free(p), f"step writes into free page {p}"
        if kvm.tree is not None:
            tree_pages: set[int] = set()
            for node in kvm.tree.all_nodes():
                tree_pages.update(node.value.tolist())
            bad = tree_pages.intersection(written.tolist())
            assert not bad, f"step overwrites radix-tree (shared, immutable) pages {bad}"

    # ------------------------------------------------------------------ step
    def execute(self, batch: ForwardBatch) -> SampleResult:
        self.num_steps += 1
        ps = self.page_size
        requests = self._scheduled.pop(id(batch)).requests
        start = batch.seq_lens - batch.num_new
        self._check_metadata(batch, requests)
        if self._engine is not None:
            self._poison_and_check_targets(batch)
        if self.record:
            self.batches.append(BatchRecord(
                [r.request_id for r in requests], batch.num_decodes, start.copy(),
                batch.num_new.copy(), batch.sample.copy()))
        for r, s, n in zip(requests, start.tolist(), batch.num_new.tolist(),
                           strict=True):
            self.computed[r.request_id].append((s, n))
        flat = self.kv.reshape(-1)
        flat[batch.slot_mapping] = batch.input_ids
        out = []
        for i in np.flatnonzero(batch.sample).tolist():
            n = int(batch.seq_lens[i])
            pos = np.arange(n)
            slots = batch.page_table[i, pos // ps].astype(np.int64) * ps + pos % ps
            seq = flat[slots]
            h = (self._pow[n] + ((seq * self._pow[:n][::-1]) % _P).sum()) % _P
            out.append(int(h) % self.vocab_size)
        return SampleResult(token_ids=np.asarray(out, dtype=np.int64), logprobs=None)

    def prefill_tokens(self, request_id: str, prompt_len: int) -> int:
        """Tokens at prompt positions (< ``prompt_len``) computed for ``request_id``."""
        return sum(max(0, min(s + n, prompt_len) - s) for s, n in self.computed[request_id])
