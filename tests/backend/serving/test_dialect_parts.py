"""A reply read into dialect-neutral parts, and those parts as Anthropic's events and
Ollama's requests as OpenAI's. The replies are scripted at the model boundary: token
events fed to a Call as the engine would send them, a character at a time."""

from __future__ import annotations

import asyncio
import json

import pytest

from backend.messages import Finished, TokenEvent
from backend.serving import anthropic_api
from backend.serving.api_errors import ApiError
from backend.serving.calls import (
    Call,
    CallArgs,
    CallDone,
    CallDropped,
    CallOpen,
    Done,
    Text,
    chat_parts,
)
from backend.serving.ollama_schema import ChatRequest


def _run(reply: str | list[str], tool_format: str | None, render=None) -> list:
    """The parts (or what ``render`` makes of the call) of ``reply``, streamed a
    character at a time (or in the given pieces, as multi-character tokens)."""

    async def main() -> list:
        call = Call(None, "r1", asyncio.get_running_loop(), "openai", [1, 2, 3])  # type: ignore[arg-type]
        for piece in reply:
            call.listener(TokenEvent("r1", 0, piece))
        text = "".join(reply)
        call.listener(Finished("r1", "stop", text, 3, len(reply)))
        await asyncio.sleep(0)
        source = render(call) if render else chat_parts(call, tool_format)
        return [p async for p in source]

    return asyncio.run(main())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_a_streamed_call_opens_sends_its_arguments_in_pieces_and_closes() -> None:
    parts = _run("Let me check. " + CALL, "hermes")
    text = "".join(p.text for p in parts if isinstance(p, Text))
    assert text.strip() == "Let me check."
    (opened,) = [p for p in parts if isinstance(p, CallOpen)]
    (done,) = [p for p in parts if isinstance(p, CallDone)]
    fragments = [p.fragment for p in parts if isinstance(p, CallArgs)]
    assert opened.name == "get_weather" and opened.index == done.index == 0
    assert done.streamed and done.call.id == opened.id and len(fragments) > 1
    assert json.loads("".join(fragments)) == {"city": "Oslo"} == json.loads(done.call.arguments)
    assert parts.index(opened) < parts.index(done)
    end = parts[-1]
    assert isinstance(end, Done) and (end.opened, end.calls) == (1, 1)


def test_a_malformed_call_is_dropped_and_the_next_takes_the_next_index() -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    parts = _run(broken + CALL, "hermes")
    kinds = [type(p).__name__ for p in parts]
    assert "CallDropped" in kinds
    (dropped,) = [p for p in parts if isinstance(p, CallDropped)]
    (done,) = [p for p in parts if isinstance(p, CallDone)]
    assert dropped.index == 0 and done.index == 1
    assert "".join(p.text for p in parts if isinstance(p, Text)) == broken  # its text stays
    assert (parts[-1].opened, parts[-1].calls) == (2, 1)


def test_anthropic_events_pair_every_block_and_end_with_the_stop_reason() -> None:
    class Counting:  # the ApiServer's token counting, all _events needs of it
        counted: list[Finished] = []

        def count(self, fin: Finished) -> None:
            self.counted.append(fin)

    api = Counting()
    events = _run(
        "Checking. " + CALL + " Done.",
        "hermes",
        lambda call: anthropic_api._events(api, call, "m", "hermes", 100),
    )
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}
    started = [e for e in events if e["type"] == "content_block_start"]
    stopped = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert [e["content_block"]["type"] for e in started] == ["text", "tool_use", "text"]
    assert [e["index"] for e in started] == stopped == [0, 1, 2]
    for e in events:  # every delta belongs to the block open at the time
        if e["type"] == "content_block_delta":
            open_now = max(s["index"] for s in started if events.index(s) < events.index(e))
            assert e["index"] == open_now
    arguments = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(arguments) == {"city": "Oslo"}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert len(api.counted) == 1


