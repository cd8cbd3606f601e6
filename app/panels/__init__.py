"""Live engine panels, each fed one :class:`~backend.messages.MetricsSnapshot` at a time.

:class:`PanelSet` builds all four, lays them out in a grid, and forwards each snapshot to every
panel through a :class:`~app.throttle.Throttle`, so however fast snapshots arrive the panels
redraw at most ten times a second and always show the newest one.
"""

from __future__ import annotations

from collections.abc import Mapping

from PySide6.QtWidgets import QGridLayout, QWidget

from app.panels.cache import CachePanel, OccupancyBar
from app.panels.overlap import OverlapPanel, intersect_intervals, merge_intervals
from app.panels.progress import ProgressPanel, RequestTableModel
from app.panels.throughput import ThroughputPanel
from app.throttle import Throttle
from backend.api import MetricsSnapshot


class PanelSet(QWidget):
    """The four panels in a 2 x 2 grid: overlap and progress on top, cache and throughput below.

    Feed it with :meth:`push` (throttled to one redraw per ``interval_ms``) or
    :meth:`update_snapshot` (immediate). The panels are also attributes, so a window may move
    them into docks of its own instead of showing this grid.
    """

    def __init__(
        self,
        session_names: Mapping[str, str] | None = None,
        interval_ms: int = 100,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.overlap = OverlapPanel()
        self.cache = CachePanel()
        self.progress = ProgressPanel(session_names)
        self.throughput = ThroughputPanel(session_names)
        self.throttle = Throttle(interval_ms, parent=self)
        self.throttle.delivered.connect(self.update_snapshot)
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.addWidget(self.overlap, 0, 0)
        grid.addWidget(self.progress, 0, 1)
        grid.addWidget(self.cache, 1, 0)
        grid.addWidget(self.throughput, 1, 1)
        for i in range(2):
            grid.setColumnStretch(i, 1)
            grid.setRowStretch(i, 1)

    @property
    def panels(self) -> tuple[OverlapPanel, CachePanel, ProgressPanel, ThroughputPanel]:
        """All four panels."""
        return self.overlap, self.cache, self.progress, self.throughput

    def push(self, snap: MetricsSnapshot) -> None:
        """Offer a snapshot; the panels get the newest one at most once per interval."""
        self.throttle.push(snap)

    def update_snapshot(self, snap: MetricsSnapshot) -> None:
        """Show ``snap`` in every panel now."""
        for panel in self.panels:
            panel.update_snapshot(snap)

    def set_session_names(self, names: Mapping[str, str]) -> None:
        """Titles (keyed by request id) for the panels that name sessions."""
        self.progress.set_session_names(names)
        self.throughput.set_session_names(names)


__all__ = [
    "CachePanel",
    "OccupancyBar",
    "OverlapPanel",
    "PanelSet",
    "ProgressPanel",
    "RequestTableModel",
    "ThroughputPanel",
    "intersect_intervals",
    "merge_intervals",
]
