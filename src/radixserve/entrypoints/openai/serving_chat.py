"""``POST /v1/chat/completions``: chat template -> engine requests -> chat completion (or SSE
``chat.completion.chunk`` stream)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.serving_common import (
    Choice,
    ChoiceDelta,
    ResponseFormatter,
    ServingState,
    chat_logprobs,
    make_choices,
    new_request_id,
    parse_body,
    run_choices,
    sampling_params_for,
    usage_dict,
)


class ChatFormatter(ResponseFormatter):
    """Chat completion shapes: ``message`` / ``delta`` with role and content."""

    object_chunk = "chat.completion.chunk"

    def prelude(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None} for c in choices]

    def delta(self, d: ChoiceDelta) -> dict[str, Any] | None:
        if not d.text and not d.logprob_rows and not d.finished:
            return None
        c = d.choice
        out: dict[str, Any] = {"index": c.index, "delta": {"content": d.text} if d.text else {},
                               "logprobs": None, "finish_reason": c.finish_reason}
        if d.logprob_rows:
            out["logprobs"] = chat_logprobs(self.state.tokenizer, d.logprob_rows)
        if d.finished:
            out["stop_reason"] = c.stop_reason
        return out

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        tok = self.state.tokenizer
        return {
            "id": self.response_id, "object": "chat.completion", "created": self.created,
            "model": self.model,
            "choices": [{
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(tok, c.logprob_rows) if c.want_logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            } for c in choices],
            "usage": usage_dict(choices, self.n),
        }


async def create_chat_completion(raw: Request, state: ServingState) -> Any:
    """Handle one chat completion request.

    Raises:
        OpenAIError: 400 (bad input, context too long, template failure), 404 (unknown model),
            429 (too many requests), 500 (engine failure).
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
    choices, requests = make_choices(state.tokenizer, [ids], sp, "chatcmpl")
    fmt = ChatFormatter(state, new_request_id("chatcmpl"), sp.n)
    return await run_choices(raw, state, fmt, choices, requests, req.stream, req.include_usage,
                             arrival)
