"""``POST /v1/completions``: prompt(s) as text or token ids -> engine requests -> text
completion (or SSE stream). Choice ``i * n + j`` is the j-th sample of prompt i."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from radixserve.entrypoints.openai.constraints import structured_outputs_for
from radixserve.entrypoints.openai.logprobs import completion_logprobs, vllm_prompt_logprobs
from radixserve.entrypoints.openai.protocol import CompletionRequest
from radixserve.entrypoints.openai.serving_driver import ResponseFormatter, run_requests
from radixserve.entrypoints.openai.serving_request import (
    check_token_ids,
    engine_requests,
    kv_transfer_field,
    parse_body,
    request_id_for,
    sampling_params_for,
)
from radixserve.entrypoints.openai.serving_state import ServingState
from radixserve.entrypoints.openai.usage import usage_dict
from radixserve.frontend.output_processor import RequestDelta, RequestState

#: ``max_tokens`` of a text completion that gives none (OpenAI's and vLLM's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionFormatter(ResponseFormatter):
    """Text completion shapes, with ``echo`` and legacy logprobs (``text_offset`` counted over
    the whole text, echoed prompt included).

    With ``echo`` and ``logprobs`` the prompt tokens come first in ``logprobs``: the first with
    ``null`` (nothing precedes it), the others with their prompt logprobs (OpenAI's shape;
    streamed, they go with the first token, which brings them). ``echo_only`` (``max_tokens``
    0 with ``echo``, as evaluation harnesses send it) answers the prompt alone: the one token
    the engine generated to get there is not shown or counted.

    Args:
        prompt_logprobs: add vLLM's ``prompt_logprobs`` to each choice (the request set it;
            not streamed, as in vLLM).
        return_token_ids / token_ids_as_strings: vLLM's ``return_token_ids`` and
            ``return_tokens_as_token_ids``.
    """

    object_chunk = "text_completion"

    def __init__(self, state: ServingState, response_id: str, n: int, echo: bool,
                 prompt_texts: list[str], return_token_ids: bool = False,
                 token_ids_as_strings: bool = False, echo_only: bool = False,
                 prompt_logprobs: bool = False) -> None:
        super().__init__(state, response_id, n)
        self.echo = echo
        self.echo_only = echo_only
        self.want_prompt_logprobs = prompt_logprobs
        self.prompt_texts = prompt_texts
        self.return_token_ids = return_token_ids
        self.as_ids = token_ids_as_strings
        self._offsets: dict[int, int] = {}
        self._ids_sent: set[int] = set()
        self._echoed: set[int] = set()

    def _token_ids(self, out: dict[str, Any], s: RequestState, new: list[int]) -> None:
        # vLLM: prompt_token_ids once per choice (its first chunk), token_ids per chunk
        if not self.return_token_ids:
            return
        if s.index not in self._ids_sent:
            self._ids_sent.add(s.index)
            out["prompt_token_ids"] = list(map(int, s.prompt_token_ids))
        out["token_ids"] = [] if self.echo_only else list(new)

    def _prompt_text(self, s: RequestState) -> str:
        return self.prompt_texts[s.index // self.n] if self.echo else ""

    def _echo_logprobs_now(self, s: RequestState) -> bool:
        # the prompt's logprobs arrive with the first token: echo waits for it
        return s.want_logprobs

    def prelude(self, states: Sequence[RequestState]) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        out = []
        for s in states:
            if self._echo_logprobs_now(s):
                continue
            self._echoed.add(s.index)
            part = {"index": s.index, "text": self._prompt_text(s), "logprobs": None,
                    "finish_reason": None}
            self._token_ids(part, s, [])
            out.append(part)
        return out

    def delta(self, d: RequestDelta) -> dict[str, Any] | None:
        s = d.state
        finish = d.finish_reason
        text = "" if self.echo_only else d.text
        rows = None if self.echo_only else d.logprob_rows
        new_ids = [] if self.echo_only else d.token_ids
        echo_now = self.echo and s.index not in self._echoed
        if echo_now:
            self._echoed.add(s.index)
            text = self._prompt_text(s) + text
        if not text and not rows and finish is None and not echo_now and not (
                self.return_token_ids and new_ids):
            return None
        lp = None
        if s.want_logprobs:
            lp, self._offsets[s.index] = completion_logprobs(
                self.state.tokenizer, rows or [], self._offsets.get(s.index, 0),
                s.prompt_token_ids if echo_now else None, self.as_ids,
                prompt_rows=s.prompt_logprob_rows)
        out: dict[str, Any] = {"index": s.index, "text": text, "logprobs": lp,
                               "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = d.stop_reason
        self._token_ids(out, s, new_ids)
        return out

    def response(self, states: Sequence[RequestState]) -> dict[str, Any]:
        tok = self.state.tokenizer
        out = []
        for s in states:
            rows = [] if self.echo_only else s.logprob_rows
            lp = None
            if s.want_logprobs:
                lp, _ = completion_logprobs(tok, rows, 0,
                                            s.prompt_token_ids if self.echo else None,
                                            self.as_ids, prompt_rows=s.prompt_logprob_rows)
            text = self._prompt_text(s) + ("" if self.echo_only else s.text)
            choice: dict[str, Any] = {"index": s.index, "text": text, "logprobs": lp,
                                      "finish_reason": s.finish_reason,
                                      "stop_reason": s.stop_reason}
            if self.want_prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, s.prompt_logprob_rows)
            if self.return_token_ids:
                choice["prompt_token_ids"] = list(map(int, s.prompt_token_ids))
                choice["token_ids"] = [] if self.echo_only else list(s.token_ids)
            out.append(choice)
        usage = usage_dict(states, self.n)
        if self.echo_only:
            usage["completion_tokens"] = 0
            usage["total_tokens"] = usage["prompt_tokens"]
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": out, "usage": usage,
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
                             DEFAULT_COMPLETION_MAX_TOKENS, "prompt", structured,
                             state.sampling_defaults,
                             vocab_size=state.info.vocab_size)
    rid = request_id_for(raw, req.request_id)
    requests = engine_requests(rid, prompts, sp, arrival, req.kv_transfer_params)
    fmt = CompletionFormatter(state, f"cmpl-{rid}", sp.n, req.echo, texts,
                              return_token_ids=bool(req.return_token_ids),
                              token_ids_as_strings=bool(req.return_tokens_as_token_ids),
                              echo_only=req.echo_only,
                              prompt_logprobs=req.prompt_logprobs is not None)
    return await run_requests(raw, state, fmt, rid, requests, req.stream, req.include_usage,
                              arrival, "prompt", continuous_usage=req.continuous_usage)
