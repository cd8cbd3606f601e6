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
