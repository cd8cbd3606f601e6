"""Stop strings over streamed text: what may be shown now, and where a reply ends.

Each stop string is matched by its KMP automaton, one character at a time, so a reply
costs time linear in its length whatever the stop strings are (a held-back suffix is
never searched again). Text that could still become a stop string is held back: as many
characters as the longest stop-string prefix the text now ends with.
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper border of s[: i + 1]."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    """Holds back text that could still become a stop string; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)  # characters of each stop matched at the text's end
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        base = len(self.pending) - len(text)  # where ``text`` starts in pending
        cut = -1
        for j, ch in enumerate(text):
            for i, s in enumerate(self.stops):
                k, f = self._state[i], self._fail[i]
                while k and ch != s[k]:
                    k = f[k - 1]
                if ch == s[k]:
                    k += 1
                if k == len(s):
                    start = base + j + 1 - len(s)
                    if cut < 0 or start < cut:
                        cut, self.matched = start, s
                    k = f[k - 1]
                self._state[i] = k
            if cut >= 0:
                # The earliest match ends the reply; a longer stop that began before it
                # but ends later is not waited for (as the stream would have shown it).
                self.stopped = True
                out, self.pending = self.pending[:cut], ""
                return out
        keep = max(self._state)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
