"""``VllmEngineServicer``: the ``vllm.grpc.engine.VllmEngine`` service over radixserve's engine
core, for smg (the Shepherd Model Gateway) and any other client of that proto.

smg tokenizes, renders chat templates, detokenizes and applies stop strings itself; this worker
takes token ids and streams token ids back. Output constraints (the ``SamplingParams``
``constraint`` oneof) are compiled here before submitting, as the HTTP server does; in
prefill/decode disaggregation (``--kv-transfer-config``, ``smg launch --pd-disaggregation``)
``kv_transfer_params_json`` goes to the engine and comes back on the prefill's
``GenerateComplete``, and ``GetServerInfo`` reports the KV role (see ``KV_HANDOFF_PROTOCOL``). Requests go through the same ``AsyncEngineClient``
and ``OutputProcessor`` as the HTTP server (so stop strings a client does send, logprob rows,
finish reasons and aborts behave the same), and the core is the same engine-core process.

RPCs: ``Generate`` (server streaming; n > 1 choices as separate indices), ``Abort``,
``HealthCheck``, ``GetModelInfo``, ``GetServerInfo``, ``GetLoads``, ``GetTokenizer``,
``FlushCache``. ``Embed``, ``StartProfile``, ``StopProfile`` and ``SubscribeKvEvents`` answer
``UNIMPLEMENTED`` (smg then routes cache-aware on its own approximate prefix tree).

Status codes: ``INVALID_ARGUMENT`` for a field the worker cannot honour (the message names it)
and for requests the engine rejects (prompt too long, token id out of range, an output
constraint that does not compile, KV-transfer params this instance's KV role cannot serve);
``INTERNAL`` when a decode instance could not load a prompt's KV under
``kv_load_failure_policy: fail``;
``ALREADY_EXISTS`` for a ``request_id`` already in flight; ``RESOURCE_EXHAUSTED`` past
``--max-concurrent-requests``; ``UNAVAILABLE`` when the engine is gone or shutting down;
``CANCELLED`` when an ``Abort`` ended the request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

import radixserve
from radixserve.engine_types import ERROR_KV_TRANSFER_FAILED, FINISH_ABORT, EngineInfo
from radixserve.entrypoints.grpc_worker import tokenizer_bundle
from radixserve.entrypoints.grpc_worker.constraints import ConstraintChecker
from radixserve.entrypoints.grpc_worker.translate import (
    KV_PARAMS_FIELD,
    InvalidArgument,
    chunk_response,
    complete_response,
    constraint_field,
    engine_requests_from_proto,
)
from radixserve.entrypoints.request_log import RequestLogger
from radixserve.entrypoints.worker_facts import LoadReporter, ModelFacts
from radixserve.frontend.async_client import (
    AsyncEngineClient,
    EngineDeadError,
    RequestEncodeError,
    RequestStream,
)
from radixserve.frontend.output_processor import RequestDelta, RequestState
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.metrics import ServerMetrics

log = logging.getLogger("radixserve.grpc")

#: What ``GetServerInfo.server_type`` says.
SERVER_TYPE = "radixserve-grpc"
#: What ``GetServerInfo.kv_connector`` says for every radixserve connector. smg picks the PD
#: handoff by this name and knows only vLLM's connectors: for "NixlConnector" it sends
#: ``{"do_remote_decode": true}`` on the prefill leg and relays the prefill's returned params to
#: the decode leg verbatim (pull-based, vLLM's NixlConnector protocol); for a name it does not
#: know it sends no params at all, so the decode side would recompute every prompt. Both
#: radixserve connectors speak exactly that handoff (only how pages move differs: NIXL or TCP),
#: so both report it; the transport itself is in ``pairing_protocol``.
KV_HANDOFF_PROTOCOL = "NixlConnector"
#: Environment variable an operator sets to a PD pairing protocol (smg's servicer reads it).
PAIRING_PROTOCOL_ENV = "SMG_PAIRING_PROTOCOL"


def pairing_protocol(connector: str | None) -> str:
    """``GetServerInfo.pairing_protocol``: ``$SMG_PAIRING_PROTOCOL`` when set (as smg's own
    servicer), else ``radixserve/<connector>`` with a KV connector, else "". smg pairs a
    prefill and a decode worker that both carry one only when the values are equal, so a
    TcpConnector prefill is never paired with a NixlConnector decode (whose handshake would
    refuse it and recompute)."""
    env = os.environ.get(PAIRING_PROTOCOL_ENV, "")
    if env:
        return env
    return f"radixserve/{connector}" if connector else ""


#: Engine rejections name radixserve's ``SamplingParams``/``EngineRequest`` field; over gRPC
#: the error names the proto field instead.
_ENGINE_PARAM_TO_FIELD = {"logit_bias": "sampling_params.logit_bias",
                          "kv_transfer_params": KV_PARAMS_FIELD}


def merge_deltas(batch: list[RequestDelta]) -> list[RequestDelta]:
    """One delta per request: a choice's consecutive deltas (several engine steps that were
    ready at once because the gateway reads slower than the engine steps) become one chunk,
    as the HTTP server merges its SSE chunks (``serving_driver.iterate_deltas``)."""
    merged: dict[str, RequestDelta] = {}
    for d in batch:
        prev = merged.get(d.request_id)
        if prev is None:
            merged[d.request_id] = d
            continue
        if prev.finish_reason == FINISH_ABORT:
            continue
        if d.finish_reason == FINISH_ABORT:
            merged[d.request_id] = d
            continue
        prev.extend(d)
    return list(merged.values())


class AbortedByClient(Exception):
    """An ``Abort`` RPC ended the request (its ``Generate`` stream ends with CANCELLED)."""


@dataclass
class WorkerState:
    """What the servicer needs once the engine is ready.

    Attributes:
        client: the engine client (started, tokenizer set).
        tokenizer: encodes ``GenerateRequest.text`` prompts.
        info: the engine's facts.
        facts: the model's facts as reported to gateways.
        metrics: Prometheus metrics (served on the side HTTP port).
        constraints: compile-checks output constraints before they are submitted.
        sampling_defaults: the model's sampling defaults (``--generation-config``) for the
            fields a request leaves unset.
        request_log: the per-request log lines.
    """

    client: AsyncEngineClient
    tokenizer: FrontendTokenizer
    info: EngineInfo
    facts: ModelFacts
    metrics: ServerMetrics
    constraints: ConstraintChecker
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    request_log: RequestLogger = field(default_factory=RequestLogger)


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    """The ``VllmEngine`` service over one radixserve engine core.

    Args:
        state: the ready engine and its facts.
        max_concurrent_requests: ``Generate`` calls in flight at most; one more gets
            RESOURCE_EXHAUSTED (None: no limit, the engine queues).
    """

    def __init__(self, state: WorkerState, max_concurrent_requests: int | None = None) -> None:
        self.s = state
        self.max_concurrent_requests = max_concurrent_requests
        self.started_at = time.time()
        self.last_receive = 0.0
        self.loads = LoadReporter()
        #: gRPC request id -> the stream of its choices, while it runs
        self.active: dict[str, RequestStream] = {}
        self._bundle: tuple[bytes, str] | None = None
        self._bundle_lock = asyncio.Lock()

    # ------------------------------------------------------------------ Generate
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        s = self.s
        rid = request.request_id
        self.last_receive = time.time()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("Generate %s: stream=%s prompt=%d tokens sampling_params={%s}", rid,
                      request.stream, len(request.tokenized.input_ids),
                      str(request.sampling_params).replace("\n", " "))
        if s.client.draining:
            # HealthCheck already answers unhealthy: the gateway retries elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the worker is draining: it finishes its running requests and "
                                "stops; retry on another worker")
        constrained = constraint_field(request.sampling_params)
        try:
            reqs = engine_requests_from_proto(request, s.tokenizer.encode,
                                              s.info.max_model_len, s.info.vocab_size,
                                              s.sampling_defaults)
            await s.constraints.check(reqs[0].sampling_params.structured_outputs, constrained)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if rid in self.active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {rid!r} is already in flight")
        limit = self.max_concurrent_requests
        if limit is not None and len(self.active) >= limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{limit} requests are in flight (--max-concurrent-requests)")
        try:
            stream = s.client.add_requests(reqs)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is not available: {e}")
        except (RequestEncodeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.active[rid] = stream
        arrival = reqs[0].arrival_time
        try:
            while not stream.finished:
                try:
                    batch = await stream.next_batch()
                except EngineDeadError as e:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"the engine is not available: {e}")
                except AbortedByClient:
                    await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
                for d in merge_deltas(batch) if len(batch) > 1 else batch:
                    if d.finish_reason == FINISH_ABORT:
                        if d.error_code == ERROR_KV_TRANSFER_FAILED:  # not the request's fault
                            await context.abort(grpc.StatusCode.INTERNAL, d.error or "")
                        if d.error is not None:  # the engine rejected it: the request's fault
                            param = d.error_param
                            param = (constrained if param == "structured_outputs" else
                                     _ENGINE_PARAM_TO_FIELD.get(param, param))
                            field = f"{param}: " if param else ""
                            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                                f"{field}{d.error}")
                        await context.abort(grpc.StatusCode.INTERNAL,
                                            "the engine aborted the request")
                    if request.stream:
                        yield chunk_response(d)
                        if d.finished:
                            yield complete_response(d.state, d.token_ids, d.logprob_rows)
                    elif d.finished:
                        st = d.state
                        yield complete_response(st, st.token_ids, st.logprob_rows or None)
        finally:
            stream.close()  # aborts what still runs (client gone, error, cancellation)
            if self.active.get(rid) is stream:
                del self.active[rid]
            self._observe(stream.states, arrival)

    def _observe(self, states: list[RequestState], arrival: float) -> None:
        self.s.request_log.finished(states, arrival, self.s.tokenizer.decode)
        now = time.time()
        for st in states:
            self.s.metrics.observe_request(
                st.finish_reason or FINISH_ABORT, e2e_latency=now - arrival,
                ttft=None if st.first_token_time is None else st.first_token_time - arrival,
                num_output_tokens=st.num_tokens, queue_time=st.queue_time,
                num_prompt_tokens=st.num_prompt_tokens)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        for rid in request.request_ids:
            stream = self.active.pop(rid, None)
            if stream is not None and not stream.finished:
                # frees its KV pages in the engine within one step; ends its Generate
                stream.cancel(AbortedByClient(rid))
                log.info("Abort %s: aborted", rid)
            else:
                # the gateway also drops the Generate call, which aborts it the same way
                log.info("Abort %s: not in flight (finished or already cancelled)", rid)
        return pb.AbortResponse()

    # ------------------------------------------------------------------ facts
    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        c = self.s.client
        if c.healthy:
            return pb.HealthCheckResponse(healthy=True, message="Health")
        reason = c.dead_reason or ("draining" if c.draining else "not ready")
        return pb.HealthCheckResponse(healthy=False, message=reason)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        f = self.s.facts
        return pb.GetModelInfoResponse(
            model_path=f.model_path, is_generation=True,
            max_context_length=f.max_context_length, vocab_size=f.vocab_size,
            supports_vision=False, served_model_name=f.served_model_name,
            tokenizer_path=f.tokenizer_path, model_type=f.model_type,
            architectures=f.architectures, eos_token_ids=f.eos_token_ids,
            pad_token_id=f.pad_token_id, bos_token_id=f.bos_token_id,
            max_req_input_len=f.max_context_length - 1)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        s = self.s
        cfg = s.client.config
        kv = cfg.kv_transfer_config
        kv_fields = {} if kv is None else {
            "kv_connector": KV_HANDOFF_PROTOCOL, "kv_role": kv.kv_role,
            "kv_engine_id": kv.engine_id}
        return pb.GetServerInfoResponse(
            active_requests=len(self.active), is_paused=False,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started_at, server_type=SERVER_TYPE,
            data_parallel_size=1, block_size=s.info.page_size,
            # the KV pool holds the model's dtype (vLLM's cache_dtype "auto")
            kv_cache_dtype="auto", attention_backend=cfg.attention_backend,
            model_dtype=s.info.dtype, max_num_seqs=cfg.max_num_seqs,
            pairing_protocol=pairing_protocol(None if kv is None else kv.kv_connector),
            # no reasoning parser: a grammar applies from the first generated token
            constrained_decoding_start="first_token", **kv_fields)

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetLoadsResponse:
        # ``include`` and ``dp_rank`` are accepted: there is one rank and only the core section
        s = self.s
        c = s.client
        fields = self.loads.load(c.stats, s.info, c.config.max_num_seqs, c.busy_s)
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=radixserve.__version__, dp_rank_count=1,
            loads=[pb.SchedulerLoad(**fields)])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async with self._bundle_lock:
            if self._bundle is None:
                try:
                    self._bundle = await asyncio.to_thread(tokenizer_bundle.build_bundle,
                                                           self.s.info.folder)
                except OSError as e:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        data, sha = self._bundle
        log.info("GetTokenizer: %d bytes, sha256 %s", len(data), sha)
        for piece, digest in tokenizer_bundle.chunks(data, sha):
            yield common_pb2.GetTokenizerChunk(data=piece, sha256=digest)

    # ------------------------------------------------------------------ not offered
    async def _unimplemented(self, context: grpc.aio.ServicerContext, what: str) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not offered by this "
                            "worker (a text-generation engine)")

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
                    ) -> pb.EmbedResponse:
        await self._unimplemented(context, "Embed")

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await self._unimplemented(context, "StartProfile")

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await self._unimplemented(context, "StopProfile")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[common_pb2.KvEventBatch]:
        # smg then routes cache-aware on its own approximate prefix tree
        await self._unimplemented(context, "SubscribeKvEvents (KV cache events)")
        yield common_pb2.KvEventBatch()  # never reached: makes this a streaming handler

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        timeout_s = request.timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "timeout_s: must be finite and >= 0")
        # live requests keep their locked prefixes, so there is nothing to wait for: the
        # flush runs at once whatever timeout_s says (0 included)
        try:
            freed = await asyncio.wait_for(self.s.client.flush_cache(), timeout_s or 10.0)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is not available: {e}")
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "flush_cache timed out")
        return common_pb2.FlushCacheResponse(
            success=True, message=f"flushed the radix cache: {freed} KV pages freed")
