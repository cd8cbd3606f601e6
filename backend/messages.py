"""Typed messages crossing the engine thread boundary (commands in, events out)."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.config import SamplingParams

# --- commands (to the engine) -----------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    request_id: str
    params: SamplingParams
    messages: list[dict] | None = None  # chat messages, rendered with the model's template
    prompt_ids: list[int] | None = None  # or pre-tokenized input (exactly one of the two)
    tools: list[dict] | None = None
    session: str = ""  # label for progress views
    # A chat longer than the context: "error", or leave out turns ("rolling" keeps the
    # system prompt, "truncate_middle" the first turn too; models.generate.fit_chat).
    overflow: str = "error"
    # With prompt_ids made from a chat elsewhere (serving.service renders chats off the
    # engine thread): how many of its messages fit_chat left out, for Finished.
    dropped_messages: int = 0
    # The chat's last message is an assistant turn the reply goes on with (a reply cut at
    # its token limit, continued): the prompt ends inside it; events carry the new text.
    continue_final: bool = False


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


Command = Submit | Abort | Shutdown

# --- events (from the engine) -----------------------------------------------------------


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int
    text: str  # newly completed text (may be empty while a character is incomplete)


@dataclass(frozen=True)
class RequestProgress:
    request_id: str
    session: str
    layer: int
    n_layers: int
    state: str  # "computing", "ready", "waiting" (for experts), "queued"
    tokens: int
    prompt_tokens: int = 0
    # How much of the prompt's reading is done, 0-1: layers passed, and within a layer
    # the rows a sliced prompt's job has done (1 once it decodes).
    prompt_read: float = 0.0


@dataclass(frozen=True)
class MetricsSnapshot:
    t: float
    tokens_per_s: float
    hit_rate: float
    both_busy_frac: float
    compute_wait_frac: float
    compute_busy_frac: float
    link_busy_frac: float
    fetched: int
    cache_slots: int
    cache_used: int
    cache_pinned: int
    runahead: str  # "on", "limited" (cache too small for every request's experts), "off"
    requests: tuple[RequestProgress, ...] = field(default=())
    # For live views: the last ``lane_window_s`` seconds of each lane as (start, end)
    # pairs in seconds before ``t`` (negative numbers), and which experts are resident.
    lane_window_s: float = 0.0
    link_lane: tuple[tuple[float, float], ...] = ()
    compute_lane: tuple[tuple[float, float], ...] = ()
    resident: tuple[tuple[int, int], ...] = ()  # (layer, expert) keys ready in the cache
    n_layers: int = 0
    n_experts: int = 0  # routed experts per layer
    tokens_total: int = 0
    expert_backend: str = ""  # the engine's expert-compute backend (backend/engine/experts)
    # Threads computing now, of the most the engine started with: fewer while other
    # processes keep CPUs busy (backend/engine/pool.py). 0: not reported.
    compute_threads: int = 0
    compute_threads_max: int = 0
    # Experts the start-up warm-up has still to read (0: none left, or no warm-up).
    warm_left: int = 0
    # Memory in bytes: the process's resident set; the total it was planned within
    # (``--memory``, or what "auto" found free; 0 for an explicit ``--cache``); the cache
    # budget and what of it the slots and the decoded working set hold; KV caches of
    # running requests and their budget; the model's dense (resident, non-expert) weights.
    rss_bytes: int = 0
    device_bytes: int = 0  # on CUDA, torch's pool there: what ``--memory`` bounds
    memory_budget_bytes: int = 0
    kv_budget_bytes: int = 0
    cache_budget_bytes: int = 0
    slots_bytes: int = 0
    working_set_bytes: int = 0
    kv_bytes: int = 0
    dense_bytes: int = 0


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: str  # "stop", "length", "abort"
    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    dropped_messages: int = 0  # left out of the prompt to fit the context (Submit.overflow)
    stop_sequence: str | None = None  # the stop string that ended it (reason "stop")


@dataclass(frozen=True)
class ErrorEvent:
    request_id: str | None  # None: the engine itself failed
    message: str
    # The server's fault (an expert read failed, the engine died), not the request's:
    # an API answers 500, and the service reports itself degraded for a while.
    server: bool = False


Event = TokenEvent | MetricsSnapshot | Finished | ErrorEvent
