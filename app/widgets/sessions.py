"""The session sidebar: chat and coding-agent sessions, search by title, rename, delete.

It keeps only what it displays (id, title, kind, busy) and never touches the store: the
user's actions leave as signals for the window. Search filters the shown list in place,
case-insensitively on titles, so typing needs no database query.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QPoint, QRect, QSize, QSortFilterProxyModel, Qt, Signal
from PySide6.QtGui import QFontMetrics, QPainter, QPalette, QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QListView,
    QMenu,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

ID_ROLE = Qt.ItemDataRole.UserRole + 1
KIND_ROLE = Qt.ItemDataRole.UserRole + 2
TITLE_ROLE = Qt.ItemDataRole.UserRole + 3
BUSY_ROLE = Qt.ItemDataRole.UserRole + 4
ACTIVITY_ROLE = Qt.ItemDataRole.UserRole + 5
BADGES_ROLE = Qt.ItemDataRole.UserRole + 6  # the markers drawn after the title
ACTIVITY_MARKS = {"thinking": "●", "running a tool": "▶", "waiting for approval": "?"}
BUSY_MARK = "●"
AGENT_BADGE = "agent"


def elide_words(fm: QFontMetrics, text: str, width: int) -> str:
    """``text`` cut at a word boundary with "…" to fit ``width`` pixels; a first word too
    long for it is cut where it must be."""
    if fm.horizontalAdvance(text) <= width:
        return text
    words = text.split(" ")
    for n in range(len(words) - 1, 0, -1):
        cut = " ".join(words[:n]).rstrip(" ,;:.-") + "…"
        if fm.horizontalAdvance(cut) <= width:
            return cut
    return fm.elidedText(text, Qt.TextElideMode.ElideRight, width)


class SessionDelegate(QStyledItemDelegate):
    """A row: the title, elided at a word boundary, then its badges (agent, busy, what an
    agent is doing), which are never elided away."""

    PAD = 6

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:
        # As wide as the list, whatever the title: a row wider than the list would put its
        # badges out of sight (and the list grew a scroll extent for long titles).
        hint = super().sizeHint(option, index)
        view = self.parent()
        if isinstance(view, QListView):
            hint.setWidth(min(hint.width(), max(1, view.viewport().width())))
        hint.setHeight(hint.height() + self.PAD)
        return hint

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        opt = QStyleOptionViewItem(option)
        self.initStyleOption(opt, index)
        title, opt.text = opt.text, ""
        widget = opt.widget
        style = widget.style() if widget is not None else QApplication.style()
        style.drawControl(QStyle.ControlElement.CE_ItemViewItem, opt, painter, widget)
        rect = style.subElementRect(QStyle.SubElement.SE_ItemViewItemText, opt, widget)
        rect = rect.adjusted(self.PAD // 2, 0, -self.PAD // 2, 0)
        fm = opt.fontMetrics
        badges = index.data(BADGES_ROLE) or ()
        selected = bool(opt.state & QStyle.StateFlag.State_Selected)
        group = QPalette.ColorGroup.Normal
        text_role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text
        muted_role = (
            QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.PlaceholderText
        )
        right = rect.right()
        painter.save()
        for badge in reversed(badges):  # right to left
            width = fm.horizontalAdvance(badge)
            painter.setPen(
                opt.palette.color(group, muted_role if badge == AGENT_BADGE else text_role)
            )
            painter.drawText(
                QRect(right - width, rect.top(), width, rect.height()),
                int(Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight),
                badge,
            )
            right -= width + self.PAD
        title_rect = QRect(rect.left(), rect.top(), max(0, right - rect.left()), rect.height())
        painter.setPen(opt.palette.color(group, text_role))
        painter.drawText(
            title_rect,
            int(Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft),
            elide_words(fm, title, title_rect.width()),
        )
        painter.restore()


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
        self.view.setItemDelegate(SessionDelegate(self.view))
        self.view.setResizeMode(QListView.ResizeMode.Adjust)  # rows follow the list's width
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
        busy = bool(item.data(BUSY_ROLE)) and not activity
        kind = item.data(KIND_ROLE)
        badges = [AGENT_BADGE] if kind == "agent" else []
        if activity in ACTIVITY_MARKS:
            badges.append(ACTIVITY_MARKS[activity])
        elif busy:
            badges.append(BUSY_MARK)
        item.setText(item.data(TITLE_ROLE))
        item.setData(tuple(badges), BADGES_ROLE)
        tip = f"{item.data(TITLE_ROLE)}\n" + (
            "coding-agent session" if kind == "agent" else "chat session"
        )
        if activity:
            tip = f"{tip}: {activity}"
        elif busy:
            tip = f"{tip}, generating"
        item.setToolTip(tip)

    def badges(self, session_id: int) -> tuple[str, ...]:
        """The markers shown after a session's title."""
        item = self._find(session_id)
        return item.data(BADGES_ROLE) if item is not None else ()

    def _find(self, session_id: int) -> QStandardItem | None:
        for row in range(self.model.rowCount()):
            item = self.model.item(row)
            if item.data(ID_ROLE) == session_id:
                return item
        return None

    def add_session(self, session_id: int, title: str, kind: str, row: int = 0) -> None:
        """Add a session at ``row`` of the list (the top by default: the newest)."""
        row = min(max(row, 0), self.model.rowCount())
        self.model.insertRow(row, self._item(session_id, title, kind))

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

    def remove(self, session_id: int) -> int:
        """Take a session out of the list; returns the row it had (-1: not listed)."""
        if (item := self._find(session_id)) is None:
            return -1
        row = item.row()
        self.model.removeRow(row)
        return row

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
