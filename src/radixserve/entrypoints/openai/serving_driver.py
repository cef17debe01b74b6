"""Drives one API response: sends its engine requests, relays their deltas to the endpoint's
formatter (a JSON body or an SSE stream), maps engine failures to OpenAI errors, and holds the
response's concurrency slot and client-disconnect handling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request

from radixserve.engine_types import ERROR_KV_TRANSFER_FAILED, FINISH_ABORT, EngineRequest
from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.serving_state import ServingState
from radixserve.entrypoints.openai.sse import SSE_DONE, sse
from radixserve.entrypoints.openai.usage import record_metrics, usage_dict
from radixserve.frontend.async_client import EngineDeadError, RequestEncodeError, RequestStream
from radixserve.frontend.output_processor import RequestDelta, RequestState

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


# -- disconnects, concurrency --------------------------------------------------------------------


async def wait_for_disconnect(raw: Request) -> None:
    """Return when the client disconnects (call after the body was read)."""
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            return


async def unless_disconnected(raw: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``, cancelling it if the client disconnects first.

    Raises:
        ClientDisconnected: the client went away (``aw`` was cancelled, its ``finally`` blocks
            ran: engine requests are aborted).
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - it failed while being cancelled; the client is gone
        pass
    raise ClientDisconnected()


class ConcurrencySlot:
    """One generation request's slot under ``state.max_concurrent_requests``.

    Taking it raises OpenAIError 429 when every slot is in use (no queueing in the frontend: the
    engine already queues what it admits). ``release`` is idempotent; for a streamed response
    it runs when the stream ends.
    """

    def __init__(self, state: ServingState) -> None:
        limit = state.max_concurrent_requests
        if limit is not None and state.active_requests >= limit:
            raise OpenAIError(f"Too many concurrent requests (limit {limit}); retry later.", 429)
        state.active_requests += 1
        self._state: ServingState | None = state

    def release(self) -> None:
        if self._state is not None:
            self._state.active_requests -= 1
            self._state = None


# -- deltas ----------------------------------------------------------------------------------------


def abort_error(d: RequestDelta, prompt_field: str) -> OpenAIError:
    """The OpenAI error for a delta that aborted its request: the engine's rejection as a 400
    naming the field (the engine's "prompt" is ``prompt_field`` of this API), or a 500 for an
    abort the engine did on its own."""
    if d.error is not None:
        param = prompt_field if d.error_param == "prompt" else d.error_param
        status = 500 if d.error_code == ERROR_KV_TRANSFER_FAILED else 400
        return OpenAIError(d.error, status, param=param, code=d.error_code)
    return OpenAIError("The request was aborted by the engine.", 500)


async def iterate_deltas(stream: RequestStream, prompt_field: str
                         ) -> AsyncIterator[list[RequestDelta]]:
    """The stream's deltas, in batches with at most one delta per request.

    Deltas that are already queued are taken together (``RequestStream.next_batch``) and a
    request's consecutive deltas merged, so a consumer that falls behind sends fewer, larger
    chunks instead of falling further behind. Closing the stream (``finally``) aborts whatever
    still runs.

    Raises:
        OpenAIError: 400 when the engine rejected a request (its message, param and code); 503
            when the engine died; 500 when it aborted a request on its own.
    """
    try:
        while not stream.finished:
            try:
                batch = await stream.next_batch()
            except EngineDeadError as e:
                raise OpenAIError(f"The engine is not available: {e}", 503) from None
            if len(batch) == 1:
                d = batch[0]
                if d.finish_reason == FINISH_ABORT:
                    raise abort_error(d, prompt_field)
                yield batch
                continue
            merged: dict[str, RequestDelta] = {}
            for d in batch:
                if d.finish_reason == FINISH_ABORT:
                    raise abort_error(d, prompt_field)
                prev = merged.get(d.request_id)
                if prev is None:
                    merged[d.request_id] = d
                    continue
                prev.extend(d)
            yield list(merged.values())
    finally:
        stream.close()


# -- the response ------------------------------------------------------------------------------------


class ResponseFormatter:
    """How one endpoint shapes its output (chat and text completions subclass it).

    Attributes:
        response_id / created / model: the response's ``id``, ``created`` and ``model``.
        object_chunk: ``object`` of a streamed chunk.
        n: engine requests (choices) per prompt.
    """

    object_chunk = ""

    def __init__(self, state: ServingState, response_id: str, n: int) -> None:
        self.state = state
        self.response_id = response_id
        self.created = int(time.time())
        self.model = state.served_model_name
        self.n = n

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A streamed chunk holding ``choices``."""
        return {"id": self.response_id, "object": self.object_chunk, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def prelude(self, states: Sequence[RequestState]) -> list[dict[str, Any]]:
        """Chunk choices sent before any token (chat: the role; completions: the echo)."""
        return []

    def prelude_extra(self, states: Sequence[RequestState]) -> dict[str, Any]:
        """Top-level fields of the first streamed chunk only (vLLM's ``prompt_token_ids``)."""
        return {}

    def delta(self, d: RequestDelta) -> dict[str, Any] | None:
        """The chunk choice for one delta, or None when there is nothing to send."""
        raise NotImplementedError

    def deltas(self, d: RequestDelta) -> list[dict[str, Any]]:
        """The chunk choices for one delta, in order (one chunk each); by default ``delta``'s
        one choice."""
        part = self.delta(d)
        return [] if part is None else [part]

    def response(self, states: Sequence[RequestState]) -> dict[str, Any]:
        """The non-streamed response body once every request finished."""
        raise NotImplementedError

    def sse_events(self, states: Sequence[RequestState], first: list[RequestDelta],
                   rest: AsyncIterator[list[RequestDelta]]) -> AsyncIterator[bytes] | None:
        """The whole body of a streamed response, for an endpoint whose stream is not a run
        of ``chunk``s (the Responses API's typed events), or None (the default): chunks.

        Args:
            first: the first batch of deltas (already awaited: a rejection was a 400).
            rest: the batches after it (``iterate_deltas``); it raises ``OpenAIError`` when
                the engine fails under the stream, which the events must report themselves.
        """
        return None


def duplicate_id_error(request_id: str) -> OpenAIError:
    """The 400 for a request id already used by a running request."""
    return OpenAIError(f"request_id {request_id!r} is already used by a running request; "
                       "request ids (X-Request-Id or the body's request_id) must be unique "
                       "among running requests", param="request_id",
                       code="duplicate_request_id")


async def run_requests(raw: Request, state: ServingState, fmt: ResponseFormatter,
                       request_id: str, requests: list[EngineRequest], stream: bool,
                       include_usage: bool, arrival: float, prompt_field: str,
                       continuous_usage: bool = False) -> Any:
    """Send the engine requests and answer: a JSON body, or an SSE ``StreamingResponse``.

    A streamed chunk carries exactly one choice (the final usage chunk none). A disconnect
    aborts every engine request of this response (within one engine step). For a
    streamed response the first delta is awaited before the headers go out, so an engine
    rejection is still a 400 rather than an in-stream error.

    Args:
        request_id: the API request's id (``serving_request.request_id_for``): unique among
            running requests while this one runs.
        requests: the response's engine requests; request i is choice i.
        arrival: ``time.time()`` when the API request arrived.
        prompt_field: "messages" or "prompt": what the engine's "prompt" errors name.
        continuous_usage: every streamed chunk carries the usage so far (vLLM's
            ``stream_options.continuous_usage_stats``).

    Raises:
        OpenAIError: 429 (concurrency limit), 400 (engine rejection, unencodable request, a
            request id a running request uses), 503
            (engine gone or shutting down), 500 (the engine aborted a request on its own).
        ClientDisconnected: the client left before the headers went out.
    """
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    if request_id in state.running_ids:
        raise duplicate_id_error(request_id)
    slot = ConcurrencySlot(state)
    try:
        rstream = state.client.add_requests(requests)
    except EngineDeadError as e:
        slot.release()
        raise OpenAIError(f"The engine is not available: {e}", 503) from None
    except RequestEncodeError as e:
        slot.release()
        raise OpenAIError(str(e)) from None
    except ValueError:
        # an engine id in flight: a child id of another request (``"{id}-{k}"``)
        slot.release()
        raise duplicate_id_error(request_id) from None
    state.running_ids.add(request_id)
    states = rstream.states
    it = iterate_deltas(rstream, prompt_field)

    finished = False

    def finish() -> None:
        nonlocal finished
        rstream.close()
        if not finished:
            finished = True
            state.running_ids.discard(request_id)
            record_metrics(state.metrics, states, arrival)
            state.request_log.finished(states, arrival, state.tokenizer.decode)
            slot.release()

    if not stream:
        try:
            async def collect() -> None:
                async for _ in it:
                    pass

            await unless_disconnected(raw, collect())
            return JSONResponse(fmt.response(states))
        finally:
            finish()

    try:
        first = await unless_disconnected(raw, it.__anext__())
    except StopAsyncIteration:
        first = []  # every request finished without a delta to show
    except BaseException:
        finish()
        raise

    async def events() -> AsyncIterator[bytes]:
        extra: dict[str, Any] = {"usage": None} if include_usage else {}

        def usage() -> dict[str, Any]:
            if continuous_usage:
                return {**extra, "usage": usage_dict(states, fmt.n)}
            return extra

        deltas = fmt.deltas
        try:
            # one choice per chunk, as vLLM sends them: many clients read only choices[0]
            once = fmt.prelude_extra(states)
            for part in fmt.prelude(states):
                yield sse(fmt.chunk([part], **usage(), **once))
                once = {}
            batch = first
            while batch is not None:
                for d in batch:
                    for part in deltas(d):
                        yield sse(fmt.chunk([part], **usage(), **once))
                        once = {}
                batch = await anext(it, None)
            if include_usage:
                yield sse(fmt.chunk([], usage=usage_dict(states, fmt.n)))
        except OpenAIError as e:
            if e.status_code == 503:
                # the server shut down (or the engine died) under the stream: each choice
                # still running ends with finish_reason "abort", then the event says why
                for s in states:
                    if s.finish_reason is None:
                        for part in deltas(RequestDelta(s.request_id, s, "", [],
                                                        finish_reason=FINISH_ABORT)):
                            yield sse(fmt.chunk([part], **usage()))
            yield sse(e.to_dict())
        finally:
            finish()
        yield SSE_DONE

    custom = fmt.sse_events(states, first, it)

    async def relay(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for b in body:
                yield b
        finally:
            finish()

    return StreamingResponse(events() if custom is None else relay(custom),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(finish))
