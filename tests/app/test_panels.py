from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QGridLayout, QWidget
from pytestqt.qtbot import QtBot

from app.panels import (
    CachePanel,
    OverlapPanel,
    ProgressPanel,
    RequestTableModel,
    ThroughputPanel,
    intersect_intervals,
    merge_intervals,
)
from app.panels.progress import FRACTION_ROLE, STATE_ROLE
from backend.messages import MetricsSnapshot, RequestProgress

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "panels"
N_LAYERS, N_EXPERTS, SLOTS = 24, 64, 512
SESSIONS = {
    "r1": "Chat: pasta recipes",
    "r2": "Agent: refactor parser",
    "r3": "Chat: trip to Porto",
}


def _lanes(rng: random.Random, window: float) -> tuple[list, list]:
    """Serial link and compute lanes over ``window`` seconds: fetches of 8-30 ms, compute jobs
    of 3-12 ms, with gaps, so the two overlap part of the time like a runahead trace."""
    lanes = []
    for busy, gap in (((0.008, 0.030), (0.0, 0.012)), ((0.003, 0.012), (0.0, 0.015))):
        t, lane = -window - 0.005, []
        while t < 0:
            start = t + rng.uniform(*gap)
            end = start + rng.uniform(*busy)
            lane.append((start, min(end, 0.0)))
            t = end
        lanes.append([(s, e) for s, e in lane if e > s])
    return lanes[0], lanes[1]


def snapshot(
    i: int, *, requests: int = 3, seed: int = 0, t0: float = 1000.0, dt: float = 0.1
) -> MetricsSnapshot:
    """The ``i``-th snapshot of a run with ``requests`` concurrent requests at different layers."""
    rng = random.Random(seed * 100_003 + i)
    states = ("computing", "ready", "waiting", "queued")
    reqs = tuple(
        RequestProgress(
            request_id=f"r{k + 1}",
            session=SESSIONS.get(f"r{k + 1}", f"Session {k + 1}").split(": ")[1],
            layer=(i * 3 + k * 7) % N_LAYERS,
            n_layers=N_LAYERS,
            state=states[(i + k) % 4],
            tokens=i * (k + 1),  # r1 1 token per snapshot, r2 2, r3 3
        )
        for k in range(requests)
    )
    link, compute = _lanes(rng, 2.0)
    resident = tuple(
        sorted({(rng.randrange(N_LAYERS), rng.randrange(N_EXPERTS)) for _ in range(400)})
    )
    return MetricsSnapshot(
        t=t0 + i * dt,
        tokens_per_s=sum(k + 1 for k in range(requests)) / dt,
        hit_rate=0.5 + 0.3 * np.sin(i / 40),
        both_busy_frac=0.77,
        compute_wait_frac=0.10,
        compute_busy_frac=0.86,
        link_busy_frac=0.83,
        fetched=5 * i,
        cache_slots=SLOTS,
        cache_used=len(resident),
        cache_pinned=96,
        runahead="on",
        requests=reqs,
        lane_window_s=2.0,
        link_lane=tuple(link),
        compute_lane=tuple(compute),
        resident=resident,
        n_layers=N_LAYERS,
        n_experts=N_EXPERTS,
        tokens_total=sum(r.tokens for r in reqs),
    )


EMPTY = MetricsSnapshot(
    t=5.0,
    tokens_per_s=0.0,
    hit_rate=0.0,
    both_busy_frac=0.0,
    compute_wait_frac=0.0,
    compute_busy_frac=0.0,
    link_busy_frac=0.0,
    fetched=0,
    cache_slots=0,
    cache_used=0,
    cache_pinned=0,
    runahead="off",
)


def dark_palette() -> QPalette:
    pal = QPalette()
    for role, color in (
        (QPalette.ColorRole.Window, "#202124"),
        (QPalette.ColorRole.Base, "#17181b"),
        (QPalette.ColorRole.AlternateBase, "#24262a"),
        (QPalette.ColorRole.Button, "#2b2d31"),
        (QPalette.ColorRole.WindowText, "#e8eaed"),
        (QPalette.ColorRole.Text, "#e8eaed"),
        (QPalette.ColorRole.ButtonText, "#e8eaed"),
        (QPalette.ColorRole.Mid, "#3c4043"),
    ):
        pal.setColor(role, QColor(color))
    return pal


