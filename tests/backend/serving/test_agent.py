"""Agents on the real engine: one chat turn with tools (LocalChatModel) on a tiny random
MoE, the agent loop beside plain chats, and `bevy agent` end to end on the demo MoE."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

from backend.agent.loop import Agent, AgentFinished, CallFinished, CallProposed
from backend.agent.workspace import Workspace
from backend.config import EngineConfig, SamplingParams
from backend.messages import Finished, Submit
from backend.serving.chat_model import LocalChatModel
from backend.serving.service import EngineService, collect
from tests.helpers.tools import CLOCK, WEATHER

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def service(tiny_chat_moe: Path):
    svc = EngineService.open(tiny_chat_moe, EngineConfig(cache="0.5"))
    yield svc
    svc.close()


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_required_turn_is_a_valid_call_of_an_offered_tool(service: EngineService) -> None:
    model = LocalChatModel(service, sampling={"temperature": 0.8, "max_tokens": 96, "seed": 3})
    shown: list[str] = []
    reply = model.complete(
        _user("weather in Oslo?"), [WEATHER, CLOCK], "required", shown.append, threading.Event()
    )
    assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1
    fn = reply.tool_calls[0]["function"]
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[fn["name"]]["function"]["parameters"]
    jsonschema.validate(json.loads(fn["arguments"]), schema)
    assert "".join(shown).strip() == ""  # the call's own text is not shown as content


def test_a_free_turn_streams_its_text_and_stop_aborts_it(service: EngineService) -> None:
    model = LocalChatModel(service, sampling={"temperature": 0.0, "max_tokens": 4000})
    stop = threading.Event()
    shown: list[str] = []

    def on_text(text: str) -> None:
        shown.append(text)
        if len(shown) == 5:
            stop.set()

    reply = model.complete(_user("Tell me a long story."), [], "auto", on_text, stop)
    assert reply.finish_reason == "abort" and reply.tool_calls == []
    assert reply.content.startswith("".join(shown[:5]))
    assert service.active == 0


def test_an_agent_and_chats_run_on_one_engine_at_once(service, tmp_path: Path) -> None:
    model = LocalChatModel(service, "agent-1", {"temperature": 0.8, "max_tokens": 256, "seed": 1})
    events = []
    agent = Agent(
        model,
        Workspace(tmp_path),
        on_event=events.append,
        max_steps=3,
        force_calls=True,
        sandbox=False,
    )
    done = threading.Event()
    threading.Thread(target=lambda: (agent.run("look around"), done.set()), daemon=True).start()
    chats = [
        collect(
            service,
            Submit(service.new_id("chat"), SamplingParams(max_tokens=24), messages=_user(q)),
        )
        for q in ("hi", "how are you?")
    ]
    assert all(isinstance(evs[-1], Finished) for evs in chats)
    assert done.wait(300)
    end = events[-1]
    assert isinstance(end, AgentFinished), events
    proposed = [e for e in events if isinstance(e, CallProposed)]
    results = [e for e in events if isinstance(e, CallFinished)]
    # A random model's free strings (a file's content) may run to max_tokens; every call
    # it does complete is held by the grammar to a real tool's schema.
    assert end.reason in ("step_limit", "repeating", "finished") or "max_tokens" in end.message
    assert len(results) == len(proposed)
    assert all(r.approval != "refused" for r in results)


def test_bevy_agent_on_the_demo_moe_prints_its_steps(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "backend.serving.cli",
            "agent",
            *("--workspace", str(ws), "--yes", "--max-steps", "3", "--temperature", "0"),
            "create hello.txt containing hi",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout
    assert out.startswith(f"workspace {ws.resolve()}; commands "), done.stderr
    assert "── step 1 ──" in out
    calls = [line for line in out.splitlines() if line.startswith("→ ")]
    assert calls and all(
        line.split()[1]
        in {"list_dir", "read_file", "search", "write_file", "edit_file", "run_command", "finish"}
        for line in calls
    )
    end = [line for line in out.splitlines() if line.startswith("== ")]
    assert len(end) == 1
    assert done.returncode == (0 if end[0].startswith(("== done", "== finished")) else 1)