def test_text_after_a_call_in_the_same_token_comes_after_the_call() -> None:
    """A token that closes a streaming call and starts the text after it: the call's
    last arguments and its end come first (Anthropic's tool block must close after its
    last input_json_delta, not before)."""
    pieces = [
        "<tool_call>",
        '\n{"name": "get_weather", "arguments": {"city": "Pa',
        'ris"}}\n</tool_call>\nok',
    ]
    parts = _run(pieces, "hermes")
    kinds = [type(p).__name__ for p in parts]
    assert kinds.index("CallDone") < kinds.index("Text")
    fragments = "".join(p.fragment for p in parts if isinstance(p, CallArgs))
    assert json.loads(fragments) == {"city": "Paris"}

    class Counting:
        def count(self, fin: Finished) -> None:
            pass

    events = _run(
        pieces, "hermes", lambda call: anthropic_api._events(Counting(), call, "m", "hermes", 100)
    )
    tool_deltas = [
        e["index"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert set(tool_deltas) == {0}  # all in the tool block, which is block 0
    stop_tool = next(i for i, e in enumerate(events) if e["type"] == "content_block_stop")
    last_delta = max(
        i for i, e in enumerate(events) if e.get("delta", {}).get("type") == "input_json_delta"
    )
    assert last_delta < stop_tool


def test_anthropic_stop_reasons() -> None:
    fin = Finished("r", "length", "", 3, 5)
    assert anthropic_api.stop_reason(fin, 0, 5) == "max_tokens"
    assert anthropic_api.stop_reason(fin, 0, 50) == "model_context_window_exceeded"
    assert anthropic_api.stop_reason(Finished("r", "stop", "", 3, 5), 0, 9) == "end_turn"
    stopped = Finished("r", "stop", "", 3, 5, stop_sequence="###")
    assert anthropic_api.stop_reason(stopped, 0, 9) == "stop_sequence"
    assert anthropic_api.stop_reason(stopped, 1, 9) == "tool_use"


def test_anthropic_blocks_become_openai_messages_in_order() -> None:
    body = anthropic_api.MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "x"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "21 C"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": "no",
                            "is_error": True,
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            "tools": [{"name": "w", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "w", "disable_parallel_tool_use": True},
        }
    )
    chat = body.chat()
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assert chat.messages[2]["tool_calls"][0]["function"] == {
        "name": "w",
        "arguments": {"city": "Oslo"},
    }
    assert chat.messages[2]["content"] == "Checking."
    assert chat.messages[4]["content"] == "Error: no" and chat.messages[4]["tool_call_id"] == "t2"
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.parallel_tool_calls is False and chat.max_tokens == 10
    with pytest.raises(ApiError, match="Anthropic's own tools"):
        anthropic_api.MessagesRequest.model_validate(
            {**body.model_dump(), "tools": [{"type": "bash_20250124", "name": "bash"}]}
        ).chat()


def test_ollama_options_map_to_sampling_and_refuse_what_is_not_done() -> None:
    body = ChatRequest.model_validate(
        {
            "model": "m:latest",
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Oslo"}}}],
                },
                {"role": "tool", "tool_name": "w", "content": "21 C"},
            ],
            "format": "json",
            "options": {
                "temperature": 0,
                "repeat_penalty": 1.2,
                "num_predict": 16,
                "num_gpu": 99,  # a load option: accepted, left
                "mirostat": 0,  # off: fine
                "stop": ["\n\n"],
            },
        }
    )
    chat, num_ctx = body.openai(4096)
    assert (
        num_ctx == 4096 and chat.max_tokens == 16
    )  # Ollama's default context and chat.repetition_penalty == 1.2
    assert chat.stop == ["\n\n"] and chat.response_format == {"type": "json_object"}
    assert chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert chat.messages[2]["name"] == "w"
    unlimited, ctx = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "options": {"num_predict": -1, "num_ctx": 512},
        }
    ).openai(4096)
    assert unlimited.max_tokens == 4096 and ctx == 512
    for bad in ({"mirostat": 2}, {"typical_p": 0.5}, {"num_predict": 0}, {"num_ctx": "big"}):
        with pytest.raises(ApiError):
            ChatRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": bad}
            ).openai(4096)
    with pytest.raises(ApiError, match="images"):
        ChatRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}
        ).openai(4096)
