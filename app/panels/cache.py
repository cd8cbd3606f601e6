"""Cache panel: hit rate over time, slot occupancy and pins, and which experts are resident."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, QSize
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.panels._theme import (
    PanelTheme,
    ThemedPanel,
    make_plot,
    mix,
    set_swatch,
    style_plot,
    theme_for,
)
from backend.api import MetricsSnapshot


class OccupancyBar(QWidget):
    """A thin bar: pinned slots, then used but evictable slots, then free slots."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.slots = self.used = self.pinned = 0
        self.setMinimumHeight(10)

    def set_counts(self, slots: int, used: int, pinned: int) -> None:
        """Show ``used`` of ``slots`` slots, of which ``pinned`` are referenced by jobs."""
        counts = (max(slots, 0), max(used, 0), max(pinned, 0))
        if counts != (self.slots, self.used, self.pinned):
            self.slots, self.used, self.pinned = counts
            self.update()

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt override)
        return QSize(200, 12)

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt override)
        theme = theme_for(self)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QColor(0, 0, 0, 0))
        rect = QRectF(self.rect()).adjusted(0.5, 1.5, -0.5, -1.5)
        painter.setBrush(theme.grid)
        painter.drawRoundedRect(rect, 3, 3)
        if self.slots > 0:
            w = rect.width() / self.slots
            painter.setBrush(used_color(theme))
            painter.drawRoundedRect(
                QRectF(rect.x(), rect.y(), w * min(self.used, self.slots), rect.height()), 3, 3
            )
            painter.setBrush(theme.accent)
            painter.drawRoundedRect(
                QRectF(rect.x(), rect.y(), w * min(self.pinned, self.slots), rect.height()), 3, 3
            )
        painter.end()


