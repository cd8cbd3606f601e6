"""Coding-agent sessions in the app: each runs its loop on a worker thread, and what it
does becomes messages and cards in the store and the view.

The loop (``backend.api.Agent``) reports every step as an event on its worker thread;
events cross to the GUI thread through a queued signal, where this class writes them to
the store (so a restart restores every card) and updates the shown messages. A call the
session's rules ask about waits on the worker thread until the user answers in the
approval bar (Approve / Deny / Always); Stop (Esc) ends the loop, kills a running command
and denies a pending call.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Qt, Signal

from app.store import Message, Store, StoreError, data_dir
from backend import api
from backend.api import (
    AgentFinished,
    AssistantTurn,
    CallFinished,
    CallProposed,
    CallStarted,
    PendingCall,
    StepStarted,
    TextDelta,
)

if TYPE_CHECKING:
    from app.controller import ChatController

# What the sidebar and title say an agent is doing.
THINKING, RUNNING, WAITING = "thinking", "running a tool", "waiting for approval"
INTERRUPTED_RESULT = "error: interrupted (the app closed while this call ran)"
log = logging.getLogger(__name__)


def default_workspace() -> str:
    """A fresh folder under the app's data dir for a new agent session."""
    return str(api.new_workspace(data_dir() / "workspaces"))


def proposed_workspace() -> str:
    """Where ``default_workspace`` would create the next folder (nothing is created)."""
    parent = data_dir() / "workspaces"
    for i in range(1, 10_000):
        p = parent / ("agent" if i == 1 else f"agent-{i}")
        if not p.exists():
            return str(p)
    return str(parent / "agent")


@dataclass
class _Run:
    """One session's loop in progress."""

    agent: api.Agent
    thread: threading.Thread | None = None
    pending: PendingCall | None = None
    answer: str = "deny"
    answered: threading.Event = field(default_factory=threading.Event)
    text_id: int | None = None  # the assistant message streaming now
    text: list[str] = field(default_factory=list)
    cards: dict[str, int] = field(default_factory=dict)  # call id -> tool message id
    activity: str = THINKING


def conversation(store: Store, session_id: int) -> list[dict]:
    """An agent session's stored messages as the loop's conversation (OpenAI-shaped):
    assistant turns with their calls, each call answered by its tool message (a call
    cut by a crash is answered as interrupted)."""
    out: list[dict] = []
    answered: set[str] = set()
    open_calls: list[str] = []
    for m in store.messages(session_id):
        if m.role == "user":
            out += _close(open_calls, answered)
            out.append({"role": "user", "content": m.content})
        elif m.role == "assistant":
            calls = m.data.get("tool_calls") or []
            if m.status == "error" or (not m.content and not calls) or m.data.get("note"):
                continue
            out += _close(open_calls, answered)
            msg: dict = {"role": "assistant", "content": m.content or None}
            if calls:
                msg["tool_calls"] = calls
                open_calls = [c["id"] for c in calls]
            out.append(msg)
        elif m.role == "tool" and m.data.get("call_id"):
            content = m.content if m.status == "done" else INTERRUPTED_RESULT
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": m.data["call_id"],
                    "name": m.data.get("name", ""),
                    "content": content,
                }
            )
            answered.add(m.data["call_id"])
    return out + _close(open_calls, answered)


def _close(open_calls: list[str], answered: set[str]) -> list[dict]:
    """Tool messages for calls left without a result."""
    missing = [c for c in open_calls if c not in answered]
    open_calls.clear()
    return [{"role": "tool", "tool_call_id": c, "content": INTERRUPTED_RESULT} for c in missing]


def shown_message(m: Message) -> dict:
    """A stored message as the view shows it."""
    shown = {"id": m.id, "role": m.role, "content": m.content, "status": m.status, "data": m.data}
    if m.branches:  # it has alternatives (edited, regenerated): the view offers them
        shown["branches"] = list(m.branches)
    return shown


