"""Ollama's and Anthropic's APIs beside OpenAI's: the official `ollama` and `anthropic`
clients against a real `bevy serve` process on the tiny MoE (random weights, SmolLM2's
tokenizer and chat template). What the model says is not checked, only that each dialect
gets the same greedy text and speaks its protocol."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.helpers.serve import serving
from tests.helpers.tools import CLOCK, WEATHER

KEY = "dialect-key"
MODEL = "tiny-moe"
PROMPT = "Name three rivers."
N = 8
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER_SCHEMA = WEATHER["function"]["parameters"]
# The same tool as Anthropic defines tools.
WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER_SCHEMA,
}


@pytest.fixture(scope="module")
def server(tiny_chat_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("serve-dialects")
    with serving(tiny_chat_moe, logs, "--api-key", KEY, "--cache", "0.5") as url:
        yield url


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oll(server: str) -> ollama.Client:
    return ollama.Client(host=server, headers=AUTH, timeout=60)


@pytest.fixture(scope="module")
def ant(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy(oai: openai.OpenAI) -> str:
    """The OpenAI endpoint's greedy reply, which every dialect must equal."""
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=N,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N
    return r.choices[0].message.content


def _stats(server: str) -> dict:
    return httpx.get(f"{server}/v1/stats", headers=AUTH, timeout=10).json()


GREEDY = {"temperature": 0, "num_predict": N}
# Anthropic's current SDKs have no temperature argument; the field still works.
GREEDY_ANTHROPIC = {"temperature": 0}


# --- Ollama ------------------------------------------------------------------------------


def test_ollama_lists_shows_and_reports_the_loaded_model(
    oll: ollama.Client, server: str, tiny_chat_moe: Path
) -> None:
    (m,) = oll.list().models
    assert m.model == f"{MODEL}:latest" and m.size > 0 and len(m.digest) == 64
    assert m.details.family == "mixtral" and m.details.format == "safetensors"
    shown = oll.show(f"{MODEL}:latest")
    assert shown.modelinfo["general.architecture"] == "mixtral"
    assert shown.modelinfo["mixtral.expert_count"] > 1 and "tools" in shown.capabilities
    assert shown.template  # the chat template the prompts are rendered with
    (running,) = oll.ps().models
    assert running.model == m.model and running.context_length > 0 and running.size > 0
    version = httpx.get(f"{server}/api/version", headers=AUTH).json()
    assert version["version"].count(".") == 2
    assert httpx.get(server).text == "Bevy is running"  # Ollama clients probe the root


