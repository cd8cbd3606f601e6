"""The main window: the layout, the menus, and the wiring between widgets and controller.

The window builds the session sidebar, the conversation view and input, the docked live
panels and the status bar, and turns menu actions and button clicks into calls on the
:class:`~app.controller.ChatController`, which owns the replies and every write of
sessions and messages. What the controller reports (a reply started, a token, a reply
finished, a session became busy or idle) comes back as signals the window turns into
widget updates. A streaming reply is re-rendered on a timer rather than per token, so the
view's cost stays the same however fast tokens arrive. The window edits the app settings
(the controller holds them) and starts the engine from them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMenu,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.bridge import Bridge
from app.controller import ChatController
from app.dialogs.agent import NewAgentDialog
from app.dialogs.engines import EnginesDialog
from app.dialogs.models import ModelManager
from app.dialogs.session import SessionSettingsDialog
from app.dialogs.settings import SettingsDialog
from app.engines import load_engines, save_engines
from app.panels import CachePanel, OverlapPanel, ProgressPanel, ThroughputPanel
from app.panels.feed import PanelFeed
from app.settings import ENGINE_KEYS, PROFILES_KEY, engine_config, merged, profile, with_profile
from app.store import Store
from app.widgets.chat import ApprovalBar, ConversationView, InputBox
from app.widgets.compare import CompareView
from app.widgets.sessions import SessionList
from backend import api
from backend.api import MetricsSnapshot

RENDER_INTERVAL_MS = 66  # a streaming reply re-renders at most ~15 times a second


UNDO_MS = 10_000  # how long a deleted session can be brought back


def _short(title: str, n: int = 32) -> str:
    return title if len(title) <= n else title[: n - 1].rstrip() + "…"


class MainWindow(QMainWindow):
    def __init__(self, store: Store, bridge: Bridge | None = None) -> None:
        super().__init__()
        self.setWindowTitle("Bevy")
        self.resize(1400, 860)
        self.store = store
        self.bridge = bridge or Bridge(self)
        # The settings themselves, not a callback: the controller (a child QObject) must not
        # refer back to the window. That cycle is left to the garbage collector, and PySide
        # crashed when the collector freed it.
        self.controller = ChatController(
            store, self.bridge, merged(store.get_setting("app")), parent=self
        )
        self.error_box: QMessageBox | None = None
        self._agent_dialog: NewAgentDialog | None = None
        self._dirty: set[int] = set()
        self._latest: MetricsSnapshot | None = None

        self.sessions = SessionList()
        self.view = ConversationView()
        self.approval = ApprovalBar()
        self.input = InputBox()
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.session_settings_button = QPushButton("Session settings…")
        self.title_label = QLabel()
        self.title_label.setStyleSheet("font-weight: bold")
        # Shown while a question is being edited: Enter sends it as a new branch.
        self.edit_note = QLabel()
        self.edit_note.setWordWrap(True)
        self.edit_note.hide()
        self._editing: tuple[int, int] | None = None  # session id, message id
        self._draft = ""  # what the input held when the edit began
        center = QWidget()
        row = QHBoxLayout()
        row.addWidget(self.title_label, 1)
        row.addWidget(self.session_settings_button)
        buttons = QHBoxLayout()
        buttons.addWidget(self.input, 1)
        col = QVBoxLayout()
        col.addWidget(self.send_button)
        col.addWidget(self.stop_button)
        buttons.addLayout(col)
        # Loading shows here, in the window: a separate progress dialog fell behind it.
        self.loading = QFrame()
        self.loading.setFrameShape(QFrame.Shape.StyledPanel)
        self.loading_label = QLabel()
        self.loading_label.setWordWrap(True)
        self.loading_bar = QProgressBar()
        self.loading_bar.setRange(0, 0)  # busy until the loader reports a fraction
        self.loading_bar.setMaximumWidth(220)
        bar_row = QHBoxLayout(self.loading)
        bar_row.setContentsMargins(8, 4, 8, 4)
        bar_row.addWidget(self.loading_label, 1)
        bar_row.addWidget(self.loading_bar)
        self.loading.hide()
        layout = QVBoxLayout(center)
        layout.addLayout(row)
        layout.addWidget(self.loading)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.approval)
        layout.addWidget(self.edit_note)
        layout.addLayout(buttons)
        split = QSplitter()
        split.addWidget(self.sessions)
        split.addWidget(center)
        split.setStretchFactor(1, 1)
        split.setSizes([240, 900])
        self.setCentralWidget(split)

        # The bridge already throttles metrics, so the panels are fed directly.
        self.panels = {
            "Overlap": OverlapPanel(),
            "Cache": CachePanel(),
            "Layer progress": ProgressPanel(),
            "Throughput": ThroughputPanel(),
        }
        self.docks: dict[str, QDockWidget] = {}
        for name in ("Overlap", "Layer progress", "Cache", "Throughput"):  # top to bottom
            dock = QDockWidget(name, self)
            dock.setObjectName(f"dock-{name}")
            dock.setWidget(self.panels[name])
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
            self.docks[name] = dock
        # Which engine they draw: this computer's, or the shown session's remote one.
        self.feed = PanelFeed(self.panels, self.docks, self.controller.remote_tokens, self)
        docks = list(self.docks.values())
        self.resizeDocks(docks, [640] * 4, Qt.Orientation.Horizontal)
        self.resizeDocks(docks, [190, 210, 230, 190], Qt.Orientation.Vertical)
        self.compare = CompareView(self.bridge, self.store)

        self.status_model = QLabel()
        self.status_engine = QLabel()
        self.status_speed = QLabel()
        self.status_api = QLabel()
        for w in (self.status_model, self.status_engine, self.status_speed, self.status_api):
            self.statusBar().addPermanentWidget(w)
        self.undo_button = QPushButton()
        self.undo_button.setFlat(True)
        self.undo_button.clicked.connect(self.undo_delete)
        self.undo_button.hide()
        self.statusBar().insertWidget(0, self.undo_button)
        self._pending_delete: tuple[int, str, str, int] | None = None  # id, title, kind, row
        self._pending_message: tuple[int, int] | None = None  # a deleted message: session, id
        self._undo_timer = QTimer(self)
        self._undo_timer.setSingleShot(True)
        self._undo_timer.timeout.connect(self.commit_delete)
        self._build_menus()

        self.sessions.selected.connect(self.show_session)
        self.sessions.new_requested.connect(self.new_session)
        self.sessions.rename_requested.connect(self.rename_session)
        self.sessions.delete_requested.connect(self.delete_session)
        self.sessions.export_requested.connect(self.export_session)
        self.input.send_requested.connect(self.send)
        self.input.stop_requested.connect(self.stop_current)
        self.send_button.clicked.connect(self._send_clicked)
        self.stop_button.clicked.connect(self.stop_current)
        self.session_settings_button.clicked.connect(self.edit_session_settings)
        self.controller.reply_started.connect(self._changed)
        self.controller.token.connect(self._changed)
        self.controller.reply_finished.connect(self._changed)
        self.controller.busy_changed.connect(self._on_busy)
        self.controller.session_renamed.connect(self._on_renamed)
        self.controller.notice.connect(lambda text: self.statusBar().showMessage(text, 6000))
        agents = self.controller.agents
        agents.approval_changed.connect(self._on_approval)
        agents.activity_changed.connect(self._on_activity)
        self.approval.answered.connect(self._answer)
        self.view.message_action.connect(self._message_action)
        # Esc stops the current session's reply wherever the focus is in the window (the
        # message box, the conversation, the sidebar), not only in the message box.
        stop = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        stop.setContext(Qt.ShortcutContext.WindowShortcut)
        stop.activated.connect(self.stop_current)
        self.bridge.metrics.connect(self._on_metrics)
        self.bridge.remote_metrics.connect(self.feed.remote)
        self.bridge.state_changed.connect(self._on_state)
        self.bridge.load_progress.connect(self._on_load_progress)
        self.bridge.api_changed.connect(self._on_api)
        self.bridge.api_error.connect(lambda err: self.show_error("The API could not start", err))
        self._render_timer = QTimer(self)
        self._render_timer.setInterval(RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._render_dirty)
        self._render_timer.start()

        self.reload_sessions()
        self._update_status()

    @property
    def settings(self) -> dict:
        """The app settings; the controller holds them, as replies are sampled with them."""
        return self.controller.settings

    @settings.setter
    def settings(self, values: dict) -> None:
        self.controller.settings = values

    # --- menus --------------------------------------------------------------------------

    def _build_menus(self) -> None:
        file = self.menuBar().addMenu("&File")
        self._action(file, "New chat", lambda: self.new_session("chat"), QKeySequence.New)
        self._action(file, "New agent session", lambda: self.new_session("agent"), "Ctrl+Shift+N")
        self._action(file, "Export session…", lambda: self.export_session(self.current_id))
        file.addSeparator()
        self._action(file, "Quit", self.close, QKeySequence.Quit)
        model = self.menuBar().addMenu("&Model")
        self._action(model, "Models…", self.open_model_manager)
        self._action(model, "Engines…", self.open_engines)
        self.settings_action = self._action(
            model, "Settings…", self.open_settings, QKeySequence.Preferences
        )
        # Preferences has no key on most Linux desktops: Ctrl+, as LM Studio and editors use.
        self.settings_action.setShortcuts(
            [QKeySequence(QKeySequence.Preferences), QKeySequence("Ctrl+,")]
        )
        view = self.menuBar().addMenu("&View")
        for dock in self.docks.values():
            view.addAction(dock.toggleViewAction())
        view.addSeparator()
        self._action(view, "Compare policies…", self.open_compare, "Ctrl+K")

    def _action(
        self,
        menu: QMenu,
        text: str,
        slot: Callable[[], object],
        shortcut: QKeySequence.StandardKey | str | None = None,
    ) -> QAction:
        action = menu.addAction(text)
        action.triggered.connect(slot)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        return action

    # --- engine -------------------------------------------------------------------------

    def start_engine(self) -> None:
        """Load the configured model; conversations stay as they are."""
        try:
            config = engine_config(self.settings)
        except ValueError as exc:
            self.show_error("Invalid engine settings", str(exc))
            return
        self.bridge.configure_api(*self._api_settings())
        self.bridge.load(self.settings["model"] or None, config)

    def _api_settings(self) -> tuple[bool, str, int, str]:
        """The local API as settings ask for it: enabled, host (loopback), port, key."""
        s = self.settings
        return s["api_enabled"], "127.0.0.1", s["api_port"], s["api_key"]

    def _on_state(self, state: str, detail: str) -> None:
        if state == "loading":
            if self.loading.isHidden() or self.loading.property("phase") != detail:
                self.loading_bar.setRange(0, 0)  # a new phase: busy until it reports
            self.loading.setProperty("phase", detail)
            self.loading_label.setText(f"{detail}…")
            self.loading.show()
        else:
            self.loading.hide()
            if state == "error":
                self.show_error("The model could not be loaded", detail)
            elif state == "failed":
                self.show_error(
                    "The engine stopped",
                    f"{detail}\n\nConversations are saved; Model → Settings → OK restarts it.",
                )
        self._update_status()

    def _on_load_progress(self, done: int, total: int) -> None:
        if not self.loading.isHidden() and total > 0:
            self.loading_bar.setRange(0, total)
            self.loading_bar.setValue(done)

    def _on_api(self, url: str) -> None:
        self.status_api.setText(f"API: {url}" if url else "")

    def _update_status(self, snap: MetricsSnapshot | None = None) -> None:
        b, s = self.bridge, self.settings
        if b.ready:
            c = b.config
            self.status_model.setText(f"Model: {b.model_name}")
            self.status_engine.setText(
                f"{c.device} · {c.storage} · policy {c.policy} · cache {c.cache} · "
                f"experts {b.expert_backend}"
            )
            self.status_engine.setToolTip(b.memory_note)
        else:
            self.status_model.setText(
                {
                    "loading": "Loading model…",
                    "error": "No model (load failed)",
                    "failed": "Engine stopped",
                }.get(b.state, "No model")
            )
            self.status_engine.setText(f"{s['device']} · {s['storage']} · policy {s['policy']}")
        if snap is not None:
            experts = (snap.slots_bytes + snap.working_set_bytes) / 2**30
            total = (
                f" of {snap.memory_budget_bytes / 2**30:.2f}" if snap.memory_budget_bytes else ""
            )
            # On a GPU the budget is its memory, which torch's pool there holds.
            held, where = (
                (snap.device_bytes, "GPU memory")
                if snap.device_bytes
                else (snap.rss_bytes, "memory")
            )
            memory = (
                f" · {where} {held / 2**30:.2f}{total} GB (experts {experts:.2f} of "
                f"{snap.cache_budget_bytes / 2**30:.2f} GB)"
                if held
                else ""
            )
            # The disk is busy after a load while every expert is read into the cache.
            warm = (
                f"reading experts into memory, {snap.warm_left} left · " if snap.warm_left else ""
            )
            self.status_speed.setText(
                f"{warm}{snap.tokens_per_s:.1f} tok/s · hit {snap.hit_rate:.0%} · "
                f"both busy {snap.both_busy_frac:.0%}{memory}"
            )
            self.status_speed.setToolTip(
                "Memory: the app's resident set (on a GPU, what torch holds there), "
                "against the total the cache was sized in where it is auto. Experts: cache "
                "slots and decoded working set, against the cache budget (Model → Settings → cache). Also held: "
                f"dense weights {snap.dense_bytes / 2**20:.0f} MiB, "
                f"KV caches {snap.kv_bytes / 2**20:.0f} of "
                f"{snap.kv_budget_bytes / 2**20:.0f} MiB."
            )

    def _on_metrics(self, snap: MetricsSnapshot) -> None:
        self._latest = snap
        self._update_status(snap)
        self.feed.local(snap)

    # --- sessions -----------------------------------------------------------------------

    @property
    def current_id(self) -> int | None:
        return self.sessions.current_id()

    def reload_sessions(self) -> None:
        rows = [{"id": s.id, "title": s.title, "kind": s.kind} for s in self.store.list_sessions()]
        self.sessions.set_sessions(rows)
        for sid in self.controller.busy_sessions():
            self.sessions.set_busy(sid, True)
        if self.current_id is None and rows:
            self.sessions.select(rows[0]["id"])

    def new_session(self, kind: str = "chat", workspace: str | None = None) -> int | None:
        """A new session, selected. An agent session asks for its workspace folder first
        (unless ``workspace`` is given) and is created once the dialog is accepted."""
        if kind == "agent" and workspace is None:
            dialog = NewAgentDialog(self)
            dialog.accepted.connect(lambda: self.new_session("agent", dialog.workspace()))
            dialog.open()
            self._agent_dialog = dialog
            return None
        s = self.controller.create_session(kind, workspace)
        self.sessions.add_session(s.id, s.title, s.kind)
        self.sessions.select(s.id)
        self.input.setFocus()
        return s.id

    def show_session(self, session_id: int) -> None:
        if self._editing and self._editing[0] != session_id:
            self.cancel_edit()
        shown = self.controller.shown(session_id)
        self.view.regenerate = self.store.session(session_id).kind == "chat"
        self._update_title(session_id)
        engine = self.controller.engine_of(session_id)
        self.feed.show_engine(engine)  # the panels follow the session's engine
        self.bridge.watch_remote(engine)
        self.view.show_messages(shown)
        self.stop_button.setEnabled(self.controller.is_busy(session_id))
        self._on_approval(session_id)

    def _update_title(self, session_id: int) -> None:
        s = self.store.session(session_id)
        where = f" · on {s.engine}" if s.engine else ""
        self.title_label.setToolTip("")
        if s.kind != "agent":
            self.title_label.setText(f"{s.title}  (chat{where})")
            return
        activity = self.controller.agents.activity(session_id)
        sandbox = "sandboxed" if api.isolation() == "bwrap" else "not sandboxed"
        doing = f" · {activity}" if activity else ""
        self.title_label.setText(f"{s.title}  (coding agent{where} · {sandbox}{doing})")
        self.title_label.setToolTip(
            f"Workspace: {s.workspace}\nCommands are {api.describe_isolation()}."
        )

    def _on_approval(self, session_id: int) -> None:
        if session_id != self.current_id:
            return
        pending = self.controller.agents.pending(session_id)
        if pending is None:
            self.approval.hide()
        else:
            self.approval.ask(pending.name, pending.preview)

    def _on_activity(self, session_id: int, activity: str) -> None:
        self.sessions.set_activity(session_id, activity)
        if session_id == self.current_id:
            self._update_title(session_id)

    def _answer(self, answer: str) -> None:
        if self.current_id is not None:
            self.controller.agents.answer(self.current_id, answer)

    def rename_session(self, session_id: int, title: str) -> None:
        self.controller.rename_session(session_id, title)  # _on_renamed updates the views

    def _on_renamed(self, session_id: int, title: str) -> None:
        self.sessions.set_title(session_id, title)
        if session_id == self.current_id:
            self.show_session(session_id)

    def delete_session(self, session_id: int) -> None:
        """Take the session out of the list and stop its reply; it is deleted for good
        after ``UNDO_MS`` unless Undo (in the status bar) brings it back."""
        if self._editing and self._editing[0] == session_id:
            self.cancel_edit()
        self.commit_delete()  # one still waiting for its undo goes now
        session = self.store.session(session_id)
        self.controller.stop(session_id)
        row = self.sessions.remove(session_id)
        self._pending_delete = (session_id, session.title, session.kind, row)
        if self.current_id is None:
            self.view.show_messages([])
            self.title_label.setText("")
        self.undo_button.setText(f"Undo delete of “{_short(session.title)}”")
        self.undo_button.show()
        self._undo_timer.start(UNDO_MS)

    def delete_message(self, session_id: int, message_id: int) -> None:
        """Take a message out of the chat; deleted for good after ``UNDO_MS``, or when
        the chat's next reply starts, unless Undo brings it back."""
        self.commit_delete()
        role = next(
            (m["role"] for m in self.controller.shown(session_id) if m.get("id") == message_id),
            None,
        )
        if role is None or not self.controller.hide_message(session_id, message_id):
            return
        self._pending_message = (session_id, message_id)
        self.undo_button.setText(
            "Undo delete of " + ("the reply" if role != "user" else "your message")
        )
        self.undo_button.show()
        self._undo_timer.start(UNDO_MS)

    def undo_delete(self) -> None:
        """Bring back the session (or message) deleted last, while its undo lasts."""
        if self._pending_message is not None:
            session_id, message_id = self._pending_message
            self._pending_message = None
            self._undo_timer.stop()
            self.undo_button.hide()
            self.controller.restore_message(session_id, message_id)
            return
        if self._pending_delete is None:
            return
        session_id, title, kind, row = self._pending_delete
        self._pending_delete = None
        self._undo_timer.stop()
        self.undo_button.hide()
        self.sessions.add_session(session_id, title, kind, max(row, 0))  # where it was
        self.sessions.select(session_id)

    def _settle_message(self, session_id: int) -> None:
        """A reply is about to read the session: a message of it deleted just before
        goes for good now (the controller drops it too), and its undo with it."""
        if self._pending_message is not None and self._pending_message[0] == session_id:
            self.commit_delete()  # at most one delete waits for its undo: this one

    def commit_delete(self) -> None:
        """Delete for good the session or message waiting for its undo, if any."""
        self._undo_timer.stop()
        self.undo_button.hide()
        if self._pending_message is not None:
            self._pending_message = None
            self.controller.drop_hidden()
        if self._pending_delete is not None:
            session_id = self._pending_delete[0]
            self._pending_delete = None
            self.controller.delete_session(session_id)

    def export_session(self, session_id: int | None, path: str | None = None) -> Path | None:
        if session_id is None:
            return None
        if path is None:
            title = self.store.session(session_id).title
            path, _ = QFileDialog.getSaveFileName(
                self, "Export session", f"{title}.md", "Markdown (*.md);;JSON (*.json)"
            )
            if not path:
                return None
        out = Path(path)
        text = (
            self.store.export_json(session_id)
            if out.suffix == ".json"
            else self.store.export_markdown(session_id)
        )
        out.write_text(text, encoding="utf-8")
        self.statusBar().showMessage(f"Exported to {out}", 5000)
        return out

    def edit_session_settings(self) -> SessionSettingsDialog | None:
        sid = self.current_id
        if sid is None:
            return None
        engines = [e.name for e in load_engines(self.store, self.controller.keys)]
        dialog = SessionSettingsDialog(self.store.session(sid), self.settings, self, engines)

        def save() -> None:
            self.controller.update_session(sid, *dialog.values())
            if sid == self.current_id:
                self.show_session(sid)  # the title and panels name its engine

        dialog.accepted.connect(save)
        dialog.open()  # not exec(): other sessions keep streaming while it is open
        return dialog

    # --- sending and streaming ----------------------------------------------------------

    def _send_clicked(self) -> None:
        text = self.input.toPlainText().strip()
        if text:
            self.input.clear()
            self.send(text)

    def send(self, text: str, session_id: int | None = None) -> None:
        """Add the user's message and start the reply in ``session_id`` (default: current,
        or a new chat when there is none)."""
        sid = session_id if session_id is not None else self.current_id
        if sid is None:
            sid = self.new_session("chat")
        busy = self.controller.is_busy(sid)
        if not busy:
            self._settle_message(sid)
        editing = self._editing
        if editing and editing[0] == sid and not self._edited_shown(sid, editing[1]):
            self.cancel_edit(restore=False)  # the message left the view (branch, delete)
            self.statusBar().showMessage(
                "The message being edited is no longer shown: this went as a new message", 6000
            )
            editing = None
        if editing and editing[0] == sid:
            if self.controller.edit_and_resend(sid, editing[1], text):
                self.cancel_edit()
                return
        elif self.controller.send(sid, text):
            return
        if busy:
            self.statusBar().showMessage("This session is still replying: Esc stops it", 4000)
        if not self.input.toPlainText():
            self.input.setPlainText(text)  # refused (the notice says why): keep what was typed

    def _message_action(self, action: str, message_id: int) -> None:
        sid = self.current_id
        if sid is None:
            return
        if action == "copy":
            for m in self.controller.shown(sid):
                if m.get("id") == message_id:
                    QGuiApplication.clipboard().setText(m.get("content") or "")
                    self.statusBar().showMessage("Reply copied", 2000)
        elif self.controller.is_busy(sid):
            self.statusBar().showMessage("Wait for the reply to finish: Esc stops it", 4000)
        elif action == "delete":
            self.delete_message(sid, message_id)
        elif action == "edit":
            self._start_edit(sid, message_id)
        elif action in ("regenerate", "continue", "branch"):
            self._settle_message(sid)
            start = {
                "regenerate": self.controller.regenerate,
                "continue": self.controller.continue_reply,
                "branch": self.controller.show_branch,
            }[action]
            start(sid, message_id)  # refusals say why (the controller's notice)

    def _edited_shown(self, session_id: int, message_id: int) -> bool:
        return any(m.get("id") == message_id for m in self.controller.shown(session_id))

    def _start_edit(self, session_id: int, message_id: int) -> None:
        """Put one of the user's messages back in the input box; Enter sends it anew. What
        was typed there comes back when the edit ends."""
        for m in self.controller.shown(session_id):
            if m.get("id") == message_id:
                if self._editing is None:
                    self._draft = self.input.toPlainText()
                self._editing = (session_id, message_id)
                self.input.setPlainText(m.get("content") or "")
                self.input.setFocus()
                self.edit_note.setText(
                    "<b>Editing your message</b> · Enter sends it as a new branch (the "
                    "old one stays: ‹ › under it switch) · Esc cancels"
                )
                self.edit_note.show()

    def cancel_edit(self, restore: bool = True) -> None:
        """End editing; ``restore``: the draft typed before it goes back in the input."""
        if self._editing is not None:
            self._editing = None
            if restore:
                self.input.setPlainText(self._draft)
            self._draft = ""
            self.edit_note.hide()

    def stop_current(self) -> None:
        if self._editing is not None:  # Esc while editing cancels the edit
            self.cancel_edit()
        elif self.current_id is not None:
            self.controller.stop(self.current_id)

    def _changed(self, session_id: int, _detail: str = "") -> None:
        self._dirty.add(session_id)  # re-rendered by the next _render_dirty

    def _on_busy(self, session_id: int, busy: bool) -> None:
        self.sessions.set_busy(session_id, busy)
        if session_id == self.current_id:
            self.stop_button.setEnabled(busy)

    def _render_dirty(self) -> None:
        sid = self.current_id
        messages = self.controller.messages
        if sid is not None and sid in self._dirty and sid in messages:
            self.view.show_messages(messages[sid])
        self._dirty.clear()

    # --- dialogs ------------------------------------------------------------------------

    def show_error(self, title: str, text: str) -> None:
        # open(), not exec(): never blocks the event loop that streams other sessions.
        self.error_box = QMessageBox(QMessageBox.Icon.Warning, title, text, parent=self)
        self.error_box.open()

    def open_settings(self) -> SettingsDialog:
        from backend.api import demo_path, list_models

        entries = [e for e in list_models() if not e.error]
        models = [str(e.path) for e in entries]
        by_path = {str(e.path): e for e in entries}
        demo = next((e for e in entries if e.path == demo_path()), None)
        if demo is not None:  # the combo's "(demo MoE)" entry
            by_path[""] = demo
        profiles = self.store.get_setting(PROFILES_KEY, {})
        dialog = SettingsDialog(self.settings, models, self, by_path, profiles)
        dialog.accepted.connect(lambda: self.apply_settings(dialog.values()))
        dialog.open()
        return dialog

    def apply_settings(self, values: dict) -> None:
        """Save (the model's own settings kept for it too); reload the engine only when
        an engine setting changed."""
        old = self.settings
        self.settings = merged(values)
        self.store.set_setting("app", self.settings)
        profiles = self.store.get_setting(PROFILES_KEY, {})
        profiles[self.settings["model"]] = profile(self.settings)
        self.store.set_setting(PROFILES_KEY, profiles)
        if any(old[k] != self.settings[k] for k in ENGINE_KEYS) or not self.bridge.ready:
            self.start_engine()
        else:
            err = self.bridge.set_api(*self._api_settings())
            if err:
                self.show_error("The API could not start", err)
        self._update_status()

    def open_model_manager(self) -> ModelManager:
        in_use = str(self.bridge.model_path) if self.bridge.model_path else None
        dialog = ModelManager(self, in_use)
        dialog.use_model.connect(self.use_model)
        dialog.open()
        return dialog

    def open_engines(self) -> EnginesDialog:
        """Remote engines: OpenAI-compatible servers a session can run on."""
        keys = self.controller.keys
        dialog = EnginesDialog(load_engines(self.store, keys), keys.where, keys.secure, self)

        def save() -> None:
            try:
                save_engines(self.store, dialog.engines(), keys)
            except ValueError as exc:
                self.show_error("The engines could not be saved", str(exc))
                return
            for old, new in dialog.renames().items():
                self.store.rename_engine(old, new)
            if self.current_id is not None:
                self.show_session(self.current_id)  # its engine may have changed

        dialog.accepted.connect(save)
        dialog.open()
        return dialog

    def use_model(self, path: str) -> None:
        """Load ``path`` with the settings remembered for it (else the current ones)."""
        profiles = self.store.get_setting(PROFILES_KEY, {})
        self.apply_settings(with_profile(self.settings, path, profiles))

    def open_compare(self) -> CompareView:
        self.compare.show()
        self.compare.raise_()
        return self.compare

    # --- shutdown -----------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt override)
        self._render_timer.stop()
        self.controller.stop_all()
        self.commit_delete()
        self.compare.close()
        self.bridge.shutdown()
        self.store.flush()
        super().closeEvent(event)
