"""Layer progress: one row per active request with a bar at its current layer and its state.

Under runahead, requests sit at different layers at the same moment; the bars make that
visible at a glance. Rows live in :class:`RequestTableModel` (keyed by request id, so rows
keep their place while a request runs and disappear when it finishes); the view only draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from PySide6.QtCore import (
    QAbstractTableModel,
    QModelIndex,
    QPersistentModelIndex,
    QRectF,
    Qt,
)
from PySide6.QtGui import QColor, QFont, QPainter
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.panels._theme import PanelTheme, ThemedPanel, set_swatch, theme_for
from backend.api import MetricsSnapshot, RequestProgress

STATES = ("computing", "ready", "waiting", "queued")
STATE_LABELS = {
    "computing": "computing",
    "ready": "ready",
    "waiting": "waiting for experts",
    "queued": "queued",
}
STATE_TIPS = {
    "computing": "A compute job ran for it in the last moment.",
    "ready": "Its experts for this layer are in the cache: it computes when its turn comes.",
    "waiting": "Some of its experts for this layer are still being read into the cache.",
    "queued": "Not admitted yet: waiting for room (KV memory or the most requests at once).",
}
STATE_ROLE = Qt.ItemDataRole.UserRole + 1  # the raw state string of a row
FRACTION_ROLE = Qt.ItemDataRole.UserRole + 2  # layer / n_layers, 0..1
COLOR_ROLE = Qt.ItemDataRole.UserRole + 3  # QColor of the row's state

_Index = QModelIndex | QPersistentModelIndex


def state_colors(theme: PanelTheme) -> dict[str, QColor]:
    """Colour of each request state in ``theme``."""
    return {
        "computing": theme.compute,
        "ready": theme.link,
        "waiting": theme.warn,
        "queued": theme.neutral,
    }


class RequestTableModel(QAbstractTableModel):
    """Active requests, one row each, in the order they first appeared."""

    COLUMNS = ("Session", "Layer", "State", "Tokens")
    SESSION, LAYER, STATE, TOKENS = range(4)

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._rows: list[RequestProgress] = []
        self._names: dict[str, str] = {}
        self._colors: dict[str, QColor] = {}

    def set_session_names(self, names: Mapping[str, str]) -> None:
        """Titles to show instead of request ids / session labels, keyed by request id."""
        self._names = dict(names)
        if self._rows:
            self._changed(0, len(self._rows) - 1)

    def set_state_colors(self, colors: Mapping[str, QColor]) -> None:
        """Colours for the state swatches and layer bars."""
        self._colors = dict(colors)
        if self._rows:
            self._changed(0, len(self._rows) - 1)

    def request(self, row: int) -> RequestProgress:
        """The request shown in ``row``."""
        return self._rows[row]

    def session_title(self, req: RequestProgress) -> str:
        """What a row calls its request: the mapped title, else the session label, else the id."""
        return self._names.get(req.request_id) or req.session or req.request_id

    def set_requests(self, requests: Sequence[RequestProgress]) -> None:
        """Make the rows match ``requests``: drop finished ones, update the rest in place,
        append new ones (so rows do not jump around while requests run)."""
        latest = {r.request_id: r for r in requests}
        for row in range(len(self._rows) - 1, -1, -1):
            if self._rows[row].request_id not in latest:
                self.beginRemoveRows(QModelIndex(), row, row)
                del self._rows[row]
                self.endRemoveRows()
        changed = [i for i, old in enumerate(self._rows) if latest[old.request_id] != old]
        for i in changed:
            self._rows[i] = latest[self._rows[i].request_id]
        if changed:
            self._changed(changed[0], changed[-1])
        known = {r.request_id for r in self._rows}
        new = [r for r in latest.values() if r.request_id not in known]
        if new:
            start = len(self._rows)
            self.beginInsertRows(QModelIndex(), start, start + len(new) - 1)
            self._rows.extend(new)
            self.endInsertRows()

    def _changed(self, first: int, last: int) -> None:
        self.dataChanged.emit(self.index(first, 0), self.index(last, len(self.COLUMNS) - 1))

    def rowCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008, N802
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008, N802
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(  # noqa: N802 (Qt override)
        self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.COLUMNS[section]
        return None

    def data(self, index: _Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        req, col = self._rows[index.row()], index.column()
        if role == STATE_ROLE:
            return req.state
        if role == FRACTION_ROLE:
            return min(max(req.layer / req.n_layers, 0.0), 1.0) if req.n_layers > 0 else 0.0
        if role == COLOR_ROLE:
            return self._colors.get(req.state)
        if role == Qt.ItemDataRole.DisplayRole:
            if col == self.SESSION:
                return self.session_title(req)
            if col == self.LAYER:
                return f"{req.layer} / {req.n_layers}"
            if col == self.STATE:
                return STATE_LABELS.get(req.state, req.state)
            return str(req.tokens)
        if role == Qt.ItemDataRole.DecorationRole and col == self.STATE:
            return self._colors.get(req.state)
        if role == Qt.ItemDataRole.ToolTipRole:
            return f"{req.request_id}: layer {req.layer} of {req.n_layers}, {req.tokens} tokens"
        if role == Qt.ItemDataRole.TextAlignmentRole and col == self.TOKENS:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None


class LayerBarDelegate(QStyledItemDelegate):
    """Draws the layer column as a track filled up to the request's layer, in its state colour."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: _Index) -> None:
        fraction = float(index.data(FRACTION_ROLE) or 0.0)
        color = index.data(COLOR_ROLE) or option.palette.color(option.palette.ColorRole.Mid)
        text = index.data(Qt.ItemDataRole.DisplayRole) or ""
        theme = theme_for(option.widget) if option.widget is not None else None
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        bar = QRectF(option.rect).adjusted(4, 5, -4, -5)
        painter.setBrush(
            theme.grid if theme else option.palette.color(option.palette.ColorRole.Mid)
        )
        painter.drawRoundedRect(bar, 3, 3)
        # At least a sliver, so a request at layer 0 still shows its state colour.
        filled = QRectF(bar.x(), bar.y(), max(bar.width() * fraction, 4.0), bar.height())
        painter.setBrush(QColor(color))
        painter.drawRoundedRect(filled, 3, 3)
        # The label may straddle the fill's edge: each part gets the colour that reads on
        # what is under it.
        inside = bar.adjusted(6, 0, -6, 0)
        align = int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        fill = QColor(color)
        luma = 0.2126 * fill.redF() + 0.7152 * fill.greenF() + 0.0722 * fill.blueF()
        on_fill = QColor("#101010") if luma > 0.5 else QColor("#ffffff")
        track = QRectF(filled.right(), bar.y(), bar.right() - filled.right(), bar.height())
        for clip, pen in (
            (filled, on_fill),
            (track, option.palette.color(option.palette.ColorRole.Text)),
        ):
            painter.setClipRect(clip)
            painter.setPen(pen)
            painter.drawText(inside, align, text)
        painter.restore()


