"""What chat and text completions share: body parsing, the model check, the context-length
check, per-choice output state (detokenizer, stop strings, logprobs), disconnect handling, SSE
framing and per-request metrics."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel

from radixserve.entrypoints.openai.errors import OpenAIError, error_from_value_error
from radixserve.frontend.async_client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineInfo,
    RequestEncodeError,
    RequestStream,
)
from radixserve.frontend.detokenizer import IncrementalDetokenizer
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.metrics import ServerMetrics
from radixserve.sampling_params import SamplingParams
from radixserve.transport.messages import FINISH_ABORT, FINISH_STOP, RequestOutput, unpack_ids

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

#: Logprob sent instead of -inf (JSON has no infinities), as vLLM does.
MIN_LOGPROB = -9999.0
_json = msgspec.json.Encoder()


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


@dataclass
class ServingState:
    """Everything a handler needs once the engine is ready.

    Attributes:
        client: the engine client.
        tokenizer: the frontend tokenizer.
        info: the engine's facts (max_model_len, vocab size, ...).
        served_model_name: the name clients use; ``model_aliases`` are also accepted.
        metrics: Prometheus metrics.
        max_concurrent_requests: generation requests in flight at most (None: no limit).
    """

    client: AsyncEngineClient
    tokenizer: FrontendTokenizer
    info: EngineInfo
    served_model_name: str
    model_aliases: frozenset[str]
    metrics: ServerMetrics
    max_concurrent_requests: int | None = None
    active_requests: int = 0

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError 404 for a model name this server does not serve (None is fine)."""
        if model is None or model == self.served_model_name or model in self.model_aliases:
            return
        raise OpenAIError(f"The model `{model}` does not exist. This server serves "
                          f"`{self.served_model_name}`.", 404, param="model",
                          code="model_not_found")


# -- request bodies ------------------------------------------------------------------------------


async def parse_body(raw: Request, model: type[M]) -> M:
    """Read and validate a JSON body.

    Raises:
        OpenAIError: 400 for a body that is not JSON (or not an object); pydantic's
            ``ValidationError`` (the app turns it into a 400 naming the field) for wrong types or
            missing fields.
    """
    body = await raw.body()
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(f"Invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError("The request body must be a JSON object.")
    return model.model_validate(data)


def sampling_params_for(req: Any, prompt_len: int, max_model_len: int,
                        default_max_tokens: int | None, prompt_field: str) -> SamplingParams:
    """Build the engine's SamplingParams and check the context length.

    Args:
        req: a ChatCompletionRequest or CompletionRequest.
        prompt_len: prompt tokens.
        max_model_len: the engine's longest sequence.
        default_max_tokens: max_tokens when the request gives none (None: all the room left).
        prompt_field: "messages" or "prompt", named in errors about the prompt.

    Raises:
        OpenAIError: 400 naming the numbers when prompt + max_tokens exceeds the context, or a
            parameter out of range (``param`` names the field).
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{prompt_field} has {prompt_len} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {prompt_field}.", param=prompt_field,
            code="context_length_exceeded")
    default = room if default_max_tokens is None else min(default_max_tokens, room)
    try:
        sp = req.to_sampling_params(default)
    except ValueError as e:
        raise error_from_value_error(e) from None
    if sp.max_tokens is not None and prompt_len + sp.max_tokens > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + sp.max_tokens} tokens ({prompt_len} in the "
            f"{prompt_field}, {sp.max_tokens} for the completion). Please reduce the length of "
            f"the {prompt_field} or max_tokens.", param="max_tokens",
            code="context_length_exceeded")
    return sp


def check_token_ids(ids: list[int], vocab_size: int, field_name: str) -> None:
    """Raises OpenAIError 400 for an empty prompt or an id outside ``[0, vocab_size)``."""
    if not ids:
        raise OpenAIError(f"{field_name} is empty: at least one token is required",
                          param=field_name)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise OpenAIError(f"{field_name} has token id {bad}; token ids must be in "
                          f"[0, {vocab_size})", param=field_name)


def child_params(sp: SamplingParams, i: int) -> SamplingParams:
    """The i-th of ``n`` samples (as ``LLM`` does it): n=1 and seed+i so samples differ but
    stay reproducible."""
    seed = None if sp.seed is None else sp.seed + i
    return msgspec.structs.replace(sp, n=1, seed=seed)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- choices ---------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One choice (one engine request) of a response and its output so far.

    Attributes:
        index: the choice index in the response.
        request_id: the engine request id.
        prompt_ids: its prompt token ids.
        detok: incremental detokenizer (stop strings applied).
        finish_reason: "stop" or "length" once finished.
        stop_reason: the stop string or stop token id that ended it.
        logprob_rows: per released token ``[[id, logprob], ...]`` (chosen first) when logprobs
            were asked for.
    """

    index: int
    request_id: str
    prompt_ids: list[int]
    detok: IncrementalDetokenizer
    want_logprobs: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprob_rows: list[list[list[float]]] = field(default_factory=list)
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    queue_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.detok.token_ids)

    @property
    def text(self) -> str:
        return self.detok.text