class CachePanel(ThemedPanel):
    """Hit rate over the last ``history_s`` seconds, slot occupancy, and a layer x expert map
    of resident experts (bright = in the cache)."""

    def __init__(self, history_s: float = 60.0, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history_s = history_s
        self._history: deque[tuple[float, float]] = deque()
        theme = theme_for(self)
        bold = QFont(self.font())
        bold.setBold(True)
        self.hit_rate_label = QLabel("hit rate –")
        self.occupancy_label = QLabel("occupancy –")
        self.pinned_label = QLabel("pinned –")
        self._used_swatch, self._pinned_swatch = QLabel(), QLabel()
        header = QHBoxLayout()
        header.setSpacing(6)
        for swatch, label in (
            (None, self.hit_rate_label),
            (self._used_swatch, self.occupancy_label),
            (self._pinned_swatch, self.pinned_label),
        ):
            label.setFont(bold)
            if swatch is not None:
                header.addSpacing(12)
                header.addWidget(swatch)
            header.addWidget(label)
        header.addStretch(1)
        self.occupancy_bar = OccupancyBar()

        self.hit_plot = make_plot(theme)
        hit_item = self.hit_plot.getPlotItem()
        hit_item.setLabel("bottom", "seconds before now")
        hit_item.setLabel("left", "hit rate", units="%")
        hit_item.getAxis("left").enableAutoSIPrefix(False)
        hit_item.showGrid(x=False, y=True, alpha=0.3)
        hit_item.setYRange(-2, 105, padding=0)  # room above 100 for its tick label
        hit_item.setXRange(-history_s, 0, padding=0)
        self.hit_curve = pg.PlotDataItem(antialias=True)
        hit_item.addItem(self.hit_curve)

        self.map_plot = make_plot(theme)
        map_item = self.map_plot.getPlotItem()
        map_item.setLabel("bottom", "expert")
        map_item.setLabel("left", "layer")
        map_item.getViewBox().invertY(True)  # layer 0 on top, like the model's stack
        self.heatmap = pg.ImageItem(axisOrder="row-major")
        map_item.addItem(self.heatmap)
        self._map_note = pg.TextItem("no model loaded", anchor=(0.5, 0.5))
        map_item.addItem(self._map_note, ignoreBounds=True)
        self.residency = np.zeros((0, 0), dtype=np.uint8)
        self._show_map_axes(False)

        self.hit_rate_label.setToolTip(
            "Share of expert uses found already in the cache, since the model loaded."
        )
        self.occupancy_label.setToolTip(
            "Cache slots holding an expert, of all the slots the cache budget buys "
            "(Model → Settings → cache)."
        )
        self.pinned_label.setToolTip(
            "Slots held for a request that is about to compute with them: they cannot be "
            "evicted until it has."
        )
        self.hit_plot.setToolTip("The hit rate over the last minute.")
        self.map_plot.setToolTip(
            "Which experts are in the cache now: one row per layer, one column per expert; "
            "coloured cells are resident."
        )
        grid = QGridLayout()
        grid.addWidget(QLabel(f"hit rate, last {history_s:g} s"), 0, 0)
        grid.addWidget(QLabel("resident experts (layer × expert)"), 0, 1)
        grid.addWidget(self.hit_plot, 1, 0)
        grid.addWidget(self.map_plot, 1, 1)
        grid.setColumnStretch(0, 1)
        grid.setColumnStretch(1, 1)
        grid.setRowStretch(1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(header)
        layout.addWidget(self.occupancy_bar)
        layout.addLayout(grid, 1)
        self._apply_theme(theme)

    def reset(self) -> None:
        """Forget the plotted hit rates (the panels now draw another engine)."""
        self._history.clear()
        self.hit_curve.setData([], [])
        self.hit_rate_label.setText("hit rate –")

    @property
    def hit_rate_history(self) -> list[tuple[float, float]]:
        """``(t, hit_rate)`` pairs currently plotted, oldest first."""
        return list(self._history)

    def update_snapshot(self, snap: MetricsSnapshot) -> None:
        """Record ``snap``'s hit rate and show its occupancy and residency."""
        if math.isfinite(snap.hit_rate):
            if self._history and snap.t < self._history[-1][0]:
                self._history.clear()  # time went backwards: a new engine, a new series
            self._history.append((snap.t, snap.hit_rate))
        while self._history and self._history[0][0] < snap.t - self.history_s:
            self._history.popleft()
        if self._history:
            t, rate = np.array(self._history).T
            self.hit_curve.setData(t - snap.t, rate * 100.0)
        else:
            self.hit_curve.setData([], [])
        self.hit_rate_label.setText(f"hit rate {_pct(snap.hit_rate)}")

        self.occupancy_bar.set_counts(snap.cache_slots, snap.cache_used, snap.cache_pinned)
        share = f" ({_pct(snap.cache_used / snap.cache_slots)})" if snap.cache_slots else ""
        self.occupancy_label.setText(
            f"occupancy {snap.cache_used} / {snap.cache_slots} slots{share}"
        )
        self.pinned_label.setText(f"pinned {snap.cache_pinned}")
        self._show_residency(snap)

    def _show_residency(self, snap: MetricsSnapshot) -> None:
        shape = (max(snap.n_layers, 0), max(snap.n_experts, 0))
        grid = np.zeros(shape, dtype=np.uint8)
        if snap.resident and grid.size:
            keys = np.asarray(snap.resident, dtype=np.int64).reshape(-1, 2)
            inside = (
                (keys[:, 0] >= 0)
                & (keys[:, 0] < shape[0])
                & (keys[:, 1] >= 0)
                & (keys[:, 1] < shape[1])
            )
            grid[keys[inside, 0], keys[inside, 1]] = 1
        self.residency = grid
        reshaped = self.heatmap.image is None or self.heatmap.image.shape != grid.shape
        if grid.size == 0:
            if self.heatmap.image is not None:
                self.heatmap.clear()
                self._show_map_axes(False)
            return
        self.heatmap.setImage(grid, autoLevels=False, levels=(0, 1))
        if reshaped:
            self._show_map_axes(True)
            # Cells centred on whole numbers, so tick "3" sits on layer 3's row.
            self.heatmap.setRect(QRectF(-0.5, -0.5, shape[1], shape[0]))
            self.map_plot.getPlotItem().setRange(
                xRange=(-0.5, shape[1] - 0.5), yRange=(-0.5, shape[0] - 0.5), padding=0
            )

    def _show_map_axes(self, shown: bool) -> None:
        """Layer and expert ticks while there is a map; a note in their place otherwise."""
        item = self.map_plot.getPlotItem()
        for name in ("left", "bottom"):
            item.getAxis(name).setStyle(showValues=shown)
        self._map_note.setVisible(not shown)
        if not shown:
            item.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
            self._map_note.setPos(0.5, 0.5)

    def _apply_theme(self, theme: PanelTheme) -> None:
        style_plot(self.hit_plot, theme)
        style_plot(self.map_plot, theme)
        fill = QColor(theme.accent)
        fill.setAlphaF(0.2)
        self.hit_curve.setPen(pg.mkPen(theme.accent, width=2))
        self.hit_curve.setFillLevel(0)
        self.hit_curve.setBrush(fill)
        # Absent experts sit just above the background so the grid shape stays visible.
        lut = np.array([_rgb(theme.grid), _rgb(theme.both)], dtype=np.uint8)
        self.heatmap.setLookupTable(lut)
        self._map_note.setColor(theme.muted)
        set_swatch(self._used_swatch, used_color(theme))
        set_swatch(self._pinned_swatch, theme.accent)
        self.occupancy_bar.update()


def used_color(theme: PanelTheme) -> QColor:
    """Colour of used, unpinned slots: a paler accent, so pinned slots stand out."""
    return mix(theme.grid, theme.accent, 0.5)


def _rgb(color: QColor) -> tuple[int, int, int]:
    return color.red(), color.green(), color.blue()


def _pct(frac: float) -> str:
    return f"{frac * 100:.0f} %" if math.isfinite(frac) else "–"
