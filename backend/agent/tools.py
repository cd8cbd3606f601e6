"""The agent's tools: their JSON schemas (offered to the model as OpenAI ``tools``) and
running one call of them on a workspace."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass

import jsonschema

from backend.agent import shell
from backend.agent.workspace import ToolError, Workspace


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


_PATH = {"type": "string", "description": "relative to the workspace"}
SPECS = [
    _tool(
        "list_dir",
        "List a folder of the workspace (sizes in bytes; folders end with /).",
        {"path": _PATH, "recursive": {"type": "boolean"}},
        ["path"],
    ),
    _tool(
        "read_file",
        "Read a text file, whole or a range of lines (1-based, inclusive).",
        {
            "path": _PATH,
            "start_line": {"type": "integer", "minimum": 1},
            "end_line": {"type": "integer", "minimum": 1},
        },
        ["path"],
    ),
    _tool(
        "search",
        "Search the workspace's files for a regular expression; lines as file:line:text.",
        {"pattern": {"type": "string"}, "path": _PATH, "glob": {"type": "string"}},
        ["pattern"],
    ),
    _tool(
        "write_file",
        "Create a file or replace its whole content.",
        {"path": _PATH, "content": {"type": "string"}},
        ["path", "content"],
    ),
    _tool(
        "edit_file",
        "Replace an exact piece of a file's text (it must occur once, or set replace_all).",
        {
            "path": _PATH,
            "old": {"type": "string", "description": "the exact text to replace"},
            "new": {"type": "string"},
            "replace_all": {"type": "boolean"},
        },
        ["path", "old", "new"],
    ),
    _tool(
        "run_command",
        "Run a bash command in the workspace folder; returns its output and exit code. "
        "Background processes are stopped when it ends.",
        {
            "command": {"type": "string"},
            "timeout": {
                "type": "integer",
                "minimum": 1,
                "maximum": 3600,
                "description": "seconds (at most the session's limit)",
            },
        },
        ["command"],
    ),
]
FINISH = _tool(
    "finish",
    "Say the task is done (or cannot be done), with a short answer for the user.",
    {"message": {"type": "string"}},
    ["message"],
)
TOOL_NAMES = tuple(s["function"]["name"] for s in SPECS)
_SCHEMAS = {s["function"]["name"]: s["function"]["parameters"] for s in [*SPECS, FINISH]}


@dataclass(frozen=True)
class ToolResult:
    output: str  # what the model reads
    ok: bool = True
    diff: str = ""  # for edits: the unified diff
    exit_code: int | None = None  # for commands; None when killed
    seconds: float = 0.0
    cut: int = 0  # characters of command output cut from the middle


def parse_arguments(name: str, arguments: str | dict) -> dict:
    """A call's arguments as a dict checked against its tool's schema; ToolError with a
    message the model can act on otherwise."""
    if name not in _SCHEMAS:
        raise ToolError(
            f"there is no tool {name!r}; the tools are {', '.join([*TOOL_NAMES, 'finish'])}"
        )
    if isinstance(arguments, str):
        try:
            args = json.loads(arguments or "{}")
        except ValueError as exc:
            raise ToolError(f"the arguments are not valid JSON: {exc}") from None
    else:
        args = arguments
    if not isinstance(args, dict):
        raise ToolError("the arguments must be a JSON object")
    try:
        jsonschema.validate(args, _SCHEMAS[name])
    except jsonschema.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path))
        raise ToolError(
            f"invalid arguments for {name}{f' ({where})' if where else ''}: {exc.message}"
        ) from None
    return args


class Toolbox:
    """Runs tool calls on one workspace."""

    def __init__(
        self,
        workspace: Workspace,
        timeout_s: float = shell.DEFAULT_TIMEOUT_S,
        sandbox: bool | None = None,
    ) -> None:
        self.workspace = workspace
        self.timeout_s = timeout_s
        self.sandbox = sandbox

    def run(self, name: str, args: dict, stop: threading.Event | None = None) -> ToolResult:
        t0 = time.monotonic()
        ws = self.workspace
        try:
            if name == "list_dir":
                return ToolResult(ws.list_dir(args.get("path", "."), bool(args.get("recursive"))))
            if name == "read_file":
                out = ws.read_file(args["path"], args.get("start_line"), args.get("end_line"))
                return ToolResult(out)
            if name == "search":
                return ToolResult(
                    ws.search(args["pattern"], args.get("path", "."), args.get("glob"))
                )
            if name == "write_file":
                msg, diff = ws.write_file(args["path"], args["content"])
                return ToolResult(msg, diff=diff, seconds=time.monotonic() - t0)
            if name == "edit_file":
                msg, diff = ws.edit_file(
                    args["path"], args["old"], args["new"], bool(args.get("replace_all"))
                )
                return ToolResult(f"{msg}\n{diff}", diff=diff, seconds=time.monotonic() - t0)
            if name == "run_command":
                r = shell.run_command(
                    args["command"],
                    ws.root,
                    # The model may ask for less time than the user allows, never more.
                    timeout_s=min(float(args.get("timeout") or self.timeout_s), self.timeout_s),
                    stop=stop,
                    sandbox=self.sandbox,
                )
                return ToolResult(
                    r.for_model(),
                    ok=r.exit_code == 0,
                    exit_code=r.exit_code,
                    seconds=r.seconds,
                    cut=r.cut,
                )
            if name == "finish":
                return ToolResult(args["message"])
        except ToolError as exc:
            return ToolResult(f"error: {exc}", ok=False, seconds=time.monotonic() - t0)
        except OSError as exc:
            return ToolResult(
                f"error: {exc.strerror or exc}", ok=False, seconds=time.monotonic() - t0
            )
        except (ValueError, UnicodeError, subprocess.SubprocessError) as exc:
            # A NUL byte in a path or command, text that is not Unicode, a tool timeout:
            # the model is told, and the run goes on.
            return ToolResult(f"error: {exc}", ok=False, seconds=time.monotonic() - t0)
        return ToolResult(f"error: there is no tool {name!r}", ok=False)
