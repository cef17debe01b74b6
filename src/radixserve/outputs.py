"""Public result objects of the offline API, shaped like vLLM's so users can switch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: position among the ``n`` completions of the prompt.
        text: detokenized output (stop string trimmed unless asked to keep it).
        token_ids: generated token ids.
        finish_reason: "stop", "length" or "abort"; None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per generated position, ``{token_id: logprob}`` holding the chosen token and
            the top N (vLLM's shape), or None when not requested.
        cumulative_logprob: sum of chosen tokens' logprobs when logprobs were requested.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) and derived latencies of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text (None when given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: ``n`` completions.
        finished: all completions finished.
        num_cached_tokens: prompt tokens served from the radix prefix cache.
        metrics: timing of the request.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt position
            ``{token_id: logprob}`` holding the prompt's token and the top N (vLLM's shape), None
            for the first position (nothing precedes it); else None.
        kv_transfer_params: what a prefill request for a remote decode hands the decode
            instance (vLLM's field), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
