"""Remote engines (``backend.serving.remote``) against a second, real `bevy serve` process: what
a session on another machine's server streams, how it stops, and how it fails."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from backend.config import SamplingParams
from backend.messages import ErrorEvent, Finished, Submit, TokenEvent
from backend.serving.remote import (
    Endpoint,
    RemoteError,
    RemoteService,
    list_models,
    server_stats,
    snapshot_from_json,
    stream_chat,
)
from tests.helpers.serve import free_port, server_process, serving
from tests.helpers.tools import WEATHER

KEY = "remote-key"
MODEL = "tiny-moe"
CHAT = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def server(tiny_chat_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(tiny_chat_moe, tmp_path_factory.mktemp("remote"), "--api-key", KEY) as url:
        yield url


@pytest.fixture
def endpoint(server: str) -> Endpoint:
    return Endpoint("lab", server, MODEL, KEY)  # no /v1: added


def events_of(service: RemoteService, msg: Submit, timeout: float = 60) -> list:
    got: queue.Queue = queue.Queue()
    service.submit(msg, got.put)
    out = [got.get(timeout=timeout)]
    while not isinstance(out[-1], Finished | ErrorEvent):
        out.append(got.get(timeout=timeout))
    return out


def test_models_come_from_the_server_and_failures_say_what_is_wrong(
    server: str, endpoint: Endpoint
) -> None:
    assert list_models(endpoint) == [MODEL]
    with pytest.raises(RemoteError, match="refused the API key") as exc:
        list_models(Endpoint("lab", server, MODEL, "wrong"))
    assert exc.value.kind == "auth"
    with pytest.raises(RemoteError, match="cannot be reached") as exc:
        list_models(Endpoint("gone", f"http://127.0.0.1:{free_port()}/v1"))
    assert exc.value.kind == "unreachable"
    stop = threading.Event()
    with pytest.raises(RemoteError, match="has no model 'nope'") as exc:
        stream_chat(Endpoint("lab", server, "nope", KEY), CHAT, {}, lambda t: None, stop)
    assert exc.value.kind == "model"


def test_a_remote_chat_streams_the_servers_own_reply(server: str, endpoint: Endpoint) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    events = events_of(RemoteService(endpoint), Submit("r1", params, messages=CHAT))
    *tokens, end = events
    assert isinstance(end, Finished) and all(isinstance(t, TokenEvent) for t in tokens)
    assert "".join(t.text for t in tokens) == end.text and end.reason in ("stop", "length")
    assert end.prompt_tokens > 0 and 0 < end.completion_tokens <= 8
    direct = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    same = direct.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
    assert end.text == same.choices[0].message.content  # greedy: the same reply
    stats = server_stats(endpoint)
    assert stats is not None and stats["model"] == MODEL  # a Bevy server reports itself
    assert "snapshot" not in stats
    # Its whole snapshot, for the app's panels, read back on this machine's clock.
    full = server_stats(endpoint, snapshot=True)
    snap = snapshot_from_json(full["snapshot"], t=123.0)
    assert snap.t == 123.0 and snap.n_layers > 0 and snap.cache_slots == full["cache_slots"]
    assert snap.tokens_total >= end.completion_tokens and isinstance(snap.requests, tuple)
    assert all(isinstance(pair, tuple) for pair in snap.compute_lane + snap.resident)
    assert server_stats(Endpoint("lab", server, MODEL, "wrong")) is None


def test_stopping_closes_the_stream_and_the_server_aborts(endpoint: Endpoint) -> None:
    stop = threading.Event()
    seen: list[str] = []

    def on_text(text: str) -> None:
        seen.append(text)
        if len(seen) == 3:
            stop.set()

    reply = stream_chat(
        endpoint, CHAT, {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}, on_text, stop
    )
    assert reply.finish_reason == "abort" and len(seen) >= 3
    deadline = time.monotonic() + 10
    while (server_stats(endpoint) or {}).get("active_requests", 1) != 0:
        assert time.monotonic() < deadline, "the server kept generating"
        time.sleep(0.1)


def test_tool_calls_come_back_whole(endpoint: Endpoint) -> None:
    reply = stream_chat(
        endpoint,
        [{"role": "user", "content": "Weather in Oslo?"}],
        {"max_tokens": 64, "temperature": 0},
        lambda t: None,
        threading.Event(),
        tools=[WEATHER],
        tool_choice="required",
    )
    (call,) = reply.tool_calls
    assert reply.finish_reason == "tool_calls" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}


def test_a_busy_server_says_so_and_one_that_dies_mid_reply_keeps_the_text(
    tiny_chat_moe: Path, tmp_path: Path
) -> None:
    with server_process(tiny_chat_moe, tmp_path, "--max-queue", "1") as (url, proc):
        endpoint = Endpoint("doomed", url, MODEL)
        service = RemoteService(endpoint)
        got: queue.Queue = queue.Queue()
        params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
        service.submit(Submit("r2", params, messages=CHAT), got.put)
        first = got.get(timeout=60)
        assert isinstance(first, TokenEvent)
        with pytest.raises(RemoteError, match="is busy") as exc:  # its one place is taken
            stream_chat(endpoint, CHAT, {"max_tokens": 4}, lambda t: None, threading.Event())
        assert exc.value.kind == "busy"
        proc.kill()
        events = [first]
        while not isinstance(events[-1], Finished | ErrorEvent):
            events.append(got.get(timeout=30))
    assert isinstance(events[-1], ErrorEvent) and "doomed" in events[-1].message
    assert service.busy() == 0  # ended before its event went out


def test_a_stop_before_the_first_token_ends_the_reply_at_once(endpoint: Endpoint) -> None:
    """Stopped while the server is still reading a long prompt: the reply ends now, the
    server is hung up on, and nothing the stream sends later reaches the listener."""
    service = RemoteService(endpoint)
    got: queue.Queue = queue.Queue()
    long = [{"role": "user", "content": "river " * 3000}]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    service.submit(Submit("r3", params, messages=long), got.put)
    t0 = time.monotonic()
    service.abort("r3")
    end = got.get(timeout=5)
    assert isinstance(end, Finished) and end.reason == "abort" and end.text == ""
    assert time.monotonic() - t0 < 1.0 and service.busy() == 0
    time.sleep(1.0)
    assert got.empty()  # the stream's own end, if any, was dropped
    deadline = time.monotonic() + 20
    while (server_stats(endpoint) or {}).get("active_requests", 1) != 0:
        assert time.monotonic() < deadline, "the server kept the request"
        time.sleep(0.1)
