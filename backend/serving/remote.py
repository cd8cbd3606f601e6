"""Remote engines: a session's chats and agent turns on any OpenAI-compatible server.

vLLM and SGLang (expert parallelism on a GPU server), llama.cpp's server on a bigger box,
LM Studio, or Bevy on another machine: each speaks the OpenAI chat API, so one client
serves them all (the official ``openai`` package, streaming). ``RemoteService`` takes
the same ``Submit`` messages and gives the same events as the local ``EngineService``,
so the app treats a remote session like a local one; ``RemoteChatModel`` is the agent
loop's ``ChatModel`` on a remote. Stopping closes the stream, which is how an
OpenAI-compatible server learns to abort. Failures become one ``RemoteError`` whose
message says what went wrong in the user's terms (unreachable, key refused, no such
model, busy, too slow), never a traceback.

No torch here, and ``openai`` is imported on first use: the app imports this module
as it starts, and a machine that only talks to remote engines never loads torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from backend.agent.loop import Reply
from backend.errors import BevyError
from backend.messages import (
    ErrorEvent,
    Finished,
    MetricsSnapshot,
    RequestProgress,
    Submit,
    TokenEvent,
)

CONNECT_TIMEOUT_S = 5.0
# The longest wait for the next piece of a stream (a long prompt being read, or a busy
# server's queue, sends nothing for a while).
READ_TIMEOUT_S = 120.0
Listener = Callable[[object], None]
_IDS = itertools.count(1)
# What a chat request may carry to any OpenAI-compatible server.
GENERATION_KEYS = frozenset(
    {"temperature", "top_p", "max_tokens", "stop", "seed", "top_k", "min_p", "repetition_penalty"}
)


@dataclass(frozen=True)
class Endpoint:
    """A server: a name for the user, its base URL (``/v1`` added when missing), the
    model to ask for and the API key ("" when it needs none)."""

    name: str
    base_url: str
    model: str = ""
    api_key: str = field(default="", repr=False)

    @property
    def api_base(self) -> str:
        url = self.base_url.strip().rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"

    @property
    def server_root(self) -> str:
        """The URL without ``/v1``: where a Bevy server answers ``/v1/stats``."""
        return self.api_base[: -len("/v1")]


class RemoteError(BevyError):
    """A remote engine failed; ``kind``: unreachable | timeout | auth | model | busy |
    server | request."""

    def __init__(self, message: str, kind: str = "server", partial: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.partial = partial  # a reply's text that came before the failure


@functools.cache
def _http_errors() -> SimpleNamespace:
    """The HTTP errors the installed ``openai`` client can raise: httpx's up to openai 2,
    httpx2's from openai 3 (the two share their API but not their classes), both kinds
    in each tuple."""
    mods = [importlib.import_module("httpx")]
    with contextlib.suppress(ImportError):
        mods.append(importlib.import_module("httpx2"))
    return SimpleNamespace(
        timeout=tuple(m.TimeoutException for m in mods),
        transport=tuple(m.TransportError for m in mods),
        http=tuple(m.HTTPError for m in mods),
        stream=tuple(m.StreamError for m in mods),
    )


def explain(exc: BaseException, endpoint: Endpoint) -> RemoteError:
    """What an ``openai`` or HTTP failure means for the user, naming the engine."""
    import openai

    errors = _http_errors()
    where = f"{endpoint.name} ({endpoint.api_base})"
    if isinstance(exc, (openai.APITimeoutError, *errors.timeout)):
        return RemoteError(f"{where} did not answer in time", "timeout")
    if isinstance(exc, (openai.APIConnectionError, *errors.transport)):
        return RemoteError(f"{where} cannot be reached: is the server running?", "unreachable")
    if isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError):
        return RemoteError(
            f"{where} refused the API key ({exc.status_code}): check it in Settings → Engines",
            "auth",
        )
    if isinstance(exc, openai.NotFoundError):
        return RemoteError(
            f"{where} has no model {endpoint.model!r} (404): pick one of its models in "
            "Settings → Engines",
            "model",
        )
    if isinstance(exc, openai.RateLimitError):
        return RemoteError(f"{where} is busy (429): try again in a moment", "busy")
    if isinstance(exc, openai.APIStatusError):
        kind = "server" if exc.status_code >= 500 else "request"
        return RemoteError(f"{where} answered {exc.status_code}: {_message(exc)}", kind)
    return RemoteError(f"{where}: {exc}", "server")


def _message(exc) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body)
    text = error.get("message") if isinstance(error, dict) else None
    return str(text or exc.message)


def _client(endpoint: Endpoint, read_timeout: float = READ_TIMEOUT_S):
    import openai

    return openai.OpenAI(
        base_url=endpoint.api_base,
        api_key=endpoint.api_key or "none",  # the client insists on one; servers ignore it
        max_retries=0,  # a retry would send the prompt twice: the user sees the error
        timeout=openai.Timeout(read_timeout, connect=CONNECT_TIMEOUT_S),
    )


def list_models(endpoint: Endpoint, timeout: float = 10.0) -> list[str]:
    """The model ids the server offers (``GET /v1/models``); RemoteError if it cannot say."""
    import openai

    errors = _http_errors()
    try:
        with _client(endpoint, timeout) as client:
            return [m.id for m in client.models.list().data]
    except (openai.OpenAIError, *errors.http) as exc:
        raise explain(exc, endpoint) from None


def snapshot_json(snap: MetricsSnapshot) -> dict:
    """A snapshot as JSON (``/v1/stats?snapshot=1``): what a remote app's panels draw.
    A figure not known yet (NaN) goes as null: JSON has no NaN."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v
        for k, v in dataclasses.asdict(snap).items()
    }


