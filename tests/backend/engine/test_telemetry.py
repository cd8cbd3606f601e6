import json
from pathlib import Path

from backend.engine.telemetry import Telemetry, overlap


def test_overlap_of_two_lanes() -> None:
    assert overlap([(0, 2), (3, 5)], [(1, 4)]) == 2
    assert overlap([(0, 1)], [(1, 2)]) == 0


def test_window_counts_only_what_falls_inside(tmp_path: Path) -> None:
    t = Telemetry()
    for i in range(10):  # link busy [i, i+0.5), compute busy [i+0.25, i+1)
        t.record_link(i, i + 0.5, (0, i), 100)
        t.record_compute(i + 0.25, i + 1, 0, ("a",), 1)
    w = t.window(8.0, 10.0)
    assert w["link_busy_s"] == 1.0 and w["compute_busy_s"] == 1.5
    assert w["both_busy_s"] == 0.5 and w["both_busy_frac"] == 0.25
    trace = json.loads(t.write_chrome_trace(tmp_path / "t.json").read_text())
    assert sum(e.get("ph") == "X" for e in trace["traceEvents"]) == 20


def test_merged_lanes_are_the_coalesced_raw_lanes() -> None:
    """The lanes a live view draws, merged as events come, are what coalescing the raw
    events over the same window gives."""
    import random

    from backend.engine.telemetry import MERGE_GAP_S, coalesce

    rng = random.Random(7)
    t, now = Telemetry(), 0.0
    for _ in range(3000):
        now += rng.choice([1e-4, 3e-4, 2e-3, 0.05])  # gaps below and above the merge gap
        end = now + rng.random() * 2e-3
        t.record_compute(now, end, 0, ("a",), 1)
        if rng.random() < 0.2:
            t.record_link(now, end + 1e-3, (0, 0), 1)
        now = end
    for start, stop in [(0.0, now), (now / 3, now / 2), (now - 1.0, now)]:
        link, comp = t.lanes(start, stop)
        assert t.merged_lanes(start, stop) == (
            coalesce(link, MERGE_GAP_S),
            coalesce(comp, MERGE_GAP_S),
        )


def test_a_full_ring_keeps_the_newest_events_in_order(tmp_path: Path) -> None:
    """Past its capacity a lane drops its oldest events; windows, counts and iteration
    read across the ring's wrap as if it were one list of the newest events."""
    from backend.engine.telemetry import ComputeEvent, LinkEvent

    t = Telemetry(capacity=7)
    for i in range(10):  # 10 events into 7 places: the ring wraps, events 3..9 kept
        t.record_link(i, i + 0.5, (i, i + 1), 100 + i, i % 2 == 0)
        t.record_compute(i + 0.5, i + 1, i, ("a", "b") if i % 2 else ("a",), i)
    assert len(t.link) == len(t.compute) == 7 and t.fetched == 10
    assert list(t.link)[0] == LinkEvent(3, 3.5, (3, 4), 103, False)
    assert list(t.link)[-1] == LinkEvent(9, 9.5, (9, 10), 109, False)
    assert [e.layer for e in t.compute] == list(range(3, 10))
    assert list(t.compute)[1] == ComputeEvent(4.5, 5, 4, ("a",), 4)
    # a window over the wrap (events 5..8 start in [5, 9)), and one before what is kept
    link, comp = t.lanes(5.2, 8.25)
    assert link == [(5.2, 5.5), (6, 6.5), (7, 7.5), (8, 8.25)]
    assert comp == [(5.5, 6), (6.5, 7), (7.5, 8)]
    assert t.lanes(0, 2.9) == ([], [])
    assert t.window(0, 20)["link_busy_s"] == 3.5  # the 7 kept
    trace = json.loads(t.write_chrome_trace(tmp_path / "t.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert names[:7] == [
        f"{'prefetch' if i % 2 == 0 else 'fetch'} L{i}E{i + 1}" for i in range(3, 10)
    ]
    assert names[7:] == [f"layer {i} x{2 if i % 2 else 1}" for i in range(3, 10)]


def test_tokens_counted_in_a_closed_window() -> None:
    t = Telemetry(capacity=5)
    for _ in range(8):
        t.record_token("r")
    times = [time for time, _ in t.tokens]
    assert len(times) == 5 and times == sorted(times) and t.n_tokens == 8
    w = t.window(times[1], times[3])  # both ends counted
    assert round(w["tokens_per_s"] * w["wall_s"]) == 3  # (a rate times its wall time)


def test_a_group_of_requests_is_held_once() -> None:
    """The engine computes layer after layer for one group: its events share one tuple."""
    t = Telemetry()
    for i in range(5):
        t.record_compute(i, i + 1, i, tuple(["a", "b"]), 2)
    groups = {id(e.requests) for e in t.compute}
    assert len(groups) == 1


def test_overlap_is_the_sum_of_pairwise_intersections() -> None:
    """The union-based overlap against the plain definition, on lanes of random gaps."""
    import random

    rng = random.Random(3)

    def lane(n: int) -> list[tuple[float, float]]:
        out, t = [], 0.0
        for _ in range(n):
            t += rng.random() * 2e-3
            out.append((t, t + rng.random() * 3e-3))
            t = out[-1][1]
        return out

    for n, m in [(0, 5), (1, 1), (40, 7), (300, 250)]:
        a, b = lane(n), lane(m)
        want = sum(max(0.0, min(e, f) - max(s, r)) for s, e in a for r, f in b)
        assert abs(overlap(a, b) - want) < 1e-9
