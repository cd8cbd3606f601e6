"""``bevy agent``: a coding agent on a workspace folder, in the terminal.

Each step is printed as it happens: the model's text, each tool call with its arguments
and permission, and its result. Calls the rules ask about are put to the user (y / n /
a = always); ``--yes`` approves them, but never what a rule denies. Without a terminal
and without ``--yes`` they are denied, and the model is told.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from backend.agent.loop import (
    DEFAULT_MAX_STEPS,
    Agent,
    AgentEvent,
    AgentFinished,
    CallFinished,
    CallProposed,
    PendingCall,
    StepStarted,
    TextDelta,
)
from backend.agent.permissions import Rule, Rules
from backend.agent.shell import describe_isolation
from backend.agent.workspace import ToolError, Workspace
from backend.errors import BevyError

_OUTPUT_LINES = 40  # of a tool's result, shown per call (the model gets all of it)


def add_parser(sub: argparse._SubParsersAction, add_model_arg, add_engine_args) -> None:
    p = sub.add_parser("agent", help="a coding agent that reads, edits and runs code in a folder")
    add_model_arg(p)
    add_engine_args(p)
    p.add_argument("--workspace", type=Path, required=True, help="the folder the agent works in")
    p.add_argument("--yes", action="store_true", help="approve what the rules would ask about")
    p.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="RULE",
        help="'allow|ask|deny TOOL [PATTERN]', e.g. 'allow run_command pytest *' (repeatable)",
    )
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS)
    p.add_argument("--max-tokens", type=int, default=1024, help="per model turn")
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per command")
    p.add_argument("task", help="what to do")


class Printer:
    """Prints an agent's events as steps in the terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._in_text = False

    def __call__(self, ev: AgentEvent) -> None:
        w = self.out.write
        if isinstance(ev, TextDelta):
            w(ev.text)
            self._in_text = True
        else:
            if self._in_text:
                w("\n")
                self._in_text = False
            if isinstance(ev, StepStarted):
                w(f"\n── step {ev.step} ──\n")
            elif isinstance(ev, CallProposed):
                args = (
                    ev.arguments
                    if isinstance(ev.arguments, str)
                    else json.dumps(ev.arguments, ensure_ascii=False)
                )
                w(f"→ {ev.name} {args[:500]}  [{ev.permission}]\n")
            elif isinstance(ev, CallFinished):
                lines = ev.result.output.splitlines()
                shown = lines[:_OUTPUT_LINES]
                if len(lines) > _OUTPUT_LINES:
                    shown.append(f"… {len(lines) - _OUTPUT_LINES} more lines")
                mark = "✓" if ev.result.ok else "✗"
                head = f"{mark} {ev.approval}, {ev.result.seconds:.1f} s"
                w(head + "\n" + "".join(f"  │ {line}\n" for line in shown))
            elif isinstance(ev, AgentFinished):
                w(f"\n== {ev.reason}: {ev.message}\n")
        self.out.flush()


def ask(call: PendingCall, yes: bool, stream_in: TextIO, out: TextIO) -> str:
    """The user's answer about ``call``: "approve", "deny" or "always"."""
    if yes:
        return "approve"
    if not stream_in.isatty():
        out.write("  (not a terminal and no --yes: denied)\n")
        return "deny"
    out.write(f"\n{call.preview}\nAllow {call.name}? [y]es / [n]o / [a]lways: ")
    out.flush()
    answer = stream_in.readline().strip().lower()
    return {"y": "approve", "yes": "approve", "a": "always", "always": "always"}.get(answer, "deny")


def cmd_agent(args: argparse.Namespace, load_model, engine_config) -> int:
    from backend.serving.chat_model import LocalChatModel
    from backend.serving.service import EngineService, on_fresh_thread

    if args.max_steps < 1 or args.max_tokens < 1 or args.timeout <= 0:
        raise BevyError("--max-steps and --max-tokens must be >= 1 and --timeout > 0")
    try:
        rules = Rules([Rule.parse(r) for r in args.rule])
    except ValueError as exc:
        raise BevyError(str(exc)) from None
    args.workspace.mkdir(parents=True, exist_ok=True)
    try:
        workspace = Workspace(args.workspace)
    except ToolError as exc:
        raise BevyError(str(exc)) from None
    config = engine_config(args)
    try:
        service = on_fresh_thread(lambda: EngineService(load_model(args), config))
    except ValueError as exc:
        raise BevyError(str(exc)) from None
    out = sys.stdout
    try:
        model = LocalChatModel(
            service, "agent", {"max_tokens": args.max_tokens, "temperature": args.temperature}
        )
        agent = Agent(
            model,
            workspace,
            rules=rules,
            approve=lambda call: ask(call, args.yes, sys.stdin, out),
            on_event=Printer(out),
            max_steps=args.max_steps,
            command_timeout_s=args.timeout,
        )
        out.write(f"workspace {workspace.root}; commands {describe_isolation(agent.isolation)}\n")
        try:
            end = agent.run(args.task)
        except KeyboardInterrupt:
            agent.stop()
            raise
    finally:
        service.close()
    return 0 if end.reason in ("done", "finished") else 1