def snapshot_from_json(data: dict, t: float) -> MetricsSnapshot:
    """``snapshot_json``'s output back as a snapshot taken at ``t`` on this machine's clock
    (lanes are kept relative to it); fields this app does not know are left out."""
    fields = {f.name for f in dataclasses.fields(MetricsSnapshot)}
    values = {k: v for k, v in data.items() if k in fields}
    known = {f.name for f in dataclasses.fields(RequestProgress)}
    values["requests"] = tuple(
        RequestProgress(**{k: v for k, v in r.items() if k in known})
        for r in data.get("requests") or ()
    )
    for lane in ("link_lane", "compute_lane", "resident"):
        values[lane] = tuple(tuple(pair) for pair in data.get(lane) or ())
    for f in dataclasses.fields(MetricsSnapshot):
        if f.type in ("float", float) and values.get(f.name, 0.0) is None:
            values[f.name] = math.nan
    values["t"] = t
    return MetricsSnapshot(**values)


def server_stats(endpoint: Endpoint, timeout: float = 3.0, snapshot: bool = False) -> dict | None:
    """A Bevy server's ``/v1/stats`` (cache, overlap, each request's layer; with
    ``snapshot``, its whole latest snapshot under "snapshot"); None from servers that do
    not report them (anything but Bevy) or cannot be reached."""
    import httpx

    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    params = {"snapshot": "1"} if snapshot else None
    try:
        r = httpx.get(f"{endpoint.api_base}/stats", headers=headers, params=params, timeout=timeout)
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) and "expert_backend" in body else None


@dataclass
class RemoteReply:
    text: str
    tool_calls: list[dict]
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0


