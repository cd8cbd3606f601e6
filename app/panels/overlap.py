"""Overlap timeline: when the link (expert fetches) and compute were busy, and when both were.

The point of runahead is that the link and compute work at the same time; this panel draws the
last ``lane_window_s`` seconds of both lanes as bars, with the intersection (both busy) as a
highlighted row between them, and states the snapshot's both-busy and compute-wait fractions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics, QPainter
from PySide6.QtWidgets import QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.panels._theme import PanelTheme, ThemedPanel, make_plot, style_plot, theme_for
from backend.api import MetricsSnapshot

# Rows of the timeline, bottom to top, as (y0, height); "both" is thinner so it reads as a
# marker between the two lanes rather than a third resource.
_COMPUTE_ROW = (0.1, 0.8)
_BOTH_ROW = (1.05, 0.4)
_LINK_ROW = (1.5, 0.8)
_DEFAULT_WINDOW_S = 2.0


def _as_intervals(pairs: Sequence[tuple[float, float]] | np.ndarray) -> np.ndarray:
    arr = np.asarray(pairs, dtype=float).reshape(-1, 2)
    return arr[arr[:, 1] > arr[:, 0]]


def _covered(lanes: Sequence[np.ndarray], need: int) -> np.ndarray:
    """Intervals where at least ``need`` of ``lanes`` are busy (a sweep over all boundaries).

    Each lane may hold unsorted, overlapping intervals; the result is sorted and disjoint,
    with touching pieces merged.
    """
    times, kinds, deltas = [], [], []
    for i, lane in enumerate(lanes):
        n = len(lane)
        times += [lane[:, 0], lane[:, 1]]
        kinds += [np.zeros(n), np.ones(n)]  # at equal times starts sort first: touching merges
        d = np.zeros((2 * n, len(lanes)))
        d[:n, i], d[n:, i] = 1, -1
        deltas.append(d)
    if not times or sum(len(t) for t in times) == 0:
        return np.zeros((0, 2))
    t = np.concatenate(times)
    order = np.lexsort((np.concatenate(kinds), t))
    t = t[order]
    busy = np.cumsum(np.concatenate(deltas)[order], axis=0) > 0  # per segment [t_i, t_i+1)
    on = busy.sum(axis=1)[:-1] >= need
    if not on.any():
        return np.zeros((0, 2))
    edges = np.diff(np.concatenate(([False], on, [False])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    out = np.column_stack((t[starts], t[ends]))
    return out[out[:, 1] > out[:, 0]]


def merge_intervals(pairs: Sequence[tuple[float, float]] | np.ndarray) -> np.ndarray:
    """Sorted, disjoint union of ``(start, end)`` intervals as an ``(n, 2)`` array."""
    return _covered([_as_intervals(pairs)], need=1)


def intersect_intervals(
    a: Sequence[tuple[float, float]] | np.ndarray, b: Sequence[tuple[float, float]] | np.ndarray
) -> np.ndarray:
    """Times when both ``a`` and ``b`` are busy, as a sorted, disjoint ``(n, 2)`` array."""
    return _covered([_as_intervals(a), _as_intervals(b)], need=2)


class IntervalsItem(pg.GraphicsObject):
    """One row of filled bars, one per ``(start, end)`` interval, in a single draw call.

    Bars are drawn antialiased without an outline: in a multi-second window a millisecond
    fetch is narrower than a pixel, and antialiasing shades each pixel by how much of it is
    busy, so a lane busy half the time looks half filled instead of solid.
    """

    def __init__(self, y0: float, height: float, color: QColor) -> None:
        super().__init__()
        self._y0, self._height = y0, height
        self._intervals = np.zeros((0, 2))
        self._rects: list[QRectF] = []
        self._bounds = QRectF()
        self.set_color(color)

    @property
    def intervals(self) -> np.ndarray:
        """The drawn intervals, ``(n, 2)``."""
        return self._intervals.copy()

    def set_color(self, color: QColor) -> None:
        """Fill and outline colour of the bars."""
        self._brush = QBrush(color)
        self.update()

    def set_intervals(self, intervals: np.ndarray) -> None:
        """Replace the bars by ``intervals`` (``(n, 2)`` array of start, end)."""
        self.prepareGeometryChange()
        self._intervals = np.asarray(intervals, dtype=float).reshape(-1, 2)
        y0, h = self._y0, self._height
        self._rects = [QRectF(s, y0, e - s, h) for s, e in self._intervals.tolist()]
        if self._rects:
            lo, hi = float(self._intervals[:, 0].min()), float(self._intervals[:, 1].max())
            self._bounds = QRectF(lo, y0, hi - lo, h)
        else:
            self._bounds = QRectF()
        self.update()

    def boundingRect(self) -> QRectF:  # noqa: N802 (Qt override)
        return self._bounds

    def paint(self, painter: QPainter, *args: object) -> None:
        if not self._rects:
            return
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(self._brush)
        painter.drawRects(self._rects)


class OverlapPanel(ThemedPanel):
    """Link and compute lanes over the last ``lane_window_s`` seconds, both-busy highlighted."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        theme = theme_for(self)
        bold = QFont(self.font())
        bold.setBold(True)
        self.both_busy_label = QLabel("both busy –")
        self.compute_wait_label = QLabel("compute waiting –")
        self.runahead_label = QLabel("runahead –")
        self.threads_label = QLabel("")
        header = QHBoxLayout()
        header.setSpacing(18)
        labels = (self.both_busy_label, self.compute_wait_label, self.runahead_label)
        for label in (*labels, self.threads_label):
            label.setFont(bold)
            header.addWidget(label)
        header.addStretch(1)
        self.both_busy_label.setToolTip(
            "Share of the last 2 s in which experts were being read (the link) while the "
            "model computed: the overlap runahead exists to create."
        )
        self.compute_wait_label.setToolTip(
            "Share of the last 2 s in which compute sat idle while requests were running, "
            "waiting for experts to arrive. Lower is better."
        )
        self.runahead_label.setToolTip(
            "on: requests advance layer by layer on their own, so the link fetches what "
            "is known to be needed while compute runs others. limited: the cache is too "
            "small for every request's experts at once. held: compute is the bottleneck "
            "and the link idles, or a CPU quota (a container's --cpus) gives the engine "
            "under 0.6 of a CPU, so requests advance together in bigger batches, which "
            "take less CPU time a token. off: a lockstep policy (sync)."
        )
        self.threads_label.setToolTip(
            "Threads computing the model, of the most it may use. Fewer while other "
            "programs keep CPU cores busy: sharing a core with one of them would make every "
            "step of the computation wait for it."
        )

        self.plot = make_plot(theme)
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "seconds before now")
        left = item.getAxis("left")
        left.setTicks(
            [[(_LINK_ROW[0] + 0.4, "link"), (_BOTH_ROW[0] + 0.2, "both"), (0.5, "compute")]]
        )
        # pyqtgraph widens an axis only after a label failed to fit, so fix it up front.
        left.setWidth(QFontMetrics(left.font()).horizontalAdvance("compute") + 16)
        item.setYRange(0.0, _LINK_ROW[0] + _LINK_ROW[1] + 0.1, padding=0)
        item.setXRange(-_DEFAULT_WINDOW_S, 0.0, padding=0)
        self.link_item = IntervalsItem(*_LINK_ROW, theme.link)
        self.compute_item = IntervalsItem(*_COMPUTE_ROW, theme.compute)
        self.both_item = IntervalsItem(*_BOTH_ROW, theme.both)
        for it in (self.link_item, self.compute_item, self.both_item):
            item.addItem(it)

        self.plot.setToolTip(
            "The last seconds, left to right. link: expert reads (SSD or host memory into "
            "the cache). compute: the model's layers running. both: the two at once."
        )
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(header)
        layout.addWidget(self.plot, 1)
        self._runahead = ""
        self._apply_theme(theme)

    def update_snapshot(self, snap: MetricsSnapshot) -> None:
        """Show ``snap``'s lanes and overlap figures."""
        window = snap.lane_window_s if snap.lane_window_s > 0 else _DEFAULT_WINDOW_S
        lo = -window
        link = _clip(merge_intervals(snap.link_lane), lo, 0.0)
        compute = _clip(merge_intervals(snap.compute_lane), lo, 0.0)
        self.link_item.set_intervals(link)
        self.compute_item.set_intervals(compute)
        self.both_item.set_intervals(intersect_intervals(link, compute))
        self.plot.getPlotItem().setXRange(lo, 0.0, padding=0)
        if snap.requests:
            self.both_busy_label.setText(f"both busy {_pct(snap.both_busy_frac)}")
            self.compute_wait_label.setText(f"compute waiting {_pct(snap.compute_wait_frac)}")
        else:  # compute is not waiting on the link when nothing asks it for work
            self.both_busy_label.setText("idle: no requests")
            self.compute_wait_label.setText("")
        self.runahead_label.setText(f"runahead {snap.runahead or '–'}")
        most = snap.compute_threads_max
        self.threads_label.setText(
            f"threads {snap.compute_threads} of {most}" if snap.compute_threads < most else ""
        )
        if snap.runahead != self._runahead:
            self._runahead = snap.runahead
            self._colour_runahead(theme_for(self))

    def _apply_theme(self, theme: PanelTheme) -> None:
        style_plot(self.plot, theme)
        self.link_item.set_color(theme.link)
        self.compute_item.set_color(theme.compute)
        self.both_item.set_color(theme.both)
        self._colour_runahead(theme)

    def _colour_runahead(self, theme: PanelTheme) -> None:
        color = {"on": theme.good, "limited": theme.warn}.get(self._runahead, theme.neutral)
        self.runahead_label.setStyleSheet(f"color: {color.name()}")
        self.threads_label.setStyleSheet(f"color: {theme.warn.name()}")


def _clip(intervals: np.ndarray, lo: float, hi: float) -> np.ndarray:
    out = np.clip(intervals, lo, hi)
    return out[out[:, 1] > out[:, 0]]


def _pct(frac: float) -> str:
    return f"{frac * 100:.0f} %" if math.isfinite(frac) else "–"


__all__ = ["IntervalsItem", "OverlapPanel", "intersect_intervals", "merge_intervals"]
