"""What a finished response accounts for: the OpenAI ``usage`` object and the per-request
Prometheus observations."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from radixserve.engine_types import FINISH_ABORT
from radixserve.frontend.output_processor import RequestState
from radixserve.metrics import ServerMetrics


def usage_dict(states: Sequence[RequestState], n: int) -> dict[str, Any]:
    """OpenAI ``usage`` of a response whose engine requests are ``states`` (``n`` per prompt,
    in order): each prompt counted once (not per choice), cached tokens from the first choice
    of each prompt."""
    firsts = states[::n]
    prompt_tokens = sum(s.num_prompt_tokens for s in firsts)
    cached = sum(s.num_cached_tokens for s in firsts)
    completion = sum(s.num_tokens for s in states)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def record_metrics(metrics: ServerMetrics, states: Sequence[RequestState],
                   arrival: float) -> None:
    """Observe each engine request in the request histograms ("abort" for unfinished ones);
    ``arrival`` is the API request's ``time.time()``."""
    now = time.time()
    for s in states:
        metrics.observe_request(
            s.finish_reason or FINISH_ABORT, e2e_latency=now - arrival,
            ttft=None if s.first_token_time is None else s.first_token_time - arrival,
            num_output_tokens=s.num_tokens, queue_time=s.queue_time,
            num_prompt_tokens=s.num_prompt_tokens)
