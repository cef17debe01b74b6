"""Stop-string matching on streamed text (used by ``IncrementalDetokenizer``)."""

from __future__ import annotations


class StopChecker:
    """Finds stop strings in text that arrives piece by piece and decides what may be released.

    Text that could still become the start of a stop string (the longest suffix that is a proper
    prefix of one) is held back, so a stop string split across pieces is never partly released.
    With ``include_stop_str_in_output`` nothing needs holding back: a partial stop string is part
    of the output either way. Work per piece is O(piece + longest stop string), not O(text).

    Attributes:
        stopped: a stop string matched (no more text is released after that).
        stop_str: the matched stop string, else None.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self._ctx_len = max((len(s) for s in self.stop), default=1) - 1
        self._chunks: list[str] = []  # released text, joined lazily by ``released``
        # The last ``_ctx_len`` released chars followed by the held-back text; ``_held`` is the
        # length of the held-back part.
        self._tail = ""
        self._held = 0
        self.stopped = False
        self.stop_str: str | None = None

    @property
    def released(self) -> str:
        """All text released so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def feed(self, new_text: str, final: bool = False) -> str:
        """Add decoded text; return the part that may be released now.

        Args:
            new_text: the next piece of decoded text.
            final: the stream ends here; release everything that did not hit a stop string.
        """
        if self.stopped:
            return ""
        if not self.stop:
            if new_text:
                self._chunks.append(new_text)
            return new_text
        window = self._tail + new_text
        start = len(window) - self._held - len(new_text)  # window[:start] is already released
        match = self._find(window, max(0, len(self._tail) - self._ctx_len))
        if match is not None:
            idx, s = match
            self.stopped, self.stop_str = True, s
            end = idx + len(s) if self.include else idx
            return self._release(window[start:end])
        hold = 0 if final or self.include else self._held_suffix_len(window, len(window) - start)
        delta = self._release(window[start : len(window) - hold])
        released_end = len(window) - hold
        ctx_start = max(0, released_end - self._ctx_len)
        self._tail = window[ctx_start:released_end] + window[released_end:]
        self._held = hold
        return delta

    def _release(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    def _find(self, window: str, start: int) -> tuple[int, str] | None:
        """The match at or after ``start`` that ends first (ties: the longer one).

        Ending first is what generating token by token would hit first, so the result does not
        depend on how the text was split into pieces.
        """
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = window.find(s, start)
            if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        return best

    def _held_suffix_len(self, window: str, unreleased: int) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of a stop string."""
        for k in range(min(self._ctx_len, unreleased), 0, -1):
            tail = window[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stop):
                return k
        return 0
