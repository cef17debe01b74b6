"""Prompt sets for benchmarks: random token prompts, ShareGPT-format files, shared-prefix
groups, a copy-heavy set and a plain chat set."""

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


#: Plain prose sentences: the passages the copy set asks to repeat, and the chat set's context.
SENTENCES = (
    "The river rises in the hills north of the town and runs south past the old mill.",
    "Every spring the meadows along its banks flood for a week or two.",
    "The stone bridge was built in 1832 and widened once, after the war.",
    "Most of the houses on the east bank belong to families who worked at the mill.",
    "A narrow road climbs from the square to the church on the ridge.",
    "On market days the square fills with stalls selling cheese, bread and honey.",
    "The school has two classrooms, a small library and a garden the children keep.",
    "In winter the road over the pass is closed and the bus goes round by the valley.",
    "The railway reached the town late, and the station still has its first clock.",
    "Visitors come for the walks, the lake and the view from the tower.",
    "The council meets on the first Monday of each month in the hall by the bridge.",
    "A new footpath now follows the river all the way to the next village.",
    "The bakery opens at six and is usually sold out of rye bread by noon.",
    "Fishing is allowed from the north bank between April and September.",
    "The museum keeps the mill's ledgers, its tools and a model of the water wheel.",
    "Heavy rain in the autumn of 1954 carried away part of the old weir.",
    "The doctor visits on Tuesdays and Fridays and the pharmacy closes at five.",
    "Two farms on the hill still keep sheep, and their wool is sold at the fair.",
    "The lake freezes in most years, and skating is allowed once the ice is measured.",
    "A plaque on the church wall lists the names of the bell ringers since 1700.",
    "The post office moved into the grocery when the old building was sold.",
    "Beech and oak woods cover the slopes above the reservoir.",
    "The summer festival ends with a concert on the bridge and a boat race.",
    "Most mornings a mist lies on the water until the sun clears the ridge.",
)

#: Words a copy prompt's passage may have, each with the word to put in its place.
_SWAPS = (("river", "stream"), ("town", "village"), ("bridge", "crossing"),
          ("road", "lane"), ("square", "plaza"), ("lake", "pond"), ("old", "ancient"),
          ("church", "chapel"), ("hill", "slope"), ("winter", "the cold season"))

_CHAT_QUESTIONS = (
    "What are the main causes of {topic}, and how could they be reduced?",
    "Explain {topic} to someone who has never heard of it.",
    "Write a short story about {topic} with a surprising ending.",
    "Give me three arguments for and three against {topic}.",
    "How would you plan a weekend project about {topic} for a group of students?",
    "What questions should I ask an expert on {topic}?",
    "Summarise what historians disagree about when they discuss {topic}.",
    "Suggest a name and a slogan for a small business built around {topic}.",
)
_CHAT_TOPICS = ("river flooding", "small-town markets", "rural railways", "beekeeping",
                "stone bridges", "village schools", "mountain passes in winter",
                "local museums", "water mills", "community festivals", "lake ice safety",
                "sheep farming")


def _fit_words(head: str, words: list[str], tail: str, max_tokens: int,
               tokenizer) -> tuple[str, list[int], int]:  # noqa: ANN001
    """``head + " ".join(words[:n]) + tail`` with the largest ``n`` whose encoding has at most
    ``max_tokens`` tokens (binary search: a text's token count grows with its word count);
    returns the text, its token ids and ``n``."""

    def build(n: int) -> tuple[str, list[int]]:
        text = head + " ".join(words[:n]) + tail
        return text, tokenizer.encode(text, add_special_tokens=False)

    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)[1]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    text, ids = build(lo)
    return text, ids, lo


def _passage_words(rng: np.random.Generator, n_words: int) -> list[str]:
    """At least ``n_words`` words of ``SENTENCES`` in a random order (repeating them once all
    were used)."""
    words: list[str] = []
    while len(words) < n_words:
        for i in rng.permutation(len(SENTENCES)).tolist():
            words += SENTENCES[i].split()
            if len(words) >= n_words:
                break
    return words


def copy_prompts(num: int, input_len: int, output_len: int | None, tokenizer,  # noqa: ANN001
                 seed: int = 0) -> list[BenchPrompt]:
    """A copy-heavy set (what n-gram speculation is for): each prompt asks to repeat a prose
    passage exactly, changing only one word (every "river" to "stream", say), so the answer
    is the passage again with a few words changed.

    Args:
        num: prompts.
        input_len: most prompt tokens (the instruction and the passage, as the user message
            encodes without special tokens); the passage is cut at a word boundary, so a
            prompt has between ``input_len`` minus one word's tokens and ``input_len``.
        output_len: tokens to generate; None: the passage's token count plus 8 (the copy,
            with room for the changed words).
        tokenizer: the served model's tokenizer.
        seed: the same seed gives the same prompts.

    Raises:
        ValueError: ``input_len`` leaves no room for a passage after the instruction.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        words = _passage_words(rng, input_len)
        text, ids, n = "", [], 0
        # the first swap (in a random order) whose word the fitted passage has: the change
        # must have something to change (the last one tried stands if none has)
        for s in rng.permutation(len(_SWAPS)).tolist():
            old, new = _SWAPS[s]
            head = (f'Repeat the following passage exactly, changing only every "{old}" to '
                    f'"{new}". Write nothing else.\n\n')
            text, ids, n = _fit_words(head, words, "", input_len, tokenizer)
            if old in (w.strip(".,") for w in words[:n]):
                break
        if n == 0:
            raise ValueError(f"input_len {input_len} leaves no room for a passage after the "
                             f"copy instruction ({len(ids)} tokens)")
        passage = len(tokenizer.encode(" ".join(words[:n]), add_special_tokens=False))
        out.append(BenchPrompt(ids, output_len or passage + 8, text))
    return out


def chat_prompts(num: int, input_len: int, output_len: int, tokenizer,  # noqa: ANN001
                 seed: int = 0) -> list[BenchPrompt]:
    """A plain chat set (answers that copy little of their prompt): a question on a topic,
    after background sentences that fill the prompt up to ``input_len`` tokens.

    Args:
        num: prompts.
        input_len: most prompt tokens (the user message encoded without special tokens); the
            background is cut at a word boundary, so a prompt has between ``input_len`` minus
            one word's tokens and ``input_len``, or just the question when that alone is
            longer.
        output_len: tokens to generate.
        tokenizer: the served model's tokenizer.
        seed: the same seed gives the same prompts.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        q = _CHAT_QUESTIONS[int(rng.integers(len(_CHAT_QUESTIONS)))]
        question = q.format(topic=_CHAT_TOPICS[int(rng.integers(len(_CHAT_TOPICS)))])
        words = _passage_words(rng, input_len)
        text, ids, n = _fit_words("Some background: ", words, "\n\n" + question, input_len,
                                  tokenizer)
        if n == 0:
            text = question
            ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(BenchPrompt(ids, output_len, text))
    return out


def as_chat(prompts: list[BenchPrompt], tokenizer) -> list[BenchPrompt]:  # noqa: ANN001
    """The same prompts with ``token_ids`` the chat template applied to their text as one user
    message (with the generation prompt), for engines fed token ids (``bench offline``);
    unchanged when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return prompts
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text or ""}],
                                            tokenize=True, add_generation_prompt=True)
        if not isinstance(ids, list):  # some transformers versions return an encoding
            ids = list(ids["input_ids"])
        out.append(BenchPrompt(list(ids), p.output_len, p.text))
    return out
