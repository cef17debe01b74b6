"""The engine core: scheduler + KV cache + model runner, one step at a time (DESIGN §3).

The offline ``LLM`` drives it in-process; the server's engine-core process wraps it in a ZMQ
loop. Both see the same ``EngineOutputs`` per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.config import EngineConfig
from radixserve.core.request import Request
from radixserve.core.scheduler import Scheduler
from radixserve.kvcache.manager import KVCacheManager
from radixserve.model_executor.runner import StepRunner
from radixserve.transport.messages import (
    FINISH_ABORT,
    EngineOutputs,
    EngineRequest,
    RequestOutput,
    SchedulerStats,
    pack_ids,
    unpack_ids,
)


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


class EngineCore:
    """Accepts requests, runs steps, reports per-step outputs.

    Args:
        config: engine configuration.
        runner: the model runner; None loads ``config.model`` into a ``ModelRunner``.
        vocab_size: token ids must be below it (taken from the runner's model when None).

    Raises:
        ValueError: bad configuration or unloadable model (nothing stays half-loaded: the
            runner is built before any other state).
    """

    def __init__(self, config: EngineConfig, runner: StepRunner | None = None,
                 vocab_size: int | None = None) -> None:
        if runner is None:
            from radixserve.model_executor.runner import ModelRunner

            runner = ModelRunner(config)
            vocab_size = runner.info.vocab_size
        self.config = config
        self.runner = runner
        self.vocab_size = vocab_size
        self.max_model_len = runner.max_model_len
        self.kv = KVCacheManager(runner.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.schedule_policy)
        self.step_count = 0
        self.timers = StepTimers() if config.step_timers else None
        self._pending: list[RequestOutput] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._last_prefill = self._last_decode = 0
        self.check_integrity_each_step = False

    # ------------------------------------------------------------------ requests
    def add_request(self, er: EngineRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: empty prompt, token id out of range, prompt of ``max_model_len`` tokens
                or more, or a request that can never fit the KV pool.
        """
        prompt = unpack_ids(er.prompt_token_ids).astype(np.int32)
        n = len(prompt)
        if n == 0:
            raise ValueError("prompt is empty: at least one token is required")
        if self.vocab_size is not None and (prompt.min() < 0 or prompt.max() >= self.vocab_size):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {self.max_model_len} "
                             "(the prompt must leave room for at least one new token)")
        if er.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {er.request_id!r} is already running")
        sp = er.sampling_params
        room = self.max_model_len - n
        max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        gen = None
        if sp.seed is not None and not sp.greedy:
            gen = torch.Generator(device=getattr(self.runner, "device", "cpu"))
            gen.manual_seed(sp.seed)
        req = Request(er.request_id, prompt, sp, frozenset(er.eos_token_ids), max_tokens,
                      generator=gen)
        self.scheduler.add(req)
        self.prompt_tokens += n

    def abort_requests(self, request_ids: list[str], notify: bool = True) -> None:
        """Remove requests (waiting or running) and free their pages. With ``notify`` each
        reports an ``abort`` output in the next step's message. Unknown ids are ignored."""
        for rid in request_ids:
            req = self.scheduler.abort(rid)
            if req is not None and notify:
                self._pending.append(self._output(req, [], FINISH_ABORT))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ------------------------------------------------------------------ step
    def step(self) -> EngineOutputs | None:
        """Schedule and run one step; None when there was nothing to do or report."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        outs, self._pending = self._pending, []
        if batch is None:
            self._last_prefill = self._last_decode = 0
            if not outs:
                return None
            return EngineOutputs(self.step_count, outs, time.time())
        t1 = time.perf_counter()
        result = self.runner.execute(batch)
        t2 = time.perf_counter()
        lp = result.logprobs
        k = 0
        sampled_rows: dict[int, int] = {}
        for i, smp in enumerate(batch.sample.tolist()):
            if smp:
                sampled_rows[id(batch.requests[i])] = k
                k += 1
        for req in self.scheduler.update(batch, result.token_ids):
            row = sampled_rows[id(req)]
            outs.append(self._output(req, [req.output_token_ids[-1]], req.finish_reason,
                                     None if lp is None or lp[row] is None else [lp[row]]))
        self.generation_tokens += int(batch.sample.sum())
        self._last_prefill = batch.num_prefill_tokens
        self._last_decode = batch.num_decodes
        self.step_count += 1
        if self.check_integrity_each_step:
            self.scheduler.check_integrity()
        if self.timers is not None:
            t3 = time.perf_counter()
            self.timers.schedule.append(t1 - t0)
            self.timers.prepare.append(0.0)
            self.timers.forward.append(t2 - t1)
            self.timers.output.append(t3 - t2)
        return EngineOutputs(self.step_count, outs, time.time())

    def _output(self, req: Request, new: list[int], finish: str | None,
                logprobs: list[list[list[float]]] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=pack_ids(new), finish_reason=finish,
            stop_reason=req.stop_reason, logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens)

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> SchedulerStats:
        s, kv = self.scheduler, self.kv
        used = kv.num_usable_pages - kv.num_free_pages
        return SchedulerStats(
            num_running=len(s.running), num_waiting=len(s.waiting), kv_pages_used=used,
            kv_pages_total=kv.num_usable_pages, kv_pages_cached=kv.num_cached_pages,
            prefix_queried_tokens=s.prefix_queried_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, step_prefill_tokens=self._last_prefill,
            step_decode_tokens=self._last_decode, num_steps=self.step_count,
            step_timings=self.timers.drain() if self.timers else {})
