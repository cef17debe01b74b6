"""``POST /v1/completions``: prompt(s) as text or token ids -> engine requests -> text
completion (or SSE stream). Choice ``i * n + j`` is the j-th sample of prompt i."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from radixserve.entrypoints.openai.protocol import CompletionRequest
from radixserve.entrypoints.openai.serving_common import (
    Choice,
    ChoiceDelta,
    ResponseFormatter,
    ServingState,
    check_token_ids,
    completion_logprobs,
    make_choices,
    new_request_id,
    parse_body,
    run_choices,
    sampling_params_for,
    usage_dict,
)

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

    def _prompt_text(self, c: Choice) -> str:
        return self.prompt_texts[c.index // self.n] if self.echo else ""

    def prelude(self, choices: list[Choice]) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        out = []
        for c in choices:
            lp = None
            if c.want_logprobs:
                lp, self._offsets[c.index] = completion_logprobs(
                    self.state.tokenizer, [], 0, c.prompt_ids)
            out.append({"index": c.index, "text": self._prompt_text(c), "logprobs": lp,
                        "finish_reason": None})
        return out

    def delta(self, d: ChoiceDelta) -> dict[str, Any] | None:
        if not d.text and not d.logprob_rows and not d.finished:
            return None
        c = d.choice
        lp = None
        if c.want_logprobs:
            lp, self._offsets[c.index] = completion_logprobs(
                self.state.tokenizer, d.logprob_rows, self._offsets.get(c.index, 0))
        out: dict[str, Any] = {"index": c.index, "text": d.text, "logprobs": lp,
                               "finish_reason": c.finish_reason}
        if d.finished:
            out["stop_reason"] = c.stop_reason
        return out

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        tok = self.state.tokenizer
        out = []
        for c in choices:
            lp = None
            if c.want_logprobs:
                lp, _ = completion_logprobs(tok, c.logprob_rows, 0,
                                            c.prompt_ids if self.echo else None)
            out.append({"index": c.index, "text": self._prompt_text(c) + c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": out, "usage": usage_dict(choices, self.n)}


async def create_completion(raw: Request, state: ServingState) -> Any:
    """Handle one text completion request.

    Raises:
        OpenAIError: 400 (bad input, empty prompt, bad token ids, context too long), 404
            (unknown model), 429 (too many requests), 500 (engine failure).
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
            texts.append(tok.decode(ids, skip_special_tokens=False) if req.echo else "")
        check_token_ids(ids, state.info.vocab_size, "prompt")
        prompts.append(ids)
    # one SamplingParams for all prompts: max_tokens must fit the longest one
    longest = max(len(ids) for ids in prompts)
    sp = sampling_params_for(req, longest, state.info.max_model_len,
                             DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
    choices, requests = make_choices(tok, prompts, sp, "cmpl")
    fmt = CompletionFormatter(state, new_request_id("cmpl"), sp.n, req.echo, texts)
    return await run_choices(raw, state, fmt, choices, requests, req.stream, req.include_usage,
                             arrival)
