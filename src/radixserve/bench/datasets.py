"""Prompt sets for benchmarks: random token prompts and ShareGPT-format files."""

from __future__ import annotations

import contextlib
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
    #: shared system prompt (shared-prefix dataset); ``text`` is then the user question and
    #: ``token_ids`` cover system + question
    system: str | None = None

    @property
    def prompt_text(self) -> str:
        """What a completions request sends: system prompt (if any) then the text."""
        return (self.system or "") + (self.text or "")


def random_prompts(num: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int = 0, avoid: set[int] | None = None,
                   output_range_ratio: float | None = None) -> list[BenchPrompt]:
    """``num`` prompts of uniformly random tokens, lengths uniform in
    ``[input_len * (1 - range_ratio), input_len]`` (vLLM's ``--random-range-ratio``); output
    lengths likewise, with ``output_range_ratio`` when given. Token ids in ``avoid`` (special
    tokens) are never used."""
    rng = np.random.default_rng(seed)
    lo_in = max(1, int(input_len * (1 - range_ratio)))
    out_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    lo_out = max(1, int(output_len * (1 - out_ratio)))
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


def _text_vocab(tokenizer) -> np.ndarray:  # noqa: ANN001
    """Token ids that decode on their own to printable ASCII with a word shape (so random
    sequences of them survive a decode / re-encode round trip with about the same length)."""
    cached = getattr(tokenizer, "_radixserve_text_vocab", None)
    if cached is not None:
        return cached
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    words = tokenizer.batch_decode([[i] for i in ids])
    keep = np.array([i for i, w in zip(ids, words, strict=True)
                     if w.isascii() and w.isprintable() and w.strip().isalpha()
                     and w.startswith(" ")], dtype=np.int64)
    if len(keep) < 100:  # an unusual tokenizer: fall back to every non-special token
        keep = np.array(ids, dtype=np.int64)
    with contextlib.suppress(AttributeError):
        tokenizer._radixserve_text_vocab = keep
    return keep


def random_text(n_tokens: int, tokenizer, rng: np.random.Generator) -> str:  # noqa: ANN001
    """Text of about ``n_tokens`` random word tokens."""
    vocab = _text_vocab(tokenizer)
    return tokenizer.decode(rng.choice(vocab, size=n_tokens).tolist())


def random_text_prompts(num: int, input_len: int, output_len: int, range_ratio: float,
                        tokenizer, seed: int = 0) -> list[BenchPrompt]:  # noqa: ANN001
    """Like ``random_prompts`` but as text (for HTTP servers): random word tokens decoded to
    text; ``token_ids`` is the text re-encoded, so its length is the real prompt length."""
    rng = np.random.default_rng(seed)
    lo_in = max(1, int(input_len * (1 - range_ratio)))
    lo_out = max(1, int(output_len * (1 - range_ratio)))
    out = []
    for _ in range(num):
        n_in = int(rng.integers(lo_in, input_len + 1))
        n_out = int(rng.integers(lo_out, output_len + 1))
        text = random_text(n_in, tokenizer, rng)
        out.append(BenchPrompt(tokenizer.encode(text, add_special_tokens=False), n_out, text))
    return out


def shared_prefix_prompts(num_groups: int, prompts_per_group: int, system_len: int,
                          question_len: int, output_len: int, tokenizer,  # noqa: ANN001
                          seed: int = 0) -> list[BenchPrompt]:
    """SGLang's "generated shared prefix" set: ``num_groups`` system prompts of
    ``system_len`` tokens, each followed by ``prompts_per_group`` unique questions of
    ``question_len`` tokens; shuffled. A radix cache should serve every group's system prompt
    from cache after its first request."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_groups):
        system = random_text(system_len, tokenizer, rng)
        for _ in range(prompts_per_group):
            q = random_text(question_len, tokenizer, rng)
            ids = tokenizer.encode(system + q, add_special_tokens=False)
            out.append(BenchPrompt(ids, output_len, q, system))
    order = rng.permutation(len(out))
    return [out[int(i)] for i in order]