@dataclass
class ChoiceDelta:
    """What one engine output added to a choice: text, token ids, logprob rows, finish."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprob_rows: list[list[list[float]]]
    finished: bool


def make_choices(tokenizer: FrontendTokenizer, prompts: list[list[int]], sp: SamplingParams,
                 prefix: str) -> tuple[list[Choice], list[tuple[str, list[int], SamplingParams]]]:
    """``n`` choices per prompt (index = prompt * n + i) and the engine requests for them."""
    choices, requests = [], []
    base = new_request_id(prefix)
    children = sp.children()
    for p, ids in enumerate(prompts):
        for i, child in enumerate(children):
            index = p * sp.n + i
            rid = f"{base}-{index}"
            detok = IncrementalDetokenizer(tokenizer.hf, ids, sp.skip_special_tokens, sp.stop,
                                           sp.include_stop_str_in_output)
            choices.append(Choice(index, rid, ids, detok, sp.logprobs is not None))
            requests.append((rid, ids, child))
    return choices, requests


async def iterate_choices(stream: RequestStream, choices: list[Choice]
                          ) -> AsyncIterator[list[ChoiceDelta]]:
    """Apply engine outputs to their choices; yield what changed, one delta per choice touched.

    Outputs that are already queued are taken together (``RequestStream.next_batch``) and a
    choice's consecutive deltas merged, so a consumer that falls behind sends fewer, larger
    chunks instead of falling further behind. A stop string found by the detokenizer finishes
    the choice ("stop") and aborts its engine request at once. Closing the stream
    (``finally``) aborts whatever still runs.

    Raises:
        OpenAIError: 400 when the engine rejected a request (its message); 503 when the engine
            died; 500 when it aborted a request on its own.
    """
    by_id = {c.request_id: c for c in choices}
    try:
        while stream.unfinished:
            try:
                outs = await stream.next_batch()
            except EngineDeadError as e:
                raise OpenAIError(f"The engine is not available: {e}", 503) from None
            if not outs:
                continue
            if len(outs) == 1:
                out = outs[0]
                yield [apply_output(stream, by_id[out.request_id], out)]
                continue
            merged: dict[int, ChoiceDelta] = {}
            for out in outs:
                choice = by_id[out.request_id]
                if choice.finish_reason is not None:
                    continue  # finished by a stop string earlier in this batch
                d = apply_output(stream, choice, out)
                prev = merged.get(choice.index)
                if prev is None:
                    merged[choice.index] = d
                else:
                    prev.text += d.text
                    prev.token_ids += d.token_ids
                    prev.logprob_rows = prev.logprob_rows + d.logprob_rows
                    prev.finished = d.finished
            yield list(merged.values())
    finally:
        stream.close()


def apply_output(stream: RequestStream, choice: Choice, out: RequestOutput) -> ChoiceDelta:
    """One engine output applied to ``choice`` (see ``iterate_choices``)."""
    if out.error is not None:
        raise OpenAIError(out.error)
    if out.finish_reason == FINISH_ABORT:
        raise OpenAIError("The request was aborted by the engine.", 500)
    new = unpack_ids(out.new_token_ids).tolist()
    if new and choice.first_token_time is None:
        choice.first_token_time = time.time()
    if out.num_prompt_tokens:  # 0: a column-wise decode, which carries none
        choice.num_cached_tokens = out.num_cached_tokens
    detok = choice.detok
    text = detok.add(new) if new else ""
    rows = (out.logprobs or []) if choice.want_logprobs else []
    if rows:
        choice.logprob_rows.extend(rows)
    finish = out.finish_reason
    if detok.stopped:
        if finish is None:
            stream.finish(choice.request_id)  # abort the engine request now
        finish = FINISH_STOP
        choice.stop_reason = detok.stop_str
    elif finish is not None:
        text += detok.finish()
        choice.stop_reason = out.stop_reason
    if finish is not None:
        choice.finish_reason = finish
        choice.queue_time = out.queue_time
    return ChoiceDelta(choice, text, new, rows, finish is not None)


# -- logprobs ------------------------------------------------------------------------------------


def _lp(x: float) -> float:
    return MIN_LOGPROB if math.isinf(x) or math.isnan(x) else float(x)


def chat_logprobs(tok: FrontendTokenizer, rows: list[list[list[float]]]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion for these rows: ``{"content": [...]}``."""
    content = []
    for row in rows:
        tid, lp = int(row[0][0]), row[0][1]
        content.append({
            "token": tok.token_str(tid), "logprob": _lp(lp), "bytes": tok.token_bytes(tid),
            "top_logprobs": [{"token": tok.token_str(int(t)), "logprob": _lp(v),
                              "bytes": tok.token_bytes(int(t))} for t, v in row[1:]]})
    return {"content": content}


