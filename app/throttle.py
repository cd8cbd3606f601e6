"""Rate-limit a stream of values so views redraw at a capped rate, newest value wins.

The engine emits metrics faster than a view needs to redraw, and a view that redraws on every
event falls behind and shows stale data. :class:`Throttle` keeps only the newest pushed value
and hands it on at most once per interval: the first value after a quiet period goes out at
once (no added latency), later ones wait for the interval to end, and values overwritten in
the meantime are dropped. Modelled on qutebrowser's ``misc/throttle.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

_NOTHING = object()  # "no pending value"; None is a value a caller may push


class Throttle(QObject):
    """Deliver the newest pushed value at most once per ``interval_ms``.

    Values arrive through :meth:`push` and leave through the :attr:`delivered` signal and,
    if given, ``callback``. Nothing is delivered while nothing new has been pushed.
    """

    delivered = Signal(object)

    def __init__(
        self,
        interval_ms: int = 100,
        callback: Callable[[Any], None] | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be positive, got {interval_ms}")
        self._callback = callback
        self._pending: Any = _NOTHING
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._on_timeout)

    @property
    def interval_ms(self) -> int:
        """Minimum time between two deliveries."""
        return self._timer.interval()

    @property
    def pending(self) -> bool:
        """Whether a pushed value is waiting for the interval to end."""
        return self._pending is not _NOTHING

    def push(self, value: Any) -> None:
        """Offer ``value``; it replaces any value still waiting to be delivered."""
        if self._timer.isActive():
            self._pending = value
            return
        # Quiet period: deliver now and open an interval in which later values wait.
        self._deliver(value)
        self._timer.start()

    def flush(self) -> None:
        """Deliver the waiting value now, if any (e.g. before a view closes)."""
        if self._pending is _NOTHING:
            return
        value, self._pending = self._pending, _NOTHING
        self._deliver(value)
        self._timer.start()

    def cancel(self) -> None:
        """Drop the waiting value and end the current interval."""
        self._pending = _NOTHING
        self._timer.stop()

    def _on_timeout(self) -> None:
        if self._pending is _NOTHING:
            return  # nothing new: stay quiet until the next push
        value, self._pending = self._pending, _NOTHING
        self._deliver(value)
        self._timer.start()  # keep the cap: the next value waits a full interval again

    def _deliver(self, value: Any) -> None:
        if self._callback is not None:
            self._callback(value)
        self.delivered.emit(value)
