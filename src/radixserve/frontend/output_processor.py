"""Turns engine steps into per-request deltas: the one output path of the server and of the
offline ``LLM`` (vLLM V1's ``OutputProcessor`` shape).

Per engine request it keeps a ``RequestState``: the incremental detokenizer (stop strings
applied), the token ids, logprob rows, finish and stop reasons, and timing facts (first token,
queue time, cached prompt tokens). ``OutputProcessor.process`` consumes one
``engine_types.StepOutputs`` and returns what changed as ``RequestDelta``s, plus the ids whose
stop string matched (the caller aborts those in the engine, without notification).

The column-wise decodes (one plain token per request, the bulk of every step) are read straight
from the step's columns in one tight loop; a delta is made only when a request has something to
show (text, logprobs or a finish), so a token whose text is held back costs no object at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from radixserve.engine_types import (
    FINISH_ABORT,
    FINISH_STOP,
    LogprobRow,
    StepOutputs,
    TokenOutput,
)
from radixserve.frontend.detokenizer import IncrementalDetokenizer
from radixserve.sampling_params import SamplingParams


class RequestState:
    """Everything the frontend knows about one engine request while (and after) it runs.

    Attributes:
        request_id: the engine request id.
        index: the caller's position for it (the choice index of an API response, the
            completion index among ``n`` offline).
        prompt_token_ids: the prompt.
        sampling_params: its params (``n`` 1).
        arrival_time: ``time.time()`` of the API request, seconds.
        detok: incremental detokenizer with the request's stop strings.
        want_logprobs: the request asked for logprobs.
        logprob_rows: every logprob row received, one per generated token (when asked).
        prompt_logprob_rows: one row per prompt position from the second (``prompt_logprobs``
            asked; they come with the first token), else None.
        finish_reason: None while running; "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended it.
        error / error_param / error_code: why the engine rejected it (finish "abort").
        num_prompt_tokens / num_cached_tokens: prompt size and prompt tokens served from the
            radix prefix cache, as the engine reported them.
        first_token_time: ``time.time()`` when its first token was processed, seconds.
        queue_time: seconds from arrival in the core to first being scheduled (set when the
            engine finished it; None when it never ran or a stop string ended it).
        kv_transfer_params: what a prefill instance's finished request tells the decode
            instance (vLLM's shape), else None.
    """

    __slots__ = ("request_id", "index", "prompt_token_ids", "sampling_params", "arrival_time",
                 "detok", "want_logprobs", "logprob_rows", "prompt_logprob_rows",
                 "finish_reason", "stop_reason",
                 "error", "error_param", "error_code", "num_prompt_tokens", "num_cached_tokens",
                 "first_token_time", "queue_time", "kv_transfer_params", "_sent")

    def __init__(self, request_id: str, index: int, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, arrival_time: float,
                 detok: IncrementalDetokenizer) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.detok = detok
        self.want_logprobs = sampling_params.logprobs is not None
        self.logprob_rows: list[LogprobRow] = []
        self.prompt_logprob_rows: list[LogprobRow] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_param: str | None = None
        self.error_code: str | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.queue_time: float | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self._sent = 0  # token ids already handed out in deltas

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids so far (none after a stop string's token)."""
        return self.detok.token_ids

    @property
    def num_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.detok.token_ids)

    @property
    def text(self) -> str:
        """Output text released so far (all of it once finished)."""
        return self.detok.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _take_token_ids(self) -> list[int]:
        ids = self.detok.token_ids
        new = ids[self._sent:]
        self._sent = len(ids)
        return new


