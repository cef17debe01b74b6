"""Wire schema between the frontend and the engine core (DESIGN §1).

MessagePack via ``msgspec`` structs, tagged unions, no pickle. The engine's own structs travel
as they are (``engine_types.EngineRequest`` in, ``engine_types.StepOutputs`` out: one struct per
concept, in-process and on the wire); the control messages are defined here. Token-id arrays
(numpy int32) travel as raw little-endian int32 bytes through the encoder's hook and come back
as int32 arrays over the message's bytes (``numpy.frombuffer``), never as per-token Python
objects. A peer in another language can speak this protocol from these definitions and
``engine_types`` alone: structs are arrays of their fields in order, tagged unions lead with the
tag.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from radixserve.engine_types import EngineInfo, EngineRequest, StepOutputs

#: Bumped on any incompatible change; checked by the Hello handshake at connect.
#: 3: Wire* names, no eos_token_ids in requests, rejections carry error_param/error_code,
#: Hello carries a typed EngineInfo, no timestamp in step outputs, no StatsRequest.
#: 4: SamplingParams carries logit_bias and structured_outputs; outputs carry prompt_logprobs.
#: 5: FlushCache / FlushCacheDone.
#: 6: kv_transfer_params in requests and outputs (prefill/decode disaggregation).
#: 7: the engine's EngineRequest and StepOutputs travel as they are (no Wire* copies): requests
#: carry eos_token_ids, outputs' token ids are msgpack ints, the step's stats ride in it.
SCHEMA_VERSION = 7


def enc_hook(obj: Any) -> Any:
    """msgspec's encode hook: a numpy int array -> its raw little-endian int32 bytes.

    Raises:
        NotImplementedError: any other type msgspec cannot encode (msgspec's convention).
    """
    if isinstance(obj, np.ndarray):
        return obj.astype("<i4", copy=False).tobytes()
    raise NotImplementedError(f"cannot encode {type(obj).__name__} on the wire")


def dec_hook(typ: type, obj: Any) -> Any:
    """msgspec's decode hook: bytes -> a read-only int32 array over them (numpy fields).

    Raises:
        TypeError: anything else (msgspec reports it as a ``ValidationError`` naming the field).
    """
    if typ is np.ndarray and isinstance(obj, bytes | bytearray | memoryview):
        return np.frombuffer(obj, dtype="<i4")
    raise TypeError(f"expected int32 bytes for {typ.__name__}, got {type(obj).__name__}")


def encoder() -> msgspec.msgpack.Encoder:
    """The encoder for every message of this protocol (with ``enc_hook``)."""
    return msgspec.msgpack.Encoder(enc_hook=enc_hook)


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder of ``kind`` (``ClientMessage`` or ``CoreMessage``) with ``dec_hook``."""
    return msgspec.msgpack.Decoder(kind, dec_hook=dec_hook)


# -- frontend -> engine core ---------------------------------------------------------------------


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
ClientMessage = EngineRequest | AbortRequests | Hello | Shutdown | FlushCache


# -- engine core -> frontend ---------------------------------------------------------------------


class EngineError(msgspec.Struct, tag="error", array_like=True):
    """The engine core failed; the frontend fails in-flight requests and exits non-zero."""

    message: str


class FlushCacheDone(msgspec.Struct, tag="flushed", array_like=True):
    """The answer to ``FlushCache``: how many KV pages the eviction freed."""

    call_id: int
    pages_freed: int


#: Everything the engine core sends to the frontend.
CoreMessage = StepOutputs | Hello | EngineError | FlushCacheDone
