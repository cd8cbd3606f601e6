"""The desktop app's persistent state: chat sessions, their messages, settings, compare runs.

One SQLite file (``bevy.db`` in the platform data dir, or ``$BEVY_DATA_DIR``) in WAL mode,
so readers never block the writer and a crash never corrupts it. Plain Python, no Qt: the
app calls it from the GUI thread; a lock makes it safe from any thread.

Streaming replies are the one hot path. The app hands every new token to
``update_message``; the store keeps the newest text in memory and writes a message at most
once per ``flush_interval_s`` (one UPDATE), plus a background flush when tokens pause, so a
crash loses at most the last interval of a reply. ``finish_message`` always writes at once.
A reply still marked "streaming" when the store opens was cut off by a crash; it becomes
"interrupted" with its text kept.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import platformdirs
from sqlite_utils import Database

APP_NAME = "bevy-desktop"
DB_NAME = "bevy.db"

KINDS = ("chat", "agent")
ROLES = ("user", "assistant", "system", "tool")
STATUSES = ("done", "streaming", "stopped", "error", "interrupted")

# One entry per schema version; entry i upgrades a database at user_version i to i + 1.
# Append new entries, never edit old ones: existing databases have already run them.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('chat', 'agent')),
        system_prompt TEXT NOT NULL DEFAULT '',
        sampling TEXT NOT NULL DEFAULT '{}',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE INDEX sessions_updated ON sessions (updated);
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        session_id INTEGER NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'system', 'tool')),
        content TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL
            CHECK (status IN ('done', 'streaming', 'stopped', 'error', 'interrupted')),
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL
    );
    CREATE INDEX messages_session ON messages (session_id, id);
    CREATE INDEX messages_status ON messages (status);
    CREATE TABLE settings (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    CREATE TABLE compare_runs (
        id INTEGER PRIMARY KEY,
        created REAL NOT NULL,
        title TEXT NOT NULL,
        policies TEXT NOT NULL,
        workload TEXT NOT NULL,
        results TEXT NOT NULL
    );
    """,
    # 2: agent sessions: a workspace and permission rules per session, and per message
    # what a card shows (an assistant turn's tool calls; a tool run's call and result).
    """
    ALTER TABLE sessions ADD COLUMN workspace TEXT NOT NULL DEFAULT '';
    ALTER TABLE sessions ADD COLUMN rules TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE messages ADD COLUMN data TEXT NOT NULL DEFAULT '{}';
    """,
    # 3: branches. Each message follows a parent (NULL: the first); a session shows the
    # path that ends at its head, so an edited message or a regenerated reply starts a
    # new branch and the old one stays, a click away. Existing sessions are one path.
    """
    ALTER TABLE messages ADD COLUMN parent_id INTEGER;
    ALTER TABLE sessions ADD COLUMN head INTEGER;
    UPDATE messages SET parent_id = (
        SELECT MAX(p.id) FROM messages p
        WHERE p.session_id = messages.session_id AND p.id < messages.id
    );
    UPDATE sessions SET head = (SELECT MAX(m.id) FROM messages m WHERE m.session_id = sessions.id);
    CREATE INDEX messages_parent ON messages (parent_id);
    """,
    # 4: the engine a session runs on: "" the local one, else a remote engine's name
    # (Settings → Engines).
    """
    ALTER TABLE sessions ADD COLUMN engine TEXT NOT NULL DEFAULT '';
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


class StoreError(Exception):
    """A missing row, a bad value, or a database written by a newer Bevy."""


def data_dir() -> Path:
    """Where the app keeps its database (``$BEVY_DATA_DIR`` overrides, for tests)."""
    base = os.environ.get("BEVY_DATA_DIR")
    return Path(base) if base else Path(platformdirs.user_data_dir(APP_NAME))


def default_db_path() -> Path:
    return data_dir() / DB_NAME


@dataclass(frozen=True)
class Session:
    id: int
    title: str
    kind: str
    system_prompt: str
    sampling: dict[str, Any]
    created: float
    updated: float
    workspace: str = ""  # agent sessions: the folder the agent works in
    rules: list[str] = field(default_factory=list)  # agent sessions: "allow run_command pytest *"
    engine: str = ""  # "" the local engine, else the name of a remote one (app/engines.py)


@dataclass(frozen=True)
class Message:
    id: int
    session_id: int
    role: str
    content: str
    status: str
    prompt_tokens: int
    completion_tokens: int
    created: float
    # Agent sessions: {"tool_calls": [...]} on an assistant turn; on a tool message the
    # call (call_id, name, arguments) and its result (approval, exit_code, seconds, diff).
    data: dict[str, Any] = field(default_factory=dict)
    parent_id: int | None = None  # the message it follows (None: the session's first)
    # With alternatives (an edited message, a regenerated reply): the ids of it and them,
    # oldest first; () when it has none.
    branches: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompareRun:
    id: int
    created: float
    title: str
    policies: list[str]
    workload: str
    results: Any  # whatever the compare view saved (JSON-serialisable)


@dataclass
class _Pending:
    """A streaming message's newest state that is not yet on disk."""

    content: str
    completion_tokens: int | None


