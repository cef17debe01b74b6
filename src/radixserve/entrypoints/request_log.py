"""The server's operational log lines (vLLM's request and stats logging), shared by the HTTP
server and the gRPC worker:

* ``RequestLogger``: one line per finished engine request (logger ``radixserve.requests``):
  id, prompt / cached / output tokens, TTFT, end-to-end latency, finish reason; the prompt text
  only with ``--log-prompts``. ``--disable-log-requests`` turns it off.
* ``StatsLogger``: one line every ``--log-stats-interval`` seconds (logger
  ``radixserve.stats``) while the engine has had work: prompt and generation tok/s over the
  interval, running and waiting requests, KV-pool use, prefix-cache hit rate.
  ``--disable-log-stats`` turns it off.

Each line's values also travel as structured fields (``extra={"fields": ...}``), which
``--log-format json`` writes as top-level JSON keys (``radixserve.logs.JsonFormatter``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from radixserve.engine_types import FINISH_ABORT, SchedulerStats
from radixserve.frontend.output_processor import RequestState

request_log = logging.getLogger("radixserve.requests")
stats_log = logging.getLogger("radixserve.stats")


@dataclass
class RequestLogger:
    """Logs each finished engine request once.

    Attributes:
        enabled: False with ``--disable-log-requests``.
        log_prompts: add the prompt text (``--log-prompts``); never logged otherwise.
    """

    enabled: bool = True
    log_prompts: bool = False

    def finished(self, states: Sequence[RequestState], arrival: float,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        """One INFO line per request of ``states`` (an unfinished one, aborted by a client
        disconnect or a shutdown, as finish reason "abort").

        Args:
            states: the engine requests of one API request.
            arrival: ``time.time()`` when the API request arrived, seconds.
            decode: token ids -> text, for ``log_prompts`` (None: the prompt is not logged).
        """
        if not self.enabled or not request_log.isEnabledFor(logging.INFO):
            return
        now = time.time()
        for st in states:
            ttft = None if st.first_token_time is None else st.first_token_time - arrival
            fields: dict[str, object] = {
                "request_id": st.request_id,
                "prompt_tokens": len(st.prompt_token_ids),
                "cached_tokens": st.num_cached_tokens,
                "output_tokens": st.num_tokens,
                "ttft_s": None if ttft is None else round(ttft, 4),
                "e2e_s": round(now - arrival, 4),
                "finish_reason": st.finish_reason or FINISH_ABORT,
            }
            if self.log_prompts and decode is not None:
                fields["prompt"] = decode([int(t) for t in st.prompt_token_ids])
            text = " ".join(f"{k}={v!r}" if k == "prompt" else f"{k}={v}"
                            for k, v in fields.items() if k != "request_id")
            request_log.info("finished request %s: %s", st.request_id, text,
                             extra={"fields": fields})


@dataclass
class StatsLogger:
    """Logs the engine's throughput and occupancy every ``interval_s`` seconds.

    Rates are over the interval (the difference of the cumulative ``SchedulerStats``
    counters); the prefix hit rate is over the interval's prefix lookups, or since start when
    the interval had none. Idle intervals log nothing, except the first one after activity
    (so the rates are seen falling to 0).

    Attributes:
        interval_s: seconds between lines (> 0).
    """

    interval_s: float = 10.0
    _last: SchedulerStats | None = field(default=None, repr=False)
    _last_at: float | None = field(default=None, repr=False)
    _was_active: bool = field(default=False, repr=False)

    def log(self, stats: SchedulerStats | None, now: float | None = None) -> bool:
        """Log one line for ``stats`` (the latest snapshot) against the previous call's;
        returns whether a line was written."""
        now = time.monotonic() if now is None else now
        if stats is None:  # no engine step yet: the counters start from zero
            self._last_at = now
            return False
        prev = self._last or SchedulerStats()
        prev_at = now if self._last_at is None else self._last_at
        self._last, self._last_at = stats, now
        dt = max(now - prev_at, 1e-9)
        d_prompt = stats.prefill_tokens - prev.prefill_tokens
        d_gen = stats.generation_tokens - prev.generation_tokens
        active = bool(d_prompt or d_gen or stats.num_running or stats.num_waiting)
        if not active and not self._was_active:
            return False
        self._was_active = active
        queried = stats.prefix_queried_tokens - prev.prefix_queried_tokens
        hits = stats.prefix_hit_tokens - prev.prefix_hit_tokens
        if queried <= 0:
            queried, hits = stats.prefix_queried_tokens, stats.prefix_hit_tokens
        fields = {
            "prompt_tokens_per_s": round(d_prompt / dt, 1),
            "generation_tokens_per_s": round(d_gen / dt, 1),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_use": round(stats.kv_usage, 4),
            "prefix_hit_rate": round(hits / queried, 4) if queried > 0 else 0.0,
        }
        stats_log.info(
            "engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, "
            "KV use %.1f%%, prefix hit rate %.1f%%", fields["prompt_tokens_per_s"],
            fields["generation_tokens_per_s"], fields["running"], fields["waiting"],
            100 * fields["kv_use"], 100 * fields["prefix_hit_rate"], extra={"fields": fields})
        return True

    async def run(self, get_stats: Callable[[], SchedulerStats | None]) -> None:
        """Log every ``interval_s`` seconds until cancelled; ``get_stats`` returns the
        latest snapshot (``AsyncEngineClient.stats``)."""
        self.log(get_stats())
        while True:
            await asyncio.sleep(self.interval_s)
            self.log(get_stats())
