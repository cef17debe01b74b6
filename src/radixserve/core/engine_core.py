"""The engine core: scheduler + KV cache + model runner, one step at a time (DESIGN §3).

It takes ``engine_types.EngineRequest`` and returns ``engine_types.StepOutputs``: plain values,
no wire format. The offline ``LLM`` drives it in-process; the engine-core process
(``engine_proc.py``) converts at its sockets.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.config import SPEC_BATCH_AUTO, EngineConfig
from radixserve.core.batch import ScheduledBatch
from radixserve.core.request import Request
from radixserve.core.resolver import StepResolver
from radixserve.core.scheduler import Scheduler
from radixserve.core.spec_decode import DraftModelProposer, NgramProposer, Proposer, StepCosts
from radixserve.engine_types import (
    ERROR_KV_TRANSFER_FAILED,
    FINISH_ABORT,
    EngineInfo,
    EngineRequest,
    KVTransferStats,
    RequestRejected,
    SchedulerStats,
    SpecDecodeCounts,
    SpecDecodeInfo,
    StepOutputs,
    TokenOutput,
)
from radixserve.kv_transfer.base import (
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from radixserve.kv_transfer.factory import create_scheduler_connector
from radixserve.kv_transfer.params import parse_kv_transfer_params
from radixserve.kvcache.manager import KVCacheManager
from radixserve.kvcache.sizing import pool_max_len
from radixserve.model_executor.forward_batch import SampleResult
from radixserve.model_executor.step_runner import StepRunner
from radixserve.sampling_params import MAX_WHOLE_VOCAB_PROMPT_LOGPROBS
from radixserve.structured.compiler import GrammarCompiler, GrammarError
from radixserve.structured.runtime import GrammarRuntime


@dataclass
class StepTimers:
    """Per-step wall-clock samples in seconds, kept only when ``step_timers`` is on."""

    schedule: list[float] = field(default_factory=list)
    prepare: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    output: list[float] = field(default_factory=list)

    def drain(self) -> dict[str, list[float]]:
        out = {k: v[:] for k, v in self.__dict__.items()}
        for v in self.__dict__.values():
            v.clear()
        return out


log = logging.getLogger(__name__)

_NO_TOKENS = np.empty(0, dtype=np.int32)
#: Seconds a step with nothing to run but loads in flight waits for one to end (no spinning).
KV_IDLE_WAIT_S = 0.002


def _observe_step_cost(costs: StepCosts, batch: ScheduledBatch, seconds: float) -> None:
    """Add a step's wall time (scheduling and drafting, forward, acceptance) to ``costs`` when
    it ran one request's decode or verify alone: then its query rows alone set the work."""
    fb = batch.forward
    if len(batch.requests) != 1:
        return
    rows = int(fb.num_new[0])
    drafts = 0 if fb.num_draft is None else int(fb.num_draft[0])
    if fb.num_decodes == 1 or (drafts and rows == drafts + 1):
        costs.observe(rows, seconds)