def test_ollama_chat_and_generate_equal_the_openai_greedy_text(
    oll: ollama.Client, greedy: str
) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    r = oll.chat(model=MODEL, messages=messages, options=GREEDY, stream=False)
    assert r.message.content == greedy and r.done and r.done_reason == "length"
    assert r.eval_count == N and r.prompt_eval_count > 0 and r.total_duration > 0
    parts = list(oll.chat(model=f"{MODEL}:latest", messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == greedy
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count == N and parts[-1].eval_duration > 0
    # /api/generate renders the prompt with the same template: the same reply.
    g = oll.generate(model=MODEL, prompt=PROMPT, options=GREEDY)
    assert g.response == greedy and g.done_reason == "length"
    assert len(g.context) == g.prompt_eval_count + N
    streamed = list(oll.generate(model=MODEL, prompt=PROMPT, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == greedy
    # The returned context continues the conversation as tokens (raw mode).
    more = oll.generate(model=MODEL, prompt=" And", context=g.context, raw=True, options=GREEDY)
    assert more.prompt_eval_count > len(g.context) and more.eval_count == N


def test_ollama_loads_with_an_empty_chat_and_refuses_what_it_cannot_do(
    oll: ollama.Client, server: str
) -> None:
    loaded = oll.chat(model=MODEL, messages=[])
    assert loaded.done and loaded.done_reason == "load"
    with pytest.raises(ollama.ResponseError) as exc:
        oll.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and "llama3.2" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        oll.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"mirostat": 2})
    assert exc.value.status_code == 400 and "mirostat" in exc.value.error
    bad = httpx.post(
        f"{server}/api/chat",
        json={"model": MODEL, "messages": [], "options": {"temperature": "hot"}},
        headers=AUTH,
    )
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    missing = httpx.post(f"{server}/api/generate", json={"prompt": "x"}, headers=AUTH)
    assert missing.status_code == 400 and "model" in missing.json()["error"]
    nokey = httpx.post(f"{server}/api/chat", json={"model": MODEL, "messages": []})
    assert nokey.status_code == 401 and "API key" in nokey.json()["error"]
    # The same guard as OpenAI's routes: a rebinding page's Host is refused.
    rebound = httpx.post(f"{server}/api/chat", json={}, headers={**AUTH, "Host": "evil.example"})
    assert rebound.status_code == 403 and "evil.example" in rebound.json()["error"]


def test_ollama_format_holds_the_reply_to_a_json_schema(oll: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"river": {"type": "string", "maxLength": 12}, "km": {"type": "integer"}},
        "required": ["river", "km"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Reply in JSON."}]
    options = {"temperature": 0.7, "seed": 3, "num_predict": 200}
    r = oll.chat(model=MODEL, messages=messages, format=schema, options=options)
    assert r.done_reason == "stop", r.message.content
    jsonschema.validate(json.loads(r.message.content), schema)
    r = oll.chat(model=MODEL, messages=messages, format="json", options=options)
    assert isinstance(json.loads(r.message.content), dict)


def test_ollama_tool_round_trip(oll: ollama.Client, server: str) -> None:
    """Ollama's API has no tool_choice; Bevy takes OpenAI's as an extension, sent here
    without the client (which has no such argument), to force the call. The answer is
    read with the client's own types, and the tool's result goes back through it."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "options": {"temperature": 0, "num_predict": 120},
        "stream": False,
    }
    r = httpx.post(f"{server}/api/chat", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    first = ollama.ChatResponse(**r.json())
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER_SCHEMA)  # an object, not text
    # Streamed, the call comes whole on one line.
    lines = []
    with httpx.stream(
        "POST", f"{server}/api/chat", json={**body, "stream": True}, headers=AUTH, timeout=60
    ) as s:
        lines = [ollama.ChatResponse(**json.loads(line)) for line in s.iter_lines() if line]
    streamed = [c for p in lines for c in p.message.tool_calls or ()]
    assert [c.function.arguments for c in streamed] == [call.function.arguments]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_name": "get_weather", "content": '{"temp": 21}'},
    ]
    final = oll.chat(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], options=GREEDY)
    assert final.done_reason in ("stop", "length") and isinstance(final.message.content, str)
    assert final.prompt_eval_count > first.prompt_eval_count  # the result is in the prompt


# --- Anthropic ---------------------------------------------------------------------------


def _ask(ant: anthropic.Anthropic, **kw):
    args = {
        "model": MODEL,
        "max_tokens": N,
        "messages": [{"role": "user", "content": PROMPT}],
        "extra_body": GREEDY_ANTHROPIC,
    }
    return ant.messages.create(**{**args, **kw})


def test_anthropic_messages_equal_the_openai_greedy_text(
    ant: anthropic.Anthropic, oai: openai.OpenAI, greedy: str
) -> None:
    r = _ask(ant)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == greedy
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == N and r.role == "assistant"
    n_prompt = r.usage.input_tokens
    with ant.messages.stream(
        model=MODEL,
        max_tokens=N,
        extra_body=GREEDY_ANTHROPIC,
        messages=[{"role": "user", "content": PROMPT}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == greedy and final.content[0].text == greedy
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == N
    counted = ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": PROMPT}])
    assert counted.input_tokens == n_prompt
    # A system prompt and text blocks are read as the OpenAI endpoint reads its messages.
    system = "Be brief."
    with_system = _ask(
        ant,
        system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    )
    same = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=N,
    )
    assert with_system.usage.input_tokens == same.usage.prompt_tokens != n_prompt
    assert with_system.content[0].text == same.choices[0].message.content


def test_anthropic_stop_sequences_say_which_one_ended_the_reply(
    ant: anthropic.Anthropic, greedy: str
) -> None:
    word = next(w for w in greedy.split()[1:] if w.strip())
    r = _ask(ant, stop_sequences=["\u2603never", word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == greedy[: greedy.index(word)]


def test_anthropic_tool_round_trip_and_streamed_input_json(ant: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = ant.messages.create(
        model=MODEL,
        max_tokens=120,
        extra_body=GREEDY_ANTHROPIC,
        messages=messages,
        tools=[WEATHER_ANTHROPIC],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    with ant.messages.stream(
        model=MODEL,
        max_tokens=120,
        extra_body=GREEDY_ANTHROPIC,
        messages=messages,
        tools=[WEATHER_ANTHROPIC],
        tool_choice={"type": "any"},
    ) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds or "content_block_delta" in kinds
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, clear"}],
        },
    ]
    final = ant.messages.create(
        model=MODEL,
        max_tokens=N,
        extra_body=GREEDY_ANTHROPIC,
        messages=messages,
        tools=[WEATHER_ANTHROPIC],
        tool_choice={"type": "none"},
    )
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"]
    question = ant.messages.count_tokens(
        model=MODEL, messages=messages[:1], tools=[WEATHER_ANTHROPIC], tool_choice={"type": "none"}
    )
    assert final.usage.input_tokens > question.input_tokens  # the call and result are in it


def test_anthropic_errors_come_in_anthropics_shape(ant: anthropic.Anthropic, server: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as exc:
        _ask(ant, model="claude-sonnet-4-5")
    assert exc.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as exc:
        _ask(ant, extra_body={"temperature": 1.5})
    assert "temperature" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=N, messages=[{"role": "user", "content": PROMPT}]
        )
    r = httpx.post(
        f"{server}/v1/messages",
        json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
        headers={"x-api-key": KEY},
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    rebound = httpx.post(
        f"{server}/v1/messages", json={}, headers={"x-api-key": KEY, "Host": "evil.example"}
    )
    assert rebound.status_code == 403 and rebound.json()["error"]["type"] == "permission_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        _ask(ant, messages=[{"role": "user", "content": [image]}])
    assert "image" in exc.value.body["error"]["message"]


# --- all three at once -------------------------------------------------------------------


def test_mixed_load_of_three_dialects_completes_with_greedy_texts(
    oai: openai.OpenAI, oll: ollama.Client, ant: anthropic.Anthropic, server: str, greedy: str
) -> None:
    texts: dict[str, list[str]] = {"openai": [], "ollama": [], "anthropic": []}
    messages = [{"role": "user", "content": PROMPT}]

    def openai_one() -> None:
        stream = oai.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=N, stream=True
        )
        texts["openai"].append(
            "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        )

    def ollama_one() -> None:
        parts = oll.chat(model=MODEL, messages=messages, options=GREEDY, stream=True)
        texts["ollama"].append("".join(p.message.content for p in parts))

    def anthropic_one() -> None:
        with ant.messages.stream(
            model=MODEL, max_tokens=N, messages=messages, extra_body=GREEDY_ANTHROPIC
        ) as s:
            texts["anthropic"].append("".join(s.text_stream))

    threads = [
        threading.Thread(target=fn)
        for fn, n in ((openai_one, 8), (ollama_one, 4), (anthropic_one, 4))
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert texts == {"openai": [greedy] * 8, "ollama": [greedy] * 4, "anthropic": [greedy] * 4}
    # Nothing is left pinned or open (the stats' snapshot may lag the last finish).
    deadline = time.monotonic() + 10
    while (s := _stats(server))["cache_pinned"] or s["open_requests"] or s["requests"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)


def test_stats_name_each_requests_dialect(ant: anthropic.Anthropic, server: str) -> None:
    """A long Anthropic stream, held open: /v1/stats lists it with its dialect."""
    with ant.messages.stream(
        model=MODEL,
        max_tokens=4000,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={"ignore_eos": True},  # runs far longer than the test waits
    ) as stream:
        next(iter(stream))
        deadline = time.monotonic() + 20
        while not any(r["dialect"] == "anthropic" for r in _stats(server)["requests"]):
            assert time.monotonic() < deadline, _stats(server)
            time.sleep(0.05)
    # Leaving the block closed the stream: the request is aborted and goes.
    deadline = time.monotonic() + 10
    while _stats(server)["requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
