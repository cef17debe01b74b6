"""The engine core's own request and output types: what ``EngineCore`` takes and returns
in-process (the offline ``LLM``), what the frontend's output processor consumes, and what
travels between the two processes: one struct per concept, as vLLM's ``EngineCoreRequest`` and
``EngineCoreOutputs``.

Plain values: token ids are Python lists or numpy arrays. On the wire (``transport/messages.py``
owns the encoder and decoder) an int32 array goes as its raw little-endian bytes through an
encode hook, never as per-token objects; the structs are ``array_like`` (positional) and the
ones that travel alone are tagged. This module sits below ``core``, ``frontend`` and
``transport``: all three import it, it imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from radixserve.sampling_params import SamplingParams

#: Finish reasons, exactly as OpenAI and vLLM spell them.
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

#: ``TokenOutput.error_code`` of a request whose prompt KV could not be loaded from the
#: prefill instance under ``kv_load_failure_policy`` "fail" (a server-side failure: HTTP 500).
ERROR_KV_TRANSFER_FAILED = "kv_transfer_failed"

#: One generated position's logprobs: ``[[token_id, logprob], ...]``, the sampled token first,
#: then the top N in descending order (the sampled token again where it is among them).
LogprobRow = list[list[float]]


class RequestRejected(ValueError):
    """The engine cannot take a request (it never ran; nothing of it is left behind).

    Attributes:
        param: the request field at fault ("prompt", "max_tokens", ...), or None.
        code: a machine-readable reason ("context_length_exceeded"), or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineRequest(msgspec.Struct, kw_only=True, tag="req", array_like=True):
    """A new request for the engine core (the frontend sends it as is).

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: int32 [P] prompt token ids, P >= 1.
        sampling_params: how to sample and when to stop (``n`` must be 1: a request with
            ``n > 1`` is split into ``SamplingParams.children`` first).
        arrival_time: ``time.time()`` when the API request arrived, seconds.
        eos_token_ids: ids that end this request instead of the model's own (None: the
            model's, which the core knows; vLLM's engine request carries the same override).
        kv_transfer_params: prefill/decode disaggregation, vLLM's dict (checked by the core:
            ``kv_transfer.params.parse_kv_transfer_params``); None without.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


def child_request_id(request_id: str, k: int, total: int) -> str:
    """The engine id of request ``k`` of the ``total`` that one API request fans out into:
    the API request's own id when it makes one engine request (so the client's id is the
    engine's, in logs and events), else ``"{request_id}-{k}"``."""
    return request_id if total == 1 else f"{request_id}-{k}"


def fan_out(request_id: str, prompts: Sequence[Sequence[int] | np.ndarray],
            sampling_params: SamplingParams, arrival_time: float,
            kv_transfer_params: dict[str, Any] | None = None) -> list[EngineRequest]:
    """The engine requests of one API request: ``sampling_params.n`` per prompt
    (``SamplingParams.children``), request ``p * n + i`` being sample i of prompt p (its choice
    index), with ids from ``child_request_id``. The one fan-out of the HTTP server, the gRPC
    worker and the offline ``LLM``.

    Args:
        request_id: the API request's id (the client's ``X-Request-Id``, the gRPC
            ``request_id``, or a generated one).
        prompts: token ids of each prompt.
        sampling_params: the request's params (any ``n``).
        arrival_time: ``time.time()`` when the API request arrived, seconds.
        kv_transfer_params: prefill/decode disaggregation params, given to every request
            (the callers allow them only with one request).
    """
    children = sampling_params.children()
    total = len(prompts) * len(children)
    out: list[EngineRequest] = []
    for ids in prompts:
        prompt = np.asarray(ids, dtype=np.int32)
        for child in children:
            out.append(EngineRequest(request_id=child_request_id(request_id, len(out), total),
                                     prompt_token_ids=prompt, sampling_params=child,
                                     arrival_time=arrival_time,
                                     kv_transfer_params=kv_transfer_params))
    return out


