"""``POST /v1/completions``: prompt(s) as text or token ids -> engine requests -> text
completion (or SSE stream). Choice ``i * n + j`` is the j-th sample of prompt i."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from radixserve.entrypoints.openai.logprobs import completion_logprobs
from radixserve.entrypoints.openai.protocol import CompletionRequest
from radixserve.entrypoints.openai.serving_driver import ResponseFormatter, run_requests
from radixserve.entrypoints.openai.serving_request import (
    check_token_ids,
    engine_requests,
    kv_transfer_field,
    new_request_id,
    parse_body,
    sampling_params_for,
)
from radixserve.entrypoints.openai.serving_state import ServingState
from radixserve.entrypoints.openai.usage import usage_dict
from radixserve.frontend.output_processor import RequestDelta, RequestState

#: ``max_tokens`` of a text completion that gives none (OpenAI's and vLLM's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionFormatter(ResponseFormatter):
    """Text completion shapes, with ``echo`` and legacy logprobs (``text_offset`` counted over
    the whole text, echoed prompt included)."""

    object_chunk = "text_completion"

    def __init__(self, state: ServingState, response_id: str, n: int, echo: bool,
                 prompt_texts: list[str]) -> None:
        super().__init__(state, response_id, n)
        self.echo = echo
        self.prompt_texts = prompt_texts
        self._offsets: dict[int, int] = {}

    def _prompt_text(self, s: RequestState) -> str:
        return self.prompt_texts[s.index // self.n] if self.echo else ""

    def prelude(self, states: Sequence[RequestState]) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        out = []
        for s in states:
            lp = None
            if s.want_logprobs:
                lp, self._offsets[s.index] = completion_logprobs(
                    self.state.tokenizer, [], 0, s.prompt_token_ids)
            out.append({"index": s.index, "text": self._prompt_text(s), "logprobs": lp,
                        "finish_reason": None})
        return out

    def delta(self, d: RequestDelta) -> dict[str, Any] | None:
        finish = d.finish_reason
        if not d.text and not d.logprob_rows and finish is None:
            return None
        s = d.state
        lp = None
        if s.want_logprobs:
            lp, self._offsets[s.index] = completion_logprobs(
                self.state.tokenizer, d.logprob_rows or [], self._offsets.get(s.index, 0))
        out: dict[str, Any] = {"index": s.index, "text": d.text, "logprobs": lp,
                               "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = d.stop_reason
        return out

    def response(self, states: Sequence[RequestState]) -> dict[str, Any]:
        tok = self.state.tokenizer
        out = []
        for s in states:
            lp = None
            if s.want_logprobs:
                lp, _ = completion_logprobs(tok, s.logprob_rows, 0,
                                            s.prompt_token_ids if self.echo else None)
            out.append({"index": s.index, "text": self._prompt_text(s) + s.text, "logprobs": lp,
                        "finish_reason": s.finish_reason, "stop_reason": s.stop_reason})
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": out, "usage": usage_dict(states, self.n),
                **kv_transfer_field(states)}


async def create_completion(raw: Request, state: ServingState) -> Any:
    """Handle one text completion request.

    Raises:
        OpenAIError: 400 (bad input, empty prompt, bad token ids, context too long), 404
            (unknown model), 429 (too many requests), 500 (engine failure), 503 (engine gone).
    """
    arrival = time.time()
    req = await parse_body(raw, CompletionRequest)
    state.check_model(req.model)
    tok = state.tokenizer
    prompts: list[list[int]] = []
    texts: list[str] = []
    for p in req.prompts():
        if isinstance(p, str):
            ids = await tok.encode_async(p)
            texts.append(p)
        else:
            ids = [int(t) for t in p]
        check_token_ids(ids, state.info.vocab_size, "prompt")
        if not isinstance(p, str):
            texts.append(tok.decode(ids, skip_special_tokens=False) if req.echo else "")
        prompts.append(ids)
    # one SamplingParams for all prompts: max_tokens must fit the longest one
    longest = max(len(ids) for ids in prompts)
    sp = sampling_params_for(req, longest, state.info.max_model_len,
                             DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
    requests = engine_requests(prompts, sp, "cmpl", arrival, req.kv_transfer_params)
    fmt = CompletionFormatter(state, new_request_id("cmpl"), sp.n, req.echo, texts)
    return await run_requests(raw, state, fmt, requests, req.stream, req.include_usage,
                              arrival, "prompt")