def _session(row: dict) -> Session:
    return Session(
        row["id"],
        row["title"],
        row["kind"],
        row["system_prompt"],
        json.loads(row["sampling"]),
        row["created"],
        row["updated"],
        row.get("workspace", ""),
        json.loads(row.get("rules") or "[]"),
        row.get("engine") or "",
    )


def _compare(row: dict) -> CompareRun:
    return CompareRun(
        row["id"],
        row["created"],
        row["title"],
        json.loads(row["policies"]),
        row["workload"],
        json.loads(row["results"]),
    )


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise StoreError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


class Store:
    """The app database. ``clock`` gives wall-clock seconds; tests pass their own to control
    timestamps and write coalescing. ``background_flush`` writes a paused stream's pending
    text once it is due, from a timer thread, without waiting for the next token."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        clock: Callable[[], float] = time.time,
        flush_interval_s: float = 1.0,
        background_flush: bool = True,
    ) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.flush_interval_s = flush_interval_s
        self._background = background_flush
        # Re-entrant: the flush timer and public methods share it, and methods call each other.
        self._lock = threading.RLock()
        self._pending: dict[int, _Pending] = {}
        self._last_write: dict[int, float] = {}  # clock time of each streaming message's write
        self._timer: threading.Timer | None = None
        self._closed = False
        # check_same_thread off: the flush timer writes too; the lock serialises all use.
        self.db = Database(sqlite3.connect(str(self.path), check_same_thread=False))
        self.db.enable_wal()
        # WAL + NORMAL survives an app crash (what we guard against) and skips an fsync per
        # commit; only a power cut can lose the newest commits.
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA foreign_keys = ON")
        try:
            self._migrate()
        except BaseException:
            self.db.close()
            raise
        # The previous process died mid-reply (this app runs one instance per database).
        self.db.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'")

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {version}, newer than this Bevy "
                f"understands ({SCHEMA_VERSION}); update Bevy"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            # One transaction per step, the version with it: executescript commits what
            # came before and runs outside any transaction of ours, so the script holds
            # its own (a crash in a step leaves the database at the step before).
            script = f"BEGIN;\n{MIGRATIONS[target - 1]}\nPRAGMA user_version = {target};\nCOMMIT;"
            try:
                self.db.executescript(script)
            except BaseException:
                if self.db.conn.in_transaction:
                    self.db.conn.rollback()
                raise

    def _rows(self, sql: str, args: list) -> list[dict]:
        """A query's rows as dicts. Plain SQL: sqlite-utils' table objects look the schema
        up on every call, a few ms each on the GUI thread while replies stream."""
        cur = self.db.execute(sql, args)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    @property
    def schema_version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    # --- sessions -----------------------------------------------------------------------

    def create_session(
        self,
        title: str = "New chat",
        kind: str = "chat",
        system_prompt: str = "",
        sampling: dict[str, Any] | None = None,
        workspace: str = "",
    ) -> Session:
        _check(kind, KINDS, "kind")
        now = self._clock()
        row = {
            "title": title,
            "kind": kind,
            "system_prompt": system_prompt,
            "sampling": json.dumps(sampling or {}),
            "workspace": workspace,
            "created": now,
            "updated": now,
        }
        with self._lock:
            sid = self.db["sessions"].insert(row).last_pk
            return self.session(sid)

    def session(self, session_id: int) -> Session:
        with self._lock:
            rows = self._rows("SELECT * FROM sessions WHERE id = ?", [session_id])
        if not rows:
            raise StoreError(f"no session {session_id}")
        return _session(rows[0])

    def update_session(
        self,
        session_id: int,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        sampling: dict[str, Any] | None = None,
        rules: list[str] | None = None,
        workspace: str | None = None,
        engine: str | None = None,
    ) -> Session:
        """Change any of title, system prompt, sampling settings, engine and (agents)
        rules and workspace; bumps ``updated``."""
        sets: dict[str, Any] = {"updated": self._clock()}
        if engine is not None:
            sets["engine"] = engine
        if rules is not None:
            sets["rules"] = json.dumps(rules)
        if workspace is not None:
            sets["workspace"] = workspace
        if title is not None:
            sets["title"] = title
        if system_prompt is not None:
            sets["system_prompt"] = system_prompt
        if sampling is not None:
            sets["sampling"] = json.dumps(sampling)
        assignments = ", ".join(f"{k} = ?" for k in sets)
        with self._lock:
            cur = self.db.execute(
                f"UPDATE sessions SET {assignments} WHERE id = ?", [*sets.values(), session_id]
            )
            if cur.rowcount == 0:
                raise StoreError(f"no session {session_id}")
            return self.session(session_id)

    def rename_session(self, session_id: int, title: str) -> Session:
        return self.update_session(session_id, title=title)

    def delete_session(self, session_id: int) -> None:
        """Delete a session and (by ON DELETE CASCADE) all its messages."""
        with self._lock:
            rows = self.db.execute("SELECT id FROM messages WHERE session_id = ?", [session_id])
            for (mid,) in rows.fetchall():
                self._forget(mid)
            cur = self.db.execute("DELETE FROM sessions WHERE id = ?", [session_id])
        if cur.rowcount == 0:
            raise StoreError(f"no session {session_id}")

    def delete_message(self, message_id: int) -> None:
        """Delete one message; what followed it follows its parent. A session shown up to
        it shows its newest alternative's branch instead (a reply generated again), else
        ends at its parent."""
        with self._lock:
            row = self.db.execute(
                "SELECT session_id, parent_id FROM messages WHERE id = ?", [message_id]
            ).fetchone()
            if row is None:
                raise StoreError(f"no message {message_id}")
            sid, parent = row
            self._forget(message_id)
            with self.db.atomic():
                self.db.execute(
                    "UPDATE messages SET parent_id = ? WHERE parent_id = ?", [parent, message_id]
                )
                self.db.execute("DELETE FROM messages WHERE id = ?", [message_id])
                head = self.db.execute("SELECT head FROM sessions WHERE id = ?", [sid]).fetchone()
                if head is not None and head[0] == message_id:
                    sibling = self.db.execute(
                        "SELECT MAX(id) FROM messages WHERE session_id = ? AND parent_id IS ?",
                        [sid, parent],
                    ).fetchone()[0]
                    self.db.execute("UPDATE sessions SET head = ? WHERE id = ?", [parent, sid])
                    if sibling is not None:
                        self.switch_branch(sid, sibling)

    def rename_engine(self, old: str, new: str) -> None:
        """Sessions on remote engine ``old`` are on ``new`` (the engine was renamed)."""
        with self._lock:
            self.db.execute("UPDATE sessions SET engine = ? WHERE engine = ?", [new, old])

    def rewind(self, session_id: int, message_id: int) -> None:
        """Show the session up to the message before ``message_id``: the next message added
        becomes an alternative to it (a new branch), and ``message_id`` stays a click away."""
        with self._lock:
            row = self.db.execute(
                "SELECT parent_id FROM messages WHERE id = ? AND session_id = ?",
                [message_id, session_id],
            ).fetchone()
            if row is None:
                raise StoreError(f"no message {message_id} in session {session_id}")
            self.db.execute("UPDATE sessions SET head = ? WHERE id = ?", [row[0], session_id])

    def switch_branch(self, session_id: int, message_id: int) -> None:
        """Show the branch through ``message_id``: it, and below it the newest message at
        each step down to the end."""
        with self._lock:
            rows = self.db.execute(
                "SELECT id, parent_id FROM messages WHERE session_id = ?", [session_id]
            ).fetchall()
            children: dict[int, int] = {}
            for mid, parent in rows:
                if parent is not None:
                    children[parent] = max(children.get(parent, mid), mid)
            if message_id not in {mid for mid, _ in rows}:
                raise StoreError(f"no message {message_id} in session {session_id}")
            head = message_id
            while head in children:
                head = children[head]
            self.db.execute("UPDATE sessions SET head = ? WHERE id = ?", [head, session_id])

    def list_sessions(self, kind: str | None = None) -> list[Session]:
        """Newest-updated first."""
        where, args = ("kind = ?", [kind]) if kind is not None else (None, None)
        with self._lock:
            rows = list(
                self.db["sessions"].rows_where(where, args, order_by="updated DESC, id DESC")
            )
        return [_session(r) for r in rows]

    # --- messages -----------------------------------------------------------------------

    def add_message(
        self,
        session_id: int,
        role: str,
        content: str = "",
        status: str = "done",
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        data: dict[str, Any] | None = None,
    ) -> Message:
        """Append a message; a reply about to stream starts with ``status="streaming"``."""
        _check(role, ROLES, "role")
        _check(status, STATUSES, "status")
        now = self._clock()
        row: dict[str, Any] = {
            "session_id": session_id,
            "role": role,
            "content": content,
            "status": status,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "created": now,
            "data": json.dumps(data or {}),
        }
        with self._lock:
            head = self.db.execute("SELECT head FROM sessions WHERE id = ?", [session_id])
            found = head.fetchone()
            if found is None:
                raise StoreError(f"no session {session_id}")
            row["parent_id"] = found[0]  # it follows the message shown last
            with self.db.atomic():
                names = ", ".join(row)
                marks = ", ".join("?" for _ in row)
                mid = self.db.execute(
                    f"INSERT INTO messages ({names}) VALUES ({marks})", list(row.values())
                ).lastrowid
                self.db.execute(
                    "UPDATE sessions SET updated = ?, head = ? WHERE id = ?",
                    [now, mid, session_id],
                )
            if status == "streaming":
                self._last_write[mid] = now
        return Message(
            mid,
            session_id,
            role,
            content,
            status,
            prompt_tokens,
            completion_tokens,
            now,
            data or {},
            found[0],
        )

    def update_message(
        self, message_id: int, content: str, completion_tokens: int | None = None
    ) -> None:
        """A streaming reply's text so far. Cheap: written now only if the message's last
        write is ``flush_interval_s`` old, else kept in memory for the next due write."""
        now = self._clock()
        with self._lock:
            last = self._last_write.get(message_id)
            # A clock that went backwards (wall-clock adjustment) must not stall writes.
            if last is None or now - last >= self.flush_interval_s or now < last:
                self._pending.pop(message_id, None)
                self._write_stream(message_id, content, completion_tokens, now)
            else:
                self._pending[message_id] = _Pending(content, completion_tokens)
                self._arm_timer(self.flush_interval_s - (now - last))

    def finish_message(
        self,
        message_id: int,
        content: str | None = None,
        status: str = "done",
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        """End a reply (done, stopped, error): written at once, superseding pending text.
        ``data`` replaces the message's card data."""
        _check(status, STATUSES, "status")
        with self._lock:
            pending = self._pending.pop(message_id, None)
            self._last_write.pop(message_id, None)
            if content is None and pending is not None:
                content = pending.content
            if completion_tokens is None and pending is not None:
                completion_tokens = pending.completion_tokens
            sets: dict[str, Any] = {"status": status}
            if content is not None:
                sets["content"] = content
            if prompt_tokens is not None:
                sets["prompt_tokens"] = prompt_tokens
            if completion_tokens is not None:
                sets["completion_tokens"] = completion_tokens
            if data is not None:
                sets["data"] = json.dumps(data)
            assignments = ", ".join(f"{k} = ?" for k in sets)
            now = self._clock()
            with self.db.atomic():
                cur = self.db.execute(
                    f"UPDATE messages SET {assignments} WHERE id = ?", [*sets.values(), message_id]
                )
                if cur.rowcount == 0:
                    raise StoreError(f"no message {message_id}")
                self.db.execute(
                    "UPDATE sessions SET updated = ? "
                    "WHERE id = (SELECT session_id FROM messages WHERE id = ?)",
                    [now, message_id],
                )

    def reopen_message(self, message_id: int) -> None:
        """Mark a finished reply as streaming again (it is being continued); its text
        stays, and ``update_message`` writes what follows."""
        with self._lock:
            cur = self.db.execute(
                "UPDATE messages SET status = 'streaming' WHERE id = ?", [message_id]
            )
            if cur.rowcount == 0:
                raise StoreError(f"no message {message_id}")
            self._last_write[message_id] = self._clock()

    def messages(self, session_id: int) -> list[Message]:
        """The session's messages on the branch it shows, oldest first (pending streamed
        text included); each with its alternatives' ids in ``branches`` when it has some."""
        with self._lock:
            head = self.db.execute("SELECT head FROM sessions WHERE id = ?", [session_id])
            found = head.fetchone()
            rows = {
                r["id"]: r
                for r in self._rows("SELECT * FROM messages WHERE session_id = ?", [session_id])
            }
            siblings: dict[int | None, list[int]] = {}
            for mid in sorted(rows):
                siblings.setdefault(rows[mid]["parent_id"], []).append(mid)
            path, at = [], found[0] if found else None
            while at is not None and at in rows and len(path) <= len(rows):
                path.append(rows[at])
                at = rows[at]["parent_id"]
            out = []
            for r in reversed(path):
                alternatives = siblings[r["parent_id"]]
                branches = tuple(alternatives) if len(alternatives) > 1 else ()
                out.append(self._message(r, branches))
            return out

    def history(self, session_id: int) -> list[dict[str, str]]:
        """The conversation for the model, OpenAI-style, system prompt first.

        Failed replies are left out (their text is an error, not the model's answer), and
        so are empty ones (a reply cut off before its first token: chat templates expect
        every assistant turn to say something)."""
        s = self.session(session_id)
        out = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
        for m in self.messages(session_id):
            if m.status == "error" or (m.role == "assistant" and not m.content):
                continue
            out.append({"role": m.role, "content": m.content})
        return out

    def set_message_data(self, message_id: int, data: dict[str, Any]) -> None:
        """Replace a message's card data (a tool call waiting for approval, then running)."""
        with self._lock:
            cur = self.db.execute(
                "UPDATE messages SET data = ? WHERE id = ?", [json.dumps(data), message_id]
            )
        if cur.rowcount == 0:
            raise StoreError(f"no message {message_id}")

    def _message(self, row: dict, branches: tuple[int, ...] = ()) -> Message:
        row = {**row, "data": json.loads(row.get("data") or "{}"), "branches": branches}
        pending = self._pending.get(row["id"])
        if pending is not None:
            row = {**row, "content": pending.content}
            if pending.completion_tokens is not None:
                row["completion_tokens"] = pending.completion_tokens
        return Message(**row)

    def _write_stream(
        self, message_id: int, content: str, completion_tokens: int | None, now: float
    ) -> None:
        # The hot path: one UPDATE statement, no read-back.
        if completion_tokens is None:
            cur = self.db.execute(
                "UPDATE messages SET content = ? WHERE id = ?", [content, message_id]
            )
        else:
            cur = self.db.execute(
                "UPDATE messages SET content = ?, completion_tokens = ? WHERE id = ?",
                [content, completion_tokens, message_id],
            )
        if cur.rowcount == 0:
            self._forget(message_id)
            raise StoreError(f"no message {message_id}")
        self._last_write[message_id] = now

    def _forget(self, message_id: int) -> None:
        self._pending.pop(message_id, None)
        self._last_write.pop(message_id, None)

    def flush_due(self) -> int:
        """Write every pending message whose last write is ``flush_interval_s`` old; returns
        how many were written."""
        now = self._clock()
        written = 0
        with self._lock:
            for mid, p in list(self._pending.items()):
                last = self._last_write.get(mid, now)
                if now - last >= self.flush_interval_s or now < last:
                    del self._pending[mid]
                    self._write_stream(mid, p.content, p.completion_tokens, now)
                    written += 1
        return written

    def flush(self) -> None:
        """Write all pending streamed text now (on close, before export, when quitting)."""
        now = self._clock()
        with self._lock:
            pending, self._pending = self._pending, {}
            for mid, p in pending.items():
                self._write_stream(mid, p.content, p.completion_tokens, now)

    def _arm_timer(self, delay: float) -> None:
        if not self._background or self._timer is not None or self._closed:
            return
        self._timer = threading.Timer(max(delay, 0.01), self._on_timer)
        self._timer.daemon = True
        self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            if self._closed:
                return
            self.flush_due()
            if self._pending:  # streams whose own interval is not up yet
                now = self._clock()
                oldest = min(self._last_write.get(m, now) for m in self._pending)
                self._arm_timer(self.flush_interval_s - (now - oldest))

    # --- settings -----------------------------------------------------------------------

    def get_setting(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self.db.execute("SELECT value FROM settings WHERE key = ?", [key]).fetchone()
        return json.loads(row[0]) if row else default

    def set_setting(self, key: str, value: Any) -> None:
        """Store any JSON-serialisable value."""
        encoded = json.dumps(value)
        with self._lock:
            self.db.execute(
                "INSERT INTO settings (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                [key, encoded],
            )

    # --- compare runs -------------------------------------------------------------------

    def save_compare(
        self, title: str, policies: Iterable[str], workload: str, results: Any
    ) -> CompareRun:
        row = {
            "created": self._clock(),
            "title": title,
            "policies": json.dumps(list(policies)),
            "workload": workload,
            "results": json.dumps(results),
        }
        with self._lock:
            rid = self.db["compare_runs"].insert(row).last_pk
        return self.load_compare(rid)

    def list_compares(self) -> list[CompareRun]:
        """Newest first."""
        with self._lock:
            rows = list(self.db["compare_runs"].rows_where(order_by="created DESC, id DESC"))
        return [_compare(r) for r in rows]

    def load_compare(self, run_id: int) -> CompareRun:
        with self._lock:
            rows = list(self.db["compare_runs"].rows_where("id = ?", [run_id]))
        if not rows:
            raise StoreError(f"no compare run {run_id}")
        return _compare(rows[0])

    # --- export -------------------------------------------------------------------------

    def export_markdown(self, session_id: int) -> str:
        """The session as a Markdown document: a heading per turn, status notes for replies
        that did not complete."""
        s = self.session(session_id)
        lines = [f"# {s.title}", "", f"*{s.kind} · created {_iso(s.created)}*", ""]
        if s.system_prompt:
            lines += ["## System prompt", "", s.system_prompt, ""]
        for m in self.messages(session_id):
            lines += [f"## {m.role.capitalize()}", ""]
            if m.role == "tool" and m.data.get("name"):
                args = m.data.get("arguments")
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                lines += [f"`{m.data['name']}` `{args}`", ""]
            for c in m.data.get("tool_calls") or []:
                fn = c.get("function") or {}
                lines += [f"- calls `{fn.get('name')}` `{fn.get('arguments')}`"]
            if m.content:
                lines += [m.content, ""]
            if m.status != "done":
                lines += [f"*[{m.status}]*", ""]
        return "\n".join(lines)

    def export_json(self, session_id: int) -> str:
        """The session and its messages as one JSON document (``format`` names the schema)."""
        s = self.session(session_id)
        doc = {
            "format": "bevy-session",
            "version": 1,
            "session": asdict(s),
            "messages": [
                {k: v for k, v in asdict(m).items() if k != "session_id"}
                for m in self.messages(session_id)
            ],
        }
        return json.dumps(doc, indent=2, ensure_ascii=False)

    # --- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Write pending streamed text and close the database."""
        with self._lock:
            if self._closed:
                return
            timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()
            self.flush()
            self._closed = True
            self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
