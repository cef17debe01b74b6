"""``POST /v1/chat/completions``: chat template -> engine requests -> chat completion (or SSE
``chat.completion.chunk`` stream)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.logprobs import chat_logprobs
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.serving_driver import ResponseFormatter, run_requests
from radixserve.entrypoints.openai.serving_request import (
    engine_requests,
    kv_transfer_field,
    new_request_id,
    parse_body,
    sampling_params_for,
)
from radixserve.entrypoints.openai.serving_state import ServingState
from radixserve.entrypoints.openai.usage import usage_dict
from radixserve.frontend.output_processor import RequestDelta, RequestState


class ChatFormatter(ResponseFormatter):
    """Chat completion shapes: ``message`` / ``delta`` with role and content."""

    object_chunk = "chat.completion.chunk"

    def prelude(self, states: Sequence[RequestState]) -> list[dict[str, Any]]:
        return [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None} for s in states]

    def delta(self, d: RequestDelta) -> dict[str, Any] | None:
        finish = d.finish_reason
        if not d.text and not d.logprob_rows and finish is None:
            return None
        out: dict[str, Any] = {"index": d.state.index,
                               "delta": {"content": d.text} if d.text else {},
                               "logprobs": None, "finish_reason": finish}
        if d.logprob_rows:
            out["logprobs"] = chat_logprobs(self.state.tokenizer, d.logprob_rows)
        if finish is not None:
            out["stop_reason"] = d.stop_reason
        return out

    def response(self, states: Sequence[RequestState]) -> dict[str, Any]:
        tok = self.state.tokenizer
        return {
            "id": self.response_id, "object": "chat.completion", "created": self.created,
            "model": self.model,
            "choices": [{
                "index": s.index,
                "message": {"role": "assistant", "content": s.text},
                "logprobs": chat_logprobs(tok, s.logprob_rows) if s.want_logprobs else None,
                "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
            } for s in states],
            "usage": usage_dict(states, self.n),
            **kv_transfer_field(states),
        }


async def create_chat_completion(raw: Request, state: ServingState) -> Any:
    """Handle one chat completion request.

    Raises:
        OpenAIError: 400 (bad input, context too long, template failure), 404 (unknown model),
            429 (too many requests), 500 (engine failure), 503 (engine gone).
    """
    arrival = time.time()
    req = await parse_body(raw, ChatCompletionRequest)
    state.check_model(req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = state.tokenizer.chat_prompt(messages, req.add_generation_prompt,
                                           req.chat_template_kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from None
    ids = await state.tokenizer.encode_async(text)
    if not ids:
        raise OpenAIError("messages produce an empty prompt", param="messages")
    sp = sampling_params_for(req, len(ids), state.info.max_model_len, None, "messages")
    requests = engine_requests([ids], sp, "chatcmpl", arrival, req.kv_transfer_params)
    fmt = ChatFormatter(state, new_request_id("chatcmpl"), sp.n)
    return await run_requests(raw, state, fmt, requests, req.stream, req.include_usage,
                              arrival, "messages")
