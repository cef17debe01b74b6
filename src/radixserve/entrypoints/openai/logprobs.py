"""Logprob rows (``[[token_id, logprob], ...]``, the chosen token first) in the OpenAI shapes:
chat ``logprobs.content`` and the legacy text-completion ``logprobs``."""

from __future__ import annotations

import math
from typing import Any

from radixserve.engine_types import LogprobRow
from radixserve.frontend.tokenizer import FrontendTokenizer

#: Logprob sent instead of -inf (JSON has no infinities), as vLLM does.
MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return MIN_LOGPROB if math.isinf(x) or math.isnan(x) else float(x)


def token_text(tok: FrontendTokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs show it: its text, or ``token_id:<id>`` with ``as_id`` (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose text is not valid UTF-8 alone)."""
    return f"token_id:{token_id}" if as_id else tok.token_str(token_id)


def chat_logprobs(tok: FrontendTokenizer, rows: list[LogprobRow],
                  as_ids: bool = False) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion for these rows: ``{"content": [...]}``;
    ``as_ids``: tokens as ``token_id:<id>``."""
    content = []
    for row in rows:
        tid, lp = int(row[0][0]), row[0][1]
        content.append({
            "token": token_text(tok, tid, as_ids), "logprob": _lp(lp),
            "bytes": tok.token_bytes(tid),
            "top_logprobs": [{"token": token_text(tok, int(t), as_ids), "logprob": _lp(v),
                              "bytes": tok.token_bytes(int(t))} for t, v in row[1:]]})
    return {"content": content}


def completion_logprobs(tok: FrontendTokenizer, rows: list[LogprobRow], text_offset: int,
                        prompt_ids: Any = None, as_ids: bool = False
                        ) -> tuple[dict[str, Any], int]:
    """Legacy ``logprobs`` of a text completion for these rows.

    ``prompt_ids`` (echo; a list or an int array) come first with ``None`` logprobs (prompt
    logprobs are not computed). ``top_logprobs`` maps token text to logprob for the top N and
    the chosen token (``as_ids``: tokens as ``token_id:<id>``). Returns the object and the text
    offset (characters) after it.
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for tid in [] if prompt_ids is None else prompt_ids:
        s = tok.token_str(int(tid))
        out["tokens"].append(token_text(tok, int(tid), as_ids))
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        out["text_offset"].append(text_offset)
        text_offset += len(s)
    for row in rows:
        tid, lp = int(row[0][0]), row[0][1]
        s = tok.token_str(tid)
        top = {token_text(tok, int(t), as_ids): _lp(v) for t, v in row[1:]}
        top.setdefault(token_text(tok, tid, as_ids), _lp(lp))
        out["tokens"].append(token_text(tok, tid, as_ids))
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(s)
    return out, text_offset
