"""The conversations and their replies, kept apart from the widgets that show them.

The main window lays out widgets and menus; this controller holds what they display and
does what they ask. It turns "send this text in that session" into a request on the
:class:`~app.bridge.Bridge`, routes the bridge's token, finished and failure events back
to the session they belong to, stops replies, and is the one place that writes sessions,
messages and streamed replies to the :class:`~app.store.Store`.

Views learn what changed through signals keyed by session id, so any number of sessions
can stream at once while the window shows one of them; nothing here knows which one is on
screen. A reply asked for while a model loads waits here and goes to the engine once the
bridge reports "ready"; a reply that cannot be served ends at once with its error saved in
the message, so no session is ever left waiting.
"""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, Signal

from app.agents import AgentSessions, default_workspace, shown_message
from app.bridge import Bridge
from app.engines import KeyStore, find_engine
from app.settings import sampling
from app.store import Session, Store, StoreError
from backend.api import Endpoint, Finished

NEW_TITLES = {"chat": "New chat", "agent": "New agent session"}  # replaced by the first message
TITLE_CHARS = 48  # a session's automatic title: the start of its first message
# A reply's label before its first token (then "generating…"): honest about the wait.
LOADING = "waiting for the model to load"
QUEUED = "queued"


@dataclass
class Reply:
    """A reply being generated: where it goes and what has arrived."""

    session_id: int
    message_id: int
    history: list[dict]  # what the model is asked to continue
    request_id: str | None = None  # None while waiting for the engine to load
    chunks: list[str] = field(default_factory=list)
    tokens: int = 0
    phase: str | None = None  # before the first token: LOADING, QUEUED, reading the prompt
    submitted_at: float | None = None  # time.monotonic() when the engine was asked
    first_token_at: float | None = None
    # A continued reply: the text and tokens it had; what arrives goes on from there.
    prefix: str = ""
    prior_tokens: int = 0
    continue_final: bool = False  # the prompt ends inside the reply (a continued one)
    engine: Endpoint | None = None  # the remote engine it runs on (None: the local one)

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.chunks)


