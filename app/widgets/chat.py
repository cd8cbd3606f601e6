"""The conversation view (Markdown, code blocks, streaming) and the message input box.

The view re-renders the whole conversation as one Markdown document; its owner calls it
at a capped rate while a reply streams, so the cost does not grow with the token rate.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QTextBrowser, QWidget

ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}
STATUS_NOTES = {
    "streaming": "generating…",
    "stopped": "stopped",
    "error": "error",
    "interrupted": "interrupted (the app closed while generating)",
}


def conversation_markdown(messages: list[dict]) -> str:
    """One Markdown document for a conversation; each message under a bold speaker label."""
    parts = []
    for m in messages:
        label = f"**{ROLE_LABELS.get(m['role'], m['role'])}**"
        note = STATUS_NOTES.get(m.get("status", "done"))
        if note:
            label += f" — *{note}*"
        body = m.get("content") or ("…" if m.get("status") == "streaming" else "")
        parts.append(f"{label}\n\n{body}")
    return "\n\n---\n\n".join(parts)


class ConversationView(QTextBrowser):
    """Renders a whole conversation; the owner calls ``show_messages`` (at a capped rate
    while a reply streams). Stays pinned to the bottom unless the user scrolled up."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setPlaceholderText("Start typing below. Enter sends, Shift+Enter adds a line.")
        self._shown = ""

    def show_messages(self, messages: list[dict]) -> None:
        text = conversation_markdown(messages)
        if text == self._shown:
            return
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        keep = bar.value()
        self._shown = text
        self.setMarkdown(text)
        bar.setValue(bar.maximum() if at_bottom else keep)

    @property
    def shown_markdown(self) -> str:
        return self._shown


class InputBox(QPlainTextEdit):
    """Enter sends, Shift+Enter inserts a newline, Esc asks to stop the running reply."""

    send_requested = Signal(str)
    stop_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line, Esc to stop)")
        self.setTabChangesFocus(True)
        self.setMaximumHeight(120)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 (Qt override)
        key, mods = event.key(), event.modifiers()
        if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            mods & Qt.KeyboardModifier.ShiftModifier
        ):
            text = self.toPlainText().strip()
            if text:
                self.clear()
                self.send_requested.emit(text)
            return
        if key == Qt.Key.Key_Escape:
            self.stop_requested.emit()
            return
        super().keyPressEvent(event)
