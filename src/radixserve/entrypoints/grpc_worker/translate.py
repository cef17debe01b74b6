"""``vllm.grpc.engine`` protobuf messages <-> radixserve's engine types.

* ``sampling_params_from_proto``: the one place a proto ``SamplingParams`` becomes radixserve's
  ``SamplingParams``; every proto field is either mapped or refused with ``InvalidArgument``
  naming it, never dropped. The ``constraint`` oneof becomes ``structured_outputs``
  (``structured_outputs_from_proto``, vLLM's ``StructuredOutputsParams`` mapping as in smg's
  own servicer), ``logit_bias`` is passed as is.
* ``engine_requests_from_proto``: a ``GenerateRequest`` -> one ``EngineRequest`` per choice,
  with ``kv_transfer_params_json`` parsed into ``EngineRequest.kv_transfer_params``
  (prefill/decode disaggregation, ``kv_transfer.params``).
* ``chunk_response`` / ``complete_response``: ``RequestDelta``s -> ``GenerateResponse``s, in the
  shape of smg's own vLLM servicer (``smg_grpc_servicer.vllm.servicer``): a streamed choice
  gets a ``GenerateStreamChunk`` per delta (its new token ids, ``completion_tokens`` the delta's
  count) and, when it finishes, a ``GenerateComplete`` carrying that last delta; a non-streamed
  choice gets one ``GenerateComplete`` with all its token ids. A prefill instance's
  ``GenerateComplete`` carries ``kv_transfer_params_json`` for the decode instance.

Proto semantics taken from ``smg-grpc-proto`` 0.4.28 (``vllm_engine.proto``) and the reference
servicer: an unset ``temperature`` means 1.0, ``top_p`` 0 means 1.0, ``top_k`` 0 means off,
``repetition_penalty`` 0 means 1.0, ``n`` 0 means 1, an unset ``max_tokens`` means "all the
room left".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from radixserve.engine_types import EngineRequest, LogprobRow, fan_out
from radixserve.frontend.output_processor import RequestDelta, RequestState
from radixserve.kv_transfer.params import kv_transfer_params_from_json, kv_transfer_params_to_json
from radixserve.sampling_params import SamplingParams, StructuredOutputsParams

#: The proto's structured-output oneof members.
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "structural_tag", "json_object",
                     "choice")
#: The oneof members this worker compiles (xgrammar, ``radixserve.structured``), and the
#: ``StructuredOutputsParams`` field each becomes (vLLM's names).
SUPPORTED_CONSTRAINTS = {"json_schema": "json", "regex": "regex", "grammar": "grammar",
                         "choice": "choice", "json_object": "json_object"}
#: ``GenerateRequest.kv_transfer_params_json``: the field errors about KV-transfer params name.
KV_PARAMS_FIELD = "kv_transfer_params_json"


class InvalidArgument(ValueError):
    """A ``GenerateRequest`` field this worker cannot honour; the servicer answers
    ``INVALID_ARGUMENT`` with the message, which starts with the field's name.

    Attributes:
        field: the proto field at fault ("sampling_params.logit_bias", ...).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def constraint_field(p: pb.SamplingParams) -> str | None:
    """``"sampling_params.<member>"`` of the ``constraint`` oneof member set, None if none."""
    kind = p.WhichOneof("constraint")
    return None if kind is None else f"sampling_params.{kind}"


