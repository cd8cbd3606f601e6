"""Stop strings over streamed text: what may be shown now, and where a reply ends."""

from __future__ import annotations


class StopMatcher:
    """Holds back text that could still become a stop string; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        cut = min((i for s in self.stops if (i := self.pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = max(
            (k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])),
            default=0,
        )
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
