"""``POST /v1/responses`` (OpenAI's Responses API): the body becomes a chat request
(``protocol_responses``) served by the chat path (``serving_chat.prepare_chat``: template,
tool prompt, output constraint, sampling params, request id) and the driver
(``serving_driver.run_requests``: concurrency slot, disconnects, metrics, request log); only
the output's shape is this module's: a ``response`` object, or its typed server-sent events.

The output is a list of items: a ``message`` with one ``output_text`` part, and a
``function_call`` item per tool call (read from the text by ``tool_calls.ToolOutput``, as in
chat). A response cut by its token limit has ``status`` "incomplete" with
``incomplete_details.reason`` "max_output_tokens", else "completed". Streamed, the events come
in OpenAI's order, each with its ``sequence_number`` (from 0): ``response.created``,
``response.in_progress``, then per item ``response.output_item.added``, for a message
``response.content_part.added``, ``response.output_text.delta``... ``response.output_text.done``,
``response.content_part.done`` (for a call ``response.function_call_arguments.delta``...
``.done``), ``response.output_item.done``; last ``response.completed``, or
``response.incomplete`` for an incomplete response, or ``response.failed`` when the engine
failed under the stream (as OpenAI ends its streams: no ``[DONE]``).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from itertools import count
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from radixserve.entrypoints.openai.errors import OpenAIError, error_from_validation
from radixserve.entrypoints.openai.protocol_responses import ResponsesRequest
from radixserve.entrypoints.openai.serving_chat import prepare_chat
from radixserve.entrypoints.openai.serving_driver import ResponseFormatter, run_requests
from radixserve.entrypoints.openai.serving_request import parse_body
from radixserve.entrypoints.openai.serving_state import ServingState
from radixserve.entrypoints.openai.sse import sse
from radixserve.entrypoints.openai.tool_calls import ToolOutput, ToolStreamer
from radixserve.entrypoints.openai.usage import usage_dict
from radixserve.frontend.output_processor import RequestDelta, RequestState
from radixserve.sampling_params import SamplingParams

#: the prompt's field in engine and template errors
PROMPT_FIELD = "input"
#: chat field names the shared path puts in errors -> the Responses field they came from
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens", "response_format": "text.format"}
_RENAMED_WORDS = re.compile(r"\b(max_completion_tokens|max_tokens|response_format)\b")


def _responses_error(e: OpenAIError) -> OpenAIError:
    """``e`` (raised by the chat path) with the chat field it names given its Responses name:
    ``max_tokens`` is ``max_output_tokens``, ``response_format`` is ``text.format``,
    ``tools.0.function.name`` is ``tools.0.name``."""
    param = e.param
    if param is not None:
        head, _, tail = param.partition(".")
        if head in _RENAMED:
            param = _RENAMED[head] + (f".{tail}" if tail else "")
        param = re.sub(r"^tools\.(\d+)\.function\b", r"tools.\1", param)
    message = _RENAMED_WORDS.sub(lambda m: _RENAMED[m.group(1)], e.message)
    return OpenAIError(message, e.status_code, e.type, param, e.code, e.headers)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``message`` output item (no content part before its text starts, when streamed)."""
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def responses_usage(states: Sequence[RequestState]) -> dict[str, Any]:
    """The Responses ``usage`` object (token counts) of a finished response."""
    u = usage_dict(states, 1)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


class _EventWriter:
    """Frames the typed events of one streamed response and keeps the output items they
    describe: at most one item is open (receiving deltas) at a time."""

    def __init__(self) -> None:
        self._seq = count()
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._buf = ""

    def event(self, type_: str, **fields: Any) -> bytes:
        """One event: its ``type``, the next ``sequence_number`` and ``fields``."""
        obj = {"type": type_, "sequence_number": next(self._seq), **fields}
        return b"event: " + type_.encode() + b"\n" + sse(obj)

    @property
    def _index(self) -> int:
        return len(self.output)

    def text(self, delta: str) -> list[bytes]:
        """Message text, in a message item (opened here when another kind is open)."""
        out: list[bytes] = []
        if self._open is None or self._open["type"] != "message":
            out += self.close("completed")
            out += self.open_message()
        self._buf += delta
        out.append(self.event("response.output_text.delta", item_id=self._open["id"],
                              output_index=self._index, content_index=0, delta=delta,
                              logprobs=[]))
        return out

    def open_message(self) -> list[bytes]:
        self._open = _message_item(_item_id("msg"), None, "in_progress")
        self._buf = ""
        return [self.event("response.output_item.added", output_index=self._index,
                           item=self._open),
                self.event("response.content_part.added", item_id=self._open["id"],
                           output_index=self._index, content_index=0, part=_text_part(""))]

    def call(self, call_id: str, name: str, arguments: str) -> list[bytes]:
        """A new function call item (closing whatever is open) and its first arguments."""
        out = self.close("completed")
        self._open = _call_item(_item_id("fc"), call_id, name, "", "in_progress")
        self._buf = ""
        out.append(self.event("response.output_item.added", output_index=self._index,
                              item=self._open))
        return out + self.arguments(arguments)

    def arguments(self, delta: str) -> list[bytes]:
        """More arguments text of the open function call."""
        if not delta or self._open is None:
            return []
        self._buf += delta
        return [self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                           output_index=self._index, delta=delta)]

    def close(self, status: str) -> list[bytes]:
        """Finish the open item, if any, with ``status``; it joins ``output``."""
        item = self._open
        if item is None:
            return []
        self._open = None
        i, text = self._index, self._buf
        out = []
        if item["type"] == "message":
            part = _text_part(text)
            done = _message_item(item["id"], text, status)
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=i,
                               content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"],
                               output_index=i, content_index=0, part=part)]
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text, status)
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=i, name=item["name"], arguments=text))
        out.append(self.event("response.output_item.done", output_index=i, item=done))
        self.output.append(done)
        return out

    def chat_delta(self, part: dict[str, Any]) -> list[bytes]:
        """The events of one chat ``delta`` from ``ToolStreamer`` (content, the start of a
        tool call with its id and name, or more of its arguments)."""
        out: list[bytes] = []
        if part.get("content"):
            out += self.text(part["content"])
        for call in part.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:
                out += self.call(call["id"], fn.get("name") or "", fn.get("arguments") or "")
            else:
                out += self.arguments(fn.get("arguments") or "")
        return out


