"""The main window: sessions, the conversation, live panels, settings, models, compare."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressDialog,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.bridge import Bridge
from app.dialogs.models import ModelManager
from app.dialogs.session import SessionSettingsDialog
from app.dialogs.settings import SettingsDialog
from app.panels import CachePanel, OverlapPanel, ProgressPanel, ThroughputPanel
from app.settings import AGENT_SYSTEM_PROMPT, ENGINE_KEYS, engine_config, merged, sampling
from app.store import Store, StoreError
from app.widgets.chat import ConversationView, InputBox
from app.widgets.compare import CompareView
from app.widgets.sessions import SessionList
from backend.api import Finished, MetricsSnapshot

RENDER_INTERVAL_MS = 66  # a streaming reply re-renders at most ~15 times a second
PANEL_STAGGER_MS = 20


@dataclass
class Reply:
    """A reply being generated: where it goes and what has arrived."""

    session_id: int
    message_id: int
    history: list[dict]  # what the model is asked to continue
    request_id: str | None = None  # None while waiting for the engine to load
    chunks: list[str] = field(default_factory=list)
    tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.chunks)


class MainWindow(QMainWindow):
    def __init__(self, store: Store, bridge: Bridge | None = None) -> None:
        super().__init__()
        self.setWindowTitle("Bevy")
        self.resize(1400, 860)
        self.store = store
        self.settings = merged(store.get_setting("app"))
        self.bridge = bridge or Bridge(self)
        self.messages: dict[int, list[dict]] = {}  # session id -> messages shown
        self.replies: dict[int, Reply] = {}  # session id -> its reply in progress
        self.by_request: dict[str, Reply] = {}
        self.error_box: QMessageBox | None = None
        self._dirty: set[int] = set()
        self._load_dialog: QProgressDialog | None = None
        self._latest: MetricsSnapshot | None = None

        self.sessions = SessionList()
        self.view = ConversationView()
        self.input = InputBox()
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.session_settings_button = QPushButton("Session settings…")
        self.title_label = QLabel()
        self.title_label.setStyleSheet("font-weight: bold")
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
        layout = QVBoxLayout(center)
        layout.addLayout(row)
        layout.addWidget(self.view, 1)
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
        self.bridge.token.connect(self._on_token)
        self.bridge.finished.connect(self._on_finished)
        self.bridge.failed.connect(self._on_failed)
        self.bridge.metrics.connect(self._on_metrics)
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
        self._action(model, "Settings…", self.open_settings, QKeySequence.Preferences)
        view = self.menuBar().addMenu("&View")
        for dock in self.docks.values():
            view.addAction(dock.toggleViewAction())
        view.addSeparator()
        self._action(view, "Compare policies…", self.open_compare, "Ctrl+K")

    def _action(self, menu, text: str, slot, shortcut=None) -> QAction:
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
            if self._load_dialog is None:
                self._load_dialog = QProgressDialog("Loading the model…", "", 0, 0, self)
                self._load_dialog.setWindowTitle("Bevy")
                self._load_dialog.setCancelButton(None)
                self._load_dialog.setMinimumDuration(300)
                # Not modal: a modal QProgressDialog pumps events inside setValue(), which
                # would re-enter this slot; sessions stay readable while a model loads.
                self._load_dialog.setWindowModality(Qt.WindowModality.NonModal)
            self._load_dialog.setLabelText(f"Loading {Path(detail).name}…")
        else:
            if self._load_dialog is not None:
                self._load_dialog.reset()
                self._load_dialog.deleteLater()
                self._load_dialog = None
            if state == "error":
                self.show_error("The model could not be loaded", detail)
            elif state == "failed":
                self.show_error(
                    "The engine stopped",
                    f"{detail}\n\nConversations are saved; Model → Settings → OK restarts it.",
                )
            elif state == "ready":
                self._submit_queued()
        self._update_status()

    def _on_load_progress(self, done: int, total: int) -> None:
        if self._load_dialog is not None:
            self._load_dialog.setMaximum(total)
            self._load_dialog.setValue(done)

    def _on_api(self, url: str) -> None:
        self.status_api.setText(f"API: {url}" if url else "")

    def _update_status(self, snap: MetricsSnapshot | None = None) -> None:
        b, s = self.bridge, self.settings
        if b.ready:
            c = b.config
            self.status_model.setText(f"Model: {b.model_name}")
            self.status_engine.setText(
                f"{c.device} · {c.storage} · policy {c.policy} · cache {c.cache}"
            )
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
            self.status_speed.setText(
                f"{snap.tokens_per_s:.1f} tok/s · hit {snap.hit_rate:.0%} · "
                f"both busy {snap.both_busy_frac:.0%}"
            )

    def _on_metrics(self, snap: MetricsSnapshot) -> None:
        # Panels take turns, PANEL_STAGGER_MS apart: redrawing all four plots in one paint
        # pass held the GUI thread for up to ~50 ms; one at a time each pass stays short.
        # Each panel still refreshes at the throttle's rate, with the newest snapshot.
        self._latest = snap
        self._update_status(snap)
        for i, panel in enumerate(self.panels.values()):
            QTimer.singleShot(i * PANEL_STAGGER_MS, self, lambda p=panel: self._feed(p))

    def _feed(self, panel) -> None:
        if self._latest is not None and panel.isVisible():
            panel.update_snapshot(self._latest)

    # --- sessions -----------------------------------------------------------------------

    @property
    def current_id(self) -> int | None:
        return self.sessions.current_id()

    def reload_sessions(self) -> None:
        rows = [{"id": s.id, "title": s.title, "kind": s.kind} for s in self.store.list_sessions()]
        self.sessions.set_sessions(rows)
        for sid in self.replies:
            self.sessions.set_busy(sid, True)
        if self.current_id is None and rows:
            self.sessions.select(rows[0]["id"])

    def new_session(self, kind: str = "chat") -> int:
        title = "New agent session" if kind == "agent" else "New chat"
        prompt = AGENT_SYSTEM_PROMPT if kind == "agent" else ""
        sampling_overrides = {"max_tokens": 1024, "temperature": 0.2} if kind == "agent" else {}
        s = self.store.create_session(title, kind, prompt, sampling_overrides)
        self.sessions.add_session(s.id, s.title, s.kind)
        self.sessions.select(s.id)
        self.input.setFocus()
        return s.id

    def show_session(self, session_id: int) -> None:
        if session_id not in self.messages:
            self.messages[session_id] = [
                {"role": m.role, "content": m.content, "status": m.status}
                for m in self.store.messages(session_id)
            ]
        s = self.store.session(session_id)
        self.title_label.setText(f"{s.title}  ({'coding agent' if s.kind == 'agent' else 'chat'})")
        self.view.show_messages(self.messages[session_id])
        self.stop_button.setEnabled(session_id in self.replies)

    def rename_session(self, session_id: int, title: str) -> None:
        self.store.rename_session(session_id, title)
        self.sessions.set_title(session_id, title)
        if session_id == self.current_id:
            self.show_session(session_id)

    def delete_session(self, session_id: int) -> None:
        reply = self.replies.pop(session_id, None)
        # Forget the reply now: tokens already queued for it have nowhere to go.
        if reply is not None and reply.request_id is not None:
            self.by_request.pop(reply.request_id, None)
            self.bridge.abort(reply.request_id)
        self.store.delete_session(session_id)
        self.messages.pop(session_id, None)
        self.sessions.remove(session_id)
        if self.current_id is None:
            self.view.show_messages([])
            self.title_label.setText("")

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
        dialog = SessionSettingsDialog(self.store.session(sid), self.settings, self)

        def save() -> None:
            prompt, overrides = dialog.values()
            self.store.update_session(sid, system_prompt=prompt, sampling=overrides)

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
        """Add the user's message and start the reply in ``session_id`` (default: current)."""
        sid = session_id if session_id is not None else self.current_id
        if sid is None:
            sid = self.new_session("chat")
        if sid in self.replies:
            self.statusBar().showMessage("This session is still replying: Esc stops it", 4000)
            return
        s = self.store.session(sid)
        if s.title in ("New chat", "New agent session"):
            title = " ".join(text.split())[:48]
            self.rename_session(sid, title)
        self.store.add_message(sid, "user", text)
        history = self.store.history(sid)
        msg = self.store.add_message(sid, "assistant", "", status="streaming")
        shown = self.messages.setdefault(sid, [])
        shown.append({"role": "user", "content": text, "status": "done"})
        shown.append({"role": "assistant", "content": "", "status": "streaming"})
        reply = Reply(sid, msg.id, history)
        self.replies[sid] = reply
        self.sessions.set_busy(sid, True)
        self._submit(reply)
        self._dirty.add(sid)
        if sid == self.current_id:
            self.stop_button.setEnabled(True)

    def _submit(self, reply: Reply) -> None:
        if not self.bridge.ready:
            if self.bridge.state not in ("loading",):
                self._end_reply(reply, "error", "No model is loaded: open Model → Settings.")
            return  # submitted by _submit_queued once the engine is up
        s = self.store.session(reply.session_id)
        try:
            params = sampling(self.settings, {"sampling": s.sampling})
        except ValueError as exc:
            self._end_reply(reply, "error", f"Invalid sampling settings: {exc}")
            return
        rid = self.bridge.submit(reply.history, params, session=s.title)
        reply.request_id = rid
        self.by_request[rid] = reply

    def _submit_queued(self) -> None:
        for reply in list(self.replies.values()):
            if reply.request_id is None:
                self._submit(reply)

    def stop_current(self) -> None:
        if self.current_id is not None:
            self.stop(self.current_id)

    def stop(self, session_id: int) -> None:
        reply = self.replies.get(session_id)
        if reply is None:
            return
        if reply.request_id is None:
            self._end_reply(reply, "stopped")
        else:
            self.bridge.abort(reply.request_id)  # Finished(abort) ends it

    def _on_token(self, request_id: str, text: str) -> None:
        reply = self.by_request.get(request_id)
        if reply is None:
            return
        reply.chunks.append(text)
        reply.tokens += 1
        self.store.update_message(reply.message_id, reply.text, reply.tokens)
        shown = self.messages.get(reply.session_id)
        if shown:
            shown[-1]["content"] = reply.text
        self._dirty.add(reply.session_id)

    def _on_finished(self, ev: Finished) -> None:
        reply = self.by_request.get(ev.request_id)
        if reply is None:
            return
        status = {"abort": "stopped", "error": "error"}.get(ev.reason, "done")
        self._end_reply(reply, status, None, ev.text, ev.prompt_tokens, ev.completion_tokens)

    def _on_failed(self, request_id: str, message: str) -> None:
        reply = self.by_request.get(request_id)
        if reply is not None:
            self._end_reply(reply, "error", message)

    def _end_reply(
        self,
        reply: Reply,
        status: str,
        error: str | None = None,
        text: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        content = text if text is not None else reply.text
        if error:
            content = f"{content}\n\n> **Error:** {error}" if content else f"> **Error:** {error}"
        with suppress(StoreError):  # the session was deleted while its reply was finishing
            self.store.finish_message(
                reply.message_id,
                content,
                status,
                prompt_tokens,
                completion_tokens if completion_tokens is not None else reply.tokens,
            )
        self.replies.pop(reply.session_id, None)
        if reply.request_id is not None:
            self.by_request.pop(reply.request_id, None)
        shown = self.messages.get(reply.session_id)
        if shown:
            shown[-1].update(content=content, status=status)
        self.sessions.set_busy(reply.session_id, False)
        self._dirty.add(reply.session_id)
        if reply.session_id == self.current_id:
            self.stop_button.setEnabled(False)

    def _render_dirty(self) -> None:
        sid = self.current_id
        if sid is not None and sid in self._dirty and sid in self.messages:
            self.view.show_messages(self.messages[sid])
        self._dirty.clear()

    # --- dialogs ------------------------------------------------------------------------

    def show_error(self, title: str, text: str) -> None:
        # open(), not exec(): never blocks the event loop that streams other sessions.
        self.error_box = QMessageBox(QMessageBox.Icon.Warning, title, text, parent=self)
        self.error_box.open()

    def open_settings(self) -> SettingsDialog:
        from backend.api import list_models

        models = [str(e.path) for e in list_models() if not e.error]
        dialog = SettingsDialog(self.settings, models, self)
        dialog.accepted.connect(lambda: self.apply_settings(dialog.values()))
        dialog.open()
        return dialog

    def apply_settings(self, values: dict) -> None:
        """Save; reload the engine only when an engine setting changed."""
        old = self.settings
        self.settings = merged(values)
        self.store.set_setting("app", self.settings)
        if any(old[k] != self.settings[k] for k in ENGINE_KEYS) or not self.bridge.ready:
            self.start_engine()
        else:
            err = self.bridge.set_api(*self._api_settings())
            if err:
                self.show_error("The API could not start", err)
        self._update_status()

    def open_model_manager(self) -> ModelManager:
        dialog = ModelManager(self)
        dialog.use_model.connect(lambda path: self.apply_settings({**self.settings, "model": path}))
        dialog.open()
        return dialog

    def open_compare(self) -> CompareView:
        self.compare.show()
        self.compare.raise_()
        return self.compare

    # --- shutdown -----------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt override)
        self._render_timer.stop()
        for reply in list(self.replies.values()):
            self._end_reply(reply, "stopped")
        self.compare.close()
        self.bridge.shutdown()
        self.store.flush()
        super().closeEvent(event)
