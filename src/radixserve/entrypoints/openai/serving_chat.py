"""``POST /v1/chat/completions``: chat template -> engine requests -> chat completion (or SSE
``chat.completion.chunk`` stream), with output constraints (``constraints``) and tool calls
(``tool_calls``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from radixserve.engine_types import EngineRequest
from radixserve.entrypoints.openai.constraints import structured_outputs_for
from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.serving_driver import ResponseFormatter, run_requests
from radixserve.entrypoints.openai.serving_request import (
    engine_requests,
    kv_transfer_field,
    parse_body,
    request_id_for,
    sampling_params_for,
)
from radixserve.entrypoints.openai.serving_state import ServingState
from radixserve.entrypoints.openai.tool_calls import ToolOutput, ToolStreamer, tool_prompt
from radixserve.entrypoints.openai.usage import usage_dict
from radixserve.frontend.output_processor import RequestDelta, RequestState
from radixserve.sampling_params import SamplingParams


class ChatFormatter(ResponseFormatter):
    """Chat completion shapes: ``message`` / ``delta`` with role, content and tool calls.

    Args:
        tools: how the output is read for tool calls (None: plain text).
        echo: text that starts every choice's content (vLLM's chat ``echo``: the last
            message's content when its role is the response's), or "".
        role: the response message's role ("assistant"; with ``add_generation_prompt``
            false, the last message's role, as vLLM answers).
        return_token_ids: add ``token_ids`` per choice and ``prompt_token_ids`` (vLLM).
        token_ids_as_strings: logprob tokens as ``token_id:<id>`` (vLLM's
            ``return_tokens_as_token_ids``).
        prompt_logprobs: add vLLM's top-level ``prompt_logprobs`` (not streamed).
    """

    object_chunk = "chat.completion.chunk"

    def __init__(self, state: ServingState, response_id: str, n: int,
                 tools: ToolOutput | None = None, echo: str = "", role: str = "assistant",
                 return_token_ids: bool = False, token_ids_as_strings: bool = False,
                 prompt_logprobs: bool = False) -> None:
        super().__init__(state, response_id, n)
        self.want_prompt_logprobs = prompt_logprobs
        self.role = role
        self.tools = tools
        self.echo = echo
        self.return_token_ids = return_token_ids
        self.token_ids_as_strings = token_ids_as_strings
        self._streamers: dict[int, ToolStreamer] = {}

    def _logprobs(self, rows: list) -> dict[str, Any]:
        return chat_logprobs(self.state.tokenizer, rows, self.token_ids_as_strings)

    def prelude(self, states: Sequence[RequestState]) -> list[dict[str, Any]]:
        out = []
        for s in states:
            part: dict[str, Any] = {"index": s.index,
                                    "delta": {"role": self.role, "content": self.echo},
                                    "logprobs": None, "finish_reason": None}
            if self.return_token_ids:
                part["token_ids"] = []
            out.append(part)
        return out

    def prelude_extra(self, states: Sequence[RequestState]) -> dict[str, Any]:
        if self.return_token_ids and states:
            return {"prompt_token_ids": list(map(int, states[0].prompt_token_ids))}
        return {}

    def deltas(self, d: RequestDelta) -> list[dict[str, Any]]:
        finish = d.finish_reason
        if not d.text and not d.logprob_rows and finish is None and not d.token_ids:
            return []
        idx = d.state.index
        parts: list[dict[str, Any]]
        if self.tools is None:
            parts = [{"content": d.text}] if d.text else []
        else:
            streamer = self._streamers.setdefault(idx, self.tools.streamer())
            parts = streamer.feed(d.text, final=finish is not None)
            if finish == "stop" and streamer.calls and self.tools.mode != "named":
                finish = "tool_calls"
        out = []
        for p in parts:
            out.append({"index": idx, "delta": p, "logprobs": None, "finish_reason": None})
        if not out and (d.logprob_rows or finish is not None or
                        (self.return_token_ids and d.token_ids)):
            out.append({"index": idx, "delta": {}, "logprobs": None, "finish_reason": None})
        if not out:
            return []
        last = out[-1]
        if d.logprob_rows:
            last["logprobs"] = self._logprobs(d.logprob_rows)
        if self.return_token_ids:
            for o in out:
                o["token_ids"] = []
            last["token_ids"] = list(d.token_ids)
        if finish is not None:
            last["finish_reason"] = finish
            last["stop_reason"] = d.stop_reason
        return out

    def response(self, states: Sequence[RequestState]) -> dict[str, Any]:
        choices = []
        for s in states:
            content: str | None = self.echo + s.text
            finish = s.finish_reason
            message: dict[str, Any] = {"role": self.role, "content": content}
            if self.tools is not None:
                content, calls, finish = self.tools.message(s.text, finish)
                message["content"] = (self.echo + content if content is not None
                                      else (self.echo or None))
                if calls:
                    message["tool_calls"] = calls
            choice: dict[str, Any] = {
                "index": s.index, "message": message,
                "logprobs": self._logprobs(s.logprob_rows) if s.want_logprobs else None,
                "finish_reason": finish, "stop_reason": s.stop_reason}
            if self.return_token_ids:
                choice["token_ids"] = list(s.token_ids)
            choices.append(choice)
        body = {
            "id": self.response_id, "object": "chat.completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": usage_dict(states, self.n),
            **kv_transfer_field(states),
        }
        if self.return_token_ids and states:
            body["prompt_token_ids"] = list(map(int, states[0].prompt_token_ids))
        if self.want_prompt_logprobs and states:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.state.tokenizer,
                                                           states[0].prompt_logprob_rows)
        return body


@dataclass
class ChatPlan:
    """A chat request made ready for the engine (``prepare_chat``).

    Attributes:
        request_id: the API request's id (``serving_request.request_id_for``).
        requests: the engine requests, request i is choice i.
        sampling: their sampling params (the parent's, before the ``n`` fan-out).
        tools: how each choice's text is read for tool calls (None: plain text).
    """

    request_id: str
    requests: list[EngineRequest]
    sampling: SamplingParams
    tools: ToolOutput | None


async def prepare_chat(raw: Request, state: ServingState, req: ChatCompletionRequest,
                       arrival: float, prompt_field: str = "messages") -> ChatPlan:
    """Template, encode and constrain a chat request and make its engine requests: the part
    of a chat completion that the Responses API (``serving_responses``) shares.

    Args:
        arrival: ``time.time()`` when the API request arrived.
        prompt_field: the request field the messages came from, named in errors about the
            prompt ("messages"; "input" for the Responses API).

    Raises:
        OpenAIError: 400 (template failure, empty prompt, invalid constraint, a value out of
            range, prompt + max tokens over the context, a bad request id), naming the field.
    """
    messages = [m.to_template() for m in req.messages]
    template_kwargs: dict[str, Any] = {"chat_template": req.chat_template,
                                       "documents": req.documents}
    tok = state.tokenizer
    tools = tool_prompt(req, tok, messages, template_kwargs, state.tool_call_parser,
                        state.enable_auto_tool_choice)
    try:
        text = tok.chat_prompt(tools.messages, req.add_generation_prompt,
                               req.chat_template_kwargs, tools=tools.template_tools,
                               continue_final_message=req.continue_final_message or None,
                               **template_kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param=prompt_field) from None
    if req.add_special_tokens:
        ids = list(tok.hf.encode(text, add_special_tokens=True))
    else:
        ids = await tok.encode_async(text)
    if not ids:
        raise OpenAIError(f"{prompt_field}: the chat template made an empty prompt",
                          param=prompt_field)
    structured, field = structured_outputs_for(req)
    if structured is not None:
        assert field is not None
        await state.check_constraint(structured, field)
    sp = sampling_params_for(req, len(ids), state.info.max_model_len, None, prompt_field,
                             structured, state.sampling_defaults,
                             vocab_size=state.info.vocab_size)
    rid = request_id_for(raw, req.request_id)
    requests = engine_requests(rid, [ids], sp, arrival, req.kv_transfer_params)
    return ChatPlan(rid, requests, sp, ToolOutput.for_request(req, tools))


async def create_chat_completion(raw: Request, state: ServingState) -> Any:
    """Handle one chat completion request.

    Raises:
        OpenAIError: 400 (bad input, unsupported field, invalid constraint, context too long,
            template failure), 404 (unknown model), 429 (too many requests), 500 (engine
            failure), 503 (engine gone).
    """
    arrival = time.time()
    req = await parse_body(raw, ChatCompletionRequest)
    state.check_model(req.model)
    plan = await prepare_chat(raw, state, req, arrival)
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    echo = last.text() if req.echo and last.role == role else ""
    fmt = ChatFormatter(state, f"chatcmpl-{plan.request_id}", plan.sampling.n,
                        tools=plan.tools, echo=echo, role=role,
                        return_token_ids=bool(req.return_token_ids),
                        token_ids_as_strings=bool(req.return_tokens_as_token_ids),
                        prompt_logprobs=req.prompt_logprobs is not None)
    return await run_requests(raw, state, fmt, plan.request_id, plan.requests, req.stream,
                              req.include_usage, arrival, "messages",
                              continuous_usage=req.continuous_usage)
