"""IncrementalDetokenizer and StopChecker: exact text, no broken characters, stop strings."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.frontend.detokenizer import IncrementalDetokenizer
from radixserve.frontend.stop import StopChecker

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FFFD = "\ufffd"


PROMPT = "The quick brown fox says:"


def stream(tok, ids, chunks=None, prompt=PROMPT, **kw):
    """Feed ``ids`` in chunks; return (deltas, final delta, detokenizer)."""
    d = IncrementalDetokenizer(tok, tok.encode(prompt), **kw)
    deltas, i = [], 0
    for n in chunks or [1] * len(ids):
        deltas.append(d.add(ids[i : i + n]))
        i += n
    if i < len(ids):
        deltas.append(d.add(ids[i:]))
    return deltas, d.finish(), d


# -- exact concatenation ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_concatenation_equals_decode_random_ids(tok, data, skip):
    vocab = len(tok)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40), label="chunks")
    prompt = data.draw(st.sampled_from(["", PROMPT, "<|im_start|>assistant\n"]), label="prompt")
    deltas, last, d = stream(tok, ids, chunks, prompt=prompt, skip_special_tokens=skip)
    # the whole decode, less the incomplete character a cut output may end with (dropped at
    # finish, never sent as U+FFFD, as vLLM)
    expected = tok.decode(ids, skip_special_tokens=skip).rstrip(FFFD)
    assert "".join(deltas) + last == expected
    assert d.text == expected
    assert d.token_ids == ids
    assert not d.stopped


ALPHABET = list("ab .\n世界你好😀🎉👍🏽é")


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=30))
def test_multibyte_characters_never_broken_mid_stream(tok, text):
    ids = tok.encode(text)
    deltas, last, d = stream(tok, ids)
    assert all(FFFD not in delta for delta in deltas)
    assert "".join(deltas) + last == tok.decode(ids) == d.text


def test_emoji_split_across_tokens_is_held_back(tok):
    ids = tok.encode("Hi 😀")
    assert len(ids) >= 3  # the emoji's bytes span two tokens
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    out = [d.add([t]) for t in ids]
    assert out[-2] == ""  # after the first half of the emoji nothing is released
    assert "".join(out) == "Hi 😀"
    assert d.finish() == ""


def test_incomplete_character_at_end_is_dropped_by_finish(tok):
    ids = tok.encode(" 😀")[:-1]  # half an emoji
    assert tok.decode(ids) == " " + FFFD
    deltas, last, d = stream(tok, ids)
    assert "".join(deltas) == ""
    assert last == " " and d.text == " "  # the space is kept, the half emoji dropped


@pytest.mark.parametrize("text", [" Hi 😀", " 你好", " 🎉👍🏽 ok", "中文 and 😀😃"])
def test_output_cut_mid_character_never_ends_in_replacement(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    for cut in range(1, len(ids) + 1):  # every max_tokens
        deltas, last, d = stream(tok, ids[:cut])
        assert FFFD not in "".join(deltas) + last
        assert "".join(deltas) + last == d.text == tok.decode(ids[:cut]).rstrip(FFFD)
        assert text.startswith(d.text)


def test_window_stays_small(tok):
    """Each step decodes a few ids, not the whole output."""
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    sizes = []
    inner = d._decode_fn
    d._decode_fn = lambda ids: (sizes.append(len(ids)), inner(ids))[1]
    ids = tok.encode("Hello world, this is a long text 世界 😀. " * 60)
    for t in ids:
        d.add([t])
    assert d.text + d.finish() == tok.decode(ids)
    assert len(ids) > 500 and max(sizes) <= 12


# -- special tokens --------------------------------------------------------------------------------


def test_skip_special_tokens(tok):
    ids = tok.encode("Hello") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" there")
    deltas, last, _ = stream(tok, ids, skip_special_tokens=True)
    assert "".join(deltas) + last == "Hello there"
    deltas, last, _ = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + last == "Hello<|im_end|> there"


# -- stop strings ----------------------------------------------------------------------------------


def pieces_to_ids(tok, pieces):
    ids, bounds = [], []
    for p in pieces:
        ids += tok.encode(p)
        bounds.append(len(ids))
    return ids, bounds


def test_stop_string_across_two_tokens_is_trimmed_and_never_sent(tok):
    ids, _ = pieces_to_ids(tok, ["Hello", " wor", "ld", " and more"])
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["world"])
    sent = ""
    for t in ids:
        sent += d.add([t])
        assert "wor" not in sent
        if d.stopped:
            break
    assert d.stopped and d.stop_str == "world"
    assert sent == d.text == "Hello "
    assert d.add(tok.encode(" tail")) == "" and d.finish() == ""


def test_include_stop_str_in_output(tok):
    ids, _ = pieces_to_ids(tok, ["Hello", " wor", "ld", " and more"])
    deltas, last, d = stream(tok, ids, stop=["world"], include_stop_str_in_output=True)
    assert d.stopped and "".join(deltas) + last == d.text == "Hello world"


def test_held_back_prefix_released_when_no_match(tok):
    ids, _ = pieces_to_ids(tok, ["Hello", " wor", "m"])
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["world"])
    out = [d.add([t]) for t in ids]
    assert "".join(out) == "Hello worm" and not d.stopped
    deltas, last, d = stream(tok, tok.encode("Hello wor"), stop=["world"])
    assert "".join(deltas) == "Hello " and last == "wor" and not d.stopped


def test_first_ending_stop_string_wins(tok):
    ids = tok.encode("one two three four")
    deltas, last, d = stream(tok, ids, chunks=[len(ids)], stop=["four", "two"])
    assert d.stop_str == "two" and "".join(deltas) + last == "one "


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abc", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_checker_matches_reference(pieces, stops, include):
    full = "".join(pieces)
    checker = StopChecker(stops, include)
    sent = []
    for p in pieces:
        sent.append(checker.feed(p))
        # Nothing released so far may ever be cut off later.
        assert "".join(sent) == checker.released
    sent.append(checker.feed("", final=True))
    # The match that ends first wins (ties: the longer one), however the text was split.
    hits = [(full.find(s) + len(s), full.find(s), i, s) for i, s in enumerate(stops) if s in full]
    if hits:
        _, idx, _, s = min(hits)
        expected = full[: idx + len(s)] if include else full[:idx]
        assert checker.stopped and checker.stop_str == s
    else:
        expected = full
        assert not checker.stopped
    assert "".join(sent) == checker.released == expected


def test_add_token_equals_add_of_one(tok):
    ids = tok.encode(" Here are emojis 😀😃 and 中文 text.", add_special_tokens=False)
    a = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["中文"])
    b = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["中文"])
    assert [a.add([t]) for t in ids] == [b.add_token(t) for t in ids]
    assert a.token_ids == b.token_ids and a.text == b.text and b.stopped