def light_palette() -> QPalette:
    pal = QPalette()
    for role, color in (
        (QPalette.ColorRole.Window, "#f3f3f3"),
        (QPalette.ColorRole.Base, "#ffffff"),
        (QPalette.ColorRole.WindowText, "#1f1f1f"),
        (QPalette.ColorRole.Text, "#1f1f1f"),
    ):
        pal.setColor(role, QColor(color))
    return pal


def render(qtbot: QtBot, widget: QWidget, name: str, size: tuple[int, int] = (720, 360)) -> None:
    """Show ``widget`` at ``size``, grab it, check the image, and save it for a human to look at."""
    widget.resize(*size)
    widget.show()
    qtbot.waitExposed(widget)
    pixmap = widget.grab()
    assert not pixmap.isNull()
    assert pixmap.width() >= size[0] * 0.9
    image = pixmap.toImage()
    colors = {
        image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)
    }
    assert len(colors) > 5  # drew something besides the background
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert pixmap.save(str(ARTIFACTS / f"{name}.png"))


# --- intervals ------------------------------------------------------------------------------


def test_intersection_of_lanes() -> None:
    link = [(-1.0, -0.6), (-0.5, -0.2)]
    compute = [(-0.8, -0.4), (-0.3, -0.1)]
    np.testing.assert_allclose(
        intersect_intervals(link, compute), [(-0.8, -0.6), (-0.5, -0.4), (-0.3, -0.2)]
    )
    assert intersect_intervals(link, []).shape == (0, 2)
    assert intersect_intervals([], []).shape == (0, 2)
    # Touching intervals merge; zero-length ones vanish.
    np.testing.assert_allclose(
        merge_intervals([(1, 2), (0, 1), (3, 3), (2.5, 4)]), [(0, 2), (2.5, 4)]
    )
    assert intersect_intervals([(0, 1)], [(1, 2)]).shape == (0, 2)


def test_intersection_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(50):
        a = [
            (s, s + rng.uniform(0, 0.3))
            for s in (rng.uniform(0, 2) for _ in range(rng.randrange(8)))
        ]
        b = [
            (s, s + rng.uniform(0, 0.3))
            for s in (rng.uniform(0, 2) for _ in range(rng.randrange(8)))
        ]
        got = intersect_intervals(a, b)
        grid = np.linspace(0.0005, 2.4995, 2500)  # midpoints of 1 ms cells

        def inside(xs: np.ndarray, ivs: list | np.ndarray) -> np.ndarray:
            return np.any(
                [(xs > s) & (xs < e) for s, e in ivs] or [np.zeros_like(xs, bool)], axis=0
            )

        want, have = inside(grid, a) & inside(grid, b), inside(grid, got)
        assert np.mean(want != have) < 0.01  # differs only in cells cut by an interval edge
        assert np.all(np.diff(got.ravel()) >= 0)  # sorted and disjoint


# --- overlap --------------------------------------------------------------------------------


def test_overlap_panel_shows_lanes_and_both_busy(qtbot: QtBot) -> None:
    panel = OverlapPanel()
    qtbot.addWidget(panel)
    snap = snapshot(0)
    snap = MetricsSnapshot(
        **{
            **snap.__dict__,
            "link_lane": ((-3.0, -1.5), (-1.0, -0.6), (-0.5, -0.2)),
            "compute_lane": ((-0.8, -0.4), (-0.3, -0.1)),
        }
    )
    panel.update_snapshot(snap)
    # The link interval starting before the 2 s window is clipped to it.
    np.testing.assert_allclose(
        panel.link_item.intervals, [(-2.0, -1.5), (-1.0, -0.6), (-0.5, -0.2)]
    )
    assert len(panel.compute_item.intervals) == 2
    np.testing.assert_allclose(
        panel.both_item.intervals, [(-0.8, -0.6), (-0.5, -0.4), (-0.3, -0.2)]
    )
    assert panel.both_busy_label.text() == "both busy 77 %"
    assert panel.compute_wait_label.text() == "compute waiting 10 %"
    assert panel.runahead_label.text() == "runahead on"
    x_range = panel.plot.getPlotItem().viewRange()[0]
    np.testing.assert_allclose(x_range, (-2.0, 0.0))
    assert panel.threads_label.text() == ""  # the engine computes with all its threads
    for now, most, shown in ((1, 2, "threads 1 of 2"), (2, 2, "")):
        loaded = {"compute_threads": now, "compute_threads_max": most}
        panel.update_snapshot(MetricsSnapshot(**{**snap.__dict__, **loaded}))
        assert panel.threads_label.text() == shown
        if shown:
            render(qtbot, panel, "overlap_fewer_threads")


