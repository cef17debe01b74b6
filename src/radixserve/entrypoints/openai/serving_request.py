"""From a parsed API body to engine requests: JSON body parsing, sampling params (with the
frontend's part of the context-length rule), prompt token-id checks, request ids (the client's or fresh ones) and the fan-out."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from radixserve.engine_types import EngineRequest, fan_out
from radixserve.entrypoints.openai.errors import OpenAIError, error_from_value_error
from radixserve.sampling_params import SamplingParams, StructuredOutputsParams

M = TypeVar("M", bound=BaseModel)


async def parse_body(raw: Request, model: type[M]) -> M:
    """Read and validate a JSON body; a model with a ``check`` method (the generation
    requests) is also checked for fields this server cannot honour.

    Raises:
        OpenAIError: 400 for a body that is not JSON (or not an object, or nested deeper
            than the parser's stack allows), or naming an unsupported field; pydantic's
            ``ValidationError`` (the app turns it into a 400 naming the field) for wrong types
            or missing fields.
    """
    body = await raw.body()
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(f"Invalid JSON body: {e}") from None
    except RecursionError:
        # arrays or objects nested deeper than the parser's stack allows
        raise OpenAIError("Invalid JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise OpenAIError("The request body must be a JSON object.")
    req = model.model_validate(data)
    check = getattr(req, "check", None)
    if check is not None:
        check()
    return req


def sampling_params_for(req: Any, prompt_len: int, max_model_len: int,
                        default_max_tokens: int | None, prompt_field: str,
                        structured: StructuredOutputsParams | None = None,
                        defaults: Mapping[str, Any] | None = None,
                        vocab_size: int | None = None) -> SamplingParams:
    """Build the engine's SamplingParams.

    A prompt too long on its own is the engine core's to reject (``EngineCore.add_request``
    is the one authority; its rejection is relayed as the 400): here ``max_tokens`` is only
    defaulted, never checked against a prompt that leaves no room.

    Args:
        req: a ChatCompletionRequest or CompletionRequest.
        prompt_len: prompt tokens (the longest prompt of the request).
        max_model_len: the engine's longest sequence.
        default_max_tokens: max_tokens when the request gives none, lowered to the room the
            prompt leaves; None: all the room left (the engine core fills it in).
        prompt_field: "messages" or "prompt", named in errors about the prompt.
        structured: the output constraint (``constraints.structured_outputs_for``).
        defaults: the model's sampling defaults (``--generation-config``) for the fields the
            request leaves unset; their ``max_tokens`` replaces ``default_max_tokens``.
        vocab_size: the model's vocabulary: every ``logit_bias`` key outside it is named in
            one 400 here (the engine core would name only the largest).

    Raises:
        OpenAIError: 400 naming the numbers when prompt + max_tokens exceeds the context, or a
            parameter out of range (``param`` names the field).
    """
    room = max_model_len - prompt_len
    default = default_max_tokens
    if defaults and "max_tokens" in defaults:
        default = defaults["max_tokens"]
    if default is not None and room >= 1:
        default = min(default, room)
    try:
        if vocab_size is not None and req.logit_bias:
            req.logit_bias_ids(vocab_size)
        sp = req.to_sampling_params(default, structured, defaults)
    except ValueError as e:
        raise error_from_value_error(e) from None
    # OpenAI's API rule, not an engine limit: the engine can run such a request (it ends with
    # "length" at max_model_len, as offline LLM.generate does, like vLLM), but the API
    # promises a 400 instead; what the engine cannot represent it rejects itself.
    if room >= 1 and sp.max_tokens is not None and prompt_len + sp.max_tokens > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + sp.max_tokens} tokens ({prompt_len} in the "
            f"{prompt_field}, {sp.max_tokens} for the completion). Please reduce the length of "
            f"the {prompt_field} or max_tokens.", param="max_tokens",
            code="context_length_exceeded")
    return sp


def check_token_ids(ids: list[int], vocab_size: int, field_name: str) -> None:
    """Raises OpenAIError 400 for an empty prompt or an id outside ``[0, vocab_size)`` (before
    anything decodes them: the tokenizer would fail on such ids)."""
    if not ids:
        raise OpenAIError(f"{field_name} is empty: at least one token is required",
                          param=field_name)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise OpenAIError(f"{field_name} has token id {bad}; token ids must be in "
                          f"[0, {vocab_size})", param=field_name)


def kv_transfer_field(states: Any) -> dict[str, Any]:
    """``{"kv_transfer_params": ...}`` for a non-streamed response body when its request
    reported some (a prefill instance's answer, vLLM's top-level field), else {}."""
    params = next((s.kv_transfer_params for s in states if s.kv_transfer_params), None)
    return {} if params is None else {"kv_transfer_params": params}


#: Longest request id accepted from a client (``X-Request-Id`` or the body's ``request_id``).
MAX_REQUEST_ID_CHARS = 256
#: The header a client names its request with; the response echoes it.
REQUEST_ID_HEADER = "x-request-id"


def request_id_for(raw: Request, body_request_id: str | None) -> str:
    """The API request's id: the ``X-Request-Id`` header, else the body's ``request_id``
    (vLLM's field), else a fresh uuid4 hex. The id names the engine request (or, with several,
    prefixes its children's ids: ``engine_types.fan_out``), appears in the request's log
    lines, is echoed in the ``X-Request-Id`` response header (``RequestIdMiddleware``), and
    the response ``id`` is ``chatcmpl-<id>`` / ``cmpl-<id>`` (as vLLM derives it).

    Raises:
        OpenAIError: 400 naming ``request_id`` for an empty id, one longer than
            ``MAX_REQUEST_ID_CHARS``, or one with characters outside printable ASCII (it goes
            back in a response header and into log lines).
    """
    rid = raw.headers.get(REQUEST_ID_HEADER)
    if rid is None:
        rid = body_request_id
    if rid is None:
        rid = uuid.uuid4().hex
    elif not rid or len(rid) > MAX_REQUEST_ID_CHARS or not all(
            " " <= c <= "~" for c in rid) or rid != rid.strip():
        raise OpenAIError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                          "characters without leading or trailing spaces", param="request_id",
                          code="invalid_request_id")
    raw.state.request_id = rid  # the response header echoes it, errors included
    return rid


def engine_requests(request_id: str, prompts: list[list[int]], sp: SamplingParams,
                    arrival_time: float,
                    kv_transfer_params: dict[str, Any] | None = None) -> list[EngineRequest]:
    """``sp.n`` engine requests per prompt (``engine_types.fan_out``); request ``p * n + i``
    is the i-th sample of prompt p, which is also its choice index.

    Raises:
        OpenAIError: 400 naming ``kv_transfer_params`` when they come with more than one
            engine request (one prompt's KV moves for one request, as in vLLM).
    """
    if kv_transfer_params is not None and len(prompts) * sp.n != 1:
        raise OpenAIError("kv_transfer_params needs exactly one prompt and n=1",
                          param="kv_transfer_params")
    return fan_out(request_id, prompts, sp, arrival_time, kv_transfer_params)