class TokenOutput(msgspec.Struct, kw_only=True, gc=False, array_like=True):
    """One request's result from one engine step, when it is more than one plain token:
    its first token, a finish, logprobs, or a rejection.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (usually one; none for an abort/rejection).
        finish_reason: None while running; "stop" (EOS / stop token), "length" or "abort".
        stop_reason: the stop token id that ended it, if any.
        logprobs: one ``LogprobRow`` per new token, when the request asked for logprobs.
        num_prompt_tokens: prompt length in tokens.
        num_cached_tokens: prompt tokens served from the radix prefix cache.
        error: why the engine rejected the request (``finish_reason`` is then "abort").
        error_param / error_code: see ``RequestRejected``.
        queue_time: seconds from arrival in the core to first being scheduled; set on the
            output that finishes the request (None when it never ran).
        prompt_logprobs: with the first token, when asked: one row per prompt position from
            the second, ``[[token, logprob, rank], [top1, logprob], ...]``.
        kv_transfer_params: on the output that finishes a prefill request for a remote decode,
            what the decode instance needs (vLLM's shape); None otherwise.
    """

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[LogprobRow] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None
    error_code: str | None = None
    queue_time: float | None = None
    prompt_logprobs: list[list[list[float]]] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class StepOutputs(msgspec.Struct, kw_only=True, tag="outputs", array_like=True):
    """Everything one engine step produced (the engine-core process sends one per step).

    The common case, a running request that got exactly one token and nothing else, is kept
    column-wise all the way to the output processor: its id in ``decode_request_ids`` and its
    token at the same index of ``decode_token_ids``. Everything else is a ``TokenOutput`` in
    ``outputs``. A request appears at most once per step.

    Attributes:
        step: the engine's step counter when this was produced.
        outputs: full per-request outputs.
        decode_request_ids: ids of the column-wise outputs, length D.
        decode_token_ids: int32 [D], one token per id.
        stats: the scheduler's snapshot after this step, attached by the engine-core process
            when it sends the step (None in-process).
    """

    step: int
    outputs: list[TokenOutput] = []
    decode_request_ids: list[str] = []
    decode_token_ids: np.ndarray = msgspec.field(
        default_factory=lambda: np.empty(0, dtype=np.int32))
    stats: SchedulerStats | None = None

    @property
    def num_outputs(self) -> int:
        """Requests with an output in this step (both forms)."""
        return len(self.outputs) + len(self.decode_request_ids)

    def all_outputs(self) -> list[TokenOutput]:
        """``outputs`` then one ``TokenOutput`` per column-wise decode (``num_prompt_tokens``
        0 in those). For tests and simple consumers: the output processor reads the columns
        directly instead."""
        return self.outputs + [TokenOutput(request_id=rid, new_token_ids=[tok])
                               for rid, tok in zip(self.decode_request_ids,
                                                   self.decode_token_ids.tolist(), strict=True)]


class SpecDecodeInfo(msgspec.Struct, kw_only=True, frozen=True):
    """Speculative decoding as the engine runs it (vLLM's ``speculative_config`` names).

    Attributes:
        method: "ngram" or "draft_model".
        num_speculative_tokens: draft tokens per step, k.
        disable_by_batch_size: the effective cap: no drafts in a step with more running
            requests than this (``"auto"`` resolved for the device), None for never.
        adaptive_draft_length: each request's draft length is chosen from its acceptance
            and the measured step costs (up to ``num_speculative_tokens``).
    """

    method: str
    num_speculative_tokens: int
    disable_by_batch_size: int | None
    adaptive_draft_length: bool = True


class EngineInfo(msgspec.Struct, kw_only=True, frozen=True):
    """Facts about the loaded engine that the frontend needs (sent once, at the handshake).

    Attributes:
        model_name: the model's display name ("SmolLM2-135M-Instruct").
        folder: Hugging Face folder with the tokenizer and chat template.
        max_model_len: longest sequence (prompt + output) in tokens.
        vocab_size: token ids must be below it.
        eos_token_ids: ids that end generation (the core applies them itself).
        dtype: "float32", "bfloat16", ... or "null" for the null model.
        device: "cpu", "cuda", ...
        num_pages: KV pages in the pool, the null page 0 included.
        page_size: tokens per KV page.
        pid: the engine-core process id (0 in-process).
        speculative: speculative decoding's settings in force, None when it is off.
        tokenizer_class: ``"module:qualname"`` of the tokenizer class AutoTokenizer picks for
            ``folder`` (``loader.auto_tokenizer_class``), so a frontend can load it without
            importing torch; "" where the engine did not resolve one (then AutoTokenizer).
    """

    model_name: str
    folder: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    num_pages: int
    page_size: int
    pid: int = 0
    speculative: SpecDecodeInfo | None = None
    tokenizer_class: str = ""


class ShadowStats(msgspec.Struct, kw_only=True):
    """Shadow checks so far (``--shadow-rate``): steps re-run on the reference path and compared.

    Attributes:
        steps: steps checked.
        tokens_agree / tokens_diverge: rows whose greedy token (argmax of the float32 logits)
            the reference computed the same / differently.
        max_abs_logit_diff / last_abs_logit_diff: largest absolute logit difference over all
            checks / in the latest check.
    """

    steps: int = 0
    tokens_agree: int = 0
    tokens_diverge: int = 0
    max_abs_logit_diff: float = 0.0
    last_abs_logit_diff: float = 0.0


