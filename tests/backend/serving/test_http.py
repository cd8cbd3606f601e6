"""`bevy serve`: the official OpenAI client against a real server process on the tiny MoE."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.serve import bevy as _bevy
from tests.helpers.serve import serving
from tests.helpers.tools import CLOCK, WEATHER

KEY = "test-key"
MODEL = "tiny-moe"  # the name of the tiny_chat_moe folder
PROMPT = "Name three rivers."
N_TOKENS = 8
LONG = {"max_tokens": 4000, "ignore_eos": True}  # runs far longer than any test waits


@pytest.fixture(scope="module")
def reference(tiny_chat_moe: Path) -> subprocess.Popen:
    """`bevy generate` at temperature 0, started early: it runs while the server loads."""
    return _bevy(
        "generate",
        "--model",
        str(tiny_chat_moe),
        "--temperature",
        "0",
        "--max-tokens",
        str(N_TOKENS),
        PROMPT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def server(
    tiny_chat_moe: Path, reference: subprocess.Popen, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("serve")
    with serving(tiny_chat_moe, logs, "--api-key", KEY, "--cache", "0.5") as url:
        yield url


@pytest.fixture(scope="module")
def greedy_text(reference: subprocess.Popen) -> str:
    stdout, stderr = reference.communicate(timeout=120)
    assert reference.returncode == 0, stderr
    assert stdout.endswith("\n")
    return stdout[:-1]  # generate ends the reply with a newline


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, **kw):
    messages = [{"role": "user", "content": PROMPT}]
    defaults = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": N_TOKENS}
    return client.chat.completions.create(**{**defaults, **kw})


def _stats(server: str) -> dict:
    r = httpx.get(f"{server}/v1/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def test_models_and_health(client: openai.OpenAI, server: str, tiny_chat_moe: Path) -> None:
    assert [m.id for m in client.models.list().data] == [tiny_chat_moe.name] == [MODEL]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"  # no key needed


def test_chat_matches_bevy_generate(client: openai.OpenAI, greedy_text: str) -> None:
    reply = _chat(client)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == greedy_text
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= N_TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_with_usage(client: openai.OpenAI, greedy_text: str) -> None:
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert not chunks[-1].choices and 0 < chunks[-1].usage.completion_tokens <= N_TOKENS


def test_sixteen_concurrent_streams_get_the_greedy_reply(
    client: openai.OpenAI, greedy_text: str
) -> None:
    texts: list[str] = []

    def one() -> None:
        stream = _chat(client, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts == [greedy_text] * 16


def test_completions_raw_prompt_stream_and_stop(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "prompt": "The river", "max_tokens": N_TOKENS, "temperature": 0}
    done = client.completions.create(**args)
    text = done.choices[0].text
    assert done.object == "text_completion" and len(text) >= 6
    assert done.usage.prompt_tokens == 2  # "The river": no chat template around it
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert streamed == text
    stop = text[3:6]
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_api_key_is_required(server: str) -> None:
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        wrong.models.list()
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    for path in ("/v1/stats", "/metrics"):
        r = httpx.get(f"{server}{path}")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_bad_requests_get_clear_4xx_errors(client: openai.OpenAI, server: str) -> None:
    r = httpx.post(
        f"{server}/v1/chat/completions",
        content=b'{"messages": [',
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as exc:
        _chat(client, model="gpt-4o")
    assert exc.value.code == "model_not_found" and "gpt-4o" in exc.value.message
    # The one model also answers to "default" and its id in another case.
    for alias in ("default", MODEL.upper()):
        assert _chat(client, model=alias, max_tokens=1).choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, max_tokens=-5)
    assert exc.value.param == "max_tokens" and "max_tokens must be >= 1" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, messages=[{"role": "user", "content": "river " * 9000}])
    assert exc.value.code == "context_length_exceeded" and "context is 8192" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:  # refused before it is tokenized
        _chat(client, messages=[{"role": "user", "content": "river " * 400_000}])
    assert exc.value.code == "context_length_exceeded" and "characters" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, n=2)
    assert exc.value.param == "n"
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, tools=[tool], tool_choice={"type": "function", "function": {"name": "rm"}})
    assert exc.value.param == "tool_choice" and "'rm'" in exc.value.message


@pytest.mark.parametrize(
    "extra, status, needle",
    [
        ({"max_tokens": "10"}, 400, "max_tokens"),
        ({"max_tokens": True}, 400, "max_tokens"),
        ({"stream": "yes"}, 400, "stream"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'wizard' is not one of"),
        ({"messages": [{"role": "user", "content": "\ud800 hi"}]}, 400, "unpaired surrogate"),
        ({"stop": ["x" * 5000]}, 400, "at most 4096 characters"),
        ({"stop": ["s"] * 17}, 400, "at most 16 strings"),
    ],
)
def test_malformed_fields_are_400s_that_say_why(server: str, extra, status, needle) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, **extra}
    r = httpx.post(  # json.dumps escapes a lone surrogate as \\ud800, as clients send it
        f"{server}/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_pathological_bodies_and_hostile_pages_are_refused(server: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{server}/v1/chat/completions", content=deep, headers=auth, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.text

    def upload():  # 40 MiB without a Content-Length: past the 32 MiB limit
        for _ in range(40):
            yield b" " * (1 << 20)

    r = httpx.post(f"{server}/v1/chat/completions", content=upload(), headers=auth, timeout=60)
    assert r.status_code == 413
    rebound = {**auth, "Host": "attacker.example"}
    r = httpx.post(f"{server}/v1/chat/completions", json={}, headers=rebound, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    page = {"Origin": "http://evil.example", "Content-Type": "text/plain"}  # no key, no preflight
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{}", headers=page, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    lower = {"Authorization": f"bearer {KEY}"}
    assert httpx.get(f"{server}/v1/models", headers=lower, timeout=30).status_code == 200
    assert httpx.get(f"{server}/health", timeout=30).json()["status"] == "ok"


def test_negative_seed_means_random_as_in_llama_cpp(client: openai.OpenAI) -> None:
    reply = _chat(client, seed=-1, temperature=0.8)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_disconnect_mid_stream_aborts_and_releases_pins(server: str) -> None:
    aborted = _stats(server)["api"]["aborted"]
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, **LONG}
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        rid = json.loads(next(lines)[6:])["id"]
        for _ in range(3):
            next(lines)
        stats = _stats(server)
        deadline = time.monotonic() + 5
        while not stats["requests"] and time.monotonic() < deadline:  # the next snapshot
            time.sleep(0.05)
            stats = _stats(server)
        # The count and the list come from one snapshot: they agree.
        assert stats["active_requests"] == len(stats["requests"]) == 1
        assert stats["open_requests"] == 1
    # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + 10
    while True:
        s = _stats(server)
        if (
            s["api"]["aborted"] == aborted + 1
            and s["active_requests"] == s["open_requests"] == 0
            and s["cache_pinned"] == 0
            and s["requests"] == []
        ):
            break
        assert time.monotonic() < deadline, f"request {rid} still holds the engine: {s}"
        time.sleep(0.1)
    assert s["api"]["completion_tokens"] < 1000  # it was cut short, not run to the end


def test_stats_show_each_request_layer_and_metrics_are_prometheus(server: str) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, **LONG}
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        rid = json.loads(next(lines)[6:])["id"]
        deadline = time.monotonic() + 10
        while not any(q["id"] == rid and q["tokens"] > 0 for q in _stats(server)["requests"]):
            assert time.monotonic() < deadline
            next(lines)
        stats = _stats(server)
        mine = next(q for q in stats["requests"] if q["id"] == rid)
        assert 0 <= mine["layer"] < mine["n_layers"] and mine["session"] == "api"
        mem = stats["memory_mib"]  # what the engine holds, against its cache budget
        assert mem["cache_slots"] + mem["working_set"] <= mem["cache_budget"]
        assert mem["kv"] > 0 and mem["rss"] > mem["dense_weights"] > 0
        assert mem["device"] == 0  # no accelerator pool on the CPU
        # Half a cache of a tiny model: what fits was read as the server started.
        assert stats["warm_up_left"] == 0
    metrics = httpx.get(f"{server}/metrics", headers=headers).text
    names = ("cache_hit_rate", "both_busy_ratio", "tokens_per_second", "cache_pinned_slots")
    more = ("resident_memory_bytes", "cache_budget_bytes", "kv_cache_bytes", "warm_up_experts_left")
    for name in (*names, *more):
        assert f"# TYPE bevy_{name} gauge\nbevy_{name} " in metrics
    assert 'bevy_api_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics


def test_embedded_server_answers_429_when_the_queue_is_full(tiny_chat_moe: Path) -> None:
    """The app's path: start_server on its own EngineService, on a free port."""
    from backend.config import EngineConfig
    from backend.serving.http import start_server
    from backend.serving.service import EngineService

    service = EngineService.open(tiny_chat_moe, EngineConfig(cache="0.5"))
    handle = start_server(service, port=0, max_queue=1)
    try:
        assert handle.port != 0 and handle.url.startswith("http://127.0.0.1:")
        # The queue's one place is taken by a long request submitted on the service itself
        # (the app's own sessions share it); the API must then answer 429.
        from backend.config import SamplingParams
        from backend.messages import Submit

        body = {"messages": [{"role": "user", "content": PROMPT}], "stream": False, **LONG}
        url = f"{handle.url}/v1/chat/completions"
        long = Submit("app-1", SamplingParams(**LONG), messages=body["messages"])
        service.submit(long, lambda ev: None)
        with httpx.Client(timeout=60) as http:
            assert service.active == 1
            busy = http.post(url, json=body)
            assert busy.status_code == 429
            assert busy.json()["error"]["code"] == "rate_limit_exceeded"
            service.abort("app-1")
            deadline = time.monotonic() + 10
            while service.active:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            ok = http.post(url, json={**body, "stream": False, "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        handle.stop()
        service.close()
    assert not handle.running


# Five shapes OpenAI clients ask for; every string and array is bounded, so the tiny random
# model's reply ends by the grammar, not by max_tokens.
SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "required": ["city"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    },
    "bounded arrays": {
        "type": "object",
        "properties": {
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["days"],
        "additionalProperties": False,
    },
    "number ranges": {
        "type": "object",
        "properties": {
            "t": {"type": "integer", "minimum": -40, "maximum": 50},
            "p": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["t", "p"],
        "additionalProperties": False,
    },
    "required fields": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_response_format_json_schema_output_validates(client: openai.OpenAI, name: str) -> None:
    import jsonschema

    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply in JSON."}],
        max_tokens=200,
        temperature=0.7,
        seed=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name.replace(" ", "_"), "schema": schema, "strict": True},
        },
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_and_completion_grammars(client: openai.OpenAI, server: str) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please."}],
        max_tokens=300,
        response_format={"type": "json_object"},
    )
    content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert content.startswith("{")
    if finish == "stop":  # an open object can grow until max_tokens ends it
        assert isinstance(json.loads(content), dict)
    # llama.cpp's extensions on /v1/completions: a GBNF grammar and a JSON schema.
    text = (
        client.completions.create(
            model=MODEL,
            prompt="Answer:",
            max_tokens=20,
            extra_body={"grammar": 'root ::= ("yes" | "no") "."'},
        )
        .choices[0]
        .text
    )
    assert text in ("yes.", "no.")
    text = (
        client.completions.create(
            model=MODEL,
            prompt="Answer:",
            max_tokens=40,
            extra_body={"json_schema": SCHEMAS["enums"]},
        )
        .choices[0]
        .text
    )
    assert json.loads(text)["unit"] in ("celsius", "fahrenheit")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        )
    assert exc.value.param == "response_format"
    r = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "x", "max_tokens": 4, "grammar": "root ::= ("},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and "invalid gbnf grammar" in r.json()["error"]["message"]