class ProgressPanel(ThemedPanel):
    """Active requests with their layer (a bar out of ``n_layers``) and state, plus a legend.

    ``session_names`` maps request ids to session titles; without a title a row shows the
    request's session label, then its id.
    """

    def __init__(
        self, session_names: Mapping[str, str] | None = None, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.model = RequestTableModel(self)
        self.model.set_session_names(session_names or {})
        bold = QFont(self.font())
        bold.setBold(True)
        self.summary_label = QLabel("no active requests")
        self.summary_label.setFont(bold)
        self.summary_label.setToolTip(
            "Requests in the engine: the layer each is at (of the model's layers) in the "
            "token it is working on, and what it is doing."
        )

        self.view = QTableView()
        self.view.setModel(self.model)
        self.view.setItemDelegateForColumn(RequestTableModel.LAYER, LayerBarDelegate(self.view))
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.view.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.view.setShowGrid(False)
        self.view.verticalHeader().hide()
        self.view.verticalHeader().setDefaultSectionSize(26)
        header = self.view.horizontalHeader()
        # The bar takes whatever the text columns leave; a handful of rows is cheap to measure.
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(RequestTableModel.LAYER, QHeaderView.ResizeMode.Stretch)
        header.setMinimumSectionSize(60)

        self._legend = QHBoxLayout()
        self._swatches: dict[str, QLabel] = {}
        for state in STATES:
            swatch = QLabel()
            self._swatches[state] = swatch
            self._legend.addWidget(swatch)
            label = QLabel(STATE_LABELS[state])
            label.setToolTip(STATE_TIPS[state])
            swatch.setToolTip(STATE_TIPS[state])
            self._legend.addWidget(label)
            self._legend.addSpacing(10)
        self._legend.addStretch(1)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.summary_label)
        layout.addWidget(self.view, 1)
        layout.addLayout(self._legend)
        self._apply_theme(theme_for(self))

    def set_session_names(self, names: Mapping[str, str]) -> None:
        """Show these titles (keyed by request id) instead of session labels."""
        self.model.set_session_names(names)

    def update_snapshot(self, snap: MetricsSnapshot) -> None:
        """Show ``snap``'s active requests."""
        self.model.set_requests(snap.requests)
        n = len(snap.requests)
        if n == 0:
            self.summary_label.setText("no active requests")
            return
        layers = [r.layer for r in snap.requests]
        spread = (
            f"layers {min(layers)}–{max(layers)}"
            if min(layers) != max(layers)
            else (f"all at layer {layers[0]}")
        )
        noun = "request" if n == 1 else "requests"
        self.summary_label.setText(f"{n} active {noun} · {spread} · runahead {snap.runahead}")

    def _apply_theme(self, theme: PanelTheme) -> None:
        colors = state_colors(theme)
        self.model.set_state_colors(colors)
        for state, swatch in self._swatches.items():
            set_swatch(swatch, colors[state])


__all__ = [
    "COLOR_ROLE",
    "FRACTION_ROLE",
    "STATE_ROLE",
    "STATES",
    "LayerBarDelegate",
    "ProgressPanel",
    "RequestTableModel",
    "state_colors",
]