class RunnerStats(msgspec.Struct, kw_only=True):
    """Which code path each part of the forward runs, and how often (cumulative).

    Attributes:
        paths: part -> path in use, e.g. {"attention": "cpu", "linear": "packed"}.
        fallbacks: part -> why its fast path could not be used (failed build or load); empty
            when every fast path asked for runs.
        steps: steps run (each on ``paths``).
        shadow: shadow-check counts; None when shadow checks are off.
    """

    paths: dict[str, str] = {}
    fallbacks: dict[str, str] = {}
    steps: int = 0
    shadow: ShadowStats | None = None
class KVTransferStats(msgspec.Struct, kw_only=True):
    """A KV connector's figures; counters are cumulative since start.

    Attributes:
        loads_ok / loads_failed: prompt KV loads from remote instances (requests).
        pages_read / bytes_read: pages and bytes read from remote instances.
        read_seconds: time spent reading (seconds, summed over reads).
        leases_granted / leases_released / leases_expired: prefill-side page leases
            (requests): granted, ended by the decode side, ended by expiry.
        held_requests / held_pages: leases held now and their pages (prefill side), plus
            pages of aborted requests whose load has not ended yet (decode side).
    """

    loads_ok: int = 0
    loads_failed: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    held_requests: int = 0
    held_pages: int = 0


class SpecDecodeCounts(msgspec.Struct, kw_only=True):
    """Speculative decoding's cumulative counters (vLLM's ``spec_decode_*`` metrics).

    Attributes:
        num_drafts: verify steps of a request (one request with draft tokens in one step).
        num_draft_tokens / num_accepted_tokens: draft tokens verified / accepted.
        accepted_per_pos: accepted draft tokens by position in the draft (0-based), one entry
            per position up to ``num_speculative_tokens``.
        disable_by_batch_size: the effective ``disable_by_batch_size`` (the device's
            crossover when the configuration left it out); 0: drafts at every batch size.
        verify_row_cost: what a verify row adds to a step, in one-row steps, as the engine
            measured it (``core.spec_decode.StepCosts``, which the adaptive draft length
            uses); 0 before it is measured.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []
    disable_by_batch_size: int = 0
    verify_row_cost: float = 0.0


class SchedulerStats(msgspec.Struct, kw_only=True):
    """Snapshot of the scheduler for metrics; counters are cumulative since start.

    Attributes:
        num_running / num_waiting: requests in each queue.
        kv_pages_used / kv_pages_total / kv_pages_cached: KV pool occupancy in pages.
        kv_pages_evictable: pages only the radix cache holds (no live request), which an
            allocation may evict: in use but reclaimable, as vLLM's cached free blocks.
        draining: the engine is draining (SIGTERM): it refuses new requests and finishes the
            running ones.
        prefix_queried_tokens / prefix_hit_tokens: prompt tokens looked up in the radix cache
            and found there.
        num_preemptions: requests preempted (pages released, recomputed later).
        prompt_tokens / generation_tokens: tokens accepted and generated.
        prefill_tokens: tokens of prefill chunks computed (prompts less their prefix hits
            and remote loads, plus contexts recomputed after preemption), counted when the
            step's outputs are applied: the log's prompt throughput.
        step_timings: per-step timer samples in seconds since the last snapshot, when step
            timers are on: {"schedule": [...], "prepare": [...], "forward": [...],
            "output": [...]}.
        runner: the runner's code paths and shadow checks (None for runners without them).
        prompt_tokens_local_compute / prompt_tokens_external: prompt tokens computed here and
            loaded from a remote (prefill) instance (with ``prefix_hit_tokens``, vLLM's
            ``prompt_tokens_by_source``), counted once per request.
        num_waiting_for_remote_kvs: requests waiting for a remote instance's KV.
        kv_transfer: the KV connector's figures, None without one.
        spec_decode: speculative decoding's counters, None when it is off.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    kv_pages_cached: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0
    step_timings: dict[str, list[float]] = {}
    runner: RunnerStats | None = None
    prompt_tokens_local_compute: int = 0
    prompt_tokens_external: int = 0
    num_waiting_for_remote_kvs: int = 0
    kv_transfer: KVTransferStats | None = None
    spec_decode: SpecDecodeCounts | None = None
    kv_pages_evictable: int = 0
    draining: bool = False

    @property
    def kv_usage(self) -> float:
        """Fraction (0..1) of the KV pages that live requests hold: pages not free, less those
        only the radix cache holds, as vLLM's ``kv_cache_usage_perc`` counts its cached free
        blocks as free; 0.0 without a pool."""
        if self.kv_pages_total <= 0:
            return 0.0
        return max(0, self.kv_pages_used - self.kv_pages_evictable) / self.kv_pages_total