def test_weather_tool_round_trip(client: openai.OpenAI) -> None:
    """tool_choice "required" -> a call whose arguments fit the tool's schema -> the tool's
    result sent back (assistant message with content None, then role "tool") -> a text
    answer. The tiny model is random: what it says is not checked, only the protocol."""
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=8
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(final.choices[0].message.content, str)
    assert not final.choices[0].message.tool_calls


def test_streamed_tool_call_deltas_reassemble_to_the_call(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            pieces += 1
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.id:  # the id and name come once, with the call's first delta
                assert "id" not in c and c["name"] == "" and tc.function.name
                c["id"] = tc.id
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert pieces > 2  # the arguments streamed in fragments, not in one piece
    assert {i: (c["name"], c["arguments"]) for i, c in calls.items()} == {
        0: (whole.function.name, whole.function.arguments)
    }


def test_a_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0.9,
        seed=5,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_context_overflow_extension_leaves_old_turns_out(client: openai.OpenAI) -> None:
    turn = "river " * 1500
    history = []
    for i in range(6):
        history += [
            {"role": "user", "content": f"{i} {turn}"},
            {"role": "assistant", "content": "ok"},
        ]
    history.append({"role": "user", "content": "and now?"})
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, messages=history)
    assert exc.value.code == "context_length_exceeded"  # OpenAI's behaviour by default
    r = _chat(client, messages=history, extra_body={"context_overflow": "rolling"})
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens < 8192


def test_a_chat_ending_in_a_reply_is_continued_as_llama_cpp_and_vllm_do(
    client: openai.OpenAI,
) -> None:
    question = [{"role": "user", "content": PROMPT}]
    partial = [*question, {"role": "assistant", "content": "Rivers: the"}]
    fresh = _chat(client, messages=question).usage.prompt_tokens
    continued = _chat(client, messages=partial)  # the reply goes on inside its turn
    closed = _chat(client, messages=partial, extra_body={"continue_final_message": False})
    # The continued prompt is the open turn and the reply's text; closing it and opening
    # another turn takes more tokens.
    assert fresh < continued.usage.prompt_tokens < closed.usage.prompt_tokens
    assert continued.choices[0].message.content
    explicit = _chat(
        client,
        messages=partial,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert explicit.usage.prompt_tokens == continued.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        _chat(
            client,
            messages=partial,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )
    with pytest.raises(openai.BadRequestError, match="only a reply with text"):
        _chat(client, messages=question, extra_body={"continue_final_message": True})
