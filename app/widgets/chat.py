"""The conversation view (Markdown, code blocks, streaming) and the message input box.

The view re-renders the whole conversation as one Markdown document; its owner calls it
at a capped rate while a reply streams, so the cost does not grow with the token rate.
"""

from __future__ import annotations

import json
import re

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import (
    QDesktopServices,
    QFontDatabase,
    QGuiApplication,
    QKeyEvent,
    QKeySequence,
    QTextCursor,
)
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.widgets.markdown import CodeTheme, Rendered, render

ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}
STATUS_NOTES = {
    "streaming": "generating…",
    "stopped": "stopped",
    "error": "error",
    "interrupted": "interrupted (the app closed while generating)",
}


CARD_LINES = 12  # a tool card shows the end of its output; a link shows the rest
APPROVALS = {
    "rules": "allowed by the rules",
    "approved": "approved",
    "always": "always allowed",
    "denied": "denied",
    "refused": "not run",
}


REASONS = {"stop": "finished", "length": "hit the token limit", "abort": "stopped"}


def reply_footer(stats: dict | None) -> str:
    """The line under a finished reply: tokens, speed, time to first token, why it ended,
    model and policy (Markdown; "" without stats, as for replies from before they were kept)."""
    if not stats:
        return ""
    n = stats.get("tokens", 0)
    parts = [f"{n} token{'s' if n != 1 else ''}"]
    if stats.get("tok_s") is not None:
        parts.append(f"{stats['tok_s']:.1f} tok/s")
    if stats.get("ttft_s") is not None:
        parts.append(f"first token {stats['ttft_s']:.2f} s")
    parts.append(REASONS.get(stats.get("reason", ""), stats.get("reason", "")))
    parts += [
        p for p in (stats.get("model"), stats.get("policy") and f"policy {stats['policy']}") if p
    ]
    return "*" + " · ".join(p for p in parts if p).replace("*", "\\*") + "*"


# Links the view acts on (copy a block, a message action, a card toggle). Only the view's
# own Markdown may hold them: in a message's text they are made inert.
_APP_LINK = re.compile(r"(\]\(\s*<?|^\s*\[[^\]]*\]:\s*<?|<)(?=(?:msg|copy|card):)", re.I | re.M)


def _inert(text: str) -> str:
    """``text`` with links to the view's own schemes turned into plain ``#`` links."""
    return _APP_LINK.sub(lambda m: m.group(1) + "#", text)


