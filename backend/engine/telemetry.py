"""What the link and the compute unit did, when: intervals, counters, metrics, traces.

Each lane is serial (one fetcher thread, one engine thread), so intervals within a lane
never overlap; "both busy" is the intersection of the two lanes.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Interval = tuple[float, float]

# Intervals of a lane closer than this are drawn as one (sub-millisecond gaps are
# invisible at panel scale, and merging keeps live snapshots small).
MERGE_GAP_S = 5e-4


def overlap(a: list[Interval] | np.ndarray, b: list[Interval] | np.ndarray) -> float:
    """Total time both lanes are busy: each lane's busy time less that of their union
    (each lane's intervals sorted and disjoint; ``(start, end)`` pairs or an ``(n, 2)``
    array). In NumPy: a live snapshot reads thousands of intervals on the engine's thread."""
    a, b = np.asarray(a, dtype=float).reshape(-1, 2), np.asarray(b, dtype=float).reshape(-1, 2)
    both = np.concatenate((a, b))
    if not len(both):
        return 0.0
    both = both[np.argsort(both[:, 0], kind="stable")]
    # each interval adds to the union what reaches past every interval begun before it
    reach = np.maximum.accumulate(both[:, 1])
    before = np.concatenate(([-np.inf], reach[:-1]))
    union = np.clip(both[:, 1] - np.maximum(both[:, 0], before), 0.0, None).sum()
    busy = (a[:, 1] - a[:, 0]).sum() + (b[:, 1] - b[:, 0]).sum()
    return max(0.0, float(busy - union))


def coalesce(intervals: list[Interval], gap: float) -> list[Interval]:
    """Merge intervals separated by less than ``gap`` (fewer shapes for live views)."""
    out: list[Interval] = []
    for s, e in intervals:
        if out and s - out[-1][1] < gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


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


