"""The app database: sessions, messages, settings, compare runs, crash recovery, coalescing."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.store import SCHEMA_VERSION, Store, StoreError, default_db_path

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """Time the test sets by hand (drives timestamps and write coalescing)."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock):
    s = Store(tmp_path / "bevy.db", clock=clock, background_flush=False)
    yield s
    s.close()


def _count_message_writes(store: Store) -> list[str]:
    """Every UPDATE of the messages table SQLite itself executes from now on."""
    writes: list[str] = []

    def trace(sql: str) -> None:
        if sql.lstrip().upper().startswith("UPDATE MESSAGES"):
            writes.append(sql)

    store.db.conn.set_trace_callback(trace)
    return writes


def _on_disk(path: Path, message_id: int) -> tuple[str, str]:
    """(content, status) as another connection sees it: what survives this process."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(
            "SELECT content, status FROM messages WHERE id = ?", [message_id]
        ).fetchone()
    finally:
        conn.close()


def test_default_path_honours_env_and_db_is_wal_and_versioned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BEVY_DATA_DIR", str(tmp_path / "data"))
    assert default_db_path() == tmp_path / "data" / "bevy.db"
    with Store() as s:
        assert s.path == tmp_path / "data" / "bevy.db" and s.path.exists()
        assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s.schema_version == SCHEMA_VERSION >= 1


def test_database_from_a_newer_bevy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bevy.db"
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        Store(path)


def test_sessions_create_rename_list_newest_updated_first(store: Store, clock: Clock) -> None:
    a = store.create_session("First", sampling={"temperature": 0.2, "max_tokens": 64})
    clock.t += 10
    b = store.create_session("Second", kind="agent", system_prompt="Be brief.")
    assert [s.id for s in store.list_sessions()] == [b.id, a.id]
    assert [s.id for s in store.list_sessions(kind="agent")] == [b.id]
    clock.t += 10
    renamed = store.rename_session(a.id, "First, renamed")
    assert renamed.title == "First, renamed" and renamed.updated == clock.t
    assert renamed.sampling == {"temperature": 0.2, "max_tokens": 64}
    assert [s.id for s in store.list_sessions()] == [a.id, b.id]
    clock.t += 10
    store.add_message(b.id, "user", "hello")  # a new message counts as activity
    assert [s.id for s in store.list_sessions()] == [b.id, a.id]
    updated = store.update_session(b.id, sampling={"temperature": 0.0})
    assert updated.sampling == {"temperature": 0.0} and updated.system_prompt == "Be brief."
    with pytest.raises(StoreError):
        store.create_session("x", kind="group")
    with pytest.raises(StoreError):
        store.rename_session(999, "nobody")


def test_delete_session_cascades_to_its_messages(store: Store) -> None:
    keep = store.create_session("keep")
    gone = store.create_session("gone")
    store.add_message(keep.id, "user", "stay")
    store.add_message(gone.id, "user", "bye")
    streaming = store.add_message(gone.id, "assistant", status="streaming")
    store.update_message(streaming.id, "partial")
    store.delete_session(gone.id)
    count = store.db.execute("SELECT count(*) FROM messages WHERE session_id = ?", [gone.id])
    assert count.fetchone()[0] == 0
    assert [m.content for m in store.messages(keep.id)] == ["stay"]
    assert [s.id for s in store.list_sessions()] == [keep.id]
    store.close()  # flushing pending text of a deleted stream must not fail or resurrect it
    with Store(store.path) as reopened:
        assert reopened.messages(gone.id) == []


def test_messages_need_a_session_and_valid_role_and_status(store: Store) -> None:
    s = store.create_session()
    with pytest.raises(StoreError, match="no session"):
        store.add_message(12345, "user", "orphan")
    with pytest.raises(StoreError, match="role"):
        store.add_message(s.id, "robot", "hi")
    with pytest.raises(StoreError, match="status"):
        store.add_message(s.id, "user", "hi", status="pending")


def test_reopening_restores_sessions_and_messages(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "bevy.db"
    with Store(path, clock=clock) as s:
        sess = s.create_session("Kept", system_prompt="sys", sampling={"top_p": 0.9})
        s.add_message(sess.id, "user", "question")
        reply = s.add_message(sess.id, "assistant", status="streaming")
        s.update_message(reply.id, "ans")
        s.finish_message(reply.id, "answer", status="stopped", prompt_tokens=7, completion_tokens=3)
        s.set_setting("theme", "dark")
        before = (s.list_sessions(), s.messages(sess.id))
    with Store(path, clock=clock) as s:
        assert (s.list_sessions(), s.messages(sess.id)) == before
        last = s.messages(sess.id)[-1]
        assert (last.content, last.status, last.prompt_tokens, last.completion_tokens) == (
            "answer",
            "stopped",
            7,
            3,
        )
        assert s.get_setting("theme") == "dark"


_CRASH = """
import os, sys
from app.store import Store

