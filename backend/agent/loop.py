"""The agent loop: generate with the tools, check each call, run it, append the result,
again; until the model answers without a call (or calls ``finish``), the step limit, or
the user stops it.

Everything the loop does is told to ``on_event`` as it happens (text as it streams, each
call with its permission, its start and its result), so a front end can draw cards and a
store can keep them; ``approve`` is asked, and waited for, about calls the rules say to
ask about.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from backend.agent import shell
from backend.agent.permissions import Rules
from backend.agent.tools import FINISH, SPECS, Toolbox, ToolResult, parse_arguments
from backend.agent.workspace import ToolError, Workspace

DEFAULT_MAX_STEPS = 30
# The same call this many times in a row: the model is stuck; stop rather than burn steps.
REPEAT_LIMIT = 3


@dataclass(frozen=True)
class Reply:
    """One assistant turn: its text and its calls, OpenAI-shaped ({"id", "type",
    "function": {"name", "arguments"}}); ``finish_reason`` as the API gives it."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"


class ChatModel(Protocol):
    """What the loop needs of a model: one chat turn with tools (the local engine,
    ``backend.serving.chat_model``, or any OpenAI-compatible server)."""

    # How the model writes calls ("hermes", "mistral", "llama3", or "generic" for a
    # template with no tool syntax: small or untuned models, whose calls are forced).
    tool_format: str

    def complete(
        self,
        messages: list[dict],
        tools: list[dict],
        tool_choice: str,
        on_text: Callable[[str], None],
        stop: threading.Event,
    ) -> Reply: ...


# --- what the loop tells its front end --------------------------------------------------


@dataclass(frozen=True)
class StepStarted:
    step: int


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class AssistantTurn:
    message: dict  # as appended to the conversation


@dataclass(frozen=True)
class CallProposed:
    call_id: str
    name: str
    arguments: dict | str  # the parsed arguments, or the raw text when they do not parse
    permission: str  # "allow", "ask" or "deny" (by the session's rules)


@dataclass(frozen=True)
class CallStarted:
    call_id: str


@dataclass(frozen=True)
class CallFinished:
    call_id: str
    result: ToolResult
    approval: str  # "rules" (ran without asking), "approved", "always", "denied", "refused"


@dataclass(frozen=True)
class AgentFinished:
    reason: str  # "done", "finished", "step_limit", "repeating", "stopped", "error"
    message: str


AgentEvent = (
    StepStarted
    | TextDelta
    | AssistantTurn
    | CallProposed
    | CallStarted
    | CallFinished
    | AgentFinished
)


@dataclass(frozen=True)
class PendingCall:
    """A call waiting for the user: Approve, Deny or Always (allow such calls for the
    rest of the session)."""

    call_id: str
    name: str
    arguments: dict
    preview: str  # what it would do, as the user should read it


def preview(name: str, args: dict, workspace: Workspace) -> str:
    """What a call would do, for an approval prompt."""
    if name == "run_command":
        return f"$ {args['command']}"
    if name == "write_file":
        return f"write {args['path']} ({len(args['content'].encode())} bytes)\n{args['content'][:2000]}"
    if name == "edit_file":
        return f"edit {args['path']}\n- {args['old'][:1000]}\n+ {args['new'][:1000]}"
    return f"{name} {json.dumps(args, ensure_ascii=False)}"


def system_prompt(workspace: Workspace, forced: bool, isolation: str) -> str:
    ending = (
        "When the task is done, or cannot be done, call finish with a short answer."
        if forced
        else "When the task is done, answer with a short summary and no tool call."
    )
    return (
        "You are a coding agent working in the folder "
        f"{workspace.root} (the workspace). Use the tools to look at files, change them "
        "and run commands; paths are relative to the workspace. Work in small steps and "
        "check your work by running it. Commands are "
        f"{shell.describe_isolation(isolation)}. {ending}"
    )