def structured_outputs_from_proto(p: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The output constraint of a proto ``SamplingParams`` (None without one): ``json_schema``
    (the schema as JSON text), ``regex``, ``grammar`` (EBNF, xgrammar's dialect), ``choice``
    and ``json_object`` become the same-named ``StructuredOutputsParams`` fields, as smg's own
    vLLM servicer maps them. Whether the constraint compiles is checked by the servicer
    before submitting (``constraints.ConstraintChecker``).

    ``grammar_from_first_token`` needs no mapping: radixserve runs no reasoning parser, so a
    grammar always starts at the first generated token, which is what the flag asks for.

    Raises:
        InvalidArgument: ``structural_tag`` (xgrammar structural tags are not supported
            here), ``json_object`` false, or an empty ``choice`` list; the field is
            ``sampling_params.<member>``.
    """
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    field = f"sampling_params.{kind}"
    target = SUPPORTED_CONSTRAINTS.get(kind)
    if target is None:
        supported = ", ".join(SUPPORTED_CONSTRAINTS)
        raise InvalidArgument(field, f"is not supported by this worker (supported: {supported})")
    value: object = getattr(p, kind)
    if kind == "choice":
        value = list(p.choice.choices)
    elif kind == "json_object" and not value:
        raise InvalidArgument(field, "false constrains nothing: leave the constraint unset")
    try:
        return StructuredOutputsParams(**{target: value})
    except ValueError as e:
        raise InvalidArgument(field, str(e)) from None


def sampling_params_from_proto(p: pb.SamplingParams,
                               defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """radixserve's ``SamplingParams`` for a proto ``SamplingParams``.

    ``defaults`` (the model's sampling defaults, ``--generation-config``) fill the fields the
    message leaves unset: ``temperature`` and ``max_tokens`` absent, ``top_p``, ``top_k``,
    ``min_p`` and ``repetition_penalty`` 0 (proto3's unset).

    ``prompt_logprobs`` is refused (the worker does not return ``input_logprobs``).
    ``truncate_prompt_tokens`` is applied to the prompt by ``engine_requests_from_proto``.
    ``logit_bias`` ids are range-checked against the vocabulary there too (the proto map's
    values are checked here). ``spaces_between_special_tokens`` only shapes detokenized text,
    which this worker does not return (the gateway detokenizes), so it has no effect on the
    output; ``skip_special_tokens`` only affects worker-side stop-string matching.

    Raises:
        InvalidArgument: an unsupported field is set, or a value is out of range (the
            message names the field and the allowed range).
    """
    structured = structured_outputs_from_proto(p)
    if p.HasField("prompt_logprobs"):
        raise InvalidArgument("sampling_params.prompt_logprobs",
                              "is not supported by this worker")
    d = defaults or {}
    try:
        return SamplingParams(
            n=p.n or 1,
            temperature=p.temperature if p.HasField("temperature") else
            d.get("temperature", 1.0),
            top_p=p.top_p if p.top_p != 0.0 else d.get("top_p", 1.0),
            top_k=p.top_k if p.top_k > 0 else d.get("top_k", -1),
            min_p=p.min_p if p.min_p != 0.0 else d.get("min_p", 0.0),
            seed=p.seed if p.HasField("seed") else None,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0.0 else
            d.get("repetition_penalty", 1.0),
            max_tokens=p.max_tokens if p.HasField("max_tokens") else d.get("max_tokens"),
            min_tokens=p.min_tokens,
            stop=list(p.stop) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            skip_special_tokens=p.skip_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            logit_bias=dict(p.logit_bias) or None,
            structured_outputs=structured,
        )
    except ValueError as e:
        # SamplingParams' messages start with "field=value"
        field = str(e).split("=", 1)[0]
        raise InvalidArgument(f"sampling_params.{field}", str(e)) from None


def _check_unsupported_inputs(req: pb.GenerateRequest) -> None:
    """Refuse what a text-only, single-instance engine cannot take."""
    if req.HasField("mm_inputs") or len(req.extra_mm_inputs) or req.HasField("media_refs"):
        field = ("mm_inputs" if req.HasField("mm_inputs") else
                 "extra_mm_inputs" if len(req.extra_mm_inputs) else "media_refs")
        raise InvalidArgument(field, "multimodal inputs are not supported (text-only model)")
    if req.HasField("kv_transfer_params"):
        # the deprecated typed field is MooncakeConnector's push handoff (host and port only)
        raise InvalidArgument("kv_transfer_params",
                              "the typed (Mooncake) KV-transfer params are not supported: "
                              f"send vLLM's connector params in {KV_PARAMS_FIELD}")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise InvalidArgument("data_parallel_rank",
                              f"{req.data_parallel_rank} is out of range: this worker has one "
                              "rank (0)")


def prompt_from_proto(req: pb.GenerateRequest, encode: Callable[[str], list[int]],
                      max_model_len: int) -> np.ndarray:
    """The prompt's token ids, int32 [P]: ``tokenized.input_ids``, or ``text`` encoded like
    the HTTP server does, cut to the last ``truncate_prompt_tokens`` tokens when set (-1: the
    last ``max_model_len``, as vLLM).

    Raises:
        InvalidArgument: no input, or a bad ``truncate_prompt_tokens``.
    """
    kind = req.WhichOneof("input")
    if kind == "tokenized":
        ids = np.fromiter(req.tokenized.input_ids, dtype=np.int64,
                          count=len(req.tokenized.input_ids))
    elif kind == "text":
        ids = np.asarray(encode(req.text), dtype=np.int64)
    else:
        raise InvalidArgument("input", "one of tokenized or text is required")
    sp = req.sampling_params
    if sp.HasField("truncate_prompt_tokens"):
        k = sp.truncate_prompt_tokens
        if k == -1:
            k = max_model_len
        if k < 1:
            raise InvalidArgument("sampling_params.truncate_prompt_tokens",
                                  f"{sp.truncate_prompt_tokens} must be -1 or >= 1")
        ids = ids[-k:]
    # the engine range-checks the ids against its vocabulary; values beyond int32 would wrap
    if len(ids) and int(ids.max()) > np.iinfo(np.int32).max:
        raise InvalidArgument("tokenized.input_ids", "token ids must be below 2**31")
    return ids.astype(np.int32)


def kv_transfer_params_from_proto(req: pb.GenerateRequest) -> dict[str, Any] | None:
    """``kv_transfer_params_json`` as the engine's ``kv_transfer_params`` dict (vLLM's keys,
    nulls dropped; ``kv_transfer.params.parse_kv_transfer_params``); None when absent, empty,
    ``{}`` or ``null``.

    Raises:
        InvalidArgument: not JSON, not an object, or a bad value (field
            ``kv_transfer_params_json``; the message names the key).
    """
    if not req.HasField("kv_transfer_params_json"):
        return None
    try:
        return kv_transfer_params_from_json(req.kv_transfer_params_json, KV_PARAMS_FIELD)
    except ValueError as e:
        # the message starts with the field: keep what follows it (".key=..." or " is ...")
        why = str(e).removeprefix(KV_PARAMS_FIELD).lstrip(":. ")
        raise InvalidArgument(KV_PARAMS_FIELD, why) from None


def engine_requests_from_proto(req: pb.GenerateRequest, encode: Callable[[str], list[int]],
                               max_model_len: int, vocab_size: int | None = None,
                               defaults: Mapping[str, Any] | None = None
                               ) -> list[EngineRequest]:
    """One ``EngineRequest`` per choice of a ``GenerateRequest`` (choice i is request i).

    Engine request ids come from ``engine_types.fan_out``, as for the HTTP server and the
    offline ``LLM``: the gRPC ``request_id`` (n = 1) or ``"{request_id}-{i}"``. A prefill and
    a decode leg of one disaggregated request share the gateway's id, which the engine needs
    only to be unique per instance. ``defaults``: see ``sampling_params_from_proto``. ``kv_transfer_params_json`` goes to the
    (single) engine request as ``kv_transfer_params``; whether this instance's KV role can
    serve it is the engine core's to decide (its rejection names the field too).

    Args:
        req: the request.
        encode: tokenizes a ``text`` prompt.
        max_model_len: the engine's longest sequence, tokens (``truncate_prompt_tokens`` -1).
        vocab_size: the model's vocabulary size; ``logit_bias`` ids must be below it (None:
            left to the engine core).

    Raises:
        InvalidArgument: see ``sampling_params_from_proto``, ``prompt_from_proto`` and
            ``kv_transfer_params_from_proto``; also an empty ``request_id``, multimodal inputs,
            the typed ``kv_transfer_params``, KV-transfer params with n > 1 (one prompt's KV
            moves for one request, as in vLLM; smg sends none then), a ``logit_bias`` id
            outside the vocabulary, a DP rank other than 0.
    """
    if not req.request_id:
        raise InvalidArgument("request_id", "must not be empty")
    _check_unsupported_inputs(req)
    sp = sampling_params_from_proto(req.sampling_params, defaults)
    if vocab_size is not None and sp.logit_bias and max(sp.logit_bias) >= vocab_size:
        raise InvalidArgument("sampling_params.logit_bias",
                              f"has token id {max(sp.logit_bias)}; token ids must be in "
                              f"[0, {vocab_size})")
    kv_params = kv_transfer_params_from_proto(req)
    if kv_params is not None and sp.n != 1:
        raise InvalidArgument(KV_PARAMS_FIELD, f"needs n=1 (got n={sp.n}): one prompt's KV "
                              "moves for one request")
    prompt = prompt_from_proto(req, encode, max_model_len)
    return fan_out(req.request_id, [prompt], sp, time.time(), kv_params)


# -- responses -----------------------------------------------------------------------------------


def output_logprobs(rows: Sequence[LogprobRow] | None, num_top: int | None
                    ) -> pb.OutputLogProbs | None:
    """``OutputLogProbs`` for logprob rows (``[[sampled id, lp], [top1 id, lp], ...]`` each):
    one entry per token, ``top_logprobs`` only when top entries were asked for."""
    if not rows:
        return None
    out = pb.OutputLogProbs()
    for row in rows:
        out.token_ids.append(int(row[0][0]))
        out.token_logprobs.append(row[0][1])
        if num_top:
            out.top_logprobs.append(pb.TopLogProbs(
                token_ids=[int(t) for t, _ in row[1:]], values=[lp for _, lp in row[1:]]))
    return out


def chunk_response(d: RequestDelta) -> pb.GenerateResponse:
    """A ``GenerateStreamChunk`` for one delta of a streamed choice."""
    s = d.state
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=d.token_ids, prompt_tokens=s.num_prompt_tokens,
        completion_tokens=len(d.token_ids), cached_tokens=s.num_cached_tokens,
        output_logprobs=output_logprobs(d.logprob_rows, s.sampling_params.logprobs),
        index=s.index))


def complete_response(s: RequestState, token_ids: list[int],
                      rows: Sequence[LogprobRow] | None) -> pb.GenerateResponse:
    """The ``GenerateComplete`` of a finished choice (with ``kv_transfer_params_json`` when
    the engine reported KV-transfer params for it: a prefill for a remote decode).

    Args:
        s: the choice's state (finish and stop reason, prompt and cache counts).
        token_ids: the ids to carry: all of them (non-streamed) or the last delta's
            (streamed; the gateway accumulated the chunks).
        rows: the logprob rows of those ids, or None.
    """
    kw: dict = {}
    if s.kv_transfer_params:  # a prefill instance's handoff, relayed verbatim by the gateway
        kw["kv_transfer_params_json"] = kv_transfer_params_to_json(s.kv_transfer_params)
    if isinstance(s.stop_reason, str):
        kw["matched_stop_str"] = s.stop_reason
    elif isinstance(s.stop_reason, int):
        kw["matched_token_id"] = s.stop_reason
    return pb.GenerateResponse(complete=pb.GenerateComplete(
        output_ids=token_ids, finish_reason=s.finish_reason or "stop",
        prompt_tokens=s.num_prompt_tokens, completion_tokens=len(token_ids),
        cached_tokens=s.num_cached_tokens,
        output_logprobs=output_logprobs(rows, s.sampling_params.logprobs), index=s.index,
        **kw))