class RequestDelta(msgspec.Struct, gc=False):
    """What one engine step (or several, once merged) added to one request.

    Attributes:
        request_id: the engine request.
        state: its ``RequestState`` (totals, timings, the choice index).
        text: new text that may be shown (stop strings trimmed, incomplete characters held).
        token_ids: token ids generated since the previous delta of this request.
        logprob_rows: the new tokens' logprob rows, or None (not asked, or none this step).
        finish_reason: set on the request's last delta: "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended it, on the last delta.
        error / error_param / error_code: on an "abort" the engine explained (a rejection:
            the request never ran); all None on an abort the engine did on its own.
    """

    request_id: str
    state: RequestState
    text: str
    token_ids: list[int]
    logprob_rows: list[LogprobRow] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None
    error_code: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, later: RequestDelta) -> None:
        """Append ``later``, the same request's next delta, to this one: its text, token ids
        and logprob rows, and its finish and stop reasons (set when it finished)."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprob_rows:
            self.logprob_rows = (self.logprob_rows or []) + later.logprob_rows
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


class ProcessedOutputs(NamedTuple):
    """``OutputProcessor.process``'s result.

    Attributes:
        deltas: at most one per request, in the step's order (full outputs first).
        abort_ids: requests a stop string finished while the engine still runs them: abort
            them in the engine (no notification needed: they are already finished here).
    """

    deltas: list[RequestDelta]
    abort_ids: list[str]


class OutputProcessor:
    """Per-request output state for every live engine request of one frontend.

    Args:
        tokenizer: the transformers tokenizer the detokenizers decode with.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        """Requests still unfinished here."""
        return len(self._states)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams, arrival_time: float, index: int = 0
                    ) -> RequestState:
        """Start tracking a request (before it is sent to the engine).

        Raises:
            ValueError: ``request_id`` is already tracked.
        """
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in flight")
        sp = sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sp.skip_special_tokens,
                                       sp.stop, sp.include_stop_str_in_output)
        state = RequestState(request_id, index, prompt_token_ids, sp, arrival_time, detok)
        self._states[request_id] = state
        return state

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Stop tracking requests (client gone, call failed); unknown ids are ignored. Their
        states are left as they are (``finish_reason`` stays None)."""
        for rid in request_ids:
            self._states.pop(rid, None)

    def process(self, step: StepOutputs) -> ProcessedOutputs:
        """Apply one engine step. Outputs of requests not tracked (aborted, or finished here by
        a stop string while the engine still ran them) are ignored."""
        states = self._states
        deltas: list[RequestDelta] = []
        aborts: list[str] = []
        now = time.time()
        for out in step.outputs:
            state = states.get(out.request_id)
            if state is not None:
                delta = self._apply(state, out, now, aborts)
                if delta is not None:
                    deltas.append(delta)
        ids = step.decode_request_ids
        if ids:
            # the hot loop: one plain token per request, no finish, no logprobs
            get = states.get
            for rid, tok in zip(ids, step.decode_token_ids.tolist(), strict=True):
                state = get(rid)
                if state is None:
                    continue
                if state.first_token_time is None:
                    state.first_token_time = now
                detok = state.detok
                text = detok.add_token(tok)
                if detok.stopped:
                    aborts.append(rid)
                    del states[rid]
                    state.finish_reason = FINISH_STOP
                    state.stop_reason = detok.stop_str
                    deltas.append(RequestDelta(rid, state, text, state._take_token_ids(),
                                               None, FINISH_STOP, detok.stop_str))
                elif text:
                    # inlined _take_token_ids: this branch runs for nearly every token
                    tids = detok.token_ids
                    sent = state._sent
                    state._sent = n = len(tids)
                    deltas.append(RequestDelta(rid, state, text,
                                               [tok] if sent == n - 1 else tids[sent:]))
        return ProcessedOutputs(deltas, aborts)

    def _apply(self, state: RequestState, out: TokenOutput, now: float,
               aborts: list[str]) -> RequestDelta | None:
        """One full output applied to its request; the delta, or None if nothing shows."""
        rid = state.request_id
        finish = out.finish_reason
        if finish == FINISH_ABORT or out.error is not None:
            del self._states[rid]
            state.finish_reason = FINISH_ABORT
            state.error, state.error_param, state.error_code = (
                out.error, out.error_param, out.error_code)
            state.queue_time = out.queue_time
            return RequestDelta(rid, state, "", state._take_token_ids(), None, FINISH_ABORT,
                                None, out.error, out.error_param, out.error_code)
        if out.num_prompt_tokens:
            state.num_prompt_tokens = out.num_prompt_tokens
            state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            state.prompt_logprob_rows = out.prompt_logprobs
        new = out.new_token_ids
        detok = state.detok
        text = ""
        rows = out.logprobs if state.want_logprobs else None
        if new:
            if state.first_token_time is None:
                state.first_token_time = now
            if len(new) == 1:
                text = detok.add(new)
            else:
                # several tokens in one step (speculative decoding): one at a time, so a stop
                # string ends the output at the token it ended at without speculation, and the
                # tokens after it (and their logprob rows) are dropped
                before = len(detok.token_ids)
                text = "".join([detok.add_token(int(t)) for t in new])
                taken = len(detok.token_ids) - before
                if rows and taken < len(new):
                    rows = rows[:taken]
        if rows:
            state.logprob_rows.extend(rows)
        if detok.stopped:
            if finish is None:
                aborts.append(rid)
            finish = FINISH_STOP
            state.stop_reason = detok.stop_str
        elif finish is not None:
            text += detok.finish()
            state.stop_reason = out.stop_reason
        if finish is not None:
            del self._states[rid]
            state.finish_reason = finish
            state.queue_time = out.queue_time
            state.kv_transfer_params = out.kv_transfer_params
        elif not text and not rows:
            return None
        return RequestDelta(rid, state, text, state._take_token_ids(), rows or None, finish,
                            state.stop_reason if finish is not None else None)