class ResponsesFormatter(ResponseFormatter):
    """The Responses API's shapes for one response (one engine request: no ``n``).

    Args:
        req: the request (echoed in the response object: instructions, tools, ...).
        sampling: the sampling params in force (their temperature and top_p are echoed).
        tools: how the text is read for tool calls (None: plain text).
    """

    def __init__(self, state: ServingState, response_id: str, req: ResponsesRequest,
                 sampling: SamplingParams, tools: ToolOutput | None) -> None:
        super().__init__(state, response_id, 1)
        self.req = req
        self.sampling = sampling
        self.tools = tools

    def body(self, status: str, output: list[dict[str, Any]],
             states: Sequence[RequestState] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object with ``status`` and ``output``; ``usage`` from ``states``
        once they finished (None before)."""
        req = self.req
        fmt = req.text.format if req.text is not None else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": self.sampling.temperature,
            "text": {"format": fmt.echo() if fmt is not None else {"type": "text"},
                     "verbosity": "medium"},
            "tool_choice": req.effective_tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": self.sampling.top_p, "truncation": "disabled",
            "usage": responses_usage(states) if states is not None else None,
            "user": req.user, "metadata": req.metadata or {},
        }

    @staticmethod
    def status(state: RequestState) -> str:
        """"incomplete" when the token limit cut the output, else "completed"."""
        return "incomplete" if state.finish_reason == "length" else "completed"

    def response(self, states: Sequence[RequestState]) -> dict[str, Any]:
        (s,) = states
        status = self.status(s)
        content: str | None = s.text
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls, _ = self.tools.message(s.text, s.finish_reason)
        output = []
        if content is not None or not calls:
            output.append(_message_item(_item_id("msg"), content or "", "completed"))
        for c in calls:
            fn = c["function"]
            output.append(_call_item(_item_id("fc"), c["id"], fn["name"], fn["arguments"],
                                     "completed"))
        output[-1]["status"] = status  # a cut output cuts its last item
        return self.body(status, output, states)

    async def sse_events(self, states: Sequence[RequestState], first: list[RequestDelta],
                         rest: AsyncIterator[list[RequestDelta]]) -> AsyncIterator[bytes]:
        (s,) = states
        w = _EventWriter()
        yield w.event("response.created", response=self.body("in_progress", []))
        yield w.event("response.in_progress", response=self.body("in_progress", []))
        streamer: ToolStreamer | None = None
        if self.tools is None:
            for b in w.open_message():  # plain text: the message starts at once
                yield b
        else:
            streamer = self.tools.streamer()
        batch: list[RequestDelta] | None = first
        try:
            while batch is not None:
                for d in batch:
                    if streamer is None:
                        events = w.text(d.text) if d.text else []
                    else:
                        events = [b for part in streamer.feed(
                            d.text, final=d.finish_reason is not None)
                            for b in w.chat_delta(part)]
                    for b in events:
                        yield b
                batch = await anext(rest, None)
        except OpenAIError as e:
            # the engine failed or the server shut down under the stream: the items so far
            # end incomplete and the response failed, with the reason
            for b in w.close("incomplete"):
                yield b
            code = "server_error" if e.status_code >= 500 else "invalid_prompt"
            yield w.event("response.failed", response=self.body(
                "failed", w.output, states, error={"code": code, "message": e.message}))
            return
        status = self.status(s)
        if not w.output and w._open is None:
            for b in w.open_message():  # nothing generated: an empty message, as unstreamed
                yield b
        for b in w.close(status):
            yield b
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        yield w.event(final, response=self.body(status, w.output, states))


async def create_response(raw: Request, state: ServingState) -> Any:
    """Handle one ``POST /v1/responses`` request.

    Raises:
        OpenAIError: 400 (bad input, an unsupported field such as ``background`` or
            ``previous_response_id``, invalid constraint, context too long), naming the
            Responses field; 404 (unknown model), 429 (too many requests), 500 (engine
            failure), 503 (engine gone).
    """
    arrival = time.time()
    req = await parse_body(raw, ResponsesRequest)
    state.check_model(req.model)
    try:
        try:
            chat = req.to_chat_request()
        except ValidationError as e:
            raise error_from_validation(e) from None
        plan = await prepare_chat(raw, state, chat, arrival, PROMPT_FIELD)
        fmt = ResponsesFormatter(state, f"resp_{plan.request_id}", req, plan.sampling,
                                 plan.tools)
        return await run_requests(raw, state, fmt, plan.request_id, plan.requests,
                                  bool(req.stream), False, arrival, PROMPT_FIELD)
    except OpenAIError as e:
        raise _responses_error(e) from None
