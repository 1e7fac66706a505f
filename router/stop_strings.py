"""Stop strings on streamed text: cut at the first match; never emit text a match may still need."""

from __future__ import annotations


class StopStringMatcher:
    """Feed text pieces; get back what is safe to emit and whether a stop string was hit.

    The longest tail of the text that begins some stop string is held back, because the next
    piece may complete the match; everything before it is released at once. The first match is the
    one that completes first (as generation meets it; among those ending at the same character,
    the one that begins first), so the result does not depend on how the text is split: a longer
    stop string that began earlier but is not complete yet does not hold the stream. Once a stop
    string is found, the text before it is released, the stop string itself is dropped and
    `stopped` stays True.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        self._pending += text
        # (end, start) of each stop's first occurrence: a string's earliest end is at its earliest start
        hits = [(i + len(s), i) for i, s in ((self._pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[:min(hits)[1]], ""
            return out
        cut = len(self._pending) - self._open_match_length()
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _open_match_length(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """End of text: release what was held back (it cannot begin a match any more)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
