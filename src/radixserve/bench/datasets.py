"""Prompt sets for benchmarks: random token prompts and ShareGPT-format files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class BenchPrompt:
    """One benchmark request: prompt token ids and the number of tokens to generate."""

    token_ids: list[int]
    output_len: int
    text: str | None = None


def random_prompts(num: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int = 0, avoid: set[int] | None = None
                   ) -> list[BenchPrompt]:
    """``num`` prompts of uniformly random tokens, lengths uniform in
    ``[input_len * (1 - range_ratio), input_len]`` (vLLM's ``--random-range-ratio``); output
    lengths likewise. Token ids in ``avoid`` (special tokens) are never used."""
    rng = np.random.default_rng(seed)
    lo_in = max(1, int(input_len * (1 - range_ratio)))
    lo_out = max(1, int(output_len * (1 - range_ratio)))
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(avoid or (), dtype=np.int64))
    out = []
    for _ in range(num):
        n_in = int(rng.integers(lo_in, input_len + 1))
        n_out = int(rng.integers(lo_out, output_len + 1))
        out.append(BenchPrompt(rng.choice(allowed, size=n_in).tolist(), n_out))
    return out


def sharegpt_prompts(path: str | Path, num: int, tokenizer, output_len: int | None = None,
                     seed: int = 0) -> list[BenchPrompt]:  # noqa: ANN001
    """First-turn prompts from a ShareGPT-format JSON file (a list of
    ``{"conversations": [{"from"|"role", "value"|"content"}, ...]}``); the output length is the
    recorded answer's token count unless ``output_len`` is given.

    Raises:
        ValueError: the file is missing, not JSON, or holds no usable conversation.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read ShareGPT file {path}: {e}") from e
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data)) if isinstance(data, list) else []
    out: list[BenchPrompt] = []
    for i in order:
        conv = data[int(i)].get("conversations") or data[int(i)].get("messages") or []
        if len(conv) < 2:
            continue
        q = conv[0].get("value", conv[0].get("content", ""))
        a = conv[1].get("value", conv[1].get("content", ""))
        ids = tokenizer.encode(q, add_special_tokens=False)
        n_out = output_len or len(tokenizer.encode(a, add_special_tokens=False))
        if len(ids) < 4 or n_out < 4:
            continue
        out.append(BenchPrompt(ids, n_out, q))
        if len(out) == num:
            break
    if not out:
        raise ValueError(f"no usable conversations in {path}")
    return out
