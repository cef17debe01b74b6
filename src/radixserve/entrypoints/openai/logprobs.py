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
                        prompt_ids: Any = None, as_ids: bool = False,
                        prompt_rows: list[LogprobRow] | None = None
                        ) -> tuple[dict[str, Any], int]:
    """Legacy ``logprobs`` of a text completion for these rows.

    ``prompt_ids`` (echo; a list or an int array) come first: the first with ``None``
    logprobs, the others with ``prompt_rows`` (the prompt logprob rows, one per prompt token
    from the second; ``None`` where missing). ``top_logprobs`` maps token text to logprob for
    the top N and the chosen token (``as_ids``: tokens as ``token_id:<id>``). Returns the object and the text
    offset (characters) after it.
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for i, tid in enumerate([] if prompt_ids is None else prompt_ids):
        s = tok.token_str(int(tid))
        out["tokens"].append(token_text(tok, int(tid), as_ids))
        row = prompt_rows[i - 1] if prompt_rows is not None and 0 < i <= len(prompt_rows) \
            else None
        if row is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            top = {token_text(tok, int(t), as_ids): _lp(v) for t, v in row[1:]}
            top.setdefault(token_text(tok, int(tid), as_ids), _lp(row[0][1]))
            out["token_logprobs"].append(_lp(row[0][1]))
            out["top_logprobs"].append(top)
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


def vllm_prompt_logprobs(tok: FrontendTokenizer, rows: list[LogprobRow] | None
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then per token
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for the prompt's token (its rank over the
    vocabulary) and the top N (ranks 1..N)."""
    if rows is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for row in rows:
        entry: dict[str, dict[str, Any]] = {}
        for rank, (t, v) in enumerate(((int(e[0]), e[1]) for e in row[1:]), start=1):
            entry[str(t)] = {"logprob": _lp(v), "rank": rank, "decoded_token": tok.token_str(t)}
        t, v = int(row[0][0]), row[0][1]
        rank = int(row[0][2]) if len(row[0]) > 2 else None
        entry[str(t)] = {"logprob": _lp(v), "rank": rank, "decoded_token": tok.token_str(t)}
        out.append(entry)
    return out
