"""Incremental detokenization with stop strings (runs in the frontend, one object per request).

Each step decodes only a small window of token ids (vLLM's ``prefix_offset`` / ``read_offset``
scheme), so the cost per token is O(window), not O(output length):

* ``ids[prefix_offset:read_offset]`` is text already released; it is decoded again only as context
  (so decoders that treat the first token specially, e.g. SentencePiece's leading space, give the
  same result as decoding the whole sequence),
* ``ids[read_offset:]`` is new; the delta is ``decode(ids[prefix_offset:])`` minus the context
  text, released only when it does not end in U+FFFD (an incomplete multi-byte character); at
  ``finish`` such an incomplete tail is dropped, never sent as U+FFFD (as in vLLM).

Stop strings are matched on the released text; the longest suffix that could still grow into a
stop string is held back, so a stop string split across tokens is never partly sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.frontend.stop import StopChecker

#: Prompt tokens used as decoding context for the first output token (as in vLLM).
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas, applying stop strings.

    Args:
        tokenizer: a transformers tokenizer; fast tokenizers are decoded through their Rust
            ``backend_tokenizer`` (no ``clean_up_tokenization_spaces``, like vLLM).
        prompt_token_ids: the prompt (a list or an int array); its last few ids give the
            decoder context.
        skip_special_tokens: drop special tokens from the text.
        stop: strings that end the output; the text is cut at the earliest match.
        include_stop_str_in_output: keep the matched stop string in the text.

    Attributes:
        text: all output text released so far (the concatenation of every delta returned).
        token_ids: all output token ids added so far (ids added after a stop match are ignored).
        stopped: a stop string matched; later ``add`` / ``finish`` calls return "".
        stop_str: the stop string that matched, else None.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode_fn = lambda ids: backend.decode(
                ids, skip_special_tokens=skip_special_tokens
            )
        else:
            self._decode_fn = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        self.token_ids: list[int] = []
        self._stop = StopChecker(stop or [], include_stop_str_in_output)

        # slice before converting: the prompt may be a long list or an int32 array
        context = [int(t) for t in prompt_token_ids[-INITIAL_CONTEXT_TOKENS:]]
        context_text = self._decode_fn(context) if context else ""
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character: decode the output on its own instead.
            context, context_text = [], ""
        # Window ids: context + output; offsets index into this list.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = context_text

    # -- public API ------------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """All output text released so far."""
        return self._stop.released

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._stop.stopped

    @property
    def stop_str(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop.stop_str

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append output tokens; return the new text that may be sent now (may be "")."""
        if self._stop.stopped:
            return ""
        new = [int(t) for t in new_token_ids]
        if not new:
            return ""
        self.token_ids.extend(new)
        self._ids.extend(new)
        return self._stop.feed(self._decode_new(final=False), final=False)

    def add_token(self, token_id: int) -> str:
        """``add([token_id])`` for one int: the per-step hot case, without the list."""
        if self._stop.stopped:
            return ""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        return self._stop.feed(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """Release all held-back text (the request ended for another reason than a stop string).

        Trailing incomplete characters (an output cut by ``max_tokens`` in the middle of a
        multi-byte character) are dropped, never sent as U+FFFD, as vLLM's incremental
        detokenizer does: ``text`` ends as ``decode(token_ids).rstrip("\ufffd")``. Returns ""
        after a stop string matched.
        """
        if self._stop.stopped:
            return ""
        return self._stop.feed(self._decode_new(final=True), final=True)

    # -- internals -------------------------------------------------------------------------------

    def _decode_new(self, final: bool) -> str:
        """Text of ``ids[read_offset:]`` that is complete now (all of it when ``final``)."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode_fn(self._ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        full_text = self._decode_fn(self._ids[self._prefix_offset :])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or an incomplete character at the end: wait
        delta = full_text[len(prefix_text) :]
        if final:
            # Incomplete trailing bytes decode to U+FFFD; they can never complete now. (A real
            # U+FFFD at the very end is dropped too: the decoded text cannot tell them apart,
            # and vLLM drops it the same way.) The text released before never ends in U+FFFD,
            # so stripping this delta strips the whole output's tail.
            delta = delta.rstrip(_REPLACEMENT)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None  # decoded lazily for the next window
        return delta
