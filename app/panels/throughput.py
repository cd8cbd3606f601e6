"""Throughput: total tokens/s over time and one line per session.

The engine reports the total rate; per-session rates are derived here from how much each
request's token count grew between snapshots, summed per session label and averaged over a
short window (at 10 Hz a single interval holds only a token or two, which would make the lines
jump between 0 and 20 tok/s).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.panels._theme import (
    PanelTheme,
    ThemedPanel,
    make_plot,
    set_swatch,
    style_plot,
    theme_for,
)
from backend.api import MetricsSnapshot


class ThroughputPanel(ThemedPanel):
    """Tokens/s over the last ``history_s`` seconds: the engine total and per session.

    ``smooth_s`` is the window per-session rates are averaged over; ``session_names`` maps
    request ids to session titles (else the request's session label, else its id is used).
    """

    def __init__(
        self,
        session_names: Mapping[str, str] | None = None,
        history_s: float = 60.0,
        smooth_s: float = 1.0,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.history_s, self.smooth_s = history_s, smooth_s
        self._names = dict(session_names or {})
        self._total: deque[tuple[float, float]] = deque()
        self._prev_tokens: dict[str, int] | None = None  # request id -> tokens, last snapshot
        self._cum: dict[str, int] = {}  # session label -> tokens seen generated
        self._recent: deque[tuple[float, dict[str, int]]] = deque()  # cum history, smoothing
        self._series: dict[str, deque[tuple[float, float]]] = {}
        self._color_index: dict[str, int] = {}
        self._last_t: float | None = None
        self._active: set[str] = set()  # session labels in the latest snapshot

        bold = QFont(self.font())
        bold.setBold(True)
        self.summary_label = QLabel("– tok/s")
        self.summary_label.setFont(bold)
        theme = theme_for(self)
        self.plot = make_plot(theme)
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "seconds before now")
        item.setLabel("left", "tokens/s")
        item.showGrid(x=False, y=True, alpha=0.3)
        item.setXRange(-history_s, 0, padding=0)
        item.setYRange(0, 1, padding=0)
        self.total_curve = pg.PlotDataItem(antialias=True)
        item.addItem(self.total_curve)
        self.session_curves: dict[str, pg.PlotDataItem] = {}
        # The legend is a row under the plot, not a box inside it, so that it never
        # covers the lines it explains.
        self.legend_row = QHBoxLayout()
        self.legend_row.setSpacing(4)
        self.legend_entries: dict[str | None, tuple[QLabel, QLabel]] = {}  # None: total
        self._add_legend_entry(None, "total")
        self.legend_row.addStretch(1)

        self.summary_label.setToolTip(
            "Tokens generated per second by all sessions together, and since the model loaded."
        )
        self.plot.setToolTip("Tokens per second over the last minute: all, and each session.")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.summary_label)
        layout.addWidget(self.plot, 1)
        layout.addLayout(self.legend_row)
        self._apply_theme(theme)

    def _add_legend_entry(self, key: str | None, text: str) -> None:
        swatch, label = QLabel(), QLabel(text)
        label.setToolTip("All sessions together" if key is None else f"Session: {text}")
        label.setMaximumWidth(160)  # a long title is cut, the entries stay on one row
        metrics = label.fontMetrics()
        label.setText(metrics.elidedText(text, Qt.TextElideMode.ElideRight, 160))
        at = max(0, self.legend_row.count() - 1)  # before the stretch
        self.legend_row.insertWidget(at, swatch)
        self.legend_row.insertWidget(at + 1, label)
        self.legend_row.insertSpacing(at + 2, 8)
        self.legend_entries[key] = (swatch, label)
        self._color_entry(key, theme_for(self))

    def _remove_legend_entry(self, key: str) -> None:
        entry = self.legend_entries.pop(key, None)
        if entry is None:
            return
        for widget in entry:
            at = self.legend_row.indexOf(widget)
            self.legend_row.takeAt(at)
            widget.deleteLater()
            if widget is entry[1]:  # its spacing follows it
                self.legend_row.takeAt(at)

    def _color_entry(self, key: str | None, theme: PanelTheme) -> None:
        swatch, _ = self.legend_entries[key]
        color = theme.foreground if key is None else theme.series(self._color_index[key])
        set_swatch(swatch, QColor(color))

    def set_session_names(self, names: Mapping[str, str]) -> None:
        """Titles keyed by request id; applies to tokens counted from now on."""
        self._names = dict(names)

    def session_rates(self) -> dict[str, float]:
        """Latest tokens/s per session label (sessions still on the plot)."""
        return {label: s[-1][1] for label, s in self._series.items() if s}

    def update_snapshot(self, snap: MetricsSnapshot) -> None:
        """Add ``snap``'s rates to the plot."""
        t = snap.t
        if self._last_t is not None and t < self._last_t:
            self._reset()  # time went backwards: a new engine, new series
        self._last_t = t
        if math.isfinite(snap.tokens_per_s):
            self._total.append((t, snap.tokens_per_s))
        self._count_tokens(snap)
        self._active = {self._label(r.request_id, r.session) for r in snap.requests}
        self._add_rates(t)
        self._prune(t)
        self._redraw(t)
        rate = f"{snap.tokens_per_s:.1f}" if math.isfinite(snap.tokens_per_s) else "–"
        self.summary_label.setText(f"{rate} tok/s total · {snap.tokens_total:,} tokens generated")

    def _label(self, request_id: str, session: str) -> str:
        return self._names.get(request_id) or session or request_id

    def _count_tokens(self, snap: MetricsSnapshot) -> None:
        tokens = {r.request_id: r.tokens for r in snap.requests}
        if self._prev_tokens is not None:
            # A request first seen now started after the previous snapshot: all its tokens
            # are new. Before the first snapshot nothing is known, so nothing is counted.
            for r in snap.requests:
                delta = max(r.tokens - self._prev_tokens.get(r.request_id, 0), 0)
                label = self._label(r.request_id, r.session)
                self._cum[label] = self._cum.get(label, 0) + delta
        else:
            for r in snap.requests:
                self._cum.setdefault(self._label(r.request_id, r.session), 0)
        self._prev_tokens = tokens

    def _add_rates(self, t: float) -> None:
        self._recent.append((t, dict(self._cum)))
        # Keep one entry at or before t - smooth_s as the base of the average.
        while len(self._recent) > 2 and self._recent[1][0] <= t - self.smooth_s:
            self._recent.popleft()
        base_t, base = self._recent[0]
        if base_t >= t:
            return  # first snapshot: no interval yet
        for label, cum in self._cum.items():
            rate = (cum - base.get(label, 0)) / (t - base_t)
            if label not in self._series:
                if rate <= 0 and label not in self._active:
                    continue
                self._series[label] = deque()
            self._series[label].append((t, rate))

    def _prune(self, t: float) -> None:
        start = t - self.history_s
        while self._total and self._total[0][0] < start:
            self._total.popleft()
        for label in list(self._series):
            series = self._series[label]
            while series and series[0][0] < start:
                series.popleft()
            if label not in self._active and not any(rate > 0 for _, rate in series):
                # A finished session whose line has been flat for the whole history. Its
                # count stays in _cum so a later base of the average still matches.
                del self._series[label]
                curve = self.session_curves.pop(label, None)
                if curve is not None:
                    self._remove_legend_entry(label)
                    self.plot.getPlotItem().removeItem(curve)

    def _redraw(self, t: float) -> None:
        top = 1.0
        if self._total:
            ts, rates = np.array(self._total).T
            self.total_curve.setData(ts - t, rates)
            top = max(top, float(rates.max()))
        else:
            self.total_curve.setData([], [])
        theme = theme_for(self)
        for label, series in self._series.items():
            curve = self.session_curves.get(label)
            if curve is None:
                index = self._color_index.setdefault(label, len(self._color_index))
                curve = pg.PlotDataItem(
                    antialias=True, pen=pg.mkPen(theme.series(index), width=1.5)
                )
                self.plot.getPlotItem().addItem(curve)
                self.session_curves[label] = curve
                self._add_legend_entry(label, label)
            if series:
                ts, rates = np.array(series).T
                curve.setData(ts - t, rates)
                top = max(top, float(rates.max()))
        self.plot.getPlotItem().setYRange(0, top * 1.15, padding=0)

    def reset(self) -> None:
        """Forget the plotted history (the panels now draw another engine)."""
        self._reset()
        self._last_t = None
        self.total_curve.setData([], [])
        self.summary_label.setText("– tok/s")

    def _reset(self) -> None:
        self._total.clear()
        self._prev_tokens = None
        self._cum.clear()
        self._recent.clear()
        for label in list(self._series):
            curve = self.session_curves.pop(label, None)
            if curve is not None:
                self._remove_legend_entry(label)
                self.plot.getPlotItem().removeItem(curve)
        self._series.clear()

    def _apply_theme(self, theme: PanelTheme) -> None:
        style_plot(self.plot, theme)
        self.total_curve.setPen(pg.mkPen(theme.foreground, width=2.5))
        for label, curve in self.session_curves.items():
            curve.setPen(pg.mkPen(theme.series(self._color_index[label]), width=1.5))
        for key in self.legend_entries:
            self._color_entry(key, theme)
