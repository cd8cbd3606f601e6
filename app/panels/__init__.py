"""Live engine panels, each fed one :class:`~backend.api.MetricsSnapshot` at a time.

Overlap (link and compute lanes), layer progress per request, cache (hit rate, slots, the
expert heat map) and throughput each show one side of the engine while it runs; the main
window docks them side by side and hands each the newest snapshot, which the bridge has
already throttled. Panels know nothing of the engine or of each other: each keeps what
history it plots from the snapshots it is given, so any of them can be hidden or moved.
"""

from __future__ import annotations

from app.panels.cache import CachePanel, OccupancyBar
from app.panels.overlap import OverlapPanel, intersect_intervals, merge_intervals
from app.panels.progress import ProgressPanel, RequestTableModel
from app.panels.throughput import ThroughputPanel

__all__ = [
    "CachePanel",
    "OccupancyBar",
    "OverlapPanel",
    "ProgressPanel",
    "RequestTableModel",
    "ThroughputPanel",
    "intersect_intervals",
    "merge_intervals",
]