class EngineCore:
    """Accepts requests, runs steps, reports per-step outputs.

    Args:
        config: engine configuration.
        runner: the model runner (``model_executor.factory.build_runner``). The pool uses its
            KV pages, or fewer when ``config.num_pages`` says so (never more). With
            ``config.kv_transfer_config`` its ``kv_connector`` is the worker-side connector.

    Raises:
        ValueError: ``kv_transfer_config`` with a runner that has no KV connector (the null
            model); a draft model (``speculative_config`` method "draft_model") over the null
            model, one that cannot be loaded, or one whose tokenizer is not the target's
            (``model_executor.draft.DraftRunner``).

    Attributes:
        info: the engine's facts (model, ``max_model_len``, pool size), typed.
        max_model_len: longest sequence in tokens.
    """

    def __init__(self, config: EngineConfig, runner: StepRunner) -> None:
        self.config = config
        self.runner = runner
        minfo = runner.info
        self.vocab_size = minfo.vocab_size
        num_pages = (runner.num_pages if config.num_pages is None
                     else min(runner.num_pages, config.num_pages))
        self.max_model_len = pool_max_len(num_pages, config.page_size, runner.max_model_len)
        self.kv = KVCacheManager(num_pages, config.page_size, config.enable_prefix_caching)
        kv_cfg = config.kv_transfer_config
        self.kv_worker: KVConnectorWorker | None = None
        self.kv_connector: KVConnectorScheduler | None = None
        self._kv_error_reasons: dict[str, str] = {}
        if kv_cfg is not None:
            self.kv_worker = getattr(runner, "kv_connector", None)
            if self.kv_worker is None:
                raise ValueError("kv_transfer_config needs a model runner with a KV pool to "
                                 "transfer (not the null model)")
            self.kv_connector = create_scheduler_connector(kv_cfg, config.page_size,
                                                           self.kv_worker)
        spec = config.speculative_config
        device_type = getattr(runner.device, "type", "cpu")
        #: the draft model's runner ("draft_model" method): it runs every step after the
        #: target (``_run``) so its KV pool, indexed by the same pages, stays consistent
        self.draft = None
        self.proposer: Proposer | None = None
        if spec is not None and spec.method == "draft_model":
            if not hasattr(runner, "forward_logits"):
                raise ValueError("speculative_config: the draft_model method needs a model "
                                 "runner with a KV pool (not the null model)")
            from radixserve.model_executor.draft import DraftRunner

            self.draft = DraftRunner(config, minfo, num_pages)
            self.proposer = DraftModelProposer(spec, self.draft, config.page_size,
                                               device_type)
        elif spec is not None:
            self.proposer = NgramProposer(spec, device_type)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            config.schedule_policy, connector=self.kv_connector,
            kv_load_failure_policy=kv_cfg.kv_load_failure_policy if kv_cfg else "recompute",
            proposer=self.proposer)
        self.resolver = StepResolver(self.scheduler.tables, self.scheduler.live,
                                     self.max_model_len)
        self.step_count = 0
        self.timers = StepTimers() if config.step_timers else None
        self._pending: list[TokenOutput] = []
        self.prompt_tokens = 0
        #: prefill-chunk tokens computed (``prompt_tokens`` counts them on arrival, cached or not)
        self.prefill_tokens = 0
        self.generation_tokens = 0
        #: decode requests and prefill tokens of the last step scheduled
        self.last_num_decodes = self.last_num_prefill_tokens = 0
        self.check_integrity_each_step = False
        if spec is not None:
            assert self.proposer is not None
            # a step's accepted tokens must be known before the next one is scheduled
            self.overlap = False
            how = (f"draft model {spec.model}" if spec.method == "draft_model" else
                   f"n-grams of {spec.prompt_lookup_min}..{spec.prompt_lookup_max} tokens")
            cap = self.proposer.disable_by_batch_size
            when = ("at every batch size" if cap is None else
                    f"in steps of at most {cap} running request{'s' if cap > 1 else ''}")
            origin = (f"the {device_type} crossover, disable_by_batch_size left out"
                      if spec.disable_by_batch_size == SPEC_BATCH_AUTO
                      else "disable_by_batch_size as given")
            log.info("speculative decoding: %s, %d draft tokens, %s, drafting %s (%s); "
                     "sampled requests by rejection sampling, constrained ones with drafts "
                     "cut to what their grammar allows; steps without overlap", spec.method,
                     spec.num_speculative_tokens, how, when, origin)
        elif config.disable_overlap is None:  # auto: see EngineConfig.disable_overlap
            self.overlap = device_type == "cuda"
        else:
            self.overlap = not config.disable_overlap
        # one thread: steps run strictly in order (see ``step``)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixserve-forward")
        self._inflight: tuple[ScheduledBatch, Future[SampleResult]] | None = None
        self._last_sampled = np.zeros(config.max_num_seqs, dtype=np.int64)
        self.eos_token_ids: frozenset[int] = frozenset(minfo.eos_token_ids)
        self.grammars = GrammarRuntime(self._make_grammar_compiler, minfo.vocab_size,
                                       config.max_num_seqs)
        self.info = EngineInfo(
            model_name=minfo.name, folder=minfo.folder, max_model_len=self.max_model_len,
            vocab_size=minfo.vocab_size, eos_token_ids=sorted(self.eos_token_ids),
            dtype=minfo.dtype, device=str(minfo.device), num_pages=num_pages,
            page_size=config.page_size,
            speculative=None if spec is None else SpecDecodeInfo(
                method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
                disable_by_batch_size=self.proposer.disable_by_batch_size,
                adaptive_draft_length=self.proposer.adaptive))

    # ------------------------------------------------------------------ requests
    def add_request(self, er: EngineRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: empty prompt, token id out of range, prompt of ``max_model_len`` tokens
                or more, a request that can never fit the KV pool, ``prompt_logprobs=-1``
                over more than ``MAX_WHOLE_VOCAB_PROMPT_LOGPROBS`` entries, or
                ``kv_transfer_params`` this engine cannot serve (``RequestRejected`` naming
                the field).
        """
        prompt = np.asarray(er.prompt_token_ids, dtype=np.int32)
        n = len(prompt)
        if n == 0:
            raise RequestRejected("prompt is empty: at least one token is required", "prompt")
        if prompt.min() < 0 or prompt.max() >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if n >= self.max_model_len:
            pool = (self.kv.num_usable_pages * self.config.page_size)
            why = (f" (the KV pool holds {pool} tokens)" if pool == self.max_model_len else "")
            # OpenAI's wording, so the server relays it as is
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens{why}. "
                f"However, your prompt has {n} tokens, which leaves no room for the "
                f"completion. Please reduce the length of the prompt.", "prompt",
                "context_length_exceeded")
        if er.request_id in self.scheduler.requests:
            raise RequestRejected(f"request_id {er.request_id!r} is already running",
                                  "request_id", "duplicate_request_id")
        if er.request_id in self.scheduler.held:
            # its KV-transfer lease and held pages are keyed by this id (clients name their
            # requests: X-Request-Id)
            raise RequestRejected(f"request_id {er.request_id!r} is in use: a finished request "
                                  "with this id still holds KV pages for a decode instance",
                                  "request_id", "duplicate_request_id")
        sp = er.sampling_params
        room = self.max_model_len - n
        max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        gen = None
        if sp.seed is not None and not sp.greedy:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(sp.seed)
        eos = self.eos_token_ids if er.eos_token_ids is None else frozenset(er.eos_token_ids)
        if sp.logit_bias and max(sp.logit_bias) >= self.vocab_size:
            raise RequestRejected(f"logit_bias has token id {max(sp.logit_bias)}; token ids "
                                  f"must be in [0, {self.vocab_size})", "logit_bias")
        grammar = None
        if sp.structured_outputs is not None:
            try:
                grammar = self.grammars.new_grammar(
                    sp.structured_outputs, None if er.eos_token_ids is None else sorted(eos))
            except GrammarError as e:
                raise RequestRejected(str(e), "structured_outputs") from None
        if sp.prompt_logprobs == -1:
            entries = (n - 1) * self.vocab_size
            if entries > MAX_WHOLE_VOCAB_PROMPT_LOGPROBS:
                raise RequestRejected(
                    f"prompt_logprobs=-1 returns the whole vocabulary ({self.vocab_size} "
                    f"logprobs) for each of the {n - 1} prompt positions after the first: "
                    f"{entries} entries, more than one request may ask for "
                    f"({MAX_WHOLE_VOCAB_PROMPT_LOGPROBS}). Use a shorter prompt, or "
                    "prompt_logprobs in [0, 20] for the top ones.", "prompt_logprobs")
            # vLLM's "the whole vocabulary": a copy whose count is the vocabulary size, set
            # past the 0..20 range check that guards what clients may ask for by number
            sp = copy.copy(sp)
            sp.prompt_logprobs = self.vocab_size
        req = Request(er.request_id, prompt, sp, eos, max_tokens, generator=gen,
                      grammar=grammar)
        kv_params = er.kv_transfer_params
        if kv_params is None and sp.extra_args:  # vLLM's offline way to pass them
            kv_params = sp.extra_args.get("kv_transfer_params")
        if kv_params is not None:
            self._check_kv_transfer(req, kv_params)
        self.scheduler.add(req)
        self.prompt_tokens += n

    def _check_kv_transfer(self, req: Request, params: object) -> None:
        """Attach a request's ``kv_transfer_params`` if this engine can serve them (params
        asking for neither a remote decode nor a remote prefill change nothing).

        Raises:
            RequestRejected: malformed, no connector configured, or not this instance's role.
        """
        try:
            parsed = parse_kv_transfer_params(params)
        except ValueError as e:
            raise RequestRejected(str(e), "kv_transfer_params") from None
        if not parsed or not (parsed.get("do_remote_decode") or parsed.get("do_remote_prefill")):
            return
        if self.kv_connector is None:
            raise RequestRejected("kv_transfer_params asks for a remote prefill or decode, but "
                                  "this server was started without --kv-transfer-config",
                                  "kv_transfer_params")
        req.kv_transfer_params = parsed
        try:
            self.kv_connector.check_request(req)
        except ValueError as e:
            raise RequestRejected(str(e), "kv_transfer_params") from None

    def abort_requests(self, request_ids: list[str], notify: bool = True) -> None:
        """Remove requests (waiting or running) and free their pages. With ``notify`` each
        reports an ``abort`` output in the next step's message. Unknown ids are ignored."""
        for rid in request_ids:
            req = self.scheduler.abort(rid)
            if req is not None and notify:
                self._pending.append(self._output(req, [], FINISH_ABORT))

    def flush_cache(self) -> int:
        """Evict every radix-cache entry no live request holds locked; returns pages freed.

        Safe while a step is in flight (overlap): that step reads only pages of live requests,
        which are locked or owned, and a freed page is reused only by a later step, which the
        one forward thread runs after it.
        """
        return self.kv.evict_all()

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending)
                or self._inflight is not None)

    def has_kv_transfer_work(self) -> bool:
        """KV transfers still need steps although no request may run: leases to expire or be
        released, loads in flight, pages held for them."""
        return self.kv_connector is not None and (self.kv_connector.has_pending_work()
                                                  or bool(self.scheduler.held))

    # ------------------------------------------------------------------ step
    def step(self) -> StepOutputs | None:
        """Schedule one step and report finished work; None when there was nothing to do.

        With overlap (the default on CUDA) the step just scheduled runs in a worker thread while
        this call turns the previous step's tokens into outputs, so scheduling and output
        handling hide behind the forward. Steps run one at a time in that thread, in order, so every KV
        write of step N happens before any read of step N+1.
        """
        t0 = time.perf_counter()
        kv_outs: list[TokenOutput] = []
        kv_changed = False
        if self.kv_connector is not None:
            kv_outs, kv_changed = self._kv_collect()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        prepare = self.scheduler.last_prepare_s if batch is not None else 0.0
        if batch is not None:
            self.resolver.commit(batch)
        outs, self._pending = self._pending, []
        outs += kv_outs
        if self.kv_connector is not None:
            self._kv_start(idle=batch is None and self._inflight is None and not outs)
        decoded: tuple[list[str], np.ndarray] = ([], _NO_TOKENS)
        forward = 0.0
        if self.overlap:
            fut = self._worker.submit(self._run, batch) if batch is not None else None
            prev, self._inflight = self._inflight, (batch, fut) if batch is not None else None
            if prev is not None:
                tw = time.perf_counter()
                result = prev[1].result()
                forward = time.perf_counter() - tw  # time spent waiting on the model
                full, decoded = self._process(prev[0], result)
                outs += full
        elif batch is not None:
            tw = time.perf_counter()
            result = self._run(batch)
            forward = time.perf_counter() - tw
            full, decoded = self._process(batch, result)
            outs += full
        if (batch is None and self._inflight is None and not outs and not decoded[0]
                and not kv_changed):
            self.last_num_decodes = self.last_num_prefill_tokens = 0
            return None
        if batch is not None:
            self.last_num_prefill_tokens = batch.forward.num_prefill_tokens
            self.last_num_decodes = batch.num_decodes
            self.step_count += 1
        if self.check_integrity_each_step:
            # valid while a step is in flight too: its pages were taken when it was scheduled
            self.scheduler.check_integrity()
        proposer = self.scheduler.proposer
        if proposer is not None and batch is not None and not self.overlap:
            _observe_step_cost(proposer.costs, batch, time.perf_counter() - t0)
        if self.timers is not None and batch is not None:
            t3 = time.perf_counter()
            self.timers.schedule.append(t1 - t0 - prepare)
            self.timers.prepare.append(prepare)
            self.timers.forward.append(forward)
            self.timers.output.append(t3 - t1 - forward)
        return StepOutputs(step=self.step_count, outputs=outs, decode_request_ids=decoded[0],
                           decode_token_ids=decoded[1])

    def _kv_start(self, idle: bool) -> None:
        """Hand the worker side the loads this step's ``schedule`` set up (they start at
        once, beside the forward; vLLM's model runner makes this call around each forward).

        Args:
            idle: nothing runs this step: if requests wait for loads, wait up to
                ``KV_IDLE_WAIT_S`` for one to end rather than returning at once (a caller
                looping on ``step`` would spin).
        """
        conn, worker = self.kv_connector, self.kv_worker
        assert conn is not None and worker is not None
        worker.bind_connector_metadata(conn.build_connector_meta())
        worker.start_load_kv()
        worker.clear_connector_metadata()
        if idle and self.scheduler.loading:
            worker.wait_for_activity(KV_IDLE_WAIT_S)

    def _kv_collect(self) -> tuple[list[TokenOutput], bool]:
        """Apply the loads and leases that ended, before ``schedule``, so a request whose
        load ended is scheduled in this very step.

        Returns:
            (error outputs of requests whose load failed under the "fail" policy, whether
            anything changed: then the step reports, so the stats show held pages freed).
        """
        worker = self.kv_worker
        assert worker is not None
        sending, recving = worker.get_finished(set())
        out = KVConnectorOutput(sending, recving, worker.get_block_ids_with_load_errors())
        if out.is_empty():
            return [], False
        self._kv_error_reasons.update(worker.get_load_error_reasons())
        failed = self.scheduler.update_from_kv_output(out)
        reasons = {rid: self._kv_error_reasons.pop(rid, "") for rid in out.finished_recving}
        outs = []
        for req in failed:
            self.scheduler.finish(req, FINISH_ABORT)
            why = reasons.get(req.request_id) or "see the decode server's log"
            outs.append(TokenOutput(
                request_id=req.request_id, finish_reason=FINISH_ABORT,
                num_prompt_tokens=req.num_prompt_tokens, error_code=ERROR_KV_TRANSFER_FAILED,
                error=f"could not load the prompt's KV from the prefill instance "
                      f"(kv_load_failure_policy is 'fail'): {why}"))
        if self.check_integrity_each_step:
            self.scheduler.check_integrity()
        return outs, True

    def _run(self, batch: ScheduledBatch) -> SampleResult:
        """Worker side of a step: fill in placeholder inputs from the previous step's sampled
        tokens (overlap), run the model, remember what it sampled per row."""
        fb = batch.forward
        d = fb.num_decodes
        if d:
            pending = fb.input_ids[:d] < 0
            if pending.any():
                fb.input_ids[:d][pending] = self._last_sampled[fb.rows[:d][pending]]
        outs = fb.sampling.penalty_outputs
        if outs:
            rows = fb.rows[fb.sample]
            for i, toks in outs.items():
                if toks and toks[-1] < 0:
                    toks[-1] = int(self._last_sampled[rows[i]])
        grammars = fb.sampling.grammars
        step = None
        if grammars is not None:
            # here, not at scheduling: the masks depend on the previous step's tokens, which
            # this thread's sampler accepted into the matchers (overlap-safe)
            step = fb.sampling.constraints = self.grammars.step(grammars,
                                                                fb.sampling.draft_tokens)
        result = self.runner.execute(fb)
        if self.draft is not None:
            self.draft.mirror(fb)
        if fb.num_draft is None:  # (speculation runs without overlap: nothing reads it)
            self._last_sampled[fb.rows[fb.sample]] = result.token_ids
        if step is not None:
            result.grammar_status = step.status
        return result

    def _make_grammar_compiler(self) -> GrammarCompiler:
        """The xgrammar compiler over the model's tokenizer (first constrained request).

        Raises:
            GrammarError: the runner has no tokenizer (the null model of a bare config).
        """
        from radixserve.model_executor.loader import load_tokenizer

        folder = self.runner.info.folder
        if not folder:
            raise GrammarError("structured outputs need the model's tokenizer, and this "
                               "engine's runner has none")
        return GrammarCompiler(load_tokenizer(folder), self.vocab_size,
                               sorted(self.eos_token_ids))

    def _process(self, batch: ScheduledBatch, result: SampleResult
                 ) -> tuple[list[TokenOutput], tuple[list[str], np.ndarray]]:
        """Apply a finished step's tokens: radix inserts of completed prompt pages, tokens and
        stop checks, finished requests released.

        Returns:
            the full outputs, and the column-wise decodes: request ids and their tokens,
            int32 [D] (``StepOutputs.decode_request_ids`` / ``decode_token_ids``).
        """
        lp = result.logprobs
        self.prefill_tokens += batch.forward.num_chunk_tokens
        self.scheduler.cache_prefills(batch)
        if batch.forward.prompt_logprobs is not None:
            self.resolver.add_prompt_logprobs(batch, result.prompt_logprobs)
        res = self.resolver.resolve(batch, result.token_ids, plain=lp is None,
                                    grammar_status=result.grammar_status)
        for req in res.finished:
            self.scheduler.finish(req, req.finish_reason or FINISH_ABORT)
        outs = [self._output(req, [tok], req.finish_reason,
                             None if lp is None or lp[row] is None else [lp[row]])
                for req, tok, row in res.full]
        for req, toks, row in res.verified:
            if req.finish_reason is None:
                self.scheduler.roll_back(req)
            rows = None if lp is None or lp[row] is None else lp[row:row + len(toks)]
            outs.append(self._output(req, toks, req.finish_reason, rows))  # type: ignore[arg-type]
        self.generation_tokens += res.num_tokens
        ids = [r.request_id for r in res.plain]
        return outs, (ids, res.plain_tokens.astype(np.int32))

    def drain(self) -> StepOutputs | None:
        """Wait for the in-flight step (overlap) and return its outputs (None: none ran)."""
        if self._inflight is None:
            return None
        batch, fut = self._inflight
        self._inflight = None
        outs, decoded = self._process(batch, fut.result())
        return StepOutputs(step=self.step_count, outputs=outs, decode_request_ids=decoded[0],
                           decode_token_ids=decoded[1])

    def shutdown(self) -> None:
        """Finish the in-flight step and stop the worker thread (and the KV connector's, and
        the runner's other ranks under tensor parallelism)."""
        self.drain()
        self._worker.shutdown(wait=True)
        if self.kv_worker is not None:
            self.kv_worker.shutdown()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _output(self, req: Request, new: list[int], finish: str | None,
                logprobs: list[list[list[float]]] | None = None) -> TokenOutput:
        prompt_lp = None
        if new and req.prompt_logprob_rows is not None and not req.prompt_lp_sent:
            prompt_lp, req.prompt_lp_sent = req.prompt_logprob_rows, True
        return TokenOutput(
            request_id=req.request_id, new_token_ids=new, finish_reason=finish,
            stop_reason=req.stop_reason, logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=prompt_lp,
            queue_time=None if finish is None or req.first_scheduled_time is None
            else req.first_scheduled_time - req.arrival_time,
            kv_transfer_params=req.kv_transfer_params_out if finish is not None else None)

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> SchedulerStats:
        """A snapshot of the scheduler and KV pool (reads only; ``step_timings`` left empty:
        see ``drain_step_timings``)."""
        s, kv = self.scheduler, self.kv
        used = kv.num_usable_pages - kv.num_free_pages
        return SchedulerStats(
            num_running=len(s.running), num_waiting=len(s.waiting), kv_pages_used=used,
            kv_pages_total=kv.num_usable_pages, kv_pages_cached=kv.num_cached_pages,
            kv_pages_evictable=kv.num_evictable_pages,
            prefix_queried_tokens=s.prefix_queried_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions, prompt_tokens=self.prompt_tokens,
            prefill_tokens=self.prefill_tokens,
            generation_tokens=self.generation_tokens,
            runner=self.runner.stats() if hasattr(self.runner, "stats") else None,
            prompt_tokens_local_compute=s.prompt_tokens_local_compute,
            prompt_tokens_external=s.prompt_tokens_external,
            num_waiting_for_remote_kvs=len(s.loading),
            kv_transfer=self._kv_stats(), spec_decode=self._spec_stats())

    def _spec_stats(self) -> SpecDecodeCounts | None:
        if self.proposer is None:
            return None
        st = self.resolver.spec_stats
        return SpecDecodeCounts(
            num_drafts=st.num_drafts, num_draft_tokens=st.num_draft_tokens,
            num_accepted_tokens=st.num_accepted_tokens,
            accepted_per_pos=list(st.accepted_per_pos)
            + [0] * (self.proposer.k - len(st.accepted_per_pos)),
            disable_by_batch_size=self.proposer.disable_by_batch_size or 0,
            verify_row_cost=self.proposer.costs.measured_row_cost() or 0.0)

    def _kv_stats(self) -> KVTransferStats | None:
        if self.kv_worker is None:
            return None
        c = self.kv_worker.counters()
        held = self.scheduler.held.values()
        return KVTransferStats(
            loads_ok=c.loads_ok, loads_failed=c.loads_failed, pages_read=c.pages_read,
            bytes_read=c.bytes_read, read_seconds=c.read_seconds,
            leases_granted=c.leases_granted, leases_released=c.leases_released,
            leases_expired=c.leases_expired, held_requests=len(held),
            held_pages=sum(len(h.pages) for h in held))

    def drain_step_timings(self) -> dict[str, list[float]]:
        """Step timer samples (seconds) recorded since the last call, and forget them; {} when
        step timers are off."""
        return self.timers.drain() if self.timers else {}
