"""Stop strings on streamed text: never emit a stop string, even one split across tokens.

Text arrives in pieces ("Hel", "lo\\nUs", "er:"). With stop "\\nUser:", the piece "lo\\nUs" can
only release "lo": "\\nUs" might be the start of the stop string, so it is held back until the
next piece decides. The held suffix is the longest one that is a proper prefix of some stop
string; any stop string that completes later must start inside it, so nothing emitted ever
needs taking back.

When several stop strings complete, the one that ends first wins (that is where generation
would have stopped), then the one that starts first; the result does not depend on how the
text was split into pieces.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    def __init__(self, stop: Iterable[str]):
        self.stop = tuple(s for s in stop if s)  # an empty stop string would match everywhere
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit).

        After a hit, the text before the stop string is emitted and everything later dropped.
        """
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, self.matched = match
            self.stopped = True
            self._held = ""
            return buffer[:start], True
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """The request ended for another reason (EOS, length): release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def finish(self, last_text: str = "") -> tuple[str, bool]:
        """push() the request's last text (e.g. the detokenizer's flush) and, unless it holds a
        stop string, release everything held: the request's final (text, stopped)."""
        text, stopped = self.push(last_text)
        return (text, True) if stopped else (text + self.flush(), False)

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first, then starts first."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            start = buffer.find(stop)  # a string's leftmost occurrence is also its earliest end
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[1], best[2])

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