def test_overlap_panel_handles_a_thousand_intervals(qtbot: QtBot) -> None:
    panel = OverlapPanel()
    qtbot.addWidget(panel)
    starts = np.linspace(-2.0, -0.002, 1000)
    link = tuple((s, s + 0.0015) for s in starts)
    compute = tuple((s + 0.001, s + 0.0019) for s in starts)
    snap = MetricsSnapshot(**{**snapshot(0).__dict__, "link_lane": link, "compute_lane": compute})
    began = time.perf_counter()
    panel.update_snapshot(snap)
    elapsed = time.perf_counter() - began
    assert len(panel.link_item.intervals) == 1000
    assert len(panel.compute_item.intervals) == 1000
    assert len(panel.both_item.intervals) == 1000
    np.testing.assert_allclose(np.diff(panel.both_item.intervals, axis=1), 0.0005, atol=1e-9)
    assert elapsed < 0.5  # generous: the machine is shared; typical is a few ms
    render(qtbot, panel, "overlap_1000_intervals")


def test_overlap_panel_empty_snapshot(qtbot: QtBot) -> None:
    panel = OverlapPanel()
    qtbot.addWidget(panel)
    panel.update_snapshot(snapshot(1))
    panel.update_snapshot(EMPTY)
    assert len(panel.link_item.intervals) == len(panel.both_item.intervals) == 0
    # Nothing asks compute for work: idle, not "compute waiting 100 %".
    assert panel.both_busy_label.text() == "idle: no requests"
    assert panel.compute_wait_label.text() == ""
    assert panel.runahead_label.text() == "runahead off"
    render(qtbot, panel, "overlap_empty")


# --- cache ----------------------------------------------------------------------------------


def test_cache_panel_residency_occupancy_and_hit_history(qtbot: QtBot) -> None:
    panel = CachePanel()
    qtbot.addWidget(panel)
    for i in range(700):  # 70 s of snapshots; only the last 60 s stay plotted
        panel.update_snapshot(snapshot(i, seed=1))
    last = snapshot(699, seed=1)
    expected = np.zeros((N_LAYERS, N_EXPERTS), dtype=np.uint8)
    for layer, expert in last.resident:
        expected[layer, expert] = 1
    np.testing.assert_array_equal(panel.heatmap.image, expected)
    np.testing.assert_array_equal(panel.residency, expected)
    assert panel.heatmap.image.shape == (N_LAYERS, N_EXPERTS)  # rows = layers

    x, y = panel.hit_curve.getData()
    assert 595 <= len(x) <= 601
    assert x.min() >= -60.0 and x.max() == pytest.approx(0.0)
    assert y[-1] == pytest.approx(last.hit_rate * 100)
    assert panel.hit_rate_label.text() == f"hit rate {last.hit_rate * 100:.0f} %"
    used = len(last.resident)
    assert panel.occupancy_label.text() == (
        f"occupancy {used} / {SLOTS} slots ({used / SLOTS * 100:.0f} %)"
    )
    assert panel.pinned_label.text() == "pinned 96"
    assert (panel.occupancy_bar.slots, panel.occupancy_bar.used, panel.occupancy_bar.pinned) == (
        SLOTS,
        used,
        96,
    )
    render(qtbot, panel, "cache_70s_history", size=(820, 340))