def stream_chat(
    endpoint: Endpoint,
    messages: list[dict],
    sampling: dict[str, Any],
    on_text: Callable[[str], None],
    stop: threading.Event,
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = None,
) -> RemoteReply:
    """One streamed chat turn: ``on_text`` gets the reply's text as it arrives; setting
    ``stop`` closes the stream (the server aborts) and the reply ends as "abort" with
    what came. ``sampling``: OpenAI request fields (temperature, top_p, max_tokens, stop,
    extra fields a server knows, such as ``continue_final_message``). RemoteError on
    failure, with ``.partial``: the text that came before it."""
    import openai

    errors = _http_errors()
    if not endpoint.model:
        raise RemoteError(f"{endpoint.name}: no model chosen: pick one in Settings → Engines")
    known = {"temperature", "top_p", "max_tokens", "stop", "seed"}
    body: dict[str, Any] = {k: v for k, v in sampling.items() if k in known and v is not None}
    extra = {k: v for k, v in sampling.items() if k not in known and v is not None}
    if tools:
        body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
    text: list[str] = []
    calls: dict[int, dict] = {}
    reason, usage = None, None
    done = threading.Event()
    if stop.is_set():  # stopped before it was sent
        return RemoteReply("", [], "abort")
    client = _client(endpoint)
    try:
        stream = client.chat.completions.create(
            model=endpoint.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra or None,
            **body,
        )
    except (openai.OpenAIError, *errors.http) as exc:
        client.close()
        raise explain(exc, endpoint) from None

    def watch() -> None:  # a stop while the server sends nothing (queued, reading)
        while not done.wait(0.05):
            if stop.is_set():
                _hang_up(stream)
                return

    watcher = threading.Thread(target=watch, name="bevy-remote-stop", daemon=True)
    watcher.start()
    try:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    text.append(delta.content)
                    on_text(delta.content)
                for tc in delta.tool_calls or ():
                    _add_call(calls, tc)
                if choice.finish_reason:
                    reason = choice.finish_reason
    # StreamError: the stream closed under the read (a stop, from the watcher thread).
    except (openai.OpenAIError, *errors.http, *errors.stream) as exc:
        if not stop.is_set():
            err = explain(exc, endpoint)
            if err.kind in ("unreachable", "server"):
                err = RemoteError(f"{endpoint.name} stopped answering mid-reply: {exc}")
            err.partial = "".join(text)
            raise err from None
    finally:
        done.set()
        stream.close()
        client.close()
    if stop.is_set() and reason is None:
        reason = "abort"
    elif reason is None:  # the stream ended without saying why: the server went away
        raise RemoteError(
            f"{endpoint.name} ended the reply without finishing it", partial="".join(text)
        )
    return RemoteReply(
        "".join(text),
        [calls[i] for i in sorted(calls)],
        reason,
        usage.prompt_tokens if usage else 0,
        usage.completion_tokens if usage else 0,
    )


def _hang_up(stream: Any) -> None:
    """Close a stream from another thread. Closing alone does not wake a read blocked on
    its socket (nor tell the server) until bytes come; shutting the socket down does."""
    import socket

    network = stream.response.extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed by the server
            sock.shutdown(socket.SHUT_RDWR)
    stream.close()


def _add_call(calls: dict[int, dict], tc: Any) -> None:
    """Merge one streamed tool-call fragment (id and name once, then arguments)."""
    call = calls.setdefault(
        tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
    )
    if tc.id:
        call["id"] = tc.id
    fn = tc.function
    if fn is not None:
        if fn.name:
            call["function"]["name"] += fn.name
        if fn.arguments:
            call["function"]["arguments"] += fn.arguments