class AgentSessions(QObject):
    """The agent loops of one controller's sessions."""

    changed = Signal(int)  # session id: its messages or cards changed
    approval_changed = Signal(int)  # session id: a call started or stopped waiting
    activity_changed = Signal(int, str)  # session id, what it is doing ("" when idle)
    finished = Signal(int, str)  # session id, "done" | "stopped" | "error"

    _event = Signal(int, object)  # from worker threads: session id, (its run, event)

    def __init__(self, controller: ChatController) -> None:
        super().__init__(controller)
        self.c = controller
        self.runs: dict[int, _Run] = {}
        self._event.connect(self._on_event, Qt.ConnectionType.QueuedConnection)

    # --- queries ------------------------------------------------------------------------

    def busy(self, session_id: int) -> bool:
        return session_id in self.runs

    def pending(self, session_id: int) -> PendingCall | None:
        run = self.runs.get(session_id)
        return run.pending if run is not None else None

    def activity(self, session_id: int) -> str:
        run = self.runs.get(session_id)
        return run.activity if run is not None else ""

    # --- commands -----------------------------------------------------------------------

    def send(self, session_id: int, text: str) -> str | None:
        """Start the loop on ``text``; None, or why it could not start."""
        if session_id in self.runs:
            return "This agent is still working: Esc stops it"
        bridge = self.c.bridge
        s = self.c.store.session(session_id)
        remote = self.c.engine_of(session_id) if s.engine else None
        if s.engine and remote is None:
            return f"The engine “{s.engine}” is not set up any more: choose one in Session settings"
        if remote is None and not bridge.ready:
            return "No model is loaded yet: agent sessions need one running"
        if not s.workspace:  # made before agents had workspaces: give it one of its own
            self.c.store.update_session(session_id, workspace=default_workspace())
            s = self.c.store.session(session_id)
        try:
            workspace = api.Workspace(s.workspace)
            rules = api.Rules([api.Rule.parse(r) for r in s.rules])
        except (api.ToolError, ValueError) as exc:
            return f"Cannot start the agent: {exc}"
        values = {k: self.c.settings[k] for k in ("temperature", "top_p", "max_tokens")}
        values.update(s.sampling or {})
        model = (
            api.RemoteChatModel(remote, values)
            if remote is not None
            else api.local_chat_model(bridge.service, s.title, values)
        )
        history = conversation(self.c.store, session_id)
        forced = model.tool_format == "generic"
        system = api.system_prompt(workspace, forced, api.isolation())
        if s.system_prompt.strip():
            system += f"\n\nInstructions for this session: {s.system_prompt.strip()}"
        run = _Run(None)  # type: ignore[arg-type]  # the agent needs the run's callbacks
        run.agent = api.Agent(
            model,
            workspace,
            rules=rules,
            approve=lambda call: self._wait_for_answer(session_id, run, call),
            on_event=lambda ev: self._event.emit(session_id, (run, ev)),
            messages=[{"role": "system", "content": system}, *history],
        )
        self.runs[session_id] = run
        self.c.store.add_message(session_id, "user", text)
        self.c.shown(session_id).append({"role": "user", "content": text, "status": "done"})
        run.thread = threading.Thread(
            target=self._work,
            args=(session_id, run, text),
            name=f"bevy-agent-{session_id}",
            daemon=True,
        )
        run.thread.start()
        self.activity_changed.emit(session_id, THINKING)
        self.changed.emit(session_id)
        return None

    def answer(self, session_id: int, answer: str) -> None:
        """The user's answer about the pending call: "approve", "deny" or "always"."""
        run = self.runs.get(session_id)
        if run is None or run.pending is None:
            return
        run.answer, run.pending = answer, None
        run.answered.set()
        self.approval_changed.emit(session_id)

    def stop(self, session_id: int) -> None:
        run = self.runs.get(session_id)
        if run is None:
            return
        run.agent.stop()
        if run.pending is not None:
            self.answer(session_id, "deny")

    def stop_all(self, wait_s: float = 5.0) -> None:
        """Stop every loop and give them ``wait_s`` in all to end (app exit)."""
        for sid in list(self.runs):
            self.stop(sid)
        deadline = time.monotonic() + wait_s
        for run in list(self.runs.values()):
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))

    # --- the worker thread ----------------------------------------------------------------

    def _work(self, session_id: int, run: _Run, text: str) -> None:
        try:
            run.agent.run(text)
        except Exception as exc:  # a bug in a tool or the loop: end the session's run, say why
            failed = AgentFinished("error", f"the agent failed: {exc!r}")
            self._event.emit(session_id, (run, failed))

    def _wait_for_answer(self, session_id: int, run: _Run, call: PendingCall) -> str:
        run.answered.clear()
        self._event.emit(session_id, (run, call))
        while not run.answered.wait(0.2):
            if run.agent.stopped:
                return "deny"
        return run.answer

    # --- events, on the GUI thread ------------------------------------------------------

    def _on_event(self, session_id: int, item: tuple) -> None:
        run, ev = item
        if self.runs.get(session_id) is not run:
            return  # a loop of a deleted session (its id may be a new session's now)
        try:
            self._apply(session_id, run, ev)
        except StoreError:  # deleted mid-run: stop the loop, drop its events
            run.agent.stop()
            self.runs.pop(session_id, None)
            return
        except Exception:  # a value the store refused (text that is not Unicode, ...)
            log.exception("agent session %s: an event could not be saved", session_id)
            if isinstance(ev, AgentFinished):
                self._release(session_id, "error")
            return
        self.changed.emit(session_id)

    def _apply(self, sid: int, run: _Run, ev: object) -> None:
        store, shown = self.c.store, self.c.shown(sid)
        if isinstance(ev, StepStarted):
            msg = store.add_message(sid, "assistant", "", status="streaming")
            run.text_id, run.text = msg.id, []
            shown.append(shown_message(msg))
            self._set_activity(sid, run, THINKING)
        elif isinstance(ev, TextDelta) and run.text_id is not None:
            run.text.append(ev.text)
            store.update_message(run.text_id, "".join(run.text))
            self._entry(shown, run.text_id)["content"] = "".join(run.text)
        elif isinstance(ev, AssistantTurn) and run.text_id is not None:
            calls = ev.message.get("tool_calls") or []
            content = ev.message.get("content") or ""
            data = {"tool_calls": calls} if calls else {}
            store.finish_message(run.text_id, content, "done", data=data)
            self._entry(shown, run.text_id).update(content=content, status="done", data=data)
            run.text_id = None
        elif isinstance(ev, CallProposed):
            data = {
                "call_id": ev.call_id,
                "name": ev.name,
                "arguments": ev.arguments,
                "permission": ev.permission,
                "state": "running" if ev.permission == "allow" else "checking",
            }
            msg = store.add_message(sid, "tool", "", status="streaming", data=data)
            run.cards[ev.call_id] = msg.id
            shown.append(shown_message(msg))
        elif isinstance(ev, PendingCall):
            run.pending = ev
            self._card(sid, run, ev.call_id, state="pending")
            self._set_activity(sid, run, WAITING)
            self.approval_changed.emit(sid)
        elif isinstance(ev, CallStarted):
            self._card(sid, run, ev.call_id, state="running")
            self._set_activity(sid, run, RUNNING)
        elif isinstance(ev, CallFinished):
            mid = run.cards.get(ev.call_id)
            if mid is not None:
                entry = self._entry(shown, mid)
                r = ev.result
                data = {
                    **entry.get("data", {}),
                    "state": "done",
                    "approval": ev.approval,
                    "ok": r.ok,
                    "exit_code": r.exit_code,
                    "seconds": round(r.seconds, 3),
                    "diff": r.diff,
                    "cut": r.cut,
                }
                store.finish_message(mid, r.output, "done", data=data)
                entry.update(content=r.output, status="done", data=data)
            if ev.approval == "always":  # the new rule holds for the session from now on
                saved = store.session(sid).rules  # as edited meanwhile, if it was
                new = str(run.agent.rules.rules[-1])
                if new not in saved:
                    store.update_session(sid, rules=[*saved, new])
        elif isinstance(ev, AgentFinished):
            self._finish(sid, run, ev)

    def _finish(self, sid: int, run: _Run, ev: AgentFinished) -> None:
        store, shown = self.c.store, self.c.shown(sid)
        status = {"done": "done", "finished": "done", "error": "error"}.get(ev.reason, "stopped")
        if run.text_id is not None:  # a turn cut by an error: keep what it said
            text = "".join(run.text)
            store.finish_message(run.text_id, text, status)
            self._entry(shown, run.text_id).update(content=text, status=status)
        for mid in run.cards.values():  # a card never finished (the loop failed mid-call)
            entry = self._entry(shown, mid)
            if entry.get("status") == "streaming":
                store.finish_message(mid, INTERRUPTED_RESULT, "interrupted")
                entry.update(content=INTERRUPTED_RESULT, status="interrupted")
        note = None
        if ev.reason == "finished":
            note = ev.message
        elif ev.reason == "error":
            note = f"> **Error:** {ev.message}"
        elif ev.reason != "done":
            note = f"*{ev.message[:1].upper()}{ev.message[1:]}.*"
        try:
            if note is not None:
                msg = store.add_message(
                    sid, "assistant", note, status=status, data={"note": ev.reason}
                )
                shown.append(shown_message(msg))
        finally:
            self._release(sid, status)

    def _release(self, sid: int, status: str) -> None:
        """The session's loop is over: it is idle again, whatever was saved."""
        self.runs.pop(sid, None)
        self.activity_changed.emit(sid, "")
        self.approval_changed.emit(sid)
        self.finished.emit(sid, status)

    def _card(self, sid: int, run: _Run, call_id: str, **changes) -> None:
        mid = run.cards.get(call_id)
        if mid is None:
            return
        entry = self._entry(self.c.shown(sid), mid)
        entry["data"] = {**entry.get("data", {}), **changes}
        with suppress(StoreError):
            self.c.store.set_message_data(mid, entry["data"])

    def _set_activity(self, sid: int, run: _Run, activity: str) -> None:
        if run.activity != activity:
            run.activity = activity
            self.activity_changed.emit(sid, activity)

    @staticmethod
    def _entry(shown: list[dict], message_id: int) -> dict:
        for entry in reversed(shown):
            if entry.get("id") == message_id:
                return entry
        return {}


def card_arguments(data: dict) -> str:
    """A call's arguments as one line for its card."""
    args = data.get("arguments")
    return args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
