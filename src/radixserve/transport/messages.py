"""Wire schema between the frontend and the engine core (DESIGN §1), and the conversions
between it and the engine's own types (``engine_types``).

MessagePack via ``msgspec`` structs, tagged unions, no pickle. Token-id arrays travel as raw
little-endian int32 bytes (``numpy.frombuffer``), never as per-token Python objects. A peer in
another language can speak this protocol from these definitions alone.

Wire structs are named ``Wire*`` where the engine has a type of the same concept, so the two
never mix: the engine-core process converts at its socket (``request_from_wire``,
``step_to_wire``), the frontend's client at its own (``request_to_wire``, ``step_from_wire``).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from radixserve import engine_types as et
from radixserve.engine_types import EngineInfo, SchedulerStats
from radixserve.sampling_params import SamplingParams

#: Bumped on any incompatible change; checked by the Hello handshake at connect.
#: 3: Wire* names, no eos_token_ids in requests, rejections carry error_param/error_code,
#: Hello carries a typed EngineInfo, no timestamp in step outputs, no StatsRequest.
#: 4: SamplingParams carries logit_bias and structured_outputs; outputs carry prompt_logprobs.
#: 5: FlushCache / FlushCacheDone.
#: 6: kv_transfer_params in requests and outputs (prefill/decode disaggregation).
SCHEMA_VERSION = 6


_I32 = struct.Struct("<i")


def pack_ids(ids: list[int] | np.ndarray) -> bytes:
    """Token ids -> raw little-endian int32 bytes (4 bytes per token)."""
    if isinstance(ids, list) and len(ids) == 1:
        return _I32.pack(ids[0])  # one decoded token per request per step: the hot case
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(buf: bytes) -> np.ndarray:
    """Raw little-endian int32 bytes -> int32 array of shape [len(buf) // 4] (read-only view)."""
    return np.frombuffer(buf, dtype="<i4")


def _ids_list(buf: bytes) -> list[int]:
    if len(buf) == 4:
        return [_I32.unpack(buf)[0]]  # a first token or a logprobs step: the common case
    return np.frombuffer(buf, dtype="<i4").tolist()


# -- frontend -> engine core ---------------------------------------------------------------------


class WireRequest(msgspec.Struct, tag="req", array_like=True):
    """A new request for the engine core (``engine_types.EngineRequest`` on the wire).

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: int32 [P] as raw little-endian bytes.
        sampling_params: with ``n`` 1 (see ``SamplingParams.children``).
        arrival_time: ``time.time()`` when the API request arrived, seconds.
        kv_transfer_params: prefill/decode disaggregation (vLLM's dict), or None.
    """

    request_id: str
    prompt_token_ids: bytes
    sampling_params: SamplingParams
    arrival_time: float
    kv_transfer_params: dict[str, Any] | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Remove these requests from the engine; no output reports them (unknown ids ignored)."""

    request_ids: list[str]


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """First message each way; the receiver refuses a different ``schema_version``. The engine
    core's carries its ``EngineInfo`` (``pid`` set); the frontend's carries none."""

    schema_version: int
    info: EngineInfo | None = None


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Ask the engine core to finish its step and exit 0."""


class FlushCache(msgspec.Struct, tag="flush", array_like=True):
    """Evict every radix-cache entry no live request holds; the core answers with
    ``FlushCacheDone`` carrying the same ``call_id``."""

    call_id: int


#: Everything the frontend sends to the engine core.
ClientMessage = WireRequest | AbortRequests | Hello | Shutdown | FlushCache


# -- engine core -> frontend ---------------------------------------------------------------------


class WireOutput(msgspec.Struct, array_like=True):
    """One request's full output from one engine step (``engine_types.TokenOutput`` on the
    wire; see it for the fields). ``new_token_ids`` are int32 bytes, usually one token."""

    request_id: str
    new_token_ids: bytes
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[list[list[float]]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None
    error_code: str | None = None
    queue_time: float | None = None
    prompt_logprobs: list[list[list[float]]] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class WireStepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine step produced, for all requests: one message per step
    (``engine_types.StepOutputs`` on the wire, plus the scheduler's stats).

    Plain decodes stay column-wise: ``decode_request_ids`` and, at the same index of
    ``decode_token_ids`` (int32 bytes, 4 per request), their one new token. A request appears
    at most once per message.

    Attributes:
        step: the engine's step counter.
        outputs: full per-request outputs.
        stats: the scheduler's snapshot after this step (with the step timer samples).
        decode_request_ids: ids of the column-wise outputs, length D.
        decode_token_ids: int32 [D] as raw little-endian bytes.
    """

    step: int
    outputs: list[WireOutput]
    stats: SchedulerStats | None = None
    decode_request_ids: list[str] = []
    decode_token_ids: bytes = b""


class EngineError(msgspec.Struct, tag="error", array_like=True):
    """The engine core failed; the frontend fails in-flight requests and exits non-zero."""

    message: str


class FlushCacheDone(msgspec.Struct, tag="flushed", array_like=True):
    """The answer to ``FlushCache``: how many KV pages the eviction freed."""

    call_id: int
    pages_freed: int


#: Everything the engine core sends to the frontend.
CoreMessage = WireStepOutputs | Hello | EngineError | FlushCacheDone


# -- conversions ---------------------------------------------------------------------------------


def request_to_wire(req: et.EngineRequest) -> WireRequest:
    """The wire form of an engine request (prompt ids -> int32 bytes). ``eos_token_ids`` does
    not travel: the core knows the model's own."""
    return WireRequest(req.request_id, pack_ids(req.prompt_token_ids), req.sampling_params,
                       req.arrival_time, req.kv_transfer_params)


def request_from_wire(msg: WireRequest) -> et.EngineRequest:
    """The engine's own request for a wire request (prompt bytes -> int32 array)."""
    return et.EngineRequest(request_id=msg.request_id,
                            prompt_token_ids=unpack_ids(msg.prompt_token_ids),
                            sampling_params=msg.sampling_params,
                            arrival_time=msg.arrival_time,
                            kv_transfer_params=msg.kv_transfer_params)


def step_to_wire(step: et.StepOutputs, stats: SchedulerStats | None = None) -> WireStepOutputs:
    """One engine step's outputs as the wire message (columns stay columns)."""
    return WireStepOutputs(
        step.step,
        [WireOutput(o.request_id, pack_ids(o.new_token_ids), o.finish_reason, o.stop_reason,
                    o.logprobs, o.num_prompt_tokens, o.num_cached_tokens, o.error,
                    o.error_param, o.error_code, o.queue_time, o.prompt_logprobs,
                    o.kv_transfer_params)
         for o in step.outputs],
        stats, step.decode_request_ids,
        step.decode_token_ids.astype("<i4", copy=False).tobytes())


def step_from_wire(msg: WireStepOutputs) -> et.StepOutputs:
    """The engine's ``StepOutputs`` for a received message. The decode column becomes an int32
    [D] view of the message's bytes (no per-token objects); full outputs get token-id lists."""
    return et.StepOutputs(
        step=msg.step,
        outputs=[et.TokenOutput(
            request_id=o.request_id, new_token_ids=_ids_list(o.new_token_ids),
            finish_reason=o.finish_reason, stop_reason=o.stop_reason, logprobs=o.logprobs,
            num_prompt_tokens=o.num_prompt_tokens, num_cached_tokens=o.num_cached_tokens,
            error=o.error, error_param=o.error_param, error_code=o.error_code,
            queue_time=o.queue_time, prompt_logprobs=o.prompt_logprobs,
            kv_transfer_params=o.kv_transfer_params) for o in msg.outputs],
        decode_request_ids=msg.decode_request_ids,
        decode_token_ids=unpack_ids(msg.decode_token_ids))