t = [1000.0]
s = Store(sys.argv[1], clock=lambda: t[0], background_flush=False)
sess = s.create_session("crashy")
s.add_message(sess.id, "user", "tell me a story")
reply = s.add_message(sess.id, "assistant", status="streaming")
for when, text in [(1000.5, "Once"), (1001.0, "Once upon"), (1001.4, "Once upon a time")]:
    t[0] = when
    s.update_message(reply.id, text)
print(sess.id, reply.id, flush=True)
os._exit(1)  # a crash: no close, no finish, no flush
"""


def test_crash_mid_reply_leaves_it_interrupted_with_the_last_flushed_text(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bevy.db"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    session_id, reply_id = map(int, proc.stdout.split())
    assert _on_disk(path, reply_id) == ("Once upon", "streaming")
    with Store(path) as s:
        m = s.messages(session_id)[-1]
        assert m.id == reply_id
        # "Once upon" was written at t=1001.0 (1 s after the insert); "a time" came 0.4 s
        # later and was still waiting in memory when the process died.
        assert (m.content, m.status) == ("Once upon", "interrupted")
        assert [x.role for x in s.messages(m.session_id)] == ["user", "assistant"]


def test_streaming_writes_are_coalesced_to_one_per_interval(store: Store, clock: Clock) -> None:
    s = store.create_session()
    a = store.add_message(s.id, "assistant", status="streaming")
    b = store.add_message(s.id, "assistant", status="streaming")
    writes = _count_message_writes(store)
    text = ""
    for i in range(42):  # 8 tokens/s for 5.25 s, two replies interleaved (binary-exact steps)
        clock.t += 0.125
        text += f"t{i} "
        store.update_message(a.id, text, completion_tokens=i + 1)
        store.update_message(b.id, text.upper())
    assert len(writes) == 10  # one per second per message, 84 updates in all
    # Readers see the newest text even while it waits in memory.
    first = store.messages(s.id)[0]
    assert first.content == text and first.completion_tokens == 42
    assert _on_disk(store.path, a.id)[0] != text
    store.finish_message(a.id, status="done", prompt_tokens=5)
    assert _on_disk(store.path, a.id) == (text, "done")  # immediate, pending text included
    assert store.messages(s.id)[0].completion_tokens == 42
    n = len(writes)
    clock.t += 0.01
    store.update_message(b.id, text.upper() + "END")
    assert len(writes) == n  # b's last write was 0.01 s ago: deferred
    clock.t += 1.0
    assert store.flush_due() == 1
    assert _on_disk(store.path, b.id)[0] == text.upper() + "END"
    assert store.flush_due() == 0


def test_background_flush_writes_a_paused_stream(tmp_path: Path) -> None:
    with Store(tmp_path / "bevy.db", flush_interval_s=0.05) as store:
        s = store.create_session()
        m = store.add_message(s.id, "assistant", status="streaming")
        store.update_message(m.id, "first words")  # right after the insert: deferred
        assert _on_disk(store.path, m.id)[0] == ""
        deadline = time.monotonic() + 5
        while _on_disk(store.path, m.id)[0] != "first words" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _on_disk(store.path, m.id)[0] == "first words"


def test_history_is_openai_style_with_system_prompt(store: Store) -> None:
    s = store.create_session(system_prompt="You are terse.")
    store.add_message(s.id, "user", "Capital of France?")
    store.add_message(s.id, "assistant", "Paris.")
    store.add_message(s.id, "user", "And Spain?")
    store.add_message(s.id, "assistant", "engine failed: out of memory", status="error")
    store.add_message(s.id, "assistant", "", status="interrupted")
    store.add_message(s.id, "user", "Spain?")
    store.add_message(s.id, "assistant", "Mad", status="stopped")
    assert store.history(s.id) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Spain?"},
        {"role": "user", "content": "Spain?"},
        {"role": "assistant", "content": "Mad"},
    ]
    bare = store.create_session()
    store.add_message(bare.id, "user", "hi")
    assert store.history(bare.id) == [{"role": "user", "content": "hi"}]


def test_settings_are_json_values_with_defaults(store: Store) -> None:
    assert store.get_setting("missing") is None
    assert store.get_setting("missing", {"x": 1}) == {"x": 1}
    store.set_setting("cache", "30%")
    store.set_setting("window", {"w": 1200, "h": 800, "maximized": False})
    store.set_setting("cache", 0.5)
    assert store.get_setting("cache") == 0.5
    assert store.get_setting("window") == {"w": 1200, "h": 800, "maximized": False}


def test_compare_runs_save_list_load(store: Store, clock: Clock) -> None:
    results = {"bevy": {"tokens_per_s": 12.5}, "lockstep": {"tokens_per_s": 7.25}}
    first = store.save_compare("cache 30%", ["bevy", "lockstep"], "chat", results)
    clock.t += 1
    second = store.save_compare("cache 50%", ("bevy",), "agentic", [1, 2, 3])
    assert [r.id for r in store.list_compares()] == [second.id, first.id]
    loaded = store.load_compare(first.id)
    assert (loaded.title, loaded.policies, loaded.workload, loaded.results) == (
        "cache 30%",
        ["bevy", "lockstep"],
        "chat",
        results,
    )
    with pytest.raises(StoreError):
        store.load_compare(999)


def test_exports_markdown_and_json(store: Store) -> None:
    s = store.create_session("Pasta night", system_prompt="You cook.", sampling={"seed": 3})
    store.add_message(s.id, "user", "A quick recipe?")
    reply = store.add_message(s.id, "assistant", status="streaming")
    store.update_message(reply.id, "Boil water, then")  # pending: exports must include it
    md = store.export_markdown(s.id)
    assert md.startswith("# Pasta night\n")
    assert "## System prompt\n\nYou cook." in md
    assert md.index("## User\n\nA quick recipe?") < md.index("## Assistant\n\nBoil water, then")
    assert "*[streaming]*" in md
    doc = json.loads(store.export_json(s.id))
    assert doc["session"]["title"] == "Pasta night" and doc["session"]["sampling"] == {"seed": 3}
    assert [(m["role"], m["content"], m["status"]) for m in doc["messages"]] == [
        ("user", "A quick recipe?", "done"),
        ("assistant", "Boil water, then", "streaming"),
    ]


def test_a_version_2_database_opens_with_each_session_as_one_branch(tmp_path: Path) -> None:
    from app.store import MIGRATIONS

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:2]:  # the database as Bevy with schema 2 left it
        conn.executescript(script)
    conn.execute("PRAGMA user_version = 2")
    for sid in (1, 2):
        conn.execute(
            "INSERT INTO sessions (id, title, kind, created, updated) VALUES (?, 't', 'chat', 0, 0)",
            [sid],
        )
    for i, sid in enumerate([1, 2, 1, 1, 2]):  # two sessions' messages interleaved
        role = "user" if i % 2 == 0 else "assistant"
        conn.execute(
            "INSERT INTO messages (session_id, role, content, status, created) "
            "VALUES (?, ?, ?, 'done', 0)",
            [sid, role, f"m{i}"],
        )
    conn.commit()
    conn.close()
    with Store(path, background_flush=False) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert [m.content for m in s.messages(1)] == ["m0", "m2", "m3"]
        assert [m.content for m in s.messages(2)] == ["m1", "m4"]
        assert all(not m.branches for m in s.messages(1))
        s.add_message(1, "user", "next")  # follows the last message, as before
        assert [m.content for m in s.messages(1)][-2:] == ["m3", "next"]


def test_rewinding_starts_a_branch_and_the_old_one_stays_reachable(store: Store) -> None:
    sid = store.create_session().id
    q1 = store.add_message(sid, "user", "q1")
    a1 = store.add_message(sid, "assistant", "a1")
    q2 = store.add_message(sid, "user", "q2")
    a2 = store.add_message(sid, "assistant", "a2")
    store.rewind(sid, q2.id)  # edit q2: the next message is its alternative
    assert [m.id for m in store.messages(sid)] == [q1.id, a1.id]
    q2b = store.add_message(sid, "user", "q2, edited")
    a2b = store.add_message(sid, "assistant", "a2b")
    shown = store.messages(sid)
    assert [m.content for m in shown] == ["q1", "a1", "q2, edited", "a2b"]
    assert shown[2].branches == (q2.id, q2b.id) and shown[3].branches == ()
    assert [m["content"] for m in store.history(sid)] == ["q1", "a1", "q2, edited", "a2b"]
    store.switch_branch(sid, q2.id)  # back to the old question and its answer
    assert [m.id for m in store.messages(sid)] == [q1.id, a1.id, q2.id, a2.id]
    store.rewind(sid, a2.id)  # regenerate a2: a second answer to q2
    a2c = store.add_message(sid, "assistant", "a2c")
    assert store.messages(sid)[-1].branches == (a2.id, a2c.id)
    store.switch_branch(sid, q2b.id)
    assert store.messages(sid)[-1].id == a2b.id  # down to the end of that branch
    with pytest.raises(StoreError):
        store.switch_branch(sid, 10_000)
    assert "q2, edited" in store.export_markdown(sid) and "a2c" not in store.export_markdown(sid)


def test_deleting_a_message_keeps_what_followed_it_on_the_branch(store: Store) -> None:
    sid = store.create_session().id
    q = store.add_message(sid, "user", "q")
    a = store.add_message(sid, "assistant", "a")
    q2 = store.add_message(sid, "user", "q2")
    store.delete_message(a.id)
    assert [m.id for m in store.messages(sid)] == [q.id, q2.id]
    store.delete_message(q2.id)  # the shown end: the branch now ends at its parent
    assert [m.id for m in store.messages(sid)] == [q.id]
    assert store.add_message(sid, "assistant", "b").parent_id == q.id
    with pytest.raises(StoreError):
        store.delete_message(10_000)


def test_a_reopened_reply_streams_on_from_its_text(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "bevy.db"
    with Store(path, clock=clock, background_flush=False) as s:
        sid = s.create_session().id
        s.add_message(sid, "user", "q")
        m = s.add_message(sid, "assistant", "cut at", status="streaming")
        s.finish_message(m.id, "cut at", "done", completion_tokens=2)
        s.reopen_message(m.id)
        assert s.messages(sid)[-1].status == "streaming"
        clock.t += 2  # past the coalescing interval: written at once
        s.update_message(m.id, "cut at the limit", 4)
        assert _on_disk(path, m.id) == ("cut at the limit", "streaming")
    with Store(path, clock=clock, background_flush=False) as s:  # a crash mid-continue
        assert (s.messages(sid)[-1].content, s.messages(sid)[-1].status) == (
            "cut at the limit",
            "interrupted",
        )


def test_deleting_the_shown_reply_shows_its_alternative(store: Store) -> None:
    sid = store.create_session().id
    q = store.add_message(sid, "user", "q")
    a1 = store.add_message(sid, "assistant", "a1")
    store.rewind(sid, a1.id)  # regenerated: a2 is shown, a1 its alternative
    a2 = store.add_message(sid, "assistant", "a2")
    store.delete_message(a2.id)
    assert [m.id for m in store.messages(sid)] == [q.id, a1.id]  # not a chat ending at q
    store.rename_engine("", "lab")
    assert store.session(sid).engine == "lab"