class Agent:
    """One agent session: a workspace, a conversation and the tools, driven by
    ``run(task)`` on the caller's thread; ``stop()`` from any thread ends it (and kills a
    running command)."""

    def __init__(
        self,
        model: ChatModel,
        workspace: Workspace,
        *,
        rules: Rules | None = None,
        approve: Callable[[PendingCall], str] | None = None,
        on_event: Callable[[AgentEvent], None] | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        force_calls: bool | None = None,
        messages: list[dict] | None = None,
        command_timeout_s: float = shell.DEFAULT_TIMEOUT_S,
        sandbox: bool | None = None,
    ) -> None:
        self.model = model
        self.workspace = workspace
        self.rules = rules if rules is not None else Rules()
        self.approve = approve or (lambda call: "deny")
        self.on_event = on_event or (lambda ev: None)
        self.max_steps = max_steps
        # Models with no tool syntax of their own get every turn held to a call, and a
        # finish tool to end with.
        self.forced = model.tool_format == "generic" if force_calls is None else force_calls
        self.toolbox = Toolbox(workspace, command_timeout_s, sandbox)
        self.isolation = shell.isolation() if sandbox is None else ("bwrap" if sandbox else "none")
        self.tools = [*SPECS, FINISH] if self.forced else list(SPECS)
        self.messages = (
            list(messages)
            if messages
            else [
                {"role": "system", "content": system_prompt(workspace, self.forced, self.isolation)}
            ]
        )
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self, task: str) -> AgentFinished:
        """Work on ``task`` (a user message) until done; returns how it ended (also told
        to ``on_event``). A stop asked for before this starts is kept: nothing runs."""
        self.messages.append({"role": "user", "content": task})
        last: list[str] = []
        repeats = 0
        for step in range(1, self.max_steps + 1):
            if self.stopped:
                return self._end("stopped", "stopped by the user")
            self.on_event(StepStarted(step))
            try:
                reply = self.model.complete(
                    self.messages,
                    self.tools,
                    "required" if self.forced else "auto",
                    lambda text: self.on_event(TextDelta(text)),
                    self._stop,
                )
            except Exception as exc:  # the model's server refused or failed: say why
                return self._end("error", str(exc) or repr(exc))
            message: dict = {"role": "assistant", "content": reply.content or None}
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            elif not reply.content:
                message["content"] = ""
            self.messages.append(message)
            self.on_event(AssistantTurn(message))
            if self.stopped:
                return self._end("stopped", "stopped by the user")
            if not reply.tool_calls:
                if reply.finish_reason == "length":
                    return self._end("error", "the reply hit max_tokens before it was complete")
                return self._end("done", reply.content)
            finished: str | None = None
            for call in reply.tool_calls:
                if self.stopped:
                    break  # the rest of the turn's calls do not run
                name = call["function"]["name"]
                result = self._handle(call)
                if name == "finish" and result.ok:
                    finished = result.output
            keys = [c["function"]["name"] + c["function"]["arguments"] for c in reply.tool_calls]
            repeats = repeats + 1 if keys == last else 1
            last = keys
            if finished is not None:
                return self._end("finished", finished)
            if self.stopped:
                return self._end("stopped", "stopped by the user")
            if repeats >= REPEAT_LIMIT:
                return self._end(
                    "repeating", f"the model made the same call {repeats} times in a row"
                )
        return self._end("step_limit", f"stopped at the limit of {self.max_steps} steps")

    def _handle(self, call: dict) -> ToolResult:
        call_id = call.get("id") or f"call_{len(self.messages)}"
        name = call["function"]["name"]
        raw = call["function"].get("arguments") or "{}"
        try:
            args = parse_arguments(name, raw)
        except ToolError as exc:
            self.on_event(CallProposed(call_id, name, raw, "deny"))
            return self._result(call_id, name, ToolResult(f"error: {exc}", ok=False), "refused")
        # Rules see the path as it resolves ("src/../.git/x" is ".git/x"); a path that
        # leads out is refused by the tool itself.
        seen = args
        if isinstance(args.get("path"), str):
            with contextlib.suppress(ToolError, ValueError, OSError):
                seen = {**args, "path": self.workspace.show(self.workspace.resolve(args["path"]))}
        permission = self.rules.decide(name, seen)
        self.on_event(CallProposed(call_id, name, args, permission))
        approval = "rules"
        if permission == "deny":
            text = "error: this call is denied by the session's rules; do something else"
            return self._result(call_id, name, ToolResult(text, ok=False), "denied")
        if permission == "ask":
            answer = self.approve(
                PendingCall(call_id, name, args, preview(name, args, self.workspace))
            )
            if self.stopped:
                answer = "deny"
            if answer == "always":
                self.rules.always(name, seen)
                approval = "always"
            elif answer == "approve":
                approval = "approved"
            else:
                text = "error: the user denied this call; ask or try another way"
                return self._result(call_id, name, ToolResult(text, ok=False), "denied")
        self.on_event(CallStarted(call_id))
        return self._result(call_id, name, self.toolbox.run(name, args, self._stop), approval)

    def _result(self, call_id: str, name: str, result: ToolResult, approval: str) -> ToolResult:
        self.messages.append(
            {"role": "tool", "tool_call_id": call_id, "name": name, "content": result.output}
        )
        self.on_event(CallFinished(call_id, result, approval))
        return result

    def _end(self, reason: str, message: str) -> AgentFinished:
        ev = AgentFinished(reason, message)
        self.on_event(ev)
        return ev


def new_workspace(parent: Path, name: str = "agent") -> Path:
    """A fresh folder under ``parent`` (``name``, ``name-2``, ...)."""
    parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 10_000):
        p = parent / (name if i == 1 else f"{name}-{i}")
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue
    raise OSError(f"no free folder name under {parent}")
