"""Agent sessions in the app, offscreen, beside chats on the real engine.

The agent's model is scripted at the model boundary: each turn really generates on the
shared engine (so the agent and the chats run at once), and then returns the recorded
tool calls of ``SCRIPT`` instead of what the tiny random model wrote. The tools, the
approvals, the store and the view are the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app import agents as agents_mod
from app.main_window import MainWindow
from tests.app.test_app import ARTIFACTS, close_window, open_window, settings_for


def call(name: str, i: int, **args) -> dict:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


SCRIPT = [
    [call("run_command", 1, command="echo hello from the agent")],
    [call("write_file", 2, path="hello.txt", content="hi\n")],
    [call("edit_file", 3, path="hello.txt", old="hi", new="hello")],
    [],  # a plain answer ends the loop
]


class ScriptedOnEngine:
    """A real engine turn for the load, then the recorded calls for the loop."""

    def __init__(self, real) -> None:
        self.real = real
        self.tool_format = "hermes"
        self.seen: list[list[dict]] = []

    def complete(self, messages, tools, tool_choice, on_text, stop):
        self.seen.append([dict(m) for m in messages])
        reply = self.real.complete(messages, [], "auto", on_text, stop)
        calls = SCRIPT[len(self.seen) - 1]
        return type(reply)(
            reply.content if not calls else "", calls, "tool_calls" if calls else "stop"
        )


@pytest.fixture
def scripted(monkeypatch):
    made: list[ScriptedOnEngine] = []
    real = agents_mod.api.local_chat_model

    def factory(service, session, sampling=None):
        made.append(
            ScriptedOnEngine(real(service, session, {**(sampling or {}), "max_tokens": 24}))
        )
        return made[-1]

    monkeypatch.setattr(agents_mod.api, "local_chat_model", factory)
    return made


def test_an_agent_beside_two_chats_asks_acts_and_is_restored(
    qtbot, env: Path, scripted, tmp_path
) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=400))
    ws = tmp_path / "ws"
    ws.mkdir()
    agent = w.new_session("agent", str(ws))
    w.controller.update_session(agent, "", {}, ["allow run_command echo *"])
    chats = [w.new_session("chat"), w.new_session("chat")]
    w.sessions.select(agent)
    w.send("Say hello in a file.", session_id=agent)
    for c in chats:
        w.send("Tell me a long story.", session_id=c)
    runs = w.controller.agents.runs
    # The first call is allowed by the session's rule and runs at once; the write asks.
    qtbot.waitUntil(lambda: w.approval.isVisible(), timeout=60_000)
    assert all(c in w.controller.replies for c in chats)  # the chats generate meanwhile
    assert w.controller.agents.pending(agent).name == "write_file"
    assert w.sessions.badges(agent) == ("agent", "?")  # waiting for approval
    w.approval.buttons["approve"].click()
    qtbot.waitUntil(lambda: (ws / "hello.txt").exists(), timeout=30_000)
    assert (ws / "hello.txt").read_text() == "hi\n"
    qtbot.waitUntil(
        lambda: w.approval.isVisible() and w.controller.agents.pending(agent).name == "edit_file",
        timeout=60_000,
    )
    qtbot.waitUntil(lambda: "waiting for your approval" in w.view.shown_markdown, timeout=5_000)
    md = w.view.shown_markdown
    assert "hello from the agent" in md and "exit 0" in md and "allowed by the rules" in md
    assert "+hi" in md  # the write's diff card
    ARTIFACTS.mkdir(exist_ok=True)
    assert w.grab().save(str(ARTIFACTS / "agent_session.png"))
    w.approval.buttons["deny"].click()
    qtbot.waitUntil(lambda: agent not in runs, timeout=60_000)
    assert (ws / "hello.txt").read_text() == "hi\n"  # the denied edit changed nothing
    told = [m for m in scripted[0].seen[-1] if m["role"] == "tool"]
    assert "the user denied this call" in told[-1]["content"]
    stored = w.store.messages(agent)
    cards = [m for m in stored if m.role == "tool"]
    assert [c.data["approval"] for c in cards] == ["rules", "approved", "denied"]
    assert cards[0].data["exit_code"] == 0
    close_window(w)

    w2 = open_window(qtbot)
    w2.sessions.select(agent)
    md = w2.view.shown_markdown
    assert md.count("**Tool** ·") == 3 and "denied" in md and "```diff" in md
    close_window(w2)


def test_stop_ends_an_agent_waiting_for_approval(qtbot, env: Path, scripted, tmp_path) -> None:
    w: MainWindow = open_window(qtbot, settings_for(env))
    agent = w.new_session("agent", str(tmp_path))
    w.sessions.select(agent)
    w.send("go", session_id=agent)
    qtbot.waitUntil(lambda: w.approval.isVisible(), timeout=60_000)  # run_command asks
    w.stop_current()
    qtbot.waitUntil(lambda: not w.controller.is_busy(agent), timeout=30_000)
    assert not w.approval.isVisible()
    last = w.store.messages(agent)[-1]
    assert last.status == "stopped" and "stopped by the user" in last.content.lower()
    close_window(w)


def test_a_tool_run_cut_by_a_crash_is_marked_interrupted(qtbot, env: Path, tmp_path) -> None:
    from app.store import Store

    store = Store()
    sid = store.create_session("A", "agent", workspace=str(tmp_path)).id
    store.add_message(sid, "user", "go")
    store.add_message(
        sid, "assistant", "", data={"tool_calls": [call("run_command", 1, command="sleep 9")]}
    )
    store.add_message(
        sid,
        "tool",
        "",
        status="streaming",
        data={
            "call_id": "call_1",
            "name": "run_command",
            "arguments": {"command": "sleep 9"},
            "state": "running",
        },
    )
    store.close()
    store = Store()  # the next start
    tool = store.messages(sid)[-1]
    assert tool.status == "interrupted"
    convo = agents_mod.conversation(store, sid)
    assert convo[-1] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "run_command",
        "content": agents_mod.INTERRUPTED_RESULT,
    }
    store.close()


def test_an_agent_session_from_before_workspaces_gets_its_own(qtbot, env: Path, scripted) -> None:
    w = open_window(qtbot, settings_for(env))
    old = w.store.create_session("Old agent", "agent").id  # as schema 1 left it: no folder
    w.reload_sessions()
    w.sessions.select(old)
    w.send("go", session_id=old)
    ws = Path(w.store.session(old).workspace)
    assert ws.is_dir() and ws.is_relative_to(agents_mod.data_dir())
    w.stop_current()
    qtbot.waitUntil(lambda: not w.controller.is_busy(old), timeout=30_000)
    close_window(w)