class RemoteService:
    """A remote engine behind the local engine's interface: ``submit`` a chat ``Submit``
    and its listener gets ``TokenEvent``s, then ``Finished`` or ``ErrorEvent`` (whose
    message is the RemoteError's), each request on a thread of its own."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._stops: dict[str, threading.Event] = {}
        self._texts: dict[str, list[str]] = {}
        self._listeners: dict[str, Listener] = {}
        self._lock = threading.Lock()

    def new_id(self, prefix: str = "remote") -> str:
        # One count for every service: an engine edited mid-reply gets a new service,
        # whose ids must not be those of the old one's replies still streaming.
        return f"{prefix}-{self.endpoint.name}-{next(_IDS)}"

    def submit(self, msg: Submit, listener: Listener) -> None:
        if msg.messages is None:
            listener(ErrorEvent(msg.request_id, "a remote engine takes chats, not token ids"))
            return
        stop = threading.Event()
        with self._lock:
            self._stops[msg.request_id] = stop
            self._texts[msg.request_id] = []
            self._listeners[msg.request_id] = listener
        threading.Thread(
            target=self._run, args=(msg, listener, stop), name="bevy-remote", daemon=True
        ).start()

    def abort(self, request_id: str) -> None:
        """Stop a request: it ends now, as "abort" with the text that came; its stream is
        hung up, so the server stops too, and whatever its thread hears later is dropped
        (a server that is silent, queued or reading a long prompt, may be slow to notice)."""
        with self._lock:
            stop = self._stops.pop(request_id, None)
            text = "".join(self._texts.pop(request_id, ()))
            listener = self._listeners.pop(request_id, None)
        if stop is not None:
            stop.set()
        if listener is not None:
            listener(Finished(request_id, "abort", text, 0, 0))

    def busy(self) -> int:
        with self._lock:
            return len(self._stops)

    def _run(self, msg: Submit, listener: Listener, stop: threading.Event) -> None:
        rid = msg.request_id

        def tell(ev: object) -> None:  # nothing more once the request ended (an abort)
            with self._lock:
                live = rid in self._stops
                if live and isinstance(ev, TokenEvent):
                    self._texts[rid].append(ev.text)
                if live and not isinstance(ev, TokenEvent):
                    self._stops.pop(rid, None)
                    self._texts.pop(rid, None)
                    self._listeners.pop(rid, None)
            if live:
                listener(ev)

        self._stream(msg, tell, stop)

    def _stream(self, msg: Submit, listener: Listener, stop: threading.Event) -> None:
        p = msg.params
        sampling: dict[str, Any] = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "max_tokens": p.max_tokens,
            "stop": list(p.stop) or None,
        }
        # Beyond OpenAI's fields, as vLLM, llama.cpp's server and Bevy name them; sent
        # only when set, so a strict server is not sent what it does not know.
        for name, value, default in (
            ("top_k", p.top_k, 0),
            ("min_p", p.min_p, 0.0),
            ("repetition_penalty", p.repetition_penalty, 1.0),
            ("ignore_eos", p.ignore_eos, False),
            ("seed", p.seed, None),
        ):
            if value != default:
                sampling[name] = value
        if msg.continue_final:
            sampling["continue_final_message"] = True  # vLLM's and Bevy's name for it
            sampling["add_generation_prompt"] = False
        rid = msg.request_id

        def on_text(text: str) -> None:
            listener(TokenEvent(rid, -1, text))

        try:
            reply = stream_chat(self.endpoint, msg.messages or [], sampling, on_text, stop)
        except RemoteError as exc:
            listener(ErrorEvent(rid, str(exc)))
        except Exception as exc:  # a bug here must still end the reply, not hang it
            listener(ErrorEvent(rid, f"{self.endpoint.name}: {exc}"))
        else:
            if reply.finish_reason == "abort":
                return  # abort() ended it already
            listener(
                Finished(
                    rid,
                    {"tool_calls": "stop"}.get(reply.finish_reason, reply.finish_reason),
                    reply.text,
                    reply.prompt_tokens,
                    reply.completion_tokens,
                )
            )


class RemoteChatModel:
    """The agent loop's ``ChatModel`` on a remote engine: the server renders the tools
    and reads the model's calls, and its ``tool_calls`` come back as they are."""

    tool_format = "openai"  # not "generic": the server holds its model to its calls

    def __init__(self, endpoint: Endpoint, sampling: dict[str, Any] | None = None) -> None:
        """``sampling``: a session's values; only generation settings go to the server
        (an app setting such as ``context_overflow`` would make a strict server refuse)."""
        self.endpoint = endpoint
        given = {k: v for k, v in (sampling or {}).items() if k in GENERATION_KEYS}
        self.sampling = {"temperature": 0.2, "max_tokens": 1024, **given}

    def complete(
        self,
        messages: list[dict],
        tools: list[dict],
        tool_choice: str,
        on_text: Callable[[str], None],
        stop: threading.Event,
    ) -> Reply:
        reply = stream_chat(
            self.endpoint, messages, self.sampling, on_text, stop, tools or None, tool_choice
        )
        return Reply(reply.text, reply.tool_calls, reply.finish_reason)