class Lane:
    """One serial lane's newest ``capacity`` events, oldest first, in typed columns (a
    ring): a start and an end, then the columns named in ``columns``. About 40 bytes an
    event where a Python object each cost about 450 (measured: ``docs/performance.md``);
    an engine records some 60 events a token, and a long session fills the ring.

    Events come in time order (one thread records each lane), so their ends ascend and a
    window is found by bisection. Iterating builds ``make(start, end, *columns)`` per
    event: for traces and tests, not for live views."""

    def __init__(self, capacity: int, columns: dict[str, object], make=None) -> None:
        if capacity < 1:
            raise ValueError(f"a lane holds at least one event, not {capacity}")
        self.capacity = capacity
        self.n = 0  # events ever appended
        self.start = np.zeros(capacity)
        self.end = np.zeros(capacity)
        self.columns = {name: np.empty(capacity, dtype) for name, dtype in columns.items()}
        self._make = make

    def __len__(self) -> int:
        return min(self.n, self.capacity)

    def append(self, start: float, end: float, *values) -> None:
        i = self.n % self.capacity
        self.start[i], self.end[i] = start, end
        for col, v in zip(self.columns.values(), values, strict=True):
            col[i] = v
        self.n += 1

    def extend_last(self, end: float) -> None:
        """Stretch the newest event to ``end`` (if later)."""
        i = (self.n - 1) % self.capacity
        self.end[i] = max(self.end[i], end)

    def last_end(self) -> float | None:
        return None if self.n == 0 else float(self.end[(self.n - 1) % self.capacity])

    def _segments(self, first: int = 0) -> list[slice]:
        """Physical slices holding the events from logical index ``first`` on, in order."""
        size, cap = len(self), self.capacity
        head = (self.n - size) % cap  # physical index of the oldest event
        lo, hi = head + first, head + size
        if hi <= cap:
            return [slice(lo, hi)]
        if lo >= cap:
            return [slice(lo - cap, hi - cap)]
        return [slice(lo, cap), slice(0, hi - cap)]

    def first_ending_after(self, t: float) -> int:
        """Logical index of the oldest event that ends after ``t`` (``len`` if none)."""
        k = 0
        for seg in self._segments():
            ends = self.end[seg]
            i = int(np.searchsorted(ends, t, side="right"))
            k += i
            if i < len(ends):
                break
        return k

    def count(self, lo: float, hi: float) -> int:
        """Events that end in [lo, hi]."""
        n = 0
        for seg in self._segments():
            ends = self.end[seg]
            n += int(np.searchsorted(ends, hi, "right") - np.searchsorted(ends, lo, "left"))
        return n

    def window(self, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the events overlapping [start, end], oldest first."""
        segs = self._segments(self.first_ending_after(start))
        s = np.concatenate([self.start[g] for g in segs]) if segs else np.zeros(0)
        e = np.concatenate([self.end[g] for g in segs]) if segs else np.zeros(0)
        keep = s < end
        return s[keep], e[keep]

    def copy(self) -> Lane:
        """The events as they are now, in a lane of their own (what a reader may then
        iterate outside the recording threads' lock)."""
        out = Lane(max(len(self), 1), {}, self._make)
        segs = self._segments()
        out.start = np.concatenate([self.start[g] for g in segs])
        out.end = np.concatenate([self.end[g] for g in segs])
        out.columns = {k: np.concatenate([c[g] for g in segs]) for k, c in self.columns.items()}
        out.n = len(self)
        return out

    def __iter__(self):
        for seg in self._segments():
            cols = [c[seg].tolist() for c in self.columns.values()]
            for row in zip(self.start[seg].tolist(), self.end[seg].tolist(), *cols, strict=True):
                yield self._make(*row) if self._make else row


def _clip(lane: tuple[np.ndarray, np.ndarray], start: float, end: float) -> np.ndarray:
    """A window's intervals (``Lane.window``) clipped to [start, end], as an (n, 2) array."""
    s, e = lane
    return np.column_stack((np.maximum(s, start), np.minimum(e, end)))


def _clipped(
    lane: tuple[np.ndarray, np.ndarray], start: float, end: float, origin: float = 0.0
) -> list[Interval]:
    """``_clip``'s intervals as pairs, less ``origin``."""
    c = _clip(lane, start, end) - origin
    return list(zip(c[:, 0].tolist(), c[:, 1].tolist(), strict=True))


class Telemetry:
    """Thread-safe; bounded (the newest ``capacity`` events of each kind are kept)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self._lock = threading.Lock()
        self.link = Lane(
            capacity,
            {"layer": np.int32, "expert": np.int32, "nbytes": np.int64, "prefetch": np.bool_},
            lambda s, e, layer, expert, nbytes, pf: LinkEvent(s, e, (layer, expert), nbytes, pf),
        )
        self.compute = Lane(
            capacity,
            {"layer": np.int32, "requests": object, "tokens": np.int32},
            ComputeEvent,
        )
        # a token's time is its event's start and end; then the request's id
        self.tokens = Lane(capacity, {"request": object}, lambda t, _, rid: (t, rid))
        # The same group of requests computes layer after layer: one tuple for all its
        # events (``_requests``), not one per event.
        self._groups: dict[tuple[str, ...], tuple[str, ...]] = {}
        # Each lane as ``coalesce(lane, MERGE_GAP_S)`` would give it, kept as events come:
        # a live view reads a few merged intervals instead of merging thousands of jobs on
        # every snapshot.
        self._merged = {"link": Lane(capacity, {}), "compute": Lane(capacity, {})}
        self.t0 = time.perf_counter()
        self.link_busy_s = 0.0
        self.compute_busy_s = 0.0
        self.fetched = 0
        self.n_tokens = 0

    def record_link(
        self, start: float, end: float, key: tuple[int, int], nbytes: int, prefetch: bool = False
    ) -> None:
        with self._lock:
            self.link.append(start, end, key[0], key[1], nbytes, prefetch)
            self._merge("link", start, end)
            self.link_busy_s += end - start
            self.fetched += 1

    def record_compute(
        self, start: float, end: float, layer: int, requests: tuple[str, ...], tokens: int
    ) -> None:
        """``requests``: the ids computed, as a tuple (groups are shared by value)."""
        with self._lock:
            group = self._groups.get(requests)
            if group is None:
                if len(self._groups) > 4096:
                    self._groups.clear()
                group = self._groups[requests] = tuple(requests)
            self.compute.append(start, end, layer, group, tokens)
            self._merge("compute", start, end)
            self.compute_busy_s += end - start

    def record_token(self, request_id: str) -> None:
        with self._lock:
            t = time.perf_counter()
            self.tokens.append(t, t, request_id)
            self.n_tokens += 1

    def _merge(self, lane: str, start: float, end: float) -> None:
        merged = self._merged[lane]
        last = merged.last_end()
        if last is not None and start - last < MERGE_GAP_S:
            merged.extend_last(end)
        else:
            merged.append(start, end)

    def merged_lanes(
        self, start: float, end: float, origin: float = 0.0
    ) -> tuple[list[Interval], list[Interval]]:
        """Both lanes over [start, end], intervals closer than ``MERGE_GAP_S`` merged:
        what ``coalesce`` gives for ``lanes`` (to within that gap at ``start``), at the
        cost of the few merged intervals; times less ``origin``."""
        with self._lock:
            link = self._merged["link"].window(start, end)
            comp = self._merged["compute"].window(start, end)
        return _clipped(link, start, end, origin), _clipped(comp, start, end, origin)

    def lanes(self, start: float, end: float) -> tuple[list[Interval], list[Interval]]:
        """Intervals of each lane overlapping [start, end], clipped to it, oldest first.
        Costs the window, not the log."""
        with self._lock:
            link, comp = self.link.window(start, end), self.compute.window(start, end)
        return _clipped(link, start, end), _clipped(comp, start, end)

    def window(self, start: float, end: float) -> dict[str, float]:
        """Busy fractions over [start, end]."""
        wall = max(end - start, 1e-9)
        with self._lock:
            lanes = [self.link.window(start, end), self.compute.window(start, end)]
            n_tokens = self.tokens.count(start, end)
        link, comp = (_clip(lane, start, end) for lane in lanes)
        link_s, comp_s = (float((x[:, 1] - x[:, 0]).sum()) for x in (link, comp))
        both = overlap(link, comp)
        return {
            "wall_s": wall,
            "link_busy_s": link_s,
            "compute_busy_s": comp_s,
            "both_busy_s": both,
            "both_busy_frac": both / wall,
            "compute_busy_frac": comp_s / wall,
            "link_busy_frac": link_s / wall,
            "compute_wait_frac": max(0.0, 1.0 - comp_s / wall),
            "tokens_per_s": n_tokens / wall,
        }

    def write_chrome_trace(self, path: str | Path) -> Path:
        """Chrome/Perfetto trace JSON: one lane for the link, one for compute."""
        with self._lock:  # copy the columns; the events are built outside the lock
            link, comp = self.link.copy(), self.compute.copy()
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
