"""``POST /v1/completions``: prompt(s) as text or token ids -> engine requests -> text
completion (or SSE stream). Choice ``i * n + j`` is the j-th sample of prompt i."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from radixserve.entrypoints.openai.constraints import structured_outputs_for
from radixserve.entrypoints.openai.logprobs import completion_logprobs
from radixserve.entrypoints.openai.protocol import CompletionRequest
from radixserve.entrypoints.openai.serving_driver import ResponseFormatter, run_requests
from radixserve.entrypoints.openai.serving_request import (
    check_token_ids,
    engine_requests,
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
                 prompt_texts: list[str], return_token_ids: bool = False,
                 token_ids_as_strings: bool = False) -> None:
        super().__init__(state, response_id, n)
        self.echo = echo
        self.prompt_texts = prompt_texts
        self.return_token_ids = return_token_ids
        self.as_ids = token_ids_as_strings
        self._offsets: dict[int, int] = {}
        self._ids_sent: set[int] = set()

    def _token_ids(self, out: dict[str, Any], s: RequestState, new: list[int]) -> None:
        # vLLM: prompt_token_ids once per choice (its first chunk), token_ids per chunk
        if not self.return_token_ids:
            return
        if s.index not in self._ids_sent:
            self._ids_sent.add(s.index)
            out["prompt_token_ids"] = list(map(int, s.prompt_token_ids))
        out["token_ids"] = list(new)

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
                    self.state.tokenizer, [], 0, s.prompt_token_ids, self.as_ids)
            part = {"index": s.index, "text": self._prompt_text(s), "logprobs": lp,
                    "finish_reason": None}
            self._token_ids(part, s, [])
            out.append(part)
        return out

    def delta(self, d: RequestDelta) -> dict[str, Any] | None:
        finish = d.finish_reason
        if (not d.text and not d.logprob_rows and finish is None
                and not (self.return_token_ids and d.token_ids)):
            return None
        s = d.state
        lp = None
        if s.want_logprobs:
            lp, self._offsets[s.index] = completion_logprobs(
                self.state.tokenizer, d.logprob_rows or [], self._offsets.get(s.index, 0),
                None, self.as_ids)
        out: dict[str, Any] = {"index": s.index, "text": d.text, "logprobs": lp,
                               "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = d.stop_reason
        self._token_ids(out, s, d.token_ids)
        return out

    def response(self, states: Sequence[RequestState]) -> dict[str, Any]:
        tok = self.state.tokenizer
        out = []
        for s in states:
            lp = None
            if s.want_logprobs:
                lp, _ = completion_logprobs(tok, s.logprob_rows, 0,
                                            s.prompt_token_ids if self.echo else None,
                                            self.as_ids)
            choice = {"index": s.index, "text": self._prompt_text(s) + s.text, "logprobs": lp,
                      "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
            if self.return_token_ids:
                choice["prompt_token_ids"] = list(map(int, s.prompt_token_ids))
                choice["token_ids"] = list(s.token_ids)
            out.append(choice)
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": out, "usage": usage_dict(states, self.n)}


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
        if isinstance(p, str) and req.add_special_tokens:
            ids = list(tok.hf.encode(p, add_special_tokens=True))
            texts.append(p)
        elif isinstance(p, str):
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
    structured, field = structured_outputs_for(req)
    if structured is not None:
        assert field is not None
        await state.check_constraint(structured, field)
    sp = sampling_params_for(req, longest, state.info.max_model_len,
                             DEFAULT_COMPLETION_MAX_TOKENS, "prompt", structured)
    requests = engine_requests(prompts, sp, "cmpl", arrival)
    fmt = CompletionFormatter(state, new_request_id("cmpl"), sp.n, req.echo, texts,
                              return_token_ids=bool(req.return_token_ids),
                              token_ids_as_strings=bool(req.return_tokens_as_token_ids))
    return await run_requests(raw, state, fmt, requests, req.stream, req.include_usage,
                              arrival, "prompt", continuous_usage=req.continuous_usage)