def completion_logprobs(tok: FrontendTokenizer, rows: list[list[list[float]]],
                        text_offset: int, prompt_ids: list[int] | None = None
                        ) -> tuple[dict[str, Any], int]:
    """Legacy ``logprobs`` of a text completion for these rows.

    ``prompt_ids`` (echo) come first with ``None`` logprobs (prompt logprobs are not computed).
    ``top_logprobs`` maps token text to logprob for the top N and the chosen token.
    Returns the object and the text offset after it.
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for tid in prompt_ids or []:
        s = tok.token_str(int(tid))
        out["tokens"].append(s)
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        out["text_offset"].append(text_offset)
        text_offset += len(s)
    for row in rows:
        tid, lp = int(row[0][0]), row[0][1]
        s = tok.token_str(tid)
        top = {tok.token_str(int(t)): _lp(v) for t, v in row[1:]}
        top.setdefault(s, _lp(lp))
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(s)
    return out, text_offset


# -- usage, metrics --------------------------------------------------------------------------------


def usage_dict(choices: list[Choice], n: int) -> dict[str, Any]:
    """OpenAI ``usage``: each prompt counted once (not per choice), cached tokens from the first
    choice of each prompt."""
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[::n])
    cached = sum(c.num_cached_tokens for c in choices[::n])
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def record_metrics(metrics: ServerMetrics, choices: list[Choice], arrival: float) -> None:
    """Observe each choice in the request histograms ("abort" for unfinished ones)."""
    now = time.time()
    for c in choices:
        metrics.observe_request(
            c.finish_reason or FINISH_ABORT, e2e_latency=now - arrival,
            ttft=None if c.first_token_time is None else c.first_token_time - arrival,
            num_output_tokens=c.num_tokens, queue_time=c.queue_time)


# -- transport helpers -----------------------------------------------------------------------------


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


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


# -- the response driver ---------------------------------------------------------------------------


class ResponseFormatter:
    """How one endpoint shapes its output (chat and text completions subclass it).

    Attributes:
        response_id / created / model: the response's ``id``, ``created`` and ``model``.
        object_chunk: ``object`` of a streamed chunk.
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

    def prelude(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """Chunk choices sent before any token (chat: the role; completions: the echo)."""
        return []

    def delta(self, d: ChoiceDelta) -> dict[str, Any] | None:
        """The chunk choice for one output, or None when there is nothing to send."""
        raise NotImplementedError

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        """The non-streamed response body."""
        raise NotImplementedError


async def run_choices(raw: Request, state: ServingState, fmt: ResponseFormatter,
                      choices: list[Choice], requests: list[tuple[str, list[int], SamplingParams]],
                      stream: bool, include_usage: bool, arrival: float) -> Any:
    """Send the engine requests and answer: a JSON body, or an SSE ``StreamingResponse``.

    A disconnect aborts every engine request of this response (within one engine step); so do
    stop strings (per choice). For a streamed response the first engine output is awaited before
    the headers go out, so an engine rejection is still a 400 rather than an in-stream error.

    Raises:
        OpenAIError: 429 (concurrency limit), 400 (engine rejection), 503 (engine gone or
            shutting down), 500 (the engine aborted a request on its own).
        ClientDisconnected: the client left before the headers went out.
    """
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    slot = ConcurrencySlot(state)
    try:
        rstream = state.client.add_requests(requests, arrival)
    except EngineDeadError as e:
        slot.release()
        raise OpenAIError(f"The engine is not available: {e}", 503) from None
    except RequestEncodeError as e:
        slot.release()
        raise OpenAIError(str(e)) from None
    it = iterate_choices(rstream, choices)

    finished = False

    def finish() -> None:
        nonlocal finished
        rstream.close()
        if not finished:
            finished = True
            record_metrics(state.metrics, choices, arrival)
            slot.release()

    if not stream:
        try:
            async def collect() -> None:
                async for _ in it:
                    pass

            await unless_disconnected(raw, collect())
            return JSONResponse(fmt.response(choices))
        finally:
            finish()

    try:
        first = await unless_disconnected(raw, it.__anext__())
    except BaseException:
        finish()
        raise

    async def events() -> AsyncIterator[bytes]:
        extra = {"usage": None} if include_usage else {}
        delta = fmt.delta
        try:
            pre = fmt.prelude(choices)
            if pre:
                yield sse(fmt.chunk(pre, **extra))
            batch = first
            while True:
                parts = [p for p in map(delta, batch) if p is not None]
                if parts:
                    yield sse(fmt.chunk(parts, **extra))
                try:
                    batch = await it.__anext__()
                except StopAsyncIteration:
                    break
            if include_usage:
                yield sse(fmt.chunk([], usage=usage_dict(choices, fmt.n)))
        except OpenAIError as e:
            yield sse(e.to_dict())
        finally:
            finish()
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(finish))
