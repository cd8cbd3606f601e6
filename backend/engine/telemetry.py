"""What the link and the compute unit did, when: intervals, counters, metrics, traces.

Each lane is serial (one fetcher thread, one engine thread), so intervals within a lane
never overlap; "both busy" is the intersection of the two lanes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

Interval = tuple[float, float]

# Intervals of a lane closer than this are drawn as one (sub-millisecond gaps are
# invisible at panel scale, and merging keeps live snapshots small).
MERGE_GAP_S = 5e-4


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Total time both lanes are busy (each list sorted, non-overlapping)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def coalesce(intervals: list[Interval], gap: float) -> list[Interval]:
    """Merge intervals separated by less than ``gap`` (fewer shapes for live views)."""
    out: list[Interval] = []
    for s, e in intervals:
        if out and s - out[-1][1] < gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def clip(intervals: list[Interval], start: float, end: float) -> list[Interval]:
    return [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]


@dataclass
class LinkEvent:
    start: float
    end: float
    key: tuple[int, int]
    nbytes: int
    prefetch: bool


@dataclass
class ComputeEvent:
    start: float
    end: float
    layer: int
    requests: tuple[str, ...]
    tokens: int


class Telemetry:
    """Thread-safe; bounded (the newest ``capacity`` events of each kind are kept)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self._lock = threading.Lock()
        self.link: deque[LinkEvent] = deque(maxlen=capacity)
        self.compute: deque[ComputeEvent] = deque(maxlen=capacity)
        self.tokens: deque[tuple[float, str]] = deque(maxlen=capacity)
        # Each lane as ``coalesce(lane, MERGE_GAP_S)`` would give it, kept as events come
        # ([start, end] lists): a live view reads a few merged intervals instead of
        # merging thousands of jobs on every snapshot.
        self._merged: dict[str, deque[list[float]]] = {
            "link": deque(maxlen=capacity),
            "compute": deque(maxlen=capacity),
        }
        self.t0 = time.perf_counter()
        self.link_busy_s = 0.0
        self.compute_busy_s = 0.0
        self.fetched = 0
        self.n_tokens = 0

    def record_link(
        self, start: float, end: float, key: tuple[int, int], nbytes: int, prefetch: bool = False
    ) -> None:
        with self._lock:
            self.link.append(LinkEvent(start, end, key, nbytes, prefetch))
            self._merge("link", start, end)
            self.link_busy_s += end - start
            self.fetched += 1

    def record_compute(
        self, start: float, end: float, layer: int, requests: tuple[str, ...], tokens: int
    ) -> None:
        with self._lock:
            self.compute.append(ComputeEvent(start, end, layer, requests, tokens))
            self._merge("compute", start, end)
            self.compute_busy_s += end - start

    def record_token(self, request_id: str) -> None:
        with self._lock:
            self.tokens.append((time.perf_counter(), request_id))
            self.n_tokens += 1

    def _merge(self, lane: str, start: float, end: float) -> None:
        merged = self._merged[lane]
        if merged and start - merged[-1][1] < MERGE_GAP_S:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])

    def merged_lanes(self, start: float, end: float) -> tuple[list[Interval], list[Interval]]:
        """Both lanes over [start, end], intervals closer than ``MERGE_GAP_S`` merged:
        what ``coalesce`` gives for ``lanes`` (to within that gap at ``start``), at the
        cost of the few merged intervals."""
        with self._lock:
            link = self._recent_merged(self._merged["link"], start, end)
            comp = self._recent_merged(self._merged["compute"], start, end)
        return clip(link, start, end), clip(comp, start, end)

    @staticmethod
    def _recent_merged(merged: deque, start: float, end: float) -> list[Interval]:
        out = []
        for s, e in reversed(merged):
            if e <= start:
                break
            if s < end:
                out.append((s, e))
        out.reverse()
        return out

    @staticmethod
    def _recent(events: deque, start: float, end: float) -> list[Interval]:
        """Intervals of a lane overlapping [start, end], oldest first. Walks back from the
        newest event only as far as ``start``: live snapshots cost the window, not the log."""
        out = []
        for e in reversed(events):
            if e.end <= start:
                break
            if e.start < end:
                out.append((e.start, e.end))
        out.reverse()
        return out

    def lanes(self, start: float, end: float) -> tuple[list[Interval], list[Interval]]:
        with self._lock:
            link = self._recent(self.link, start, end)
            comp = self._recent(self.compute, start, end)
        return clip(link, start, end), clip(comp, start, end)

    def window(self, start: float, end: float) -> dict[str, float]:
        """Busy fractions over [start, end]."""
        wall = max(end - start, 1e-9)
        link, comp = self.lanes(start, end)
        link_s, comp_s = sum(e - s for s, e in link), sum(e - s for s, e in comp)
        with self._lock:
            n_tokens = 0
            for t, _ in reversed(self.tokens):
                if t < start:
                    break
                n_tokens += t <= end
        return {
            "wall_s": wall,
            "link_busy_s": link_s,
            "compute_busy_s": comp_s,
            "both_busy_s": overlap(link, comp),
            "both_busy_frac": overlap(link, comp) / wall,
            "compute_busy_frac": comp_s / wall,
            "link_busy_frac": link_s / wall,
            "compute_wait_frac": max(0.0, 1.0 - comp_s / wall),
            "tokens_per_s": n_tokens / wall,
        }

    def write_chrome_trace(self, path: str | Path) -> Path:
        """Chrome/Perfetto trace JSON: one lane for the link, one for compute."""
        with self._lock:
            link, comp = list(self.link), list(self.compute)
        us = lambda t: (t - self.t0) * 1e6  # noqa: E731
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "bevy engine"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "link"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "compute"}},
        ]
        for e in link:
            name = f"{'prefetch' if e.prefetch else 'fetch'} L{e.key[0]}E{e.key[1]}"
            events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": 1,
                    "tid": 1,
                    "ts": us(e.start),
                    "dur": us(e.end) - us(e.start),
                    "args": {"bytes": e.nbytes},
                }
            )
        for e in comp:
            events.append(
                {
                    "name": f"layer {e.layer} x{len(e.requests)}",
                    "ph": "X",
                    "pid": 1,
                    "tid": 2,
                    "ts": us(e.start),
                    "dur": us(e.end) - us(e.start),
                    "args": {"requests": list(e.requests), "tokens": e.tokens},
                }
            )
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path
