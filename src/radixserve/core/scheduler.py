"""Token-budget scheduler with mixed prefill/decode batches, chunked prefill, a radix prefix
cache and preemption by recompute (DESIGN §3).

Each step: running requests in decode take one token each first; the rest of
``max_num_batched_tokens`` goes to prefill chunks, first of partly prefilled running requests,
then of waiting ones (FCFS, or longest prefix match first with ``lpm``). Pages are taken per
chunk and per decoded token, never reserved for ``max_tokens`` up front; when a decode cannot get
a page, the most recently admitted running request is preempted (pages released to the radix
cache, request back at the front of the waiting queue). This is vLLM V1's scheduling shape
(Sarathi-Serve's stall-free batching) over SGLang's radix cache.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from radixserve.core.batch import ScheduledBatch, build_batch
from radixserve.core.request import Request, Status
from radixserve.engine_types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from radixserve.kvcache.manager import KVCacheManager


@dataclass
class Resolved:
    """The tokens one step sampled, applied by ``Scheduler.resolve``.

    Attributes:
        full: (request, token, sample row) for each request whose output needs more than its
            token: its first token, a finished request (``finish_reason`` set), or every
            request when ``resolve`` was asked for no plain outputs.
        plain: requests that got one ordinary token: still running, not their first.
        plain_tokens: int64 [len(plain)] their tokens, in order.
    """

    full: list[tuple[Request, int, int]]
    plain: list[Request]
    plain_tokens: np.ndarray

    @property
    def num_outputs(self) -> int:
        return len(self.full) + len(self.plain)


class Scheduler:
    """Decides each step's work and owns every request's KV pages.

    Args:
        kv: the KV page manager.
        max_num_seqs: most requests per step (and rows of the tables).
        max_num_batched_tokens: token budget per step.
        max_model_len: longest sequence in tokens.
        policy: "fcfs" or "lpm".
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs") -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        max_pages = -(-max_model_len // self.page_size)
        self.page_table = np.zeros((max_num_seqs, max_pages), dtype=np.int32)
        self.token_table = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # per-row state read by ``resolve`` without visiting requests:
        #: int64 [rows] bumped each time a row is released
        self.row_gen = np.zeros(max_num_seqs, dtype=np.int64)
        #: int64 [rows] prompt length of the row's request
        self.row_prompt_len = np.zeros(max_num_seqs, dtype=np.int64)
        #: int64 [rows] output tokens after which the row's request stops for length
        self.row_limit = np.zeros(max_num_seqs, dtype=np.int64)
        # every live request's stop and EOS ids (refcounted), and their sorted array
        self._stop_refs: dict[int, int] = {}
        self._stop_arr: np.ndarray | None = None
        # live requests with min_tokens / a penalty (build_batch skips looking when 0)
        self._num_min_tokens = 0
        self._num_penalty = 0
        # cumulative counters for metrics
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        #: seconds the last ``schedule()`` spent building the step's metadata (``build_batch``)
        self.last_prepare_s = 0.0

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Queue a request; raises ValueError if it can never fit the KV pool."""
        need = -(-(req.num_prompt_tokens + req.max_tokens) // self.page_size)
        if need > self.kv.num_usable_pages:
            raise ValueError(
                f"request needs {need} KV pages ({req.num_prompt_tokens} prompt + "
                f"{req.max_tokens} max_tokens tokens) but the pool has "
                f"{self.kv.num_usable_pages}; lower max_tokens or enlarge the KV cache")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self._count_live(req, 1)

    def _count_live(self, req: Request, delta: int) -> None:
        """Count ``req`` in (``delta`` 1) or out (-1) of the live requests: its stop and EOS
        ids, and whether it has ``min_tokens`` or a penalty."""
        self._num_min_tokens += delta * bool(req.params.min_tokens)
        self._num_penalty += delta * req.needs_penalty_tokens
        refs = self._stop_refs
        for t in req.stop_ids | req.eos_token_ids:
            n = refs.get(t, 0) + delta
            if n > 0:
                refs[t] = n
            else:
                refs.pop(t, None)
            if n <= 0 or (n == 1 and delta > 0):
                self._stop_arr = None  # the set changed

    def _stop_candidates(self, tokens: np.ndarray) -> np.ndarray:
        """bool [N]: which of ``tokens`` may end their request (a live stop or EOS id)."""
        if self._stop_arr is None:
            self._stop_arr = np.array(sorted(self._stop_refs), dtype=np.int64)
        if not self._stop_arr.size:
            return np.zeros(tokens.shape, dtype=bool)
        return np.isin(tokens, self._stop_arr)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        """Remove a waiting or running request and release its pages; None if unknown."""
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        if req.status == Status.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self.finish(req, FINISH_ABORT)
        return req

    # ------------------------------------------------------------------ pages
    def _grow(self, req: Request, upto_tokens: int) -> bool:
        """Ensure ``req`` holds pages for ``upto_tokens`` tokens; False if the pool is short."""
        need = -(-upto_tokens // self.page_size) - req.num_pages
        if need <= 0:
            return True
        pages = self.kv.allocate(need)
        if pages is None:
            return False
        self.page_table[req.row, req.num_pages:req.num_pages + need] = pages
        req.num_pages += need
        return True

    def _release(self, req: Request) -> None:
        pages = self.page_table[req.row, :req.num_pages].copy()
        self.kv.release(req.all_token_ids(), pages, req.num_computed, req.node)
        self.page_table[req.row, :req.num_pages] = 0
        self.row_gen[req.row] += 1
        self._free_rows.append(req.row)
        req.row, req.num_pages, req.num_matched_pages, req.node = -1, 0, 0, None
        req.num_computed = 0

    def _admit(self, req: Request) -> bool:
        """Take a row, match the cached prefix, mark the request running."""
        tokens = req.all_token_ids()
        pages, node = self.kv.match(tokens)
        row = self._free_rows.pop()
        req.row, req.node = row, node
        req.num_pages = req.num_matched_pages = len(pages)
        self.page_table[row, :len(pages)] = pages
        self.token_table[row, :len(tokens)] = tokens
        self.row_prompt_len[row] = req.num_prompt_tokens
        self.row_limit[row] = min(req.max_tokens, self.max_model_len - req.num_prompt_tokens)
        req.num_computed = len(pages) * self.page_size
        req.status = Status.RUNNING
        return True

    def _account_admission(self, req: Request) -> None:
        if req.first_scheduled_time is None:
            req.num_cached_tokens = req.num_computed
            self.prefix_queried_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += req.num_computed
            req.first_scheduled_time = time.monotonic()

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ step
    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's work; None when there is nothing to run."""
        budget = self.max_num_batched_tokens
        prefills: list[Request] = []
        chunks: list[int] = []
        # 1. decodes, oldest first; preempt the newest when the pool is short
        decodes, others = self._schedule_decodes_fast(budget)
        if decodes is None:
            decodes, others = self._schedule_decodes(budget)
        budget -= len(decodes)
        # 2. chunks of running requests still in prefill (only those step 1 passed over can be)
        for req in others:
            if budget <= 0:
                break
            remaining = req.num_tokens - req.num_computed
            if remaining == 1 or req.status != Status.RUNNING:
                continue  # decodes were handled above
            n = min(remaining, budget)
            grown = self._grow(req, req.num_computed + n)
            # Only when the step would otherwise be empty: preempt the newest to make progress
            # (all running requests mid-prefill with a full pool would deadlock).
            while not grown and not decodes and not prefills:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
                grown = self._grow(req, req.num_computed + n)
            if not grown:
                break
            prefills.append(req)
            chunks.append(n)
            budget -= n
        # 3. admit waiting requests while budget, rows and pages allow
        if self.waiting and budget > 0 and self.policy == "lpm":
            self._sort_waiting_lpm()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted while its last token was in flight: wait for it
            self._admit(req)
            n = min(req.num_tokens - req.num_computed, budget)
            need = -(-(req.num_computed + n) // self.page_size) - req.num_pages
            # Keep one page per running decode in reserve so admitting does not force an
            # immediate preemption next step (vLLM keeps a similar watermark).
            reserve = len(self.running) if self.running else 0
            if (self.kv.num_available_pages - need < reserve
                    or not self._grow(req, req.num_computed + n)):
                self._release(req)
                req.status = Status.WAITING
                break
            self._account_admission(req)
            self.waiting.popleft()
            self.running.append(req)
            prefills.append(req)
            chunks.append(n)
            budget -= n
        if not decodes and not prefills:
            return None
        t0 = time.perf_counter()
        batch = build_batch(decodes + prefills, len(decodes), [1] * len(decodes) + chunks,
                            self.token_table, self.page_table, self.page_size,
                            self._num_min_tokens > 0, self._num_penalty > 0)
        batch.row_gens = self.row_gen[batch.rows[batch.sample]]
        self.last_prepare_s = time.perf_counter() - t0
        return batch

    def _schedule_decodes(self, budget: int) -> tuple[list[Request], list[Request]]:
        """Step 1 of ``schedule``, one request at a time: each running request in decode takes
        one token of ``budget`` (oldest first) and, when its next token starts a page, a page;
        when the pool is short, the newest running request is preempted.

        Returns:
            (the decodes, the running requests passed over: prefilling, or whose in-flight
            token is their last), both in ``running`` order.
        """
        decodes: list[Request] = []
        others: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not self._decode_ready(req):
                others.append(req)
                i += 1
                continue
            while (req.num_computed >= req.num_pages * self.page_size
                   and not self._grow(req, req.num_computed + 1)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break  # req preempted itself: everything after it is gone too
            decodes.append(req)
            budget -= 1
            i += 1
        return decodes, others

    def _decode_ready(self, req: Request) -> bool:
        """``req`` has exactly one token to compute and that token is not its last (overlap:
        a request whose in-flight token ends it must not decode again)."""
        n_out = len(req.output_token_ids)
        n_tok = req.num_prompt_tokens + n_out
        return (n_tok - req.num_computed == 1 and n_out < req.max_tokens
                and n_tok < self.max_model_len)

    def _schedule_decodes_fast(self, budget: int
                               ) -> tuple[list[Request] | None, list[Request]]:
        """``_schedule_decodes`` when no preemption is needed: one pass that only reads the
        requests (the ``_decode_ready`` test inlined), then the new pages of every decode
        entering a page taken in one allocation. Returns (None, []) and changes nothing if
        the pool cannot give them all."""
        decodes: list[Request] = []
        others: list[Request] = []
        needy: list[Request] = []  # their next token starts a new page
        ps, max_len = self.page_size, self.max_model_len
        for req in self.running:
            if budget <= 0:
                break
            n_out = len(req.output_token_ids)
            n_tok = req.num_prompt_tokens + n_out
            nc = req.num_computed
            if n_tok - nc != 1 or n_out >= req.max_tokens or n_tok >= max_len:
                others.append(req)
                continue
            if nc >= req.num_pages * ps:
                needy.append(req)
            decodes.append(req)
            budget -= 1
        if needy:
            pages = self.kv.allocate(len(needy))
            if pages is None:
                return None, []
            rows = [r.row for r in needy]
            cols = [r.num_pages for r in needy]
            self.page_table[rows, cols] = pages
            for r in needy:
                r.num_pages += 1
        return decodes, others

    def _sort_waiting_lpm(self) -> None:
        """Longest cached prefix first (SGLang's ``lpm``); preempted requests keep the front."""
        tree = self.kv.tree
        if tree is None or len(self.waiting) < 2:
            return
        front = [r for r in self.waiting if r.num_preemptions]
        rest = [r for r in self.waiting if not r.num_preemptions]

        def hit(r: Request) -> int:
            pages, _ = tree.match_prefix(r.prompt_token_ids)
            return len(pages)

        rest.sort(key=hit, reverse=True)
        self.waiting = deque(front + rest)

    # ------------------------------------------------------------------ outputs
    def commit(self, batch: ScheduledBatch) -> None:
        """Advance requests as if ``batch`` already ran: KV is counted as computed and each
        sampling request gets a placeholder token (-1) that ``resolve`` fills in. Called right
        after ``schedule`` so the next step can be scheduled while this one runs (overlap)."""
        d = batch.num_decodes
        for req in batch.requests[:d]:  # one token each, always sampling
            req.num_computed += 1
            req.output_token_ids.append(-1)
            req.num_pending += 1
        for req, n, smp in zip(batch.requests[d:], batch.num_new[d:].tolist(),
                               batch.sample[d:].tolist(), strict=True):
            req.num_computed += n
            if smp:
                req.output_token_ids.append(-1)
                req.num_pending += 1
        # the placeholder sits right after the step's last position
        rows, at = batch.rows[batch.sample], batch.seq_lens[batch.sample]
        self.token_table[rows, at] = -1

    def resolve(self, batch: ScheduledBatch, sampled: np.ndarray, plain: bool = True
                ) -> Resolved:
        """Fill in the tokens ``batch`` sampled and apply stop conditions.

        Requests that can only have got an ordinary token (row unchanged since scheduled, not
        their first token, not a stop/EOS id, below their length limit) are applied with numpy
        and one short loop; the others go through ``_resolve_one``.

        Args:
            sampled: int64 [S] one token per request with ``batch.sample`` set, in order.
            plain: False puts every request in ``Resolved.full`` (outputs with logprobs).

        Returns:
            the requests that got a new token (finished ones have ``finish_reason``). A
            request that finished or was aborted meanwhile gets nothing: no extra token, no
            output.
        """
        self._cache_prefills(batch)
        samplers, gens = batch.samplers, batch.row_gens
        assert samplers is not None and gens is not None
        sampled = np.asarray(sampled, dtype=np.int64)
        rows = batch.rows[batch.sample]
        at = batch.seq_lens[batch.sample]  # where each sampled token goes in its sequence
        n_out = at - self.row_prompt_len[rows] + 1
        special = ((self.row_gen[rows] != gens) | (n_out <= 1)
                   | (n_out >= self.row_limit[rows]) | self._stop_candidates(sampled))
        if not plain:
            special[:] = True
        full: list[tuple[Request, int, int]] = []
        if special.any():
            for k in np.flatnonzero(special).tolist():
                req, tok = samplers[k], int(sampled[k])
                if self._resolve_one(req, tok):
                    full.append((req, tok, k))
            keep = ~special
            reqs = list(itertools.compress(samplers, keep.tolist()))
            rows, at, toks = rows[keep], at[keep], sampled[keep]
        else:
            reqs, toks = samplers, sampled
        # plain tokens: their requests still hold the rows they were scheduled with
        self.token_table[rows, at] = toks
        for req, tok in zip(reqs, toks.tolist(), strict=True):
            req.output_token_ids[-req.num_pending] = tok
            req.num_pending -= 1
        return Resolved(full, reqs, toks)

    def _resolve_one(self, req: Request, tok: int) -> bool:
        """Apply one sampled token to ``req`` (any case); False if it gets no output."""
        if req.status == Status.FINISHED:
            return False
        idx = len(req.output_token_ids) - req.num_pending
        req.output_token_ids[idx] = tok
        req.num_pending -= 1
        if req.row >= 0:
            self.token_table[req.row, req.num_prompt_tokens + idx] = tok
        n_out = idx + 1
        self._check_stop(req, tok, n_out)
        if req.finish_reason is not None:
            # drop the placeholder of a step scheduled before we knew it would stop
            del req.output_token_ids[idx + 1:]
            req.num_pending = 0
            req.num_computed = min(req.num_computed, req.num_tokens)
            if req.status == Status.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self.finish(req, req.finish_reason)
        return True

    def _cache_prefills(self, batch: ScheduledBatch) -> None:
        """Insert the prompt pages this batch's prefill chunks completed into the radix tree.

        Runs after the batch's KV is written. A step scheduled meanwhile (overlap) may still
        read a request's replaced duplicate pages; they can only be reused by a later step,
        and steps run in order."""
        if self.kv.tree is None:
            return
        d = batch.num_decodes
        assert batch.epochs is not None
        for i in range(d, len(batch.requests)):
            req = batch.requests[i]
            if req.status != Status.RUNNING or req.num_preemptions != batch.epochs[i - d]:
                continue
            upto = min(int(batch.seq_lens[i]), req.num_prompt_tokens)
            res = self.kv.cache_prefix(req.prompt_token_ids,
                                       self.page_table[req.row, :req.num_pages],
                                       req.num_matched_pages, req.node, upto)
            if res is None:
                continue
            pages, node = res
            self.page_table[req.row, :len(pages)] = pages
            req.node, req.num_matched_pages = node, len(pages)

    def update(self, batch: ScheduledBatch, sampled: np.ndarray, plain: bool = True
               ) -> Resolved:
        """``commit`` then ``resolve``: one step applied without overlap."""
        self.commit(batch)
        return self.resolve(batch, sampled, plain)

    def _check_stop(self, req: Request, tok: int, n_out: int) -> None:
        """Stop rules for the ``n_out``-th generated token ``tok``."""
        if n_out >= req.params.min_tokens:
            if tok in req.stop_ids:
                req.finish_reason, req.stop_reason = FINISH_STOP, tok
                return
            if tok in req.eos_token_ids and not req.params.ignore_eos:
                req.finish_reason = FINISH_STOP
                return
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            req.finish_reason = FINISH_LENGTH

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and release pages (the computed prefix goes to the radix cache)."""
        if req.row >= 0:
            self._release(req)
        if req.status != Status.FINISHED:
            self._count_live(req, -1)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert KV invariants over all live requests (cheap enough to run every step)."""
        live = []
        for req in self.running:
            assert req.row >= 0
            live.append((self.page_table[req.row, :req.num_pages].copy(), req.node,
                         req.num_matched_pages))
            assert req.num_computed <= req.num_pages * self.page_size
        for req in self.waiting:
            assert req.row < 0 and req.num_pages == 0, "waiting request holds pages"
        self.kv.check_integrity(live)
        assert len(self._free_rows) + len(self.running) == self.max_num_seqs, "row leak"
