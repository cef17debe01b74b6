"""Wire schema between the frontend and the engine core (DESIGN §1).

MessagePack via ``msgspec`` structs, tagged unions, no pickle. Token-id arrays travel as raw
little-endian int32 bytes (``numpy.frombuffer``), never as per-token Python objects. A peer in
another language can speak this protocol from these definitions alone.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np

from radixserve import engine_types as et
from radixserve.engine_types import SchedulerStats
from radixserve.sampling_params import SamplingParams

#: Bumped on any incompatible change; checked by the Hello handshake at connect.
SCHEMA_VERSION = 2


_I32 = struct.Struct("<i")


def pack_ids(ids: list[int] | np.ndarray) -> bytes:
    """Token ids -> raw little-endian int32 bytes (4 bytes per token)."""
    if isinstance(ids, list) and len(ids) == 1:
        return _I32.pack(ids[0])  # one decoded token per request per step: the hot case
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(buf: bytes) -> np.ndarray:
    """Raw little-endian int32 bytes -> int32 array of shape [len(buf) // 4] (read-only view)."""
    return np.frombuffer(buf, dtype="<i4")


class EngineRequest(msgspec.Struct, tag="req", array_like=True):
    """A new request for the engine core: prompt ids as int32 bytes."""

    request_id: str
    prompt_token_ids: bytes
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """First message each way; the receiver refuses a different ``schema_version``."""

    schema_version: int
    info: dict[str, str | int | float] = {}


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class StatsRequest(msgspec.Struct, tag="stats_req", array_like=True):
    pass


#: Everything the frontend sends to the engine core.
ClientMessage = EngineRequest | AbortRequests | Hello | Shutdown | StatsRequest

from radixserve.engine_types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP  # noqa: E402,F401


class RequestOutput(msgspec.Struct, array_like=True):
    """One request's new tokens from one engine step.

    Attributes:
        new_token_ids: int32 bytes, usually one token.
        finish_reason: None while running; "stop" (EOS / stop token), "length", or "abort".
        stop_reason: the stop token id that ended it, if any.
        logprobs: per new token, ``[[token_id, logprob], ...]`` chosen token first, then top-N.
        num_prompt_tokens / num_cached_tokens: prompt size and prompt tokens served from the
            radix cache. Set in every output sent as a struct (a request's first output always
            is); 0 in those expanded from ``EngineOutputs``' decode columns, which carry no
            prompt information: a consumer keeps the values it got (``num_prompt_tokens > 0``).
        error: set when the core rejected the request (finish_reason is then "abort").
        queue_time: seconds from arrival in the core to first being scheduled; set on the
            output that finishes the request (None when it never ran).
    """

    request_id: str
    new_token_ids: bytes
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[list[list[float]]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time: float | None = None


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine step produced, for all requests: one message per step.

    The common case, a running request that got exactly one new token and nothing else (no
    finish, no logprobs, not its first token), travels column-wise: its id in
    ``decode_request_ids`` and its token at the same index of ``decode_token_ids`` (int32
    bytes, 4 per request). Every other output is a full ``RequestOutput`` in ``outputs``. A
    request appears at most once per message. ``all_outputs()`` gives both as structs.

    Attributes:
        outputs: full per-request outputs.
        decode_request_ids: ids of the column-wise outputs, length D.
        decode_token_ids: int32 [D] as raw little-endian bytes, one token per id.
    """

    step: int
    outputs: list[RequestOutput]
    timestamp: float
    stats: SchedulerStats | None = None
    decode_request_ids: list[str] = []
    decode_token_ids: bytes = b""

    @property
    def num_outputs(self) -> int:
        """Requests with an output in this message (both forms)."""
        return len(self.outputs) + len(self.decode_request_ids)

    def all_outputs(self) -> list[RequestOutput]:
        """``outputs`` then one ``RequestOutput`` per column-wise decode (``num_prompt_tokens``
        and ``num_cached_tokens`` 0 in those: see ``RequestOutput``)."""
        return self.outputs + expand_decodes(self.decode_request_ids, self.decode_token_ids)


def expand_decodes(request_ids: list[str], token_ids: bytes) -> list[RequestOutput]:
    """Column-wise decodes -> one ``RequestOutput`` per request, its token as int32 bytes."""
    return list(map(RequestOutput, request_ids, map(_I32.pack, unpack_ids(token_ids).tolist())))


class EngineError(msgspec.Struct, tag="error", array_like=True):
    """The engine core failed; the frontend fails in-flight requests and exits non-zero."""

    message: str


#: Everything the engine core sends to the frontend.
CoreMessage = EngineOutputs | Hello | EngineError


def request_from_wire(msg: EngineRequest) -> et.EngineRequest:
    """The engine's own request for a wire request (prompt bytes -> int32 array)."""
    return et.EngineRequest(request_id=msg.request_id,
                            prompt_token_ids=unpack_ids(msg.prompt_token_ids),
                            sampling_params=msg.sampling_params,
                            arrival_time=msg.arrival_time)


def output_to_wire(o: et.TokenOutput) -> RequestOutput:
    """One full engine output as its wire struct (token ids -> int32 bytes)."""
    return RequestOutput(o.request_id, pack_ids(o.new_token_ids), o.finish_reason,
                         o.stop_reason, o.logprobs, o.num_prompt_tokens, o.num_cached_tokens,
                         o.error, o.queue_time)


def step_to_wire(step: et.StepOutputs, stats: SchedulerStats | None = None) -> EngineOutputs:
    """One engine step's outputs as the wire message (columns stay columns)."""
    return EngineOutputs(step.step, [output_to_wire(o) for o in step.outputs], 0.0, stats,
                         step.decode_request_ids,
                         step.decode_token_ids.astype("<i4", copy=False).tobytes())