def test_cache_panel_ignores_out_of_range_keys_and_empty_snapshots(qtbot: QtBot) -> None:
    panel = CachePanel()
    qtbot.addWidget(panel)
    snap = MetricsSnapshot(
        **{
            **EMPTY.__dict__,
            "n_layers": 2,
            "n_experts": 3,
            "resident": ((0, 2), (1, 0), (5, 1), (1, 9)),
        }
    )
    panel.update_snapshot(snap)
    np.testing.assert_array_equal(panel.heatmap.image, [[0, 0, 1], [1, 0, 0]])
    panel.update_snapshot(MetricsSnapshot(**{**EMPTY.__dict__, "t": 6.0}))
    assert panel.heatmap.image is None and panel.residency.shape == (0, 0)
    assert panel.occupancy_label.text() == "occupancy 0 / 0 slots"
    render(qtbot, panel, "cache_empty")


# --- progress -------------------------------------------------------------------------------


def states(model: RequestTableModel) -> list[tuple[str, str, str]]:
    return [
        (
            model.index(row, model.SESSION).data(),
            model.index(row, model.LAYER).data(),
            model.index(row, model.STATE).data(STATE_ROLE),
        )
        for row in range(model.rowCount())
    ]


def test_progress_rows_follow_requests(qtbot: QtBot) -> None:
    panel = ProgressPanel(session_names={"r2": "Agent: refactor parser"})
    qtbot.addWidget(panel)
    model = panel.model
    panel.update_snapshot(snapshot(2))
    assert states(model) == [
        ("pasta recipes", "6 / 24", "waiting"),
        ("Agent: refactor parser", "13 / 24", "queued"),  # mapped title beats the label
        ("trip to Porto", "20 / 24", "computing"),
    ]
    assert model.index(1, model.LAYER).data(FRACTION_ROLE) == pytest.approx(13 / 24)
    assert model.index(0, model.STATE).data() == "waiting for experts"
    assert model.index(0, model.STATE).data(Qt.ItemDataRole.DecorationRole) is not None
    assert panel.summary_label.text() == "3 active requests · layers 6–20 · runahead on"

    # r1 finishes: its row goes, the others keep their order; then r1 is back as a new row.
    snap = snapshot(3)
    with qtbot.waitSignal(model.rowsRemoved, timeout=100):
        panel.update_snapshot(MetricsSnapshot(**{**snap.__dict__, "requests": snap.requests[1:]}))
    assert [model.request(r).request_id for r in range(model.rowCount())] == ["r2", "r3"]
    assert [s for _, _, s in states(model)] == ["computing", "ready"]
    with qtbot.waitSignal(model.rowsInserted, timeout=100):
        panel.update_snapshot(snapshot(4))
    assert [model.request(r).request_id for r in range(model.rowCount())] == ["r2", "r3", "r1"]

    panel.set_session_names(SESSIONS)
    assert model.index(2, model.SESSION).data() == "Chat: pasta recipes"
    render(qtbot, panel, "progress_rows", size=(640, 220))


def test_progress_empty_snapshot(qtbot: QtBot) -> None:
    panel = ProgressPanel()
    qtbot.addWidget(panel)
    panel.update_snapshot(snapshot(0))
    panel.update_snapshot(EMPTY)
    assert panel.model.rowCount() == 0
    assert panel.summary_label.text() == "no active requests"
    render(qtbot, panel, "progress_empty", size=(640, 200))


# --- throughput -----------------------------------------------------------------------------


