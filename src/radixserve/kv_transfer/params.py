"""``kv_transfer_params``: what an API request and response carry between the prefill and the
decode instance, in vLLM's shape (NixlConnector's ``request_finished`` and the routers: vLLM's
proxy, vllm-router, smg).

A request for the prefill instance carries ``{"do_remote_decode": true}`` (the other keys null);
its response carries ``{"do_remote_prefill": true, "do_remote_decode": false,
"remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
"tp_size", "remote_num_tokens", "remote_prompt_hash"}``, which the router passes verbatim to
the decode instance. The last two are radixserve's: they let the decode side check that its
prompt is the one whose KV it would read.

``parse_kv_transfer_params`` / ``kv_transfer_params_from_json`` / ``kv_transfer_params_to_json``
are what a server layer calls (the HTTP body's dict, gRPC's ``kv_transfer_params_json``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

#: Keys and the JSON types allowed for them (None is always allowed: routers send nulls).
_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_decode": (bool,),
    "do_remote_prefill": (bool,),
    "remote_engine_id": (str,),
    "remote_request_id": (str,),
    "remote_block_ids": (list,),
    "remote_host": (str,),
    "remote_port": (int,),
    "tp_size": (int,),
    "remote_num_tokens": (int,),
    "remote_prompt_hash": (str,),
}
#: What a decode request needs besides ``do_remote_prefill`` (vLLM checks the same keys).
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
               "remote_port")
FIELD = "kv_transfer_params"


def parse_kv_transfer_params(obj: Any, field: str = FIELD) -> dict[str, Any] | None:
    """Check a ``kv_transfer_params`` value and return it normalized: a new dict without null
    entries, or None for null / an empty object.

    Keys other than vLLM's and radixserve's are kept as they are (a router may add its own);
    known keys must have their JSON type. With ``do_remote_prefill`` true every key of
    ``REMOTE_KEYS`` is required, ``remote_block_ids`` a list of page ids >= 0 and
    ``remote_port`` in [1, 65535]; ``tp_size`` must be 1 (radixserve has no tensor-parallel
    KV split). ``do_remote_decode`` and ``do_remote_prefill`` cannot both be true.

    Args:
        obj: the decoded JSON value.
        field: the name errors use for it (``kv_transfer_params_json`` over gRPC).

    Raises:
        ValueError: the message starts with ``field`` (or ``field.key``).
    """
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError(f"{field} must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if value is None:
            continue
        types = _TYPES.get(key)
        if types is not None and (not isinstance(value, types)
                                  or (bool not in types and isinstance(value, bool))):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{field}.{key} must be {names} or null, got {value!r}")
        out[key] = value
    if not out:
        return None
    if out.get("do_remote_decode") and out.get("do_remote_prefill"):
        raise ValueError(f"{field}: do_remote_decode and do_remote_prefill cannot both be true")
    if out.get("tp_size", 1) != 1:
        raise ValueError(f"{field}.tp_size={out['tp_size']} is not supported (only 1)")
    if out.get("do_remote_prefill"):
        missing = [k for k in REMOTE_KEYS if k not in out]
        if missing:
            raise ValueError(f"{field}.{missing[0]} is required when do_remote_prefill is true")
        ids = out["remote_block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise ValueError(f"{field}.remote_block_ids must be a list of page ids >= 0")
        if not 1 <= out["remote_port"] <= 65535:
            raise ValueError(f"{field}.remote_port={out['remote_port']} must be in [1, 65535]")
    return out


def kv_transfer_params_from_json(text: str | bytes | None,
                                 field: str = "kv_transfer_params_json") -> dict[str, Any] | None:
    """``parse_kv_transfer_params`` of a JSON text (gRPC's ``kv_transfer_params_json``); an
    empty or absent text is None.

    Raises:
        ValueError: not JSON, or a bad value (the message starts with ``field``).
    """
    if not text:
        return None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from None
    return parse_kv_transfer_params(obj, field)


def kv_transfer_params_to_json(params: dict[str, Any] | None) -> str:
    """A response's ``kv_transfer_params`` as compact JSON text; "" when None."""
    if params is None:
        return ""
    return json.dumps(params, separators=(",", ":"))


def prompt_hash(prompt_token_ids: np.ndarray) -> str:
    """A short digest of a prompt's token ids (int32 [n]), so a decode instance can check that
    the KV it would read was computed for the same tokens: blake2b-64 of the little-endian
    int32 bytes, as 16 hex digits."""
    data = np.asarray(prompt_token_ids, dtype="<i4").tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()
