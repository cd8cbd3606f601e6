"""The agent loop with the model's turns scripted at the model boundary (``Scripted``
stands in for the model: it returns recorded replies) and the real tools on a temp
workspace: files really change and commands really run."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from backend.agent.loop import (
    Agent,
    AgentFinished,
    CallFinished,
    CallProposed,
    CallStarted,
    Reply,
    TextDelta,
)
from backend.agent.permissions import Rule, Rules
from backend.agent.workspace import Workspace


def call(name: str, i: int = 0, **args) -> dict:
    return {
        "id": f"call_{name}_{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


class Scripted:
    """The model's side, scripted: each turn returns the next recorded reply and keeps
    what it was shown."""

    def __init__(self, replies: list[Reply], tool_format: str = "hermes") -> None:
        self.replies = list(replies)
        self.tool_format = tool_format
        self.seen: list[list[dict]] = []
        self.choices: list[str] = []

    def complete(self, messages, tools, tool_choice, on_text, stop) -> Reply:
        self.seen.append([dict(m) for m in messages])
        self.choices.append(tool_choice)
        reply = self.replies.pop(0)
        if reply.content:
            on_text(reply.content)
        return reply


@pytest.fixture
def project(tmp_path: Path) -> Workspace:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "test_calc.py").write_text(
        "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    return Workspace(root)


PYTEST = f"{sys.executable} -m pytest -q -p no:cacheprovider"


def test_a_multi_step_task_reads_edits_runs_the_tests_and_finishes(project: Workspace) -> None:
    model = Scripted(
        [
            Reply("Let me look.", [call("read_file", path="calc.py")], "tool_calls"),
            Reply("", [call("edit_file", path="calc.py", old="a - b", new="a + b")], "tool_calls"),
            Reply("", [call("run_command", command=PYTEST)], "tool_calls"),
            Reply("Fixed add(); the test passes.", [], "stop"),
        ]
    )
    events = []
    agent = Agent(
        model, project, approve=lambda c: "approve", on_event=events.append, sandbox=False
    )
    end = agent.run("Fix the failing test.")
    assert end == AgentFinished("done", "Fixed add(); the test passes.")
    assert (project.root / "calc.py").read_text().endswith("return a + b\n")
    results = [e for e in events if isinstance(e, CallFinished)]
    assert [r.approval for r in results] == ["rules", "approved", "approved"]
    assert "def add" in results[0].result.output
    assert "+    return a + b" in results[1].result.diff
    assert results[2].result.exit_code == 0 and "1 passed" in results[2].result.output
    # the model saw each result as a tool message answering its call
    last = model.seen[-1]
    tool_msgs = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [
        "call_read_file_0",
        "call_edit_file_0",
        "call_run_command_0",
    ]
    assert last[2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert any(isinstance(e, TextDelta) and e.text == "Let me look." for e in events)
    assert model.choices == ["auto"] * 4


def test_a_denied_call_is_told_to_the_model_which_goes_on(project: Workspace) -> None:
    model = Scripted(
        [
            Reply("", [call("run_command", command="rm -rf /tmp/x")], "tool_calls"),
            Reply("", [call("write_file", path="notes.txt", content="plan")], "tool_calls"),
            Reply("Wrote the plan instead.", [], "stop"),
        ]
    )
    asked = []

    def approve(pending):
        asked.append(pending)
        return "deny" if pending.name == "run_command" else "approve"

    agent = Agent(model, project, approve=approve, sandbox=False)
    assert agent.run("Clean up.").reason == "done"
    assert asked[0].preview == "$ rm -rf /tmp/x"
    told = [m for m in model.seen[1] if m["role"] == "tool"][0]["content"]
    assert "the user denied this call" in told
    assert (project.root / "notes.txt").read_text() == "plan"


def test_rules_deny_without_asking_and_always_stops_asking(project: Workspace) -> None:
    model = Scripted(
        [
            Reply("", [call("run_command", 0, command="rm -rf build")], "tool_calls"),
            Reply("", [call("run_command", 1, command="echo one")], "tool_calls"),
            Reply("", [call("run_command", 2, command="echo two")], "tool_calls"),
            Reply("done", [], "stop"),
        ]
    )
    asked = []
    events = []
    rules = Rules([Rule.parse("deny run_command rm *")])
    agent = Agent(
        model,
        project,
        rules=rules,
        approve=lambda c: asked.append(c.arguments["command"]) or "always",
        on_event=events.append,
        sandbox=False,
    )
    agent.run("go")
    assert asked == ["echo one"]  # rm was denied by the rule, echo two allowed by "always"
    approvals = [e.approval for e in events if isinstance(e, CallFinished)]
    assert approvals == ["denied", "always", "rules"]
    assert [e.permission for e in events if isinstance(e, CallProposed)] == ["deny", "ask", "allow"]


def test_bad_calls_are_refused_with_a_reason_the_model_can_use(project: Workspace) -> None:
    bad_json = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{"}}
    model = Scripted(
        [
            Reply("", [bad_json, call("delete_all"), call("read_file", path=3)], "tool_calls"),
            Reply("ok", [], "stop"),
        ]
    )
    agent = Agent(model, project, sandbox=False)
    agent.run("go")
    told = [m["content"] for m in model.seen[1] if m["role"] == "tool"]
    assert "not valid JSON" in told[0]
    assert "there is no tool 'delete_all'" in told[1] and "read_file" in told[1]
    assert "invalid arguments for read_file (path)" in told[2]


def test_the_step_limit_and_a_repeating_model_end_the_loop(project: Workspace) -> None:
    looping = Scripted(
        [Reply("", [call("search", i, pattern=f"x{i}")], "tool_calls") for i in range(10)]
    )
    end = Agent(looping, project, max_steps=4, sandbox=False).run("go")
    assert end.reason == "step_limit" and len(looping.seen) == 4
    same = Scripted([Reply("", [call("list_dir", path=".")], "tool_calls")] * 5)
    end = Agent(same, project, sandbox=False).run("go")
    assert end.reason == "repeating" and len(same.seen) == 3


def test_a_model_without_tool_syntax_is_held_to_calls_and_ends_with_finish(project) -> None:
    model = Scripted(
        [
            Reply("", [call("list_dir", path=".")], "tool_calls"),
            Reply("", [call("finish", message="It holds calc.py and its test.")], "tool_calls"),
        ],
        tool_format="generic",
    )
    agent = Agent(model, project, sandbox=False)
    end = agent.run("What is here?")
    assert end == AgentFinished("finished", "It holds calc.py and its test.")
    assert model.choices == ["required", "required"]
    assert "call finish" in model.seen[0][0]["content"]


def test_stop_kills_a_running_command_and_ends_the_loop(project: Workspace) -> None:
    model = Scripted([Reply("", [call("run_command", command="sleep 600")], "tool_calls")])
    started = threading.Event()
    agent = Agent(
        model,
        project,
        rules=Rules([Rule.parse("allow run_command sleep *")]),
        on_event=lambda e: isinstance(e, CallStarted) and started.set(),
        sandbox=False,
    )
    threading.Thread(target=lambda: started.wait(10) and agent.stop(), daemon=True).start()
    end = agent.run("wait")
    assert end.reason == "stopped"
    told = [m["content"] for m in agent.messages if m["role"] == "tool"]
    assert "stopped by the user" in told[0]


def test_a_failing_model_ends_the_loop_with_its_message(project: Workspace) -> None:
    class Down(Scripted):
        def complete(self, *args):
            raise RuntimeError("the prompt has 9000 tokens; the model's context is 8192")

    end = Agent(Down([]), project, sandbox=False).run("go")
    assert end.reason == "error" and "context is 8192" in end.message


def test_rules_see_the_path_as_it_resolves(project: Workspace) -> None:
    (project.root / "src").mkdir()
    model = Scripted(
        [
            Reply(
                "",
                [call("write_file", 1, path="src/../.git/hooks/x", content="evil")],
                "tool_calls",
            ),
            Reply("", [call("write_file", 2, path="src/ok.py", content="ok")], "tool_calls"),
            Reply("done", [], "stop"),
        ]
    )
    asked = []
    agent = Agent(
        model,
        project,
        rules=Rules([Rule.parse("allow write_file src/*")]),
        approve=lambda c: asked.append(c.arguments["path"]) or "deny",
        sandbox=False,
    )
    agent.run("go")
    assert asked == ["src/../.git/hooks/x"]  # ".git/hooks/x" is not under src/: asked
    assert (project.root / "src" / "ok.py").read_text() == "ok"
    assert not (project.root / ".git").exists()


def test_a_stop_before_the_run_starts_runs_nothing(project: Workspace) -> None:
    model = Scripted([Reply("", [call("write_file", path="x", content="x")], "tool_calls")])
    agent = Agent(model, project, sandbox=False)
    agent.stop()
    assert agent.run("go").reason == "stopped" and model.seen == []


def test_bad_text_in_a_call_is_a_tool_error_not_a_crash(project: Workspace) -> None:
    model = Scripted(
        [
            Reply("", [call("read_file", 1, path="a\0b")], "tool_calls"),
            Reply("", [call("run_command", 2, command="echo \0")], "tool_calls"),
            Reply("done", [], "stop"),
        ]
    )
    agent = Agent(model, project, approve=lambda c: "approve", sandbox=False)
    assert agent.run("go").reason == "done"
    told = [m["content"] for m in agent.messages if m["role"] == "tool"]
    assert all(t.startswith("error:") for t in told)
