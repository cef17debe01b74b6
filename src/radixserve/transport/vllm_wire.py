"""vLLM's EngineCore wire, engine side: the messages smg's ZMQ worker mode sends and reads.

smg (``smg launch --backend vllm --worker-urls ipc://PATH --model-path M``) drives a vLLM
EngineCore directly over ZMQ: smg does HTTP, tokenization, detokenization, stop strings and
``n`` > 1 in Rust, and the engine core only generates, with no Python frontend in between.
This module is the message layer of that protocol for radixserve's engine core: pure
conversions between smg's MessagePack payloads and ``engine_types``. ``vllm_zmq.py`` owns the
sockets and the handshake.

Sources of the layouts: vLLM 0.32 ``vllm/v1/engine/__init__.py`` (``EngineCoreRequest`` and
``EngineCoreOutput(s)`` as positional arrays, ``FinishReason``, ``EngineCoreRequestType``,
``EngineCoreReadyResponse``), ``vllm/v1/serial_utils.py`` (an ndarray is ``[dtype, shape,
Ext(3, raw bytes)]``), ``vllm/sampling_params.py`` (a map, omitted defaults) and
``vllm/v1/metrics/stats.py`` (``SchedulerStats``, ``PrefillStats``); checked against smg
1.13.0 (``crates/engine_zmq_client`` of github.com/smg-project/smg and the installed binary).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from radixserve.engine_types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineInfo,
    EngineRequest,
    RequestRejected,
    SchedulerStats,
    StepOutputs,
    TokenOutput,
)
from radixserve.sampling_params import SamplingParams, StructuredOutputsParams

#: ``EngineCoreRequestType``: the first frame of every message smg sends to the engine.
REQUEST_ADD = b"\x00"
REQUEST_ABORT = b"\x01"
REQUEST_START_DP_WAVE = b"\x02"
REQUEST_UTILITY = b"\x03"

#: The single frame an engine core pushes on its output socket when it exits, so the frontend
#: fails the in-flight requests at once (vLLM ``EngineCoreProc.ENGINE_CORE_DEAD``).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"

#: ``FinishReason`` ints (vLLM ``v1/engine/__init__.py``): smg turns ERROR into HTTP 500.
FINISH_CODE_STOP, FINISH_CODE_LENGTH, FINISH_CODE_ABORT, FINISH_CODE_ERROR = 0, 1, 2, 3
_FINISH_CODES = {FINISH_STOP: FINISH_CODE_STOP, FINISH_LENGTH: FINISH_CODE_LENGTH,
                 FINISH_ABORT: FINISH_CODE_ABORT}

#: ``num_waiting_reqs`` a draining engine reports: past any waiting-requests threshold of smg's
#: overload guard (``--worker-overload-waiting-requests``), as its ``kv_cache_usage`` of 1.0 is
#: past any KV ceiling, so smg leaves the worker out of routing (vLLM's wire has no drain
#: signal, and smg answers the engine's refusal of a request with a 500).
DRAINING_WAITING_REQS = 1 << 20

#: ``numpy`` dtypes smg accepts for the registration's ``dtype`` (the model's compute dtype).
_REGISTRATION_DTYPES = ("float16", "bfloat16", "float32")

#: MessagePack extension code of raw ndarray bytes (vLLM ``serial_utils.CUSTOM_TYPE_RAW_VIEW``).
EXT_RAW_VIEW = 3

# Positions in the ``EngineCoreRequest`` array (vLLM 0.32; smg sends the first 21).
_R_ID, _R_PROMPT, _R_MM, _R_SAMPLING, _R_POOLING, _R_ARRIVAL = 0, 1, 2, 3, 4, 5
_R_LORA, _R_CACHE_SALT, _R_DP_RANK, _R_EMBEDS = 6, 7, 8, 9
_R_PRIORITY, _R_RESUMABLE, _R_REASONING_ENDED, _R_REASONING_KWARGS = 13, 15, 17, 18
_R_ABORT_NOW = 19

#: Request fields the engine cannot honour when set: (position, name, why).
_UNSUPPORTED_REQUEST_FIELDS = (
    (_R_MM, "mm_features", "multimodal inputs are not supported (text-only model)"),
    (_R_POOLING, "pooling_params", "pooling (embeddings) is not supported"),
    (_R_LORA, "lora_request", "LoRA adapters are not supported"),
    (_R_CACHE_SALT, "cache_salt", "salted prefix caching is not supported"),
    (_R_EMBEDS, "prompt_embeds", "prompt embeddings are not supported"),
    (_R_REASONING_KWARGS, "reasoning_parser_kwargs", "reasoning parsers are not supported"),
)

#: smg's sampling keys with radixserve's field of the same meaning; all others are refused
#: when set (see ``sampling_params_from_vllm``).
_SAMPLING_SAME = ("temperature", "top_p", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens",
                  "stop_token_ids", "logprobs", "prompt_logprobs", "extra_args")
#: Keys that only steer what a vLLM frontend or vLLM's own sampler does, with nothing to
#: honour here: ``_all_stop_token_ids`` is the set vLLM masks before ``min_tokens`` (radixserve
#: does not stop on them before ``min_tokens`` instead), ``n``/``stop``/detokenization keys
#: are the gateway's, ``output_kind`` is vLLM's frontend's.
_SAMPLING_IGNORED = frozenset({"_all_stop_token_ids", "n", "stop", "skip_special_tokens",
                               "spaces_between_special_tokens", "include_stop_str_in_output",
                               "detokenize", "output_kind"})
#: vLLM structured-output keys radixserve supports (``StructuredOutputsParams``); ``_backend``
#: names vLLM's grammar backend, and radixserve always uses xgrammar.
_STRUCTURED_SAME = ("json", "regex", "choice", "grammar", "json_object",
                    "disable_any_whitespace", "disable_additional_properties")


def handshake_address(url: str) -> str:
    """The ``tcp://`` handshake address of a smg ZMQ worker URL.

    smg binds its handshake ROUTER at ``tcp://127.0.0.1:P`` where P is the FNV-1a 64-bit hash
    of the ``--worker-urls`` path folded into [20000, 30000) (smg
    ``model_gateway/src/routers/grpc/zmq_client.rs``; smg's tests: ``/tmp/smg-zmq/ts0.ipc`` ->
    25152). A ``tcp://host:port`` URL is that address already.

    Raises:
        ValueError: neither an ``ipc://`` nor a ``tcp://`` URL.
    """
    if url.startswith("tcp://"):
        return url
    if not url.startswith("ipc://"):
        raise ValueError(f"--zmq-worker {url!r}: expected ipc://PATH (as given to smg's "
                         "--worker-urls) or tcp://HOST:PORT (its handshake address)")
    h = 0xCBF29CE484222325
    for b in url[len("ipc://"):].encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"tcp://127.0.0.1:{20000 + h % 10000}"


def _reject(field: str, why: str) -> RequestRejected:
    return RequestRejected(f"{field}: {why}", field)


def structured_outputs_from_vllm(so: dict[str, Any]) -> StructuredOutputsParams:
    """radixserve's constraint for vLLM's ``structured_outputs`` map.

    Raises:
        RequestRejected: a key radixserve does not support (``structural_tag``,
            ``whitespace_pattern``, ...) or an invalid constraint (param
            ``sampling_params.structured_outputs``).
    """
    field = "sampling_params.structured_outputs"
    kwargs: dict[str, Any] = {}
    for key, value in so.items():
        if value is None or key == "_backend":
            continue
        if key not in _STRUCTURED_SAME:
            raise _reject(f"{field}.{key}", "is not supported (supported: "
                          f"{', '.join(_STRUCTURED_SAME)})")
        kwargs[key] = value
    try:
        return StructuredOutputsParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise _reject(field, str(e)) from None


def sampling_params_from_vllm(sp: dict[str, Any]) -> tuple[SamplingParams, list[int] | None]:
    """radixserve's ``SamplingParams`` and the request's EOS ids for vLLM's sampling map.

    The map is what smg sends (vLLM's ``SamplingParams`` with defaults omitted): ``top_k`` 0
    means off; ``_eos_token_id`` is the primary EOS, absent when the client set ``ignore_eos``
    (smg then leaves EOS out of ``stop_token_ids`` too); ``logprobs`` -1 (the whole vocabulary)
    is refused like any value outside [0, 20].

    Returns:
        (params with ``n`` 1, the EOS ids that end this request or None for the model's own).

    Raises:
        RequestRejected: a key radixserve cannot honour (``allowed_token_ids``,
            ``_bad_words_token_ids``, ``thinking_token_budget``, ...) or a value out of range;
            ``param`` names the field (``sampling_params.KEY``).
    """
    kwargs: dict[str, Any] = {}
    eos: list[int] | None = None
    ignore_eos = True
    for key, value in sp.items():
        if key in _SAMPLING_SAME:
            if value is not None:
                kwargs[key] = value
        elif key == "top_k":
            kwargs["top_k"] = -1 if value in (None, 0) else value
        elif key == "_eos_token_id":
            if value is not None:
                eos, ignore_eos = [value], False
        elif key == "logit_bias":
            if value:
                kwargs["logit_bias"] = {int(k): float(v) for k, v in value.items()}
        elif key == "structured_outputs":
            if value is not None:
                kwargs["structured_outputs"] = structured_outputs_from_vllm(value)
        elif key == "skip_reading_prefix_cache":
            if value:
                raise _reject(f"sampling_params.{key}", "is not supported")
        elif key not in _SAMPLING_IGNORED and value not in (None, [], {}, False):
            raise _reject(f"sampling_params.{key}", "is not supported by radixserve")
    if ignore_eos:
        # the model's EOS ids still end a grammar; they just do not stop the output
        kwargs["ignore_eos"] = True
    elif kwargs.get("stop_token_ids"):
        # smg also lists the EOS in stop_token_ids; as an EOS it finishes with no stop_reason
        # (vLLM's check_stop looks at the EOS first)
        kwargs["stop_token_ids"] = [t for t in kwargs["stop_token_ids"] if t not in eos]
    try:
        return SamplingParams(**kwargs), eos
    except (TypeError, ValueError) as e:
        # SamplingParams' messages start with "field=value"
        field = str(e).split("=", 1)[0]
        raise RequestRejected(f"sampling_params.{e}", f"sampling_params.{field}") from None


def request_id_of(fields: Any) -> str | None:
    """The request id of a decoded ADD payload, or None when there is none to answer to."""
    if isinstance(fields, list) and fields and isinstance(fields[_R_ID], str):
        return fields[_R_ID]
    return None


def request_from_vllm(fields: list[Any]) -> EngineRequest:
    """The engine request for a decoded ``EngineCoreRequest`` array (smg sends 21 fields;
    vLLM 0.32 has 22, and trailing ones are optional).

    Fields without an effect on generation (trace headers, ids for logs, the client index and
    DP wave of a single engine) are accepted; ``abort_immediately`` is handled by the caller.

    Raises:
        RequestRejected: a missing prompt or sampling map, or a field radixserve cannot honour
            (multimodal, pooling, LoRA, cache salt, prompt embeddings, a DP rank other than 0,
            a priority other than 0, resumable requests); ``param`` names the field.
    """
    if len(fields) <= _R_ARRIVAL:
        raise _reject("EngineCoreRequest", f"has {len(fields)} fields, at least "
                      f"{_R_ARRIVAL + 1} are required")
    def field(pos: int) -> Any:
        return fields[pos] if len(fields) > pos else None

    for pos, name, why in _UNSUPPORTED_REQUEST_FIELDS:
        if field(pos) not in (None, [], {}):
            raise _reject(name, why)
    if field(_R_DP_RANK) not in (None, 0):
        raise _reject("data_parallel_rank", f"{field(_R_DP_RANK)} is out of range: this "
                      "engine has one rank (0)")
    for pos, name in ((_R_PRIORITY, "priority"), (_R_RESUMABLE, "resumable")):
        if field(pos):
            raise _reject(name, "is not supported (priority scheduling, resumable requests)")
    prompt = fields[_R_PROMPT]
    if not isinstance(prompt, list):
        raise _reject("prompt_token_ids", "token ids are required")
    if not isinstance(fields[_R_SAMPLING], dict):
        raise _reject("sampling_params", "a sampling map is required (pooling is not "
                      "supported)")
    params, eos = sampling_params_from_vllm(fields[_R_SAMPLING])
    try:
        ids = np.asarray(prompt, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise _reject("prompt_token_ids", "must be a list of token ids") from None
    if ids.ndim != 1 or (len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max)):
        raise _reject("prompt_token_ids", "must be a flat list of token ids in [0, 2**31)")
    arrival = fields[_R_ARRIVAL]
    return EngineRequest(
        request_id=fields[_R_ID], prompt_token_ids=ids.astype(np.int32),
        sampling_params=params, eos_token_ids=eos,
        arrival_time=float(arrival) if isinstance(arrival, (int, float)) else time.time())


def abort_immediately(fields: list[Any]) -> bool:
    """True when an ADD asks to be aborted at once (vLLM's ``abort_immediately``)."""
    return len(fields) > _R_ABORT_NOW and bool(fields[_R_ABORT_NOW])


# -- engine -> smg -------------------------------------------------------------------------------


def ndarray(a: np.ndarray) -> list[Any]:
    """vLLM's MessagePack form of a numpy array: ``[dtype str, shape, Ext(3, raw bytes)]``
    (inline: smg also accepts aux frames, which pay off only for large arrays)."""
    a = np.ascontiguousarray(a)
    return [a.dtype.str, list(a.shape), msgspec.msgpack.Ext(EXT_RAW_VIEW, a.tobytes())]


def logprobs_lists(rows: list[list[list[float]]]) -> list[Any]:
    """vLLM's ``LogprobsLists`` for logprob rows: ``[token ids int64 [P, K+1], logprobs
    float32 [P, K+1], sampled-token ranks int64 [P], None]``, column 0 the sampled (or prompt)
    token, columns 1..K the top K in rank order.

    Args:
        rows: P rows ``[[token, logprob, rank], [top1, lp], ...]``, each K + 1 entries (the
            sampler's ``logprob_rows`` / ``prompt_logprob_rows``).
    """
    ids = np.array([[e[0] for e in row] for row in rows], dtype=np.int64)
    lps = np.array([[e[1] for e in row] for row in rows], dtype=np.float32)
    ranks = np.array([row[0][2] for row in rows], dtype=np.int64)
    return [ndarray(ids), ndarray(lps), ndarray(ranks), None]


def output_from_token_output(o: TokenOutput) -> list[Any]:
    """One ``EngineCoreOutput`` (positional, trailing defaults left out) for a full output.

    The first output of a request carries ``prefill_stats`` (smg's source of the usage's
    ``prompt_tokens`` and ``cached_tokens``). A rejection or a failed KV load finishes with
    ERROR (smg answers 500); ``stop_reason`` is the stop token id, None for an EOS (as vLLM).
    """
    if o.error is not None or o.error_code is not None:
        finish: int | None = FINISH_CODE_ERROR
    else:
        finish = None if o.finish_reason is None else _FINISH_CODES[o.finish_reason]
    prefill = None
    if o.num_prompt_tokens:
        computed = o.num_prompt_tokens - o.num_cached_tokens
        prefill = {"num_prompt_tokens": o.num_prompt_tokens, "num_computed_tokens": computed,
                   "num_cached_tokens": o.num_cached_tokens,
                   "num_local_cached_tokens": o.num_cached_tokens,
                   "num_external_cached_tokens": 0, "num_cache_creation_tokens": computed}
    out: list[Any] = [
        o.request_id, o.new_token_ids,
        None if not o.logprobs else logprobs_lists(o.logprobs),
        None if not o.prompt_logprobs else logprobs_lists(o.prompt_logprobs),
        None, finish, o.stop_reason, None, o.kv_transfer_params, None, None, prefill]
    while out[-1] is None:
        out.pop()
    return out


class StatsDelta:
    """vLLM's ``SchedulerStats`` map for each message, from radixserve's cumulative counters.

    vLLM's prefix-cache figures cover the interval since the previous message; smg reads
    ``num_running_reqs``, ``num_waiting_reqs`` and ``kv_cache_usage`` (its load signal) and
    refuses a batch whose stats lack a required key, so every key is always sent. A draining
    engine reports itself full (``kv_cache_usage`` 1.0, ``DRAINING_WAITING_REQS`` waiting):
    smg's overload guard then routes new requests to another worker, or with
    ``--worker-overload-shed`` and none left answers 503 with ``Retry-After``, as the HTTP
    server does while it drains.
    """

    def __init__(self) -> None:
        self._queries = 0
        self._hits = 0

    def __call__(self, s: SchedulerStats, step: int) -> dict[str, Any]:
        """The map for stats ``s`` after engine step ``step``."""
        queries, self._queries = s.prefix_queried_tokens - self._queries, s.prefix_queried_tokens
        hits, self._hits = s.prefix_hit_tokens - self._hits, s.prefix_hit_tokens
        usable = max(s.kv_pages_total - 1, 1)  # the null page 0 holds no KV
        # pages only the radix cache holds are free to smg, as vLLM's cached free blocks are:
        # a warm cache is not load (smg's overload guard vetoes a worker at 0.8)
        usage = min(max(0, s.kv_pages_used - s.kv_pages_evictable) / usable, 1.0)
        waiting = s.num_waiting
        if s.draining:
            usage, waiting = 1.0, max(waiting, DRAINING_WAITING_REQS)
        return {
            "num_running_reqs": s.num_running, "num_waiting_reqs": waiting,
            "step_counter": step, "current_wave": 0,
            "kv_cache_usage": usage,
            "prefix_cache_stats": {"reset": False, "requests": 0, "queries": queries,
                                   "hits": hits, "preempted_requests": 0,
                                   "preempted_queries": 0, "preempted_hits": 0},
            "kv_cache_eviction_events": [],
        }


def outputs_message(step: StepOutputs, stats: dict[str, Any] | None) -> list[Any]:
    """The ``EngineCoreOutputs`` array for one engine step: ``[engine_index 0, outputs,
    scheduler_stats, timestamp, utility_output None, finished_requests]``.

    Plain decodes become ``[request_id, [token]]`` (the two required fields); finished ids are
    listed in ``finished_requests`` after their terminal output.
    """
    outs = [output_from_token_output(o) for o in step.outputs]
    outs.extend([rid, [tok]] for rid, tok in zip(step.decode_request_ids,
                                                 step.decode_token_ids.tolist(), strict=True))
    finished = [o.request_id for o in step.outputs if o.finish_reason is not None]
    return [0, outs, stats, time.monotonic(), None, finished or None]


def utility_reply(call_id: int, result: Any = None, failure: str | None = None) -> list[Any]:
    """The ``EngineCoreOutputs`` answering a UTILITY call: only ``utility_output`` is set,
    ``[call_id, failure message, UtilityResult [None, value]]``."""
    return [0, [], None, time.monotonic(),
            [call_id, failure, None if failure is not None else [None, result]]]


def ready_response(info: EngineInfo, max_num_seqs: int, max_num_batched_tokens: int,
                   instance_id: str) -> dict[str, Any]:
    """The registration map (vLLM's ``EngineCoreReadyResponse``) the engine sends on its input
    socket once it can serve. ``dtype`` is the model's compute dtype, float32 for the null
    model (smg accepts only float16, bfloat16 or float32)."""
    usable_pages = info.num_pages - 1  # page 0 is the null page
    return {
        "max_model_len": info.max_model_len, "num_gpu_blocks": usable_pages,
        "block_size": info.page_size,
        "dp_stats_address": None,
        "dtype": info.dtype if info.dtype in _REGISTRATION_DTYPES else "float32",
        "vllm_version": f"radixserve-{_version()}", "world_size": 1, "data_parallel_size": 1,
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1, "data_parallel_rank": 0,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "instance_id": instance_id, "kv_cache_size_tokens": usable_pages * info.page_size,
        "kv_cache_max_concurrency": None, "kv_events_config": None,
        "supports_lora": False, "max_loras": 0,
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("radixserve")
    except PackageNotFoundError:
        return "dev"
