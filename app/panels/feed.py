"""Which engine the docked panels draw: this computer's, or the remote one the shown
session runs on.

A remote Bevy server reports its whole snapshot (``/v1/stats?snapshot=1``, polled by
the bridge), so all four panels draw it as they draw the local engine, their titles
naming it. Any other server reports nothing of the kind: the overlap, layer-progress
and cache panels then say so instead of showing this computer's figures under its name,
and throughput is measured here, from the tokens the app receives from it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, QTimer
from PySide6.QtWidgets import QDockWidget, QLabel, QStackedWidget, QWidget

from backend.api import Endpoint, MetricsSnapshot, RequestProgress

# Panels take turns this far apart: redrawing all four plots in one paint pass holds the
# GUI thread long enough to delay streaming replies; one at a time each pass stays short.
PANEL_STAGGER_MS = 20
BEVY_ONLY = ("Overlap", "Layer progress", "Cache")  # what only a Bevy engine can report
CLIENT_TICK_MS = 250
RATE_WINDOW_S = 2.0


class PanelFeed(QObject):
    """Feeds ``panels`` (by dock name) from one engine at a time; ``show_engine`` picks
    it. ``tokens`` answers, for the client-side throughput of a non-Bevy remote, each
    request in flight on that engine: request id -> (session title, tokens so far)."""

    def __init__(
        self,
        panels: dict[str, QWidget],
        docks: dict[str, QDockWidget],
        tokens: Callable[[str], dict[str, tuple[str, int]]],
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.panels, self.docks, self._tokens = panels, docks, tokens
        self.source: Endpoint | None = None  # None: this computer's engine
        self.reports = True  # whether the source reports Bevy's figures
        self._latest: MetricsSnapshot | None = None
        self._stacks: dict[str, QStackedWidget] = {}
        self.notes: dict[str, QLabel] = {}
        for name, dock in docks.items():
            stack = QStackedWidget()
            stack.addWidget(panels[name])
            note = QLabel(wordWrap=True, alignment=Qt.AlignmentFlag.AlignCenter)
            note.setMargin(12)
            stack.addWidget(note)
            dock.setWidget(stack)
            self._stacks[name], self.notes[name] = stack, note
        self._seen: deque[tuple[float, int]] = deque()  # client side: (time, tokens in all)
        self._total = 0
        self._last: dict[str, int] = {}
        self._client = QTimer(self)
        self._client.setInterval(CLIENT_TICK_MS)
        self._client.timeout.connect(self._client_tick)

    def show_engine(self, engine: Endpoint | None) -> None:
        """Draw ``engine``'s figures from now on (None: this computer's)."""
        if engine == self.source:
            return
        self.source, self.reports, self._latest = engine, True, None
        self._client.stop()
        self._seen.clear()
        self._last.clear()
        self._total = 0
        for panel in self.panels.values():
            reset = getattr(panel, "reset", None)
            if reset is not None:
                reset()
        for name, dock in self.docks.items():
            dock.setWindowTitle(f"{name} — {engine.name}" if engine else name)
            self._stacks[name].setCurrentIndex(0)

    def local(self, snap: MetricsSnapshot) -> None:
        """A snapshot of this computer's engine."""
        if self.source is None:
            self._show(snap)

    def remote(self, name: str, snap: MetricsSnapshot | None, reports: bool) -> None:
        """A remote engine's snapshot (None: none to show; ``reports`` False: it is not a
        Bevy server, or cannot be reached)."""
        if self.source is None or name != self.source.name:
            return
        if snap is not None:
            self._set_reports(True)
            self._show(snap)
        elif not reports:
            self._set_reports(False)

    def _set_reports(self, reports: bool) -> None:
        if reports == self.reports:
            return
        self.reports = reports
        engine = self.source.name if self.source else ""
        for name in BEVY_ONLY:
            self.notes[name].setText(
                f"{engine} does not report this: its server is not Bevy (or cannot be "
                "reached now), and only Bevy reports expert-cache figures. Throughput "
                "below is measured here, from the replies as they arrive."
            )
            self._stacks[name].setCurrentIndex(0 if reports else 1)
        if reports:
            self._client.stop()
        else:
            self._client.start()

    def _client_tick(self) -> None:
        """Throughput of a non-Bevy remote, from the tokens received here."""
        if self.source is None:
            return
        now = time.perf_counter()
        flight = self._tokens(self.source.name)
        for rid, (_session, n) in flight.items():
            self._total += max(n - self._last.get(rid, 0), 0)
        self._last = {rid: n for rid, (_s, n) in flight.items()}
        self._seen.append((now, self._total))
        while len(self._seen) > 2 and self._seen[1][0] <= now - RATE_WINDOW_S:
            self._seen.popleft()
        t0, n0 = self._seen[0]
        rate = (self._total - n0) / (now - t0) if now > t0 else math.nan
        requests = tuple(
            RequestProgress(rid, session, 0, 0, "computing", n)
            for rid, (session, n) in flight.items()
        )
        snap = MetricsSnapshot(
            now, rate, math.nan, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, "off", requests,
            tokens_total=self._total,
        )  # fmt: skip
        self.panels["Throughput"].update_snapshot(snap)

    def _show(self, snap: MetricsSnapshot) -> None:
        # Each panel still refreshes at the snapshots' rate, with the newest snapshot.
        self._latest = snap
        for i, panel in enumerate(self.panels.values()):
            QTimer.singleShot(i * PANEL_STAGGER_MS, self, lambda p=panel: self._feed(p))

    def _feed(self, panel: QWidget) -> None:
        if self._latest is not None and panel.isVisible():
            panel.update_snapshot(self._latest)