def _fence(text: str, lang: str = "") -> str:
    """``text`` in a code block whose fence no run of backticks in it can close."""
    longest = max((len(r) for r in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def _closed(text: str) -> str:
    """``text`` with a code fence it left open closed: a reply cut mid-block (stopped, or
    still streaming) must not turn every message after it into code."""
    open_fence = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if open_fence is None:
            if stripped.startswith(("```", "~~~")):
                mark = stripped[0]
                open_fence = mark * (len(stripped) - len(stripped.lstrip(mark)))
        elif stripped.startswith(open_fence) and not stripped.strip(open_fence[0]):
            open_fence = None
    return f"{text}\n{open_fence}" if open_fence else text


def _subject(name: str, args: object) -> str:
    if not isinstance(args, dict):
        return f"`{str(args)[:200]}`"
    if name == "run_command":
        return _fence(f"$ {args.get('command', '')}", "bash")
    if name == "search":
        return f"`{args.get('pattern', '')}` in `{args.get('path', '.')}`"
    if name == "finish":
        return ""
    if "path" in args:
        return f"`{args['path']}`"
    return f"`{json.dumps(args, ensure_ascii=False)[:200]}`"


def tool_card(m: dict, expanded: bool = False) -> str:
    """A tool call as a card: the tool, what it acts on, its state or result, and its
    output (the last ``CARD_LINES`` lines unless ``expanded``) or diff."""
    d = m.get("data") or {}
    name = d.get("name", "tool")
    state, status = d.get("state"), m.get("status", "done")
    if status == "interrupted":
        badge = "✗ *interrupted (the app closed while it ran)*"
    elif state == "pending":
        badge = "**waiting for your approval** (below)"
    elif state in ("running", "checking") or status == "streaming":
        badge = "*running…*"
    else:
        parts = ["✓" if d.get("ok") else "✗"]
        if name == "run_command" and d.get("approval") in ("rules", "approved", "always"):
            parts.append(f"exit {d['exit_code']}" if d.get("exit_code") is not None else "killed")
        parts.append(f"{d.get('seconds') or 0:.1f} s")
        parts.append(APPROVALS.get(d.get("approval", ""), d.get("approval", "")))
        badge = " · ".join(parts)
    out = [f"**Tool** · `{name}` — {badge}"]
    subject = _subject(name, d.get("arguments"))
    if subject:
        out.append(subject)
    body = d.get("diff") or m.get("content") or ""
    if body.strip() and state not in ("pending", "running", "checking"):
        lines = body.rstrip().splitlines()
        key = m.get("id")
        if len(lines) > CARD_LINES and not expanded:
            out.append(_fence("\n".join(lines[-CARD_LINES:]), "diff" if d.get("diff") else ""))
            out.append(f"[▸ show all {len(lines)} lines](card:{key})")
        else:
            out.append(_fence(body, "diff" if d.get("diff") else ""))
            if len(lines) > CARD_LINES:
                out.append(f"[▾ show less](card:{key})")
    return "\n\n".join(out)


def conversation_markdown(messages: list[dict], expanded: set | frozenset = frozenset()) -> str:
    """One Markdown document for a conversation; each message under a bold speaker label,
    tool calls as cards (``expanded``: the message ids of cards shown whole)."""
    return "\n\n---\n\n".join(conversation_parts(messages, expanded))


def _branch_links(m: dict) -> str:
    """ "‹ 2/3 ›" for a message with alternatives: links to the one before and after it."""
    ids = m.get("branches") or []
    if m.get("id") not in ids:
        return ""
    k = ids.index(m["id"])
    before = f"[‹](msg:branch:{ids[k - 1]})" if k > 0 else "‹"
    after = f"[›](msg:branch:{ids[k + 1]})" if k + 1 < len(ids) else "›"
    return f"{before} {k + 1}/{len(ids)} {after}"


def _can_continue(m: dict) -> bool:
    """A reply that ended early (its token limit, or stopped) with text to go on from."""
    reason = ((m.get("data") or {}).get("stats") or {}).get("reason")
    early = m.get("status") == "stopped" or (m.get("status") == "done" and reason == "length")
    return early and bool((m.get("content") or "").strip())


def _actions(m: dict, last: bool, chat: bool) -> list[str]:
    """A shown message's action links (``msg:<action>:<id>``): copy a reply; in chats,
    regenerate or continue the last reply, edit a question, delete, and move between
    branches."""
    links = []
    if m.get("status") != "streaming" and m.get("id"):
        if m["role"] == "assistant":
            links.append(f"[copy](msg:copy:{m['id']})")
            if chat and last:
                links.append(f"[regenerate](msg:regenerate:{m['id']})")
                if _can_continue(m):
                    links.append(f"[continue](msg:continue:{m['id']})")
        elif m["role"] == "user" and chat:
            links.append(f"[edit](msg:edit:{m['id']})")
        if chat and m["role"] in ("user", "assistant"):
            links.append(f"[delete](msg:delete:{m['id']})")
    nav = _branch_links(m)
    return [*links, nav] if nav else links


def conversation_parts(
    messages: list[dict], expanded: set | frozenset = frozenset(), regenerate: bool = False
) -> list[str]:
    """The conversation's Markdown, one part per shown message (the view renders each
    once, and while a reply streams only its own). Finished replies get action links
    (``msg:copy:<id>``); with ``regenerate`` (a chat) the last reply can be generated
    again or continued, questions edited, and alternatives reached (``_actions``)."""
    parts = []
    for i, m in enumerate(messages):
        data = m.get("data") or {}
        if m["role"] == "tool" and data.get("name"):
            parts.append(tool_card(m, m.get("id") in expanded))
            continue
        if m["role"] == "assistant" and data.get("tool_calls") and not m.get("content"):
            continue  # a turn that only called tools: its cards follow
        if data.get("dropped"):
            n = data["dropped"]
            parts.append(
                f"*⋯ {n} earlier message{'s' if n > 1 else ''} no longer fit the model's "
                "context and were left out of what it read for this reply.*"
            )
        label = f"**{ROLE_LABELS.get(m['role'], m['role'])}**"
        note = STATUS_NOTES.get(m.get("status", "done"))
        if note and m.get("status") == "streaming" and m.get("phase"):
            note = f"{m['phase']}…"  # before the first token: loading, queued, reading
        if note:
            label += f" — *{note}*"
        body = _closed(
            _inert(m.get("content") or "") or ("…" if m.get("status") == "streaming" else "")
        )
        footer = reply_footer(data.get("stats")) if m.get("status") != "streaming" else ""
        links = _actions(m, i == len(messages) - 1, regenerate)
        if links:
            footer = " · ".join([footer, *links] if footer else links)
        parts.append(f"{label}\n\n{body}" + (f"\n\n{footer}" if footer else ""))
    return parts


class ConversationView(QTextBrowser):
    """Renders a whole conversation; the owner calls ``show_messages`` (at a capped rate
    while a reply streams). Stays pinned to the bottom unless the user scrolled up."""

    # "copy" | "regenerate" | "continue" | "edit" | "branch" | "delete", message id
    message_action = Signal(str, int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)  # card links toggle cards; others open in the browser
        self.anchorClicked.connect(self._on_link)
        self.setPlaceholderText("Start typing below. Enter sends, Shift+Enter adds a line.")
        self._shown = ""
        self._code: dict[int, list[str]] = {}  # part -> its code blocks, for copy links
        self._parts: list[str] = []  # the Markdown of each shown part
        self._last_start = 0  # where the last part begins in the document
        self._rendered: dict[tuple, Rendered] = {}
        self._messages: list[dict] = []
        self.expanded: set[int] = set()  # message ids of tool cards shown whole
        self.regenerate = False  # a chat's actions: regenerate, continue, edit, branches

    def _on_link(self, url: QUrl) -> None:
        if url.scheme() == "copy":  # a code block's copy link: copy:<part>.<n>
            part, _, n = (url.path() or url.toString().split(":", 1)[1]).partition(".")
            blocks = self._code.get(int(part), []) if part.isdigit() else []
            if n.isdigit() and int(n) < len(blocks):
                QGuiApplication.clipboard().setText(blocks[int(n)])
        elif url.scheme() == "msg":  # msg:<action>:<message id>
            action, _, mid = (url.path() or url.toString().split(":", 1)[1]).partition(":")
            if mid.isdigit():
                self.message_action.emit(action, int(mid))
        elif url.scheme() == "card":
            key = int(url.path() or url.toString().split(":", 1)[1])
            self.expanded.symmetric_difference_update({key})
            self.show_messages(self._messages)
        else:
            QDesktopServices.openUrl(url)

    def show_messages(self, messages: list[dict]) -> None:
        self._messages = messages
        parts = conversation_parts(messages, self.expanded, self.regenerate)
        text = "\n\n---\n\n".join(parts)
        if text == self._shown:
            return
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        keep = bar.value()
        self._shown = text
        theme = CodeTheme(dark=self.palette().base().color().lightness() < 128)
        streaming = bool(messages) and messages[-1].get("status") == "streaming"
        html = [
            self._html(i, part, theme, keep=not (streaming and i == len(parts) - 1))
            for i, part in enumerate(parts)
        ]
        if parts and parts[:-1] == self._parts[:-1] and len(parts) == len(self._parts):
            # Only the last message changed (a streaming reply): replace it alone. Setting
            # the whole document again takes ~200 ms for 2,000 messages.
            cursor = QTextCursor(self.document())
            cursor.setPosition(self._last_start)
            cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
            cursor.insertHtml(self._last_html(html))
        else:
            # The rule before the last part goes in with it: inserted after a document
            # that ends with one, Qt merges the rule into the part's first line.
            self.setHtml("<hr/>".join(html[:-1]))
            cursor = QTextCursor(self.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            self._last_start = cursor.position()
            if html:
                cursor.insertHtml(self._last_html(html))
        self._parts = parts
        bar.setValue(bar.maximum() if at_bottom else keep)

    @staticmethod
    def _last_html(html: list[str]) -> str:
        return ("<hr/>" if len(html) > 1 else "") + html[-1]

    def _html(self, index: int, part: str, theme: CodeTheme, keep: bool = True) -> str:
        """A part's HTML, rendered once per text (``keep``; a streaming reply's passing
        texts are not kept): its code blocks' copy links name the part
        (``copy:<part>.<n>``)."""
        key = (index, part, theme)
        hit = self._rendered.get(key)
        if hit is None:
            hit = render(part, theme, anchor=f"{index}.")
            if keep:
                if len(self._rendered) > 4096:  # a bound for long sessions switched often
                    self._rendered.clear()
                self._rendered[key] = hit
        self._code[index] = hit.code
        return hit.html

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


class ApprovalBar(QFrame):
    """A tool call waiting for the user: what it would do, and Approve (Ctrl+Enter),
    Always allow such calls in this session (Ctrl+Shift+Enter) or Deny (Ctrl+Backspace)."""

    answered = Signal(str)  # "approve" | "always" | "deny"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setStyleSheet("ApprovalBar { background: #fff6d6; border: 1px solid #e0b000; }")
        self.title = QLabel()
        self.title.setStyleSheet("font-weight: bold")
        self.preview = QPlainTextEdit(readOnly=True)
        self.preview.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.preview.setMaximumHeight(130)
        self.buttons = {}
        row = QHBoxLayout()
        row.addWidget(self.title, 1)
        for answer, text, keys in (
            ("approve", "Approve", "Ctrl+Return"),
            ("always", "Always allow", "Ctrl+Shift+Return"),
            ("deny", "Deny", "Ctrl+Backspace"),
        ):
            b = QPushButton(
                f"{text}  ({QKeySequence(keys).toString(QKeySequence.SequenceFormat.NativeText)})"
            )
            b.setShortcut(QKeySequence(keys))
            b.clicked.connect(lambda _=False, a=answer: self.answered.emit(a))
            row.addWidget(b)
            self.buttons[answer] = b
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.addLayout(row)
        layout.addWidget(self.preview)
        self.hide()

    def ask(self, name: str, preview: str) -> None:
        self.title.setText(f"Allow {name}?")
        self.preview.setPlainText(preview)
        self.show()
