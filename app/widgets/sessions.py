"""The session sidebar: chat and coding-agent sessions, search by title, rename, delete.

It keeps only what it displays (id, title, kind, busy) and never touches the store: the
user's actions leave as signals for the window. Search filters the shown list in place,
case-insensitively on titles, so typing needs no database query.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QPoint, QSortFilterProxyModel, Qt, Signal
from PySide6.QtGui import QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QListView,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

ID_ROLE = Qt.ItemDataRole.UserRole + 1
KIND_ROLE = Qt.ItemDataRole.UserRole + 2
TITLE_ROLE = Qt.ItemDataRole.UserRole + 3
BUSY_ROLE = Qt.ItemDataRole.UserRole + 4
ACTIVITY_ROLE = Qt.ItemDataRole.UserRole + 5
KIND_SUFFIX = {"chat": "", "agent": "  · agent"}
# Before the title, where eliding a long title cannot hide it.
ACTIVITY_MARKS = {"thinking": "● ", "running a tool": "▶ ", "waiting for approval": "? "}


class SessionList(QWidget):
    selected = Signal(int)  # session id
    new_requested = Signal(str)  # kind
    rename_requested = Signal(int, str)  # id, new title
    delete_requested = Signal(int)
    export_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = QStandardItemModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setFilterRole(TITLE_ROLE)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.search = QLineEdit(placeholderText="Search sessions")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.proxy.setFilterFixedString)
        self.view = QListView()
        self.view.setModel(self.proxy)
        self.view.setEditTriggers(QListView.EditTrigger.NoEditTriggers)
        self.view.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.view.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.view.customContextMenuRequested.connect(self._menu)
        self.view.selectionModel().currentChanged.connect(self._current_changed)
        new_chat = QPushButton("New chat")
        new_chat.clicked.connect(lambda: self.new_requested.emit("chat"))
        new_agent = QPushButton("New agent")
        new_agent.setToolTip("A coding agent that reads, edits and runs code in a folder")
        new_agent.clicked.connect(lambda: self.new_requested.emit("agent"))
        buttons = QHBoxLayout()
        buttons.addWidget(new_chat)
        buttons.addWidget(new_agent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(buttons)
        layout.addWidget(self.search)
        layout.addWidget(self.view)

    # --- data ---------------------------------------------------------------------------

    def set_sessions(self, sessions: list[dict]) -> None:
        """Replace the list (newest first): dicts with id, title, kind."""
        current = self.current_id()
        self.model.clear()
        for s in sessions:
            self.model.appendRow(self._item(s["id"], s["title"], s["kind"]))
        if current is not None:
            self.select(current)

    def _item(self, session_id: int, title: str, kind: str) -> QStandardItem:
        item = QStandardItem()
        item.setData(session_id, ID_ROLE)
        item.setData(kind, KIND_ROLE)
        item.setData(title, TITLE_ROLE)
        item.setData(False, BUSY_ROLE)
        self._label(item)
        return item

    @staticmethod
    def _label(item: QStandardItem) -> None:
        activity = item.data(ACTIVITY_ROLE) or ""
        busy = " ●" if item.data(BUSY_ROLE) and not activity else ""
        kind = item.data(KIND_ROLE)
        mark = ACTIVITY_MARKS.get(activity, "")
        item.setText(f"{mark}{item.data(TITLE_ROLE)}{KIND_SUFFIX.get(kind, '')}{busy}")
        tip = "coding-agent session" if kind == "agent" else "chat session"
        if activity:
            tip = f"{tip}: {activity}"
        elif busy:
            tip = f"{tip}, generating"
        item.setToolTip(tip)

    def _find(self, session_id: int) -> QStandardItem | None:
        for row in range(self.model.rowCount()):
            item = self.model.item(row)
            if item.data(ID_ROLE) == session_id:
                return item
        return None

    def add_session(self, session_id: int, title: str, kind: str) -> None:
        self.model.insertRow(0, self._item(session_id, title, kind))

    def set_title(self, session_id: int, title: str) -> None:
        if (item := self._find(session_id)) is not None:
            item.setData(title, TITLE_ROLE)
            self._label(item)

    def set_busy(self, session_id: int, busy: bool) -> None:
        if (item := self._find(session_id)) is not None and item.data(BUSY_ROLE) != busy:
            item.setData(busy, BUSY_ROLE)
            self._label(item)

    def set_activity(self, session_id: int, activity: str) -> None:
        """What an agent is doing ("thinking", "running a tool", "waiting for approval";
        "" when idle), shown before its title."""
        if (item := self._find(session_id)) is not None and item.data(ACTIVITY_ROLE) != activity:
            item.setData(activity, ACTIVITY_ROLE)
            self._label(item)

    def remove(self, session_id: int) -> None:
        if (item := self._find(session_id)) is not None:
            self.model.removeRow(item.row())

    def titles(self) -> list[str]:
        """Titles in view order (after the search filter)."""
        return [self.proxy.index(r, 0).data(TITLE_ROLE) for r in range(self.proxy.rowCount())]

    # --- selection ----------------------------------------------------------------------

    def current_id(self) -> int | None:
        idx = self.view.currentIndex()
        return idx.data(ID_ROLE) if idx.isValid() else None

    def select(self, session_id: int) -> None:
        if (item := self._find(session_id)) is not None:
            self.view.setCurrentIndex(self.proxy.mapFromSource(item.index()))

    def _current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid():
            self.selected.emit(current.data(ID_ROLE))

    def _menu(self, pos: QPoint) -> None:
        idx = self.view.indexAt(pos)
        if not idx.isValid():
            return
        sid, title = idx.data(ID_ROLE), idx.data(TITLE_ROLE)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.ask_rename(sid, title))
        menu.addAction("Export…", lambda: self.export_requested.emit(sid))
        menu.addAction("Delete", lambda: self.delete_requested.emit(sid))
        menu.popup(self.view.viewport().mapToGlobal(pos))

    def ask_rename(self, session_id: int, title: str) -> None:
        new, ok = QInputDialog.getText(self, "Rename session", "Title:", text=title)
        if ok and new.strip():
            self.rename_requested.emit(session_id, new.strip())