def test_throughput_per_session_rates(qtbot: QtBot) -> None:
    panel = ThroughputPanel()
    qtbot.addWidget(panel)

    # r1 and r4 share a session label: their rates add up.
    def snap(i: int) -> MetricsSnapshot:
        base = snapshot(i)
        extra = RequestProgress("r4", "pasta recipes", 3, N_LAYERS, "ready", 2 * i)
        return MetricsSnapshot(**{**base.__dict__, "requests": (*base.requests, extra)})

    for i in range(40):
        panel.update_snapshot(snap(i))
    rates = panel.session_rates()
    assert set(rates) == {"pasta recipes", "refactor parser", "trip to Porto"}
    assert rates["pasta recipes"] == pytest.approx(30.0)  # (1 + 2) tokens per 0.1 s
    assert rates["refactor parser"] == pytest.approx(20.0)
    assert rates["trip to Porto"] == pytest.approx(30.0)
    assert set(panel.session_curves) == set(rates)
    # The legend is a row under the plot: the total and one entry per session line.
    assert set(panel.legend_entries) == {None, *rates}
    panel.resize(520, 260)
    panel.show()
    qtbot.waitExposed(panel)
    plot_bottom = panel.plot.geometry().bottom()
    assert all(label.geometry().top() > plot_bottom for _, label in panel.legend_entries.values())
    x, y = panel.total_curve.getData()
    assert len(x) == 40 and y[-1] == pytest.approx(60.0)
    assert panel.summary_label.text() == "60.0 tok/s total · 234 tokens generated"
    render(qtbot, panel, "throughput_sessions")

    # The sessions finish; their lines fall to 0 and leave once flat for the whole history.
    for i in range(40, 700):
        panel.update_snapshot(MetricsSnapshot(**{**EMPTY.__dict__, "t": 1000.0 + i * 0.1}))
    assert panel.session_rates() == {} and panel.session_curves == {}
    assert set(panel.legend_entries) == {None}


def test_throughput_empty_and_restart(qtbot: QtBot) -> None:
    panel = ThroughputPanel()
    qtbot.addWidget(panel)
    panel.update_snapshot(EMPTY)
    assert panel.session_rates() == {}
    for i in range(5):
        panel.update_snapshot(snapshot(i))
    panel.update_snapshot(snapshot(0, t0=1.0))  # a new engine restarts its clock
    assert panel.session_rates() == {}
    assert len(panel.total_curve.getData()[0]) == 1


# --- all four, both palettes ---------------------------------------------------------------


def four_panels() -> tuple[QWidget, tuple]:
    """The four panels in one 2 x 2 grid widget (the window docks them instead)."""
    panels = OverlapPanel(), CachePanel(), ProgressPanel(SESSIONS), ThroughputPanel(SESSIONS)
    box = QWidget()
    grid = QGridLayout(box)
    for i, panel in enumerate(panels):
        grid.addWidget(panel, i // 2, i % 2)
    return box, panels


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_panels_render_on_both_palettes(qtbot: QtBot, theme: str) -> None:
    box, panels = four_panels()
    qtbot.addWidget(box)
    box.setPalette(dark_palette() if theme == "dark" else light_palette())
    for i in range(300):
        for panel in panels:
            panel.update_snapshot(snapshot(i, seed=2))
    background = panels[0].plot.backgroundBrush().color()
    assert (background.lightnessF() < 0.5) == (theme == "dark")
    render(qtbot, box, f"panels_{theme}", size=(1400, 760))
    for panel in panels:
        name = type(panel).__name__.removesuffix("Panel").lower()
        pixmap = panel.grab()
        assert not pixmap.isNull()
        assert pixmap.save(str(ARTIFACTS / f"{name}_{theme}.png"))


def test_every_figure_and_lane_explains_itself(qtbot: QtBot) -> None:
    from PySide6.QtWidgets import QLabel

    panels = [OverlapPanel(), CachePanel(), ProgressPanel(), ThroughputPanel()]
    for panel in panels:
        qtbot.addWidget(panel)
        panel.update_snapshot(snapshot(1))
        # Each figure in a header, each legend entry, each plot has a one-line explanation.
        figures = [
            label
            for label in panel.findChildren(QLabel)
            if label.text() and any(ch.isalpha() for ch in label.text())
        ]
        plots = [w for w in vars(panel).values() if type(w).__name__ == "PlotWidget"]
        for widget in figures + plots:
            text = widget.text() if isinstance(widget, QLabel) else type(widget).__name__
            if isinstance(widget, QLabel) and widget.parent() is not panel:
                continue  # inside a plot or table: explained by it
            if text.startswith(("hit rate, last", "resident experts")):
                continue  # captions of plots that have their own tooltip
            assert widget.toolTip(), f"{type(panel).__name__}: {text!r} has no tooltip"
