"""Token-budget scheduler with mixed prefill/decode batches, chunked prefill, a radix prefix
cache and preemption by recompute (DESIGN §3).

Each step: running requests in decode take one token each first; the rest of
``max_num_batched_tokens`` goes to prefill chunks, first of partly prefilled running requests,
then of waiting ones (FCFS, or longest prefix match first with ``lpm``). Pages are taken per
chunk and per decoded token, never reserved for ``max_tokens`` up front; when a decode cannot get
a page, the most recently admitted running request is preempted (pages released to the radix
cache, request back at the front of the waiting queue). Where pages go is the pool's choice: a
request's pages continue its previous ones when those ids are free (``PagePool``), with room
for its expected length kept ahead of it, which the decode attention reads faster. This is
vLLM V1's scheduling shape (Sarathi-Serve's stall-free batching) over SGLang's radix cache.

With a KV connector (prefill/decode disaggregation) a request admitted with an asynchronous
remote load takes its row and pages, then waits in ``loading`` (``WAITING_FOR_REMOTE_KVS``)
while the others run; ``update_from_kv_output`` moves it to ``running`` once the load ended. A
finished request whose pages the connector still needs (a prefill instance's lease, an aborted
load) leaves them in ``held`` until the connector reports it.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from radixserve.core.batch import ScheduledBatch, build_batch
from radixserve.core.live_index import LiveIndex
from radixserve.core.request import Request, Status
from radixserve.core.row_tables import RowTables
from radixserve.core.spec_decode import (
    DraftModelProposer,
    Proposer,
    grammar_prefix,
    may_speculate,
)
from radixserve.engine_types import FINISH_ABORT
from radixserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler
from radixserve.kvcache.manager import HeldPages, KVCacheManager

_NO_PAGES = np.empty(0, dtype=np.int32)
#: the most pages a request's run keeps free ahead of it (``_room``): 64 pages of 16 are 1,024
#: tokens, past which a long generation opens a new run rather than spreading new requests thin
ROOM_PAGES_MAX = 64


class Scheduler:
    """Decides each step's work and owns every request's KV pages and table row.

    Args:
        kv: the KV page manager.
        max_num_seqs: most requests per step (and rows of the tables).
        max_num_batched_tokens: token budget per step.
        max_model_len: longest sequence in tokens.
        policy: "fcfs" or "lpm".
        connector: the scheduler side of a KV connector, or None.
        kv_load_failure_policy: "recompute" or "fail" (what a failed remote load leads to).
        proposer: drafts tokens for speculative decoding (``spec_decode``), or None.

    Attributes:
        tables: the running requests' rows (``RowTables``).
        live: what the live requests need (``LiveIndex``).
        loading: requests waiting for a remote load (they hold rows and pages).
        held: pages of finished requests the connector still needs, by request id.
        num_preemptions / prefix_queried_tokens / prefix_hit_tokens: cumulative counters.
        prompt_tokens_local_compute / prompt_tokens_external: prompt tokens computed here /
            loaded from a remote instance, once per request.
        last_prepare_s: seconds the last ``schedule()`` spent in ``build_batch``.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs",
                 connector: KVConnectorScheduler | None = None,
                 kv_load_failure_policy: str = "recompute",
                 proposer: Proposer | None = None) -> None:
        self.kv = kv
        self.proposer = proposer
        self.page_size = kv.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.tables = RowTables(max_num_seqs, max_model_len, self.page_size)
        self.live = LiveIndex()
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prompt_tokens_local_compute = 0
        self.prompt_tokens_external = 0
        self.last_prepare_s = 0.0
        self.connector = connector
        self.kv_load_failure_policy = kv_load_failure_policy
        self.loading: dict[str, Request] = {}
        self.held: dict[str, HeldPages] = {}
        #: local pages whose remote load failed, until their request's load is reported
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Queue a request (``EngineCore.add_request`` has checked that it fits)."""
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.live.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def abort(self, request_id: str) -> Request | None:
        """Remove a waiting or running request and release its pages; None if unknown."""
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        self.finish(req, FINISH_ABORT)
        return req

    def finish(self, req: Request, reason: str) -> None:
        """Take ``req`` out of its queue, release its pages (the computed prefix goes to the
        radix cache) and mark it finished with ``reason``."""
        status = req.status
        if status == Status.RUNNING:
            self.running.remove(req)
        elif status == Status.WAITING:
            self.waiting.remove(req)
        elif status == Status.WAITING_FOR_REMOTE_KVS:
            del self.loading[req.request_id]
        if status != Status.FINISHED:
            req.finish_reason = reason
            if self.connector is not None and req.kv_transfer_params:
                self._finish_transfer(req, loading=status == Status.WAITING_FOR_REMOTE_KVS)
            elif req.row >= 0:
                self._release(req)
            self.live.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    def _finish_transfer(self, req: Request, loading: bool) -> None:
        """Finish a request the connector knows: it decides whether its pages are held (a
        prefill instance's lease; an aborted load still writing them) and what the output's
        ``kv_transfer_params`` are (vLLM's ``request_finished``)."""
        assert self.connector is not None
        if req.row < 0:
            self.connector.request_finished(req, [])
            return
        pages = self.tables.page_table[req.row, :req.num_pages]
        held = self.kv.hold(req.all_token_ids(), pages, req.num_computed, req.node,
                            req.num_matched_pages, cache=not loading)
        self.tables.release(req.row, req.num_pages)
        req.row, req.num_pages, req.num_matched_pages, req.node = -1, 0, 0, None
        req.num_computed = 0
        delay, req.kv_transfer_params_out = self.connector.request_finished(
            req, held.pages.tolist())
        if delay:
            self.held[req.request_id] = held
        else:
            self.kv.release_held(held)

    # ------------------------------------------------------------------ pages
    def _grow(self, req: Request, upto_tokens: int) -> bool:
        """Ensure ``req`` holds pages for ``upto_tokens`` tokens; False if the pool is short."""
        need = -(-upto_tokens // self.page_size) - req.num_pages
        if need <= 0:
            return True
        pages = self.kv.allocate(need, self._last_page(req), max(self._room(req), need))
        if pages is None:
            return False
        self.tables.page_table[req.row, req.num_pages:req.num_pages + need] = pages
        req.num_pages += need
        return True

    def _last_page(self, req: Request) -> int:
        """The page a request's next pages should follow (0: it has none)."""
        return int(self.tables.page_table[req.row, req.num_pages - 1]) if req.num_pages else 0

    def _room(self, req: Request) -> int:
        """Pages ``req`` expects to take from now on (prompt and ``max_tokens`` to come), at
        most ``ROOM_PAGES_MAX``: only where its pages are placed (``PagePool``) reads it."""
        end = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        return min(-(-end // self.page_size) - req.num_pages, ROOM_PAGES_MAX)

    def _release(self, req: Request) -> None:
        pages = self.tables.page_table[req.row, :req.num_pages].copy()
        self.kv.release(req.all_token_ids(), pages, req.num_computed, req.node)
        self.tables.release(req.row, req.num_pages)
        req.row, req.num_pages, req.num_matched_pages, req.node = -1, 0, 0, None
        req.num_computed = 0

    def _admit(self, req: Request) -> None:
        """Take a row, match the cached prefix, mark the request running."""
        tokens = req.all_token_ids()
        # prompt logprobs need every prompt position's logits: no prefix hit (as vLLM)
        pages, node = self.kv.match(tokens if req.prompt_logprob_rows is None else tokens[:0])
        row = self.tables.acquire(tokens, req.num_prompt_tokens,
                                  min(req.max_tokens, self.max_model_len - req.num_prompt_tokens),
                                  req.params, req.generator)
        req.row, req.node = row, node
        req.num_pages = req.num_matched_pages = len(pages)
        self.tables.page_table[row, :len(pages)] = pages
        req.num_computed = len(pages) * self.page_size
        req.status = Status.RUNNING

    def _account_admission(self, req: Request, computed_here: int | None = None) -> None:
        """First admission: cached tokens and the prefix-cache counters; prompt tokens
        computed here are all the rest unless ``computed_here`` says (a remote load counts
        its own when it ends)."""
        if req.first_scheduled_time is None:
            req.num_cached_tokens = req.num_computed
            self.prefix_queried_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += req.num_computed
            self.prompt_tokens_local_compute += (req.num_prompt_tokens - req.num_computed
                                                 if computed_here is None else computed_here)
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
        decodes, others = self._schedule_decodes(budget)
        budget -= len(decodes)
        verifies: list[Request] = []
        drafts: list[int] = []
        if self.proposer is not None and decodes and self.proposer.active(len(self.running)):
            decodes, verifies, drafts = self._draft(decodes, budget)
            budget -= sum(drafts)
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
            while not grown and not decodes and not verifies and not prefills:
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
        while (self.waiting and budget > 0
               and len(self.running) + len(self.loading) < self.max_num_seqs):
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted while its last token was in flight: wait for it
            self._admit(req)
            if self.connector is not None and req.kv_transfer_params:
                if not self._admit_transfer(req):
                    break
                if req.status == Status.WAITING_FOR_REMOTE_KVS:
                    continue
            n = min(req.num_tokens - req.num_computed, budget)
            need = -(-(req.num_computed + n) // self.page_size) - req.num_pages
            # Keep one page per running decode in reserve so admitting does not force an
            # immediate preemption next step (vLLM keeps a similar watermark).
            reserve = len(self.running)
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
        if not decodes and not prefills and not verifies:
            return None
        t0 = time.perf_counter()
        # verify requests go right after the decodes: k + 1 tokens each, like a prefill chunk
        batch = build_batch(decodes + verifies + prefills, len(decodes),
                            [1] * len(decodes) + [k + 1 for k in drafts] + chunks,
                            self.tables, self.page_size, self.live,
                            num_draft=[0] * len(decodes) + drafts + [0] * len(prefills)
                            if verifies else None)
        self.last_prepare_s = time.perf_counter() - t0
        return batch

    def _admit_transfer(self, req: Request) -> bool:
        """Admission of a just ``_admit``-ted request that carries ``kv_transfer_params``: with
        an asynchronous remote load it gets pages up to the loaded tokens and moves to
        ``loading``; otherwise the connector is told nothing is loaded and the request goes on
        as usual. False (request back to waiting): the pool is short."""
        assert self.connector is not None
        n_ext, load_async = self.connector.get_num_new_matched_tokens(req, req.num_computed)
        if not load_async:
            self.connector.update_state_after_alloc(req, _NO_PAGES, 0)
            return True
        upto = req.num_computed + n_ext
        need = -(-upto // self.page_size) - req.num_pages
        if (self.kv.num_available_pages - need < len(self.running)
                or not self._grow(req, upto)):
            self._release(req)
            req.status = Status.WAITING
            return False
        self._account_admission(req, computed_here=0)
        self.waiting.popleft()
        req.status = Status.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = req
        first = req.num_computed // self.page_size
        self.connector.update_state_after_alloc(
            req, self.tables.page_table[req.row, first:req.num_pages].copy(), n_ext)
        return True

    def update_from_kv_output(self, out: KVConnectorOutput) -> list[Request]:
        """Apply what the worker-side connector reported: free held pages it no longer needs,
        move requests whose load ended to ``running`` (with their loaded prompt pages shared
        through the radix tree; after a failed load they recompute from their local prefix
        hit, or, with the "fail" policy, are returned for the engine to finish with an error).

        Returns:
            requests whose load failed under the "fail" policy (running; finish them).
        """
        assert self.connector is not None
        self.connector.update_connector_output(out)
        self._load_errors |= out.invalid_block_ids
        for rid in out.finished_sending | out.finished_recving:
            held = self.held.pop(rid, None)
            if held is not None:
                self._load_errors.difference_update(held.pages.tolist())
                self.kv.release_held(held)
        failed: list[Request] = []
        for rid in out.finished_recving:
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            pages = self.tables.page_table[req.row, :req.num_pages]
            own = set(pages[req.num_computed // self.page_size:].tolist())
            ok = not (own & self._load_errors)
            self._load_errors -= own
            req.status = Status.RUNNING
            self.running.append(req)
            hit = req.num_computed
            if ok:
                # every prompt token but the last is loaded: that one is computed here and
                # samples the first output token (vLLM's decode side does the same)
                req.num_computed = req.num_prompt_tokens - 1
                req.num_cached_tokens = req.num_computed
                self.prompt_tokens_external += req.num_computed - hit
                self.prompt_tokens_local_compute += req.num_prompt_tokens - req.num_computed
                res = self.kv.cache_prefix(req.prompt_token_ids, pages, req.num_matched_pages,
                                           req.node, req.num_computed)
                if res is not None:
                    tree_pages, req.node = res
                    pages[:len(tree_pages)] = tree_pages
                    req.num_matched_pages = len(tree_pages)
            elif self.kv_load_failure_policy == "fail":
                failed.append(req)
            else:
                self.prompt_tokens_local_compute += req.num_prompt_tokens - hit
        return failed

    def _schedule_decodes(self, budget: int) -> tuple[list[Request], list[Request]]:
        """Step 1 of ``schedule``: each running request in decode takes one token of
        ``budget``, oldest first, and a page when its next token starts one. One read-only
        pass, then the new pages of all of them in one allocation; when the pool is short the
        newest running request is preempted and the pass repeated (rare).

        A request is in decode when it has exactly one token to compute and that token is
        not its last (overlap: a request whose in-flight token ends it must not decode again).

        Returns:
            (the decodes, the running requests passed over: prefilling, or whose in-flight
            token is their last), both in ``running`` order.
        """
        ps, max_len = self.page_size, self.max_model_len
        while True:
            decodes: list[Request] = []
            others: list[Request] = []
            needy: list[Request] = []  # their next token starts a new page
            left = budget
            for req in self.running:
                if left <= 0:
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
                left -= 1
            if not needy:
                return decodes, others
            pages = self.kv.allocate_after(
                np.array([self._last_page(r) for r in needy], dtype=np.int64),
                np.array([self._room(r) for r in needy], dtype=np.int64))
            if pages is not None:
                rows = [r.row for r in needy]
                cols = [r.num_pages for r in needy]
                self.tables.page_table[rows, cols] = pages
                for r in needy:
                    r.num_pages += 1
                return decodes, others
            self._preempt(self.running[-1])

    def _draft(self, decodes: list[Request], budget: int
               ) -> tuple[list[Request], list[Request], list[int]]:
        """Speculative decoding: draft tokens for the decodes that may speculate, within the
        step's token budget left after every decode got its one token (speculation never
        takes a decode's place) and within the pages the pool has free now (a draft never
        preempts anyone). The drafts are written into the token table after the request's
        tokens, where the step's input ids are read from.

        The n-gram proposer drafts first and takes pages for what it found; the draft model
        takes pages first (its decode steps write their KV there), then drafts every
        speculating request of the step in one batch per position. A constrained request's
        draft is cut before the first token its grammar refuses (``grammar_prefix``); a
        draft-model request left with none is a plain decode again, and pages taken past
        what is kept go back at once.

        Returns:
            (the plain decodes, the verify requests, their draft counts), in ``running``
            order within each list.
        """
        proposer = self.proposer
        assert proposer is not None
        ps, max_len, table = self.page_size, self.max_model_len, self.tables.token_table
        plain: list[Request] = []
        verifies: list[Request] = []
        counts: list[int] = []
        by_model = isinstance(proposer, DraftModelProposer)
        for req in decodes:
            n_tok = req.num_tokens
            # room: budget, max_model_len, and max_tokens (a token past it is never output)
            most = min(budget, max_len - n_tok,
                       req.max_tokens - len(req.output_token_ids) - 1)
            if most > 0 and may_speculate(req):
                # the request's own draft length (0: drafting does not pay for it now)
                most = min(most, proposer.draft_length(req))
            else:
                most = 0
            if most <= 0:
                plain.append(req)
                continue
            d = (None if by_model else
                 grammar_prefix(req, proposer.propose(table[req.row, :n_tok], most)))
            k = most if d is None else int(d.shape[0])
            if k and not self._grow(req, n_tok + k):
                # no page for every draft: keep those that fit in the pages held
                k = min(k, req.num_pages * ps - n_tok)
            if k <= 0:
                plain.append(req)
                continue
            if d is not None:
                table[req.row, n_tok:n_tok + k] = d[:k]
            verifies.append(req)
            counts.append(k)
            budget -= k
        if by_model and verifies:
            assert isinstance(proposer, DraftModelProposer)
            n_toks = [r.num_tokens for r in verifies]
            drafts = proposer.propose_batch(table, self.tables.page_table,
                                            [r.row for r in verifies], n_toks, counts)
            kept: list[Request] = []
            wanted, counts = counts, []
            for req, n_tok, d, k in zip(verifies, n_toks, drafts, wanted, strict=True):
                d = grammar_prefix(req, d)
                if len(d) < k:
                    self._shrink(req, n_tok + len(d))
                if not len(d):
                    continue
                table[req.row, n_tok:n_tok + len(d)] = d
                kept.append(req)
                counts.append(len(d))
            if len(kept) < len(verifies):
                ids = {id(r) for r in kept}
                plain = [r for r in decodes if id(r) not in ids]
                verifies = kept
        return plain, verifies, counts

    def _shrink(self, req: Request, upto_tokens: int) -> None:
        """Release ``req``'s owned pages past those ``upto_tokens`` tokens need (drafts
        taken pages for, then cut)."""
        keep = -(-upto_tokens // self.page_size)
        if req.num_pages <= keep:
            return
        assert keep >= req.num_matched_pages, "a shrink would release radix-tree pages"
        row = self.tables.page_table[req.row]
        self.kv.free_owned(row[keep:req.num_pages].copy())
        row[keep:req.num_pages] = 0
        req.num_pages = keep

    def roll_back(self, req: Request) -> None:
        """After a verify step: release the pages past ``req``'s computed tokens (those held
        only rejected drafts' KV). The rejected slots in its last kept page are past
        ``num_computed``: never read, overwritten by its next tokens, never cached."""
        if req.row >= 0:
            self._shrink(req, req.num_computed)

    def _sort_waiting_lpm(self) -> None:
        """Longest cached prefix first (SGLang's ``lpm``); preempted requests keep the front.
        Reads the tree without changing it."""
        tree = self.kv.tree
        if tree is None or len(self.waiting) < 2:
            return
        front = [r for r in self.waiting if r.num_preemptions]
        rest = [r for r in self.waiting if not r.num_preemptions]
        rest.sort(key=lambda r: tree.peek_prefix_len(r.prompt_token_ids), reverse=True)
        self.waiting = deque(front + rest)

    def cache_prefills(self, batch: ScheduledBatch) -> None:
        """Insert the prompt pages this batch's prefill chunks completed into the radix tree,
        so requests arriving meanwhile share them (SGLang caches each chunk the same way).

        Runs after the batch's KV is written. A step scheduled meanwhile (overlap) may still
        read a request's replaced duplicate pages; they can only be reused by a later step,
        and steps run in order."""
        if self.kv.tree is None:
            return
        d = batch.num_decodes
        seq_lens = batch.forward.seq_lens
        nd = batch.forward.num_draft
        page_table = self.tables.page_table
        for i in range(d, len(batch.requests)):
            req = batch.requests[i]
            if req.status != Status.RUNNING or req.num_preemptions != batch.epochs[i - d]:
                continue
            if nd is not None and nd[i]:
                continue  # a verify step: its prompt is cached already
            upto = min(int(seq_lens[i]), req.num_prompt_tokens)
            res = self.kv.cache_prefix(req.prompt_token_ids, page_table[req.row, :req.num_pages],
                                       req.num_matched_pages, req.node, upto)
            if res is None:
                continue
            pages, node = res
            page_table[req.row, :len(pages)] = pages
            req.node, req.num_matched_pages = node, len(pages)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert KV invariants over all live requests (cheap enough to run every step).

        Raises:
            AssertionError: naming the broken invariant.
        """
        live = []
        for req in self.running:
            assert req.row >= 0
            live.append((self.tables.page_table[req.row, :req.num_pages].copy(), req.node,
                         req.num_matched_pages))
            assert req.num_computed <= req.num_pages * self.page_size
            if req.output_token_ids and not req.num_pending:
                # in decode: no page past the computed tokens (rejected drafts' pages are
                # rolled back), but for the one the next token starts
                assert (req.num_pages <= -(-(req.num_computed + 1) // self.page_size)), (
                    f"{req.request_id} holds {req.num_pages} pages for {req.num_computed} "
                    f"computed tokens")
        for req in self.waiting:
            assert req.row < 0 and req.num_pages == 0, "waiting request holds pages"
        for req in self.loading.values():
            assert req.row >= 0 and req.status == Status.WAITING_FOR_REMOTE_KVS
            live.append((self.tables.page_table[req.row, :req.num_pages].copy(), req.node,
                         req.num_matched_pages))
        for held in self.held.values():
            live.append((held.pages, held.node, held.num_matched))
        self.kv.check_integrity(live)
        assert (self.tables.num_free + len(self.running) + len(self.loading)
                == self.max_num_seqs), "row leak"