class ChatController(QObject):
    """Sessions, their messages and the replies in flight, one reply per session at a time.

    ``messages`` holds each opened session's messages as the view shows them (role,
    content, status), updated as replies stream; ``replies`` maps a session id to its reply
    in progress and ``by_request`` maps the bridge's request ids to the same replies.
    ``settings`` are the app settings; a reply's sampling parameters are the session's
    overrides on top of them.
    """

    reply_started = Signal(int)  # session id: its user message and an empty reply were added
    token = Signal(int, str)  # session id, the text that just arrived
    reply_finished = Signal(int, str)  # session id, final status: "done" | "stopped" | "error"
    busy_changed = Signal(int, bool)  # session id, whether it has a reply in progress
    session_renamed = Signal(int, str)  # session id, new title
    notice = Signal(str)  # why a request could not start, for the status bar

    def __init__(
        self,
        store: Store,
        bridge: Bridge,
        settings: dict,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.store = store
        self.bridge = bridge
        self.settings = settings
        self.messages: dict[int, list[dict]] = {}  # session id -> messages shown
        self.replies: dict[int, Reply] = {}  # session id -> its reply in progress
        self.by_request: dict[str, Reply] = {}
        # Messages deleted but still undoable: out of view and of what the model reads,
        # in the store until ``drop_hidden`` (the window's undo runs out, or a new reply).
        self.hidden: dict[int, set[int]] = {}
        self.keys = KeyStore()  # remote engines' API keys
        bridge.token.connect(self._on_token)
        bridge.finished.connect(self._on_finished)
        bridge.failed.connect(self._on_failed)
        bridge.state_changed.connect(self._on_state)
        bridge.metrics.connect(self._on_metrics)
        bridge.load_progress.connect(self._on_load_progress)
        # Agent sessions run their loops there; their changes reach views like tokens do.
        self.agents = AgentSessions(self)
        self.agents.changed.connect(lambda sid: self.token.emit(sid, ""))
        self.agents.finished.connect(self._on_agent_finished)

    # --- queries ------------------------------------------------------------------------

    def is_busy(self, session_id: int) -> bool:
        """Whether ``session_id`` has a reply in progress (or waiting for the engine), or
        its agent is working."""
        return session_id in self.replies or self.agents.busy(session_id)

    def remote_tokens(self, engine: str) -> dict[str, tuple[str, int]]:
        """The replies in flight on remote engine ``engine``: request id -> (session
        title, tokens so far), for throughput measured on this side."""
        return {
            r.request_id: (self.store.session(r.session_id).title, r.tokens)
            for r in self.replies.values()
            if r.engine is not None and r.engine.name == engine and r.request_id
        }

    def busy_sessions(self) -> list[int]:
        """The sessions with a reply in progress or an agent working."""
        return [*self.replies, *self.agents.runs]

    def shown(self, session_id: int) -> list[dict]:
        """The session's messages for the view, read from the store the first time."""
        if session_id not in self.messages:
            self._reload(session_id)
        return self.messages[session_id]

    # --- sessions -----------------------------------------------------------------------

    def create_session(self, kind: str = "chat", workspace: str | None = None) -> Session:
        """A new, empty session; an agent session works in ``workspace`` (default: a new
        folder under the app's data dir) with the agent's sampling (longer replies, low
        temperature)."""
        if kind != "agent":
            return self.store.create_session(NEW_TITLES.get(kind, "New chat"), kind)
        return self.store.create_session(
            NEW_TITLES["agent"],
            "agent",
            "",
            {"max_tokens": 1024, "temperature": 0.2},
            workspace=workspace or default_workspace(),
        )

    def rename_session(self, session_id: int, title: str) -> None:
        self.store.rename_session(session_id, title)
        self.session_renamed.emit(session_id, title)

    def update_session(
        self,
        session_id: int,
        system_prompt: str,
        overrides: dict,
        rules: list[str] | None = None,
        engine: str | None = None,
    ) -> None:
        """Save a session's system prompt, sampling overrides, engine ("" local, else a
        remote one's name) and (agents) permission rules, used from its next reply."""
        self.store.update_session(
            session_id, system_prompt=system_prompt, sampling=overrides, rules=rules, engine=engine
        )

    def delete_session(self, session_id: int) -> None:
        """Delete the session and everything in it, aborting its reply if one is running."""
        if self.agents.busy(session_id):
            self.agents.stop(session_id)
            self.agents.runs.pop(session_id, None)
            self.busy_changed.emit(session_id, False)
        reply = self.replies.pop(session_id, None)
        # Forget the reply now: tokens already queued for it have nowhere to go.
        if reply is not None:
            if reply.request_id is not None:
                self.by_request.pop(reply.request_id, None)
                self.bridge.abort(reply.request_id)
            self.busy_changed.emit(session_id, False)
        self.store.delete_session(session_id)
        self.messages.pop(session_id, None)
        self.hidden.pop(session_id, None)

    # --- replies ------------------------------------------------------------------------

    def send(self, session_id: int, text: str) -> bool:
        """Add the user's message and start the reply; False (nothing done) while the
        session is still replying."""
        if session_id in self.replies:
            return False
        self.drop_hidden(session_id)  # a deleted message is not read by the next reply
        session = self.store.session(session_id)
        if session.kind == "agent":
            return self._send_agent(session, text)
        if session.title in NEW_TITLES.values():
            self.rename_session(session_id, " ".join(text.split())[:TITLE_CHARS])
        asked = self.store.add_message(session_id, "user", text)
        shown = self.messages.setdefault(session_id, [])
        shown.append({"id": asked.id, "role": "user", "content": text, "status": "done"})
        self._start_reply(session_id)
        return True

    def regenerate(self, session_id: int, message_id: int | None = None) -> bool:
        """Answer the chat's last reply's question again (``message_id``, if given, must be
        that reply): the new reply takes its place and the old one stays as a branch. False,
        and nothing done, while it is replying, when its last message is not that reply,
        or when no new one could start (no model, bad sampling settings)."""
        last = self._last_reply(session_id, message_id)
        if last is None or not self._can_reply(session_id):
            return False
        self.store.rewind(session_id, last.id)
        self._start_reply(session_id, reload=True)  # shown with its alternative
        return True

    def edit_and_resend(self, session_id: int, message_id: int, text: str) -> bool:
        """Send ``text`` in place of the chat's user message ``message_id``: a new branch
        from there (the old question and everything after it stay a click away) and a new
        reply to it. False, and nothing done, while the session replies, for a message
        that is not one of its user messages, or when no reply could start."""
        if session_id in self.replies or self.store.session(session_id).kind != "chat":
            return False
        if not text.strip():
            return False
        self.drop_hidden(session_id)
        shown = [m for m in self.store.messages(session_id) if m.role == "user"]
        if not any(m.id == message_id for m in shown) or not self._can_reply(session_id):
            return False
        self.store.rewind(session_id, message_id)
        self.store.add_message(session_id, "user", text)
        self._reload(session_id)
        self._start_reply(session_id)
        return True

    def continue_reply(self, session_id: int, message_id: int | None = None) -> bool:
        """Let the chat's last reply (``message_id``, if given, must be it) go on where it
        ended (cut at its token limit, or stopped): new text is added to it. False, and
        nothing done, as for ``regenerate``, or when the reply has no text to go on from."""
        last = self._last_reply(session_id, message_id)
        if last is None or not last.content.strip() or last.status not in ("done", "stopped"):
            return False
        if not self._can_reply(session_id):
            return False
        history = self.store.history(session_id)  # ends with the reply itself
        self.store.reopen_message(last.id)
        shown = self.shown(session_id)
        if shown and shown[-1].get("id") == last.id:
            shown[-1].update(status="streaming")
        reply = Reply(session_id, last.id, history, prefix=last.content)
        reply.prior_tokens = last.completion_tokens
        self._begin(reply, continue_final=True)
        return True

    def show_branch(self, session_id: int, message_id: int) -> bool:
        """Show the branch through ``message_id`` (one of a message's alternatives); False
        while the session replies."""
        if self.is_busy(session_id):
            return False
        self.drop_hidden(session_id)
        try:
            self.store.switch_branch(session_id, message_id)
        except StoreError:
            return False
        self._reload(session_id)
        self.token.emit(session_id, "")  # views re-render
        return True

    def _last_reply(self, session_id: int, message_id: int | None):
        """The chat's last message if it is a reply (and ``message_id``, if given) and the
        chat is not replying; else None."""
        if session_id in self.replies or self.store.session(session_id).kind != "chat":
            return None
        self.drop_hidden(session_id)  # deleted ones go before a reply reads the history
        stored = self.store.messages(session_id)
        if not stored or stored[-1].role != "assistant":
            return None
        if message_id is not None and stored[-1].id != message_id:
            return None
        return stored[-1]

    def _can_reply(self, session_id: int) -> bool:
        """Whether a reply could start now (a model loaded or loading, or a remote engine;
        valid sampling settings); the notice says why not."""
        name = self.store.session(session_id).engine
        if name and self.engine_of(session_id) is None:
            self.notice.emit(f"The engine “{name}” is not set up any more: see Session settings.")
            return False
        if not name and not self.bridge.ready and self.bridge.state != "loading":
            self.notice.emit("No model is loaded: open Model → Settings.")
            return False
        try:
            sampling(self.settings, {"sampling": self.store.session(session_id).sampling})
        except ValueError as exc:
            self.notice.emit(f"Invalid sampling settings: {exc}")
            return False
        return True

    def _reload(self, session_id: int) -> None:
        """The shown messages read again from the store (its branch changed)."""
        hidden = self.hidden.get(session_id, ())
        self.messages[session_id] = [
            shown_message(m) for m in self.store.messages(session_id) if m.id not in hidden
        ]

    # --- deleting a message, undoably ---------------------------------------------------

    def hide_message(self, session_id: int, message_id: int) -> bool:
        """Take a message out of a chat (view and history) until ``drop_hidden`` deletes
        it or ``restore_message`` brings it back; False while the chat replies."""
        if self.is_busy(session_id) or self.store.session(session_id).kind != "chat":
            return False
        if not any(m.get("id") == message_id for m in self.shown(session_id)):
            return False
        self.hidden.setdefault(session_id, set()).add(message_id)
        self._reload(session_id)
        self.token.emit(session_id, "")  # views re-render
        return True

    def restore_message(self, session_id: int, message_id: int) -> None:
        self.hidden.get(session_id, set()).discard(message_id)
        self._reload(session_id)
        self.token.emit(session_id, "")

    def drop_hidden(self, session_id: int | None = None) -> None:
        """Delete for good the hidden messages of ``session_id`` (default: all sessions)."""
        for sid in [session_id] if session_id is not None else list(self.hidden):
            for mid in self.hidden.pop(sid, ()):
                with suppress(StoreError):  # its session was deleted meanwhile
                    self.store.delete_message(mid)

    def _start_reply(self, session_id: int, reload: bool = False) -> None:
        """A streaming reply to the session's history as it is stored now; ``reload``: the
        shown messages are read again after it is added (the branch changed)."""
        history = self.store.history(session_id)
        msg = self.store.add_message(session_id, "assistant", "", status="streaming")
        if reload:
            self._reload(session_id)
        else:
            shown = self.messages.setdefault(session_id, [])
            shown.append({"id": msg.id, "role": "assistant", "content": "", "status": "streaming"})
        self._begin(Reply(session_id, msg.id, history))

    def _begin(self, reply: Reply, continue_final: bool = False) -> None:
        """Track ``reply`` and ask the engine for it (once it is up)."""
        session_id = reply.session_id
        self.replies[session_id] = reply
        self.reply_started.emit(session_id)
        self.busy_changed.emit(session_id, True)
        reply.continue_final = continue_final
        if self.store.session(session_id).engine:
            self._submit_remote(reply)
            return
        self._set_phase(reply, LOADING if self.bridge.state == "loading" else QUEUED)
        self._submit(reply)

    def engine_of(self, session_id: int) -> Endpoint | None:
        """The remote engine the session runs on; None for the local one (or when the
        one it names is no longer set up)."""
        name = self.store.session(session_id).engine
        return find_engine(self.store, name, self.keys) if name else None

    def _submit_remote(self, reply: Reply) -> None:
        s = self.store.session(reply.session_id)
        engine = self.engine_of(s.id)
        if engine is None:
            self._end_reply(
                reply,
                "error",
                f"The engine “{s.engine}” is not set up any more: choose one in Session "
                "settings, or add it again in Model → Engines.",
            )
            return
        try:
            params = sampling(self.settings, {"sampling": s.sampling})
        except ValueError as exc:
            self._end_reply(reply, "error", f"Invalid sampling settings: {exc}")
            return
        reply.engine = engine
        rid = self.bridge.submit_remote(engine, reply.history, params, reply.continue_final)
        reply.request_id = rid
        reply.submitted_at = time.monotonic()
        self.by_request[rid] = reply
        self._set_phase(reply, f"waiting for {engine.name}")

    # --- what a reply is doing before its first token -----------------------------------

    def _set_phase(self, reply: Reply, phase: str | None) -> None:
        """Show ``phase`` in the reply's label (None once it generates); views re-render."""
        if reply.phase == phase:
            return
        reply.phase = phase
        shown = self.messages.get(reply.session_id)
        if shown and shown[-1].get("status") == "streaming":
            if phase is None:
                shown[-1].pop("phase", None)
            else:
                shown[-1]["phase"] = phase
        self.token.emit(reply.session_id, "")

    def _on_load_progress(self, done: int, total: int) -> None:
        if total <= 0:
            return
        for reply in self.replies.values():
            if reply.request_id is None:
                self._set_phase(reply, f"{LOADING} ({100 * done // total} %)")

    def _on_metrics(self, snap) -> None:
        """Queued, or reading the prompt (how much of it), from the engine's own view."""
        for progress in snap.requests:
            reply = self.by_request.get(progress.request_id)
            if reply is None or reply.tokens or progress.tokens:
                continue
            if progress.state == "queued":
                self._set_phase(reply, QUEUED)
            else:
                pct = int(100 * min(max(progress.prompt_read, 0.0), 1.0))
                size = f" ({progress.prompt_tokens:,} tokens)" if progress.prompt_tokens else ""
                self._set_phase(reply, f"reading the prompt{size}: {pct} %")

    def _send_agent(self, session: Session, text: str) -> bool:
        if self.agents.busy(session.id):
            return False
        if session.title in NEW_TITLES.values():
            self.rename_session(session.id, " ".join(text.split())[:TITLE_CHARS])
        refusal = self.agents.send(session.id, text)
        if refusal is not None:
            self.notice.emit(refusal)
            return False
        self.reply_started.emit(session.id)
        self.busy_changed.emit(session.id, True)
        return True

    def _on_agent_finished(self, session_id: int, status: str) -> None:
        self.reply_finished.emit(session_id, status)
        self.busy_changed.emit(session_id, False)

    def stop(self, session_id: int) -> None:
        """Stop the session's reply, keeping what it has said so far."""
        if self.agents.busy(session_id):
            self.agents.stop(session_id)
            return
        reply = self.replies.get(session_id)
        if reply is None:
            return
        if reply.request_id is None:
            self._end_reply(reply, "stopped")
        else:
            self.bridge.abort(reply.request_id)  # Finished(abort) ends it

    def stop_all(self) -> None:
        """End every reply as stopped, now, without waiting for the engine (app exit)."""
        self.agents.stop_all()
        for reply in list(self.replies.values()):
            self._end_reply(reply, "stopped")

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
        # The session's own choice, else the model's (Settings; rolling by default).
        overflow = (s.sampling or {}).get("context_overflow") or self.settings.get(
            "context_overflow", "rolling"
        )
        rid = self.bridge.submit(
            reply.history,
            params,
            session=s.title,
            overflow=overflow,
            continue_final=reply.continue_final,
        )
        reply.request_id = rid
        reply.submitted_at = time.monotonic()
        self.by_request[rid] = reply
        self._set_phase(reply, QUEUED)

    def _submit_queued(self) -> None:
        for reply in list(self.replies.values()):
            if reply.request_id is None:
                self._submit(reply)

    def _on_state(self, state: str, _detail: str) -> None:
        if state == "ready":
            self._submit_queued()

    def _on_token(self, request_id: str, text: str) -> None:
        reply = self.by_request.get(request_id)
        if reply is None:
            return
        reply.chunks.append(text)
        reply.tokens += 1
        if reply.first_token_at is None:
            reply.first_token_at = time.monotonic()
        if reply.phase is not None:
            self._set_phase(reply, None)
        self.store.update_message(reply.message_id, reply.text, reply.prior_tokens + reply.tokens)
        shown = self.messages.get(reply.session_id)
        if shown:
            shown[-1]["content"] = reply.text
        self.token.emit(reply.session_id, text)

    def _on_finished(self, ev: Finished) -> None:
        reply = self.by_request.get(ev.request_id)
        if reply is None:
            return
        status = {"abort": "stopped", "error": "error"}.get(ev.reason, "done")
        if not ev.completion_tokens and reply.tokens:
            # A remote stream stopped, or a server that reports no usage: what came here.
            ev = replace(ev, completion_tokens=reply.tokens)
        data = {"stats": self._reply_stats(reply, ev)}
        if ev.dropped_messages:  # the view says where the model's view of the chat began
            data["dropped"] = ev.dropped_messages
        self._end_reply(
            reply,
            status,
            None,
            reply.prefix + ev.text,
            ev.prompt_tokens,
            reply.prior_tokens + ev.completion_tokens,
            data,
        )

    def _reply_stats(self, reply: Reply, ev: Finished) -> dict:
        """What the footer under a reply shows: its tokens, speed, wait, why it ended, and
        the model and policy that made it."""
        now = time.monotonic()
        first, n = reply.first_token_at, ev.completion_tokens
        config = None if reply.engine else self.bridge.config
        return {
            "tokens": reply.prior_tokens + n,  # a continued reply counts all its text
            "prompt_tokens": ev.prompt_tokens,
            # Decode speed: the tokens after the first, over the time they took.
            "tok_s": (n - 1) / (now - first)
            if first is not None and n > 1 and now > first
            else None,
            "ttft_s": first - reply.submitted_at
            if first is not None and reply.submitted_at
            else None,
            "reason": ev.reason,
            "model": f"{reply.engine.model} on {reply.engine.name}"
            if reply.engine
            else self.bridge.model_name,
            "policy": config.policy if config is not None else "",
        }

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
        data: dict | None = None,
    ) -> None:
        content = text if text is not None else reply.text
        if error and reply.prefix:
            # A continuation that failed: the reply keeps what it had (and stays the
            # model's answer in the history); the notice says what went wrong.
            self.notice.emit(f"The reply could not be continued: {error}")
            status, error = "stopped", None
        if error:
            content = f"{content}\n\n> **Error:** {error}" if content else f"> **Error:** {error}"
        with suppress(StoreError):  # the session was deleted while its reply was finishing
            self.store.finish_message(
                reply.message_id,
                content,
                status,
                prompt_tokens,
                completion_tokens
                if completion_tokens is not None
                else reply.prior_tokens + reply.tokens,
                data,
            )
        self.replies.pop(reply.session_id, None)
        if reply.request_id is not None:
            self.by_request.pop(reply.request_id, None)
        shown = self.messages.get(reply.session_id)
        if shown:
            shown[-1].update(content=content, status=status)
            shown[-1].pop("phase", None)
            if data is not None:
                shown[-1]["data"] = data
        self.reply_finished.emit(reply.session_id, status)
        self.busy_changed.emit(reply.session_id, False)
