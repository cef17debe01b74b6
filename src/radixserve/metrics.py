"""Prometheus metrics, all in one place, on a registry owned by a ``ServerMetrics`` object.

Names use the ``radixserve:`` prefix the way vLLM uses ``vllm:`` (so dashboards port over);
counters get prometheus_client's ``_total`` suffix. Every metric carries a ``model_name`` label.
No global registry: two servers (or tests) in one process never share metrics.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from radixserve.engine_types import RunnerStats, SchedulerStats

PREFIX = "radixserve:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: Token-count buckets (1, 2, 5, 10, ... 1,000,000 tokens), as vLLM's 1-2-5 series.
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5)
                       if m * 10 ** e <= 1_000_000)
_STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                 0.1, 0.25, 0.5, 1.0, 2.5)

#: Step timer names in ``SchedulerStats.step_timings`` -> metric ``radixserve:step_<name>_seconds``
#: ("forward" is the model forward and sampling: the runner does both in one call).
STEP_TIMERS = ("schedule", "prepare", "forward", "output")

#: Cumulative ``SchedulerStats`` counters -> attribute of the matching Counter child.
_STAT_COUNTERS = {
    "prefix_queried_tokens": "prefix_cache_queries",
    "prefix_hit_tokens": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
}


#: ``SchedulerStats`` prompt counters -> the ``source`` label of ``prompt_tokens_by_source``
#: (vLLM's ``vllm:prompt_tokens_by_source``: where each prompt token's KV came from).
_PROMPT_SOURCES = {
    "prompt_tokens_local_compute": "local_compute",
    "prefix_hit_tokens": "local_cache_hit",
    "prompt_tokens_external": "external_kv_transfer",
}
#: Cumulative ``KVTransferStats`` counters -> metric name (after ``radixserve:``) and help.
_KV_COUNTERS = {
    "loads_ok": ("kv_transfer_loads_ok", "Prompt KV loads from a prefill instance that "
                 "succeeded (requests)."),
    "loads_failed": ("kv_transfer_loads_failed", "Prompt KV loads that failed (requests; "
                     "recomputed or failed per kv_load_failure_policy)."),
    "pages_read": ("kv_transfer_pages_read", "KV pages read from prefill instances."),
    "bytes_read": ("kv_transfer_bytes_read", "KV bytes read from prefill instances."),
    "read_seconds": ("kv_transfer_read_seconds", "Seconds spent reading KV from prefill "
                     "instances."),
    "leases_granted": ("kv_transfer_leases_granted", "Prefill requests whose pages were "
                       "held for a decode instance."),
    "leases_released": ("kv_transfer_leases_released", "Page leases ended by the decode "
                        "instance."),
    "leases_expired": ("kv_transfer_leases_expired", "Page leases ended by expiry "
                       "(kv_lease_s)."),
}


#: Cumulative ``SpecDecodeCounts`` counters -> metric name (after ``radixserve:``) and help
#: (vLLM's ``vllm:spec_decode_*``; mean accepted length = 1 + accepted / drafts).
_SPEC_COUNTERS = {
    "num_drafts": ("spec_decode_num_drafts", "Speculative verify steps of a request (drafts "
                   "verified)."),
    "num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


class ServerMetrics:
    """The server's Prometheus metrics.

    Args:
        registry: where to register; a fresh ``CollectorRegistry`` when None.
        model_name: value of the ``model_name`` label.

    Gauges (from ``SchedulerStats``): ``num_requests_running``, ``num_requests_waiting``,
    ``kv_cache_usage_perc`` (pages live requests hold / all pages, 0..1: pages only the radix
    cache holds count as free, as in vLLM),
    ``kv_cache_pages_used`` / ``kv_cache_pages_cached`` / ``kv_cache_pages_total`` (pages).
    Counters (tokens unless noted): ``prefix_cache_queries``, ``prefix_cache_hits``,
    ``num_preemptions`` (requests), ``prompt_tokens``, ``generation_tokens``,
    ``request_success`` (requests, label ``finished_reason``).
    Code paths (from ``SchedulerStats.runner``): ``forward_path_info`` (labels part, path),
    ``forward_path_steps`` (steps per part and path; shadow re-runs count as path
    "reference"), ``fast_path_fallbacks`` (1 per part whose fast path failed to build or load),
    ``shadow_steps``, ``shadow_tokens`` (label result: agree | diverge),
    ``shadow_max_abs_logit_diff``.
    Histograms (seconds): ``time_to_first_token_seconds``, ``time_per_output_token_seconds``,
    ``e2e_request_latency_seconds``, ``request_queue_time_seconds``,
    ``request_prefill_time_seconds``, ``request_decode_time_seconds``,
    ``request_inference_time_seconds``, ``step_<timer>_seconds``; (tokens)
    ``request_prompt_tokens``, ``request_generation_tokens``. ``docs/metrics.md`` lists each
    beside vLLM's name.
    Prefill/decode disaggregation: ``prompt_tokens_by_source`` (tokens, label ``source``:
    local_compute, local_cache_hit, external_kv_transfer), ``num_requests_waiting_for_remote_kvs``
    and, with a KV connector, the ``kv_transfer_*`` counters of ``_KV_COUNTERS`` and the gauges
    ``kv_transfer_held_requests`` / ``kv_transfer_held_pages``.
    """

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache pages used by live requests (1 = 100%)."
        )
        self.kv_cache_pages_used = gauge(
            "kv_cache_pages_used", "KV cache pages not free (live requests + radix cache).")
        self.kv_cache_pages_cached = gauge(
            "kv_cache_pages_cached", "KV cache pages held by the radix prefix cache.")
        self.kv_cache_pages_total = gauge("kv_cache_pages_total", "Usable KV cache pages.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Requests preempted for KV space.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first.",
            _TPOT_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to finish.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated per finished request.",
            _TOKEN_BUCKETS)
        self.step_seconds = {
            name: histogram(f"step_{name}_seconds", f"Engine step time: {name}.", _STEP_BUCKETS)
            for name in STEP_TIMERS
        }
        self._last_counts = dict.fromkeys(_STAT_COUNTERS, 0)
        self._path_info = Gauge(
            PREFIX + "forward_path_info", "1 for the code path each part of the forward runs.",
            ["model_name", "part", "path"], registry=self.registry)
        self._path_steps = Counter(
            PREFIX + "forward_path_steps", "Steps run, by part of the forward and its path.",
            ["model_name", "part", "path"], registry=self.registry)
        self._path_fallbacks = Gauge(
            PREFIX + "fast_path_fallbacks",
            "1 for each part whose fast path failed to build or load (reference path in use).",
            ["model_name", "part"], registry=self.registry)
        self._shadow_tokens = Counter(
            PREFIX + "shadow_tokens", "Shadow-checked rows, by whether the reference path's "
            "greedy token agreed with the fast path's.", ["model_name", "result"],
            registry=self.registry)
        self.shadow_steps = counter("shadow_steps", "Steps re-run on the reference path.")
        self.shadow_max_abs_logit_diff = gauge(
            "shadow_max_abs_logit_diff",
            "Largest absolute logit difference, fast path vs reference, over all shadow checks.")
        self._last_runner = (0, 0, 0, 0)
        by_source = Counter(PREFIX + "prompt_tokens_by_source",
                            "Prompt tokens by where their KV came from.",
                            ["model_name", "source"], registry=self.registry)
        self.prompt_tokens_by_source = {
            field: by_source.labels(model_name, src) for field, src in _PROMPT_SOURCES.items()}
        self.num_requests_waiting_for_remote_kvs = gauge(
            "num_requests_waiting_for_remote_kvs",
            "Requests waiting for their prompt's KV from a prefill instance.")
        self.kv_transfer = {field: counter(name, doc)
                            for field, (name, doc) in _KV_COUNTERS.items()}
        self.kv_transfer_held_requests = gauge(
            "kv_transfer_held_requests", "Finished requests whose KV pages are held for a KV "
            "transfer (prefill leases, aborted loads).")
        self.kv_transfer_held_pages = gauge(
            "kv_transfer_held_pages", "KV pages held for KV transfers.")
        self._last_sources = dict.fromkeys(_PROMPT_SOURCES, 0)
        self._last_kv: dict[str, float] = dict.fromkeys(_KV_COUNTERS, 0)
        # speculative decoding, vLLM's names (vllm:spec_decode_*)
        self.spec_decode = {field: counter(name, doc)
                            for field, (name, doc) in _SPEC_COUNTERS.items()}
        self._spec_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0-based).",
            ["model_name", "position"], registry=self.registry)
        self.spec_decode_disable_by_batch_size = gauge(
            "spec_decode_disable_by_batch_size", "Most running requests at which a step "
            "still drafts (the device's measured crossover unless configured); 0: every "
            "batch size.")
        self.spec_decode_verify_row_cost = gauge(
            "spec_decode_verify_row_cost", "What a verify row adds to a step, in one-row "
            "steps, as measured for the adaptive draft length; 0 before it is measured.")
        self._last_spec: dict[str, float] = dict.fromkeys(_SPEC_COUNTERS, 0)
        self._last_spec_pos: list[float] = []

    def update_from_stats(self, stats: SchedulerStats) -> None:
        """Apply one scheduler snapshot: set gauges, add counter deltas, observe step timers.

        ``stats`` counters are cumulative; each is incremented by its growth since the previous
        call (a counter that went backwards, e.g. a restarted engine, counts from zero again).
        """
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        if stats.kv_pages_total > 0:
            self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_cache_pages_used.set(stats.kv_pages_used)
        self.kv_cache_pages_cached.set(stats.kv_pages_cached)
        self.kv_cache_pages_total.set(stats.kv_pages_total)
        for field, attr in _STAT_COUNTERS.items():
            value = getattr(stats, field)
            last = self._last_counts[field]
            delta = value - last if value >= last else value
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_counts[field] = value
        if stats.runner is not None:
            self._update_runner(stats.runner)
        for field, child in self.prompt_tokens_by_source.items():
            self._last_sources[field] = _inc(child, getattr(stats, field),
                                             self._last_sources[field])
        self.num_requests_waiting_for_remote_kvs.set(stats.num_waiting_for_remote_kvs)
        kv = stats.kv_transfer
        if kv is not None:
            for field, child in self.kv_transfer.items():
                self._last_kv[field] = _inc(child, getattr(kv, field), self._last_kv[field])
            self.kv_transfer_held_requests.set(kv.held_requests)
            self.kv_transfer_held_pages.set(kv.held_pages)
        spec = stats.spec_decode
        if spec is not None:
            self.spec_decode_disable_by_batch_size.set(spec.disable_by_batch_size)
            self.spec_decode_verify_row_cost.set(spec.verify_row_cost)
            for field, child in self.spec_decode.items():
                self._last_spec[field] = _inc(child, getattr(spec, field),
                                              self._last_spec[field])
            last = self._last_spec_pos
            last.extend([0] * (len(spec.accepted_per_pos) - len(last)))
            for pos, value in enumerate(spec.accepted_per_pos):
                last[pos] = _inc(self._spec_per_pos.labels(self.model_name, str(pos)), value,
                                 last[pos])
        for name, samples in stats.step_timings.items():
            hist = self.step_seconds.get(name)
            if hist is not None:
                for s in samples:
                    hist.observe(s)

    def _update_runner(self, r: RunnerStats) -> None:
        m = self.model_name
        for part, path in r.paths.items():
            self._path_info.labels(m, part, path).set(1)
        for part in r.fallbacks:
            self._path_fallbacks.labels(m, part).set(1)
        sh = r.shadow
        now = (r.steps, sh.steps if sh else 0, sh.tokens_agree if sh else 0,
               sh.tokens_diverge if sh else 0)
        # cumulative in the engine: add the growth (from zero again after an engine restart)
        d = [v - last if v >= last else v for v, last in zip(now, self._last_runner, strict=True)]
        self._last_runner = now
        if d[0] > 0:
            for part, path in r.paths.items():
                self._path_steps.labels(m, part, path).inc(d[0])
        if sh is not None:
            if d[1] > 0:
                self.shadow_steps.inc(d[1])
                for part in r.paths:
                    self._path_steps.labels(m, part, "reference").inc(d[1])
            if d[2] > 0:
                self._shadow_tokens.labels(m, "agree").inc(d[2])
            if d[3] > 0:
                self._shadow_tokens.labels(m, "diverge").inc(d[3])
            self.shadow_max_abs_logit_diff.set(sh.max_abs_logit_diff)

    def observe_request(
        self,
        finished_reason: str,
        *,
        e2e_latency: float,
        ttft: float | None = None,
        num_output_tokens: int = 0,
        queue_time: float | None = None,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Record one finished request.

        Args:
            finished_reason: "stop", "length" or "abort".
            e2e_latency: seconds from arrival to finish.
            ttft: seconds from arrival to the first output token (None if none came).
            num_output_tokens: tokens generated; with ``ttft`` gives the time per output token.
            queue_time: seconds from arrival in the engine to first being scheduled, if known.
            num_prompt_tokens: the prompt's length in tokens, if known.

        The phase times are differences of these: decode = ``e2e_latency - ttft`` (one clock),
        prefill = ``ttft - queue_time`` and inference = ``e2e_latency - queue_time``, so those
        two also hold the frontend's tokenization and the hop to the engine (a few ms), which
        vLLM's engine-side timestamps leave out. None of these raises.
        """
        self._request_success.labels(self.model_name, finished_reason).inc()
        self.e2e_request_latency.observe(e2e_latency)
        self.request_generation_tokens.observe(num_output_tokens)
        if num_prompt_tokens is not None:
            self.request_prompt_tokens.observe(num_prompt_tokens)
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
            self.request_decode_time.observe(max(0.0, e2e_latency - ttft))
            if num_output_tokens > 1:
                self.time_per_output_token.observe(
                    max(0.0, e2e_latency - ttft) / (num_output_tokens - 1)
                )
        if queue_time is not None:
            self.request_queue_time.observe(queue_time)
            if ttft is not None:
                # a request aborted before it was scheduled had no prefill nor inference
                self.request_prefill_time.observe(max(0.0, ttft - queue_time))
                self.request_inference_time.observe(max(0.0, e2e_latency - queue_time))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _inc(counter: Counter, value: float, last: float) -> float:
    """Add a cumulative value's growth since ``last`` to ``counter`` (a value that went
    backwards, a restarted engine, counts from zero again); returns ``value``."""
    delta = value - last if value >= last else value
    if delta > 0:
        counter.inc(delta)
    return value
