"""The backend as the desktop app sees it: ``app/`` imports this module and no other.

Importing it loads no torch (a test checks): the names below are plain dataclasses and
tables, and everything that runs a model goes through a function that imports the
engine when it is first called, on the loader thread, so the window appears at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from backend.agent.loop import (
    Agent,
    AgentEvent,
    AgentFinished,
    AssistantTurn,
    CallFinished,
    CallProposed,
    CallStarted,
    PendingCall,
    StepStarted,
    TextDelta,
    new_workspace,
    system_prompt,
)
from backend.agent.permissions import Rule, Rules
from backend.agent.shell import describe_isolation, isolation
from backend.agent.workspace import ToolError, Workspace
from backend.config import AUTO, EngineConfig, SamplingParams, parse_cache_size, system_memory
from backend.errors import BevyError
from backend.messages import (
    Abort,
    ErrorEvent,
    Event,
    Finished,
    MetricsSnapshot,
    RequestProgress,
    Submit,
    TokenEvent,
)
from backend.policies import POLICIES, POLICY_NOTES
from backend.serving.catalog import (
    ModelEntry,
    add_model,
    format_size,
    list_models,
    remove_model,
)
from backend.serving.remote import (
    Endpoint,
    RemoteChatModel,
    RemoteError,
    RemoteService,
    server_stats,
    snapshot_from_json,
)
from backend.serving.remote import list_models as remote_models

if TYPE_CHECKING:
    from backend.serving.chat_model import LocalChatModel
    from backend.serving.http import ServerHandle
    from backend.serving.service import EngineService

__all__ = [
    "AUTO",
    "POLICIES",
    "POLICY_NOTES",
    "Abort",
    "Agent",
    "AgentEvent",
    "AgentFinished",
    "AssistantTurn",
    "BevyError",
    "CallFinished",
    "CallProposed",
    "CallStarted",
    "Endpoint",
    "EngineConfig",
    "ErrorEvent",
    "Event",
    "Finished",
    "MetricsSnapshot",
    "ModelEntry",
    "PendingCall",
    "RemoteChatModel",
    "RemoteError",
    "RemoteService",
    "RequestProgress",
    "Rule",
    "Rules",
    "SamplingParams",
    "StepStarted",
    "Submit",
    "TextDelta",
    "TokenEvent",
    "ToolError",
    "Workspace",
    "add_model",
    "describe_isolation",
    "demo_path",
    "ensure_demo",
    "format_size",
    "isolation",
    "list_models",
    "local_chat_model",
    "new_workspace",
    "open_service",
    "parse_cache_size",
    "remote_models",
    "remove_model",
    "run_cli",
    "server_stats",
    "snapshot_from_json",
    "start_api_server",
    "system_memory",
    "system_prompt",
]


def demo_path() -> Path:
    """Where the embedded demo MoE is (or will be, once built)."""
    from backend.demo.build import demo_path as path

    return path()


def ensure_demo(quiet: bool = True) -> Path:
    """The embedded demo MoE's path, built first if it is not in the cache yet."""
    from backend.demo.build import ensure_demo as build

    return build(quiet=quiet)


def open_service(
    model_path: str | Path | None,
    config: EngineConfig,
    progress: Callable[[int, int], None] | None = None,
    phase: Callable[[str], None] | None = None,
) -> tuple[EngineService, EngineConfig]:
    """Load a model (the demo MoE when ``model_path`` is None) and start its engine.
    Returns the running service and the config with ``device="auto"`` resolved.
    ``phase`` hears what is being done ("Building the demo MoE…", "Loading <file>…");
    ``progress`` the loading's (done, total)."""
    from backend.demo.build import demo_is_built
    from backend.serving.service import EngineService, resolve_device

    say = phase or (lambda _text: None)
    if model_path is None:
        if not demo_is_built():
            say("Building the demo MoE (first run: a 93 MB download, then about a minute)")
        model_path = ensure_demo()
    say(f"Loading {Path(model_path).name}")
    resolved = EngineConfig(**{**vars(config), "device": resolve_device(config.device)})
    return EngineService.open(model_path, resolved, progress=progress), resolved


def local_chat_model(
    service: EngineService, session: str, sampling: dict | None = None
) -> LocalChatModel:
    """Chat turns with tools on ``service``'s engine, for an agent session (labelled
    ``session`` in the progress views); ``sampling``: OpenAI request fields."""
    from backend.serving.chat_model import LocalChatModel

    return LocalChatModel(service, session, sampling)


def start_api_server(
    service: EngineService, host: str, port: int, api_key: str | None
) -> ServerHandle:
    """Serve ``service``'s OpenAI-compatible API on a background thread."""
    from backend.serving.http import start_server

    return start_server(service, host=host, port=port, api_key=api_key)


def run_cli(argv: list[str]) -> int:
    """The ``bevy`` command line (``bevy --help``)."""
    from backend.serving.cli import main

    return main(argv)
