"""The OpenAI tool-call round trip rendered the way each format's templates expect."""

from __future__ import annotations

import json

import pytest

from backend.serving.api_errors import ApiError
from backend.serving.openai_schema import ChatCompletionRequest
from backend.text.chat_template import render_chat
from backend.text.tool_calls import Syntax, parse

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
# A Hermes/Qwen-style template: tools in the system turn, calls and results in tags.
HERMES = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content }}<tools>"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% elif not (tools and m.role == 'system') %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n"
)


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=ROUND_TRIP, tools=[TOOL], **kw)


def test_hermes_templates_get_calls_with_object_arguments() -> None:
    body = request()
    messages = body.chat_messages("hermes")
    assert messages[1]["content"] == "Weather in Oslo?"
    assert messages[2]["content"] == ""  # None would render as "None" or fail
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert ROUND_TRIP[2]["content"] is None  # the request's own messages are untouched
    text = render_chat(HERMES, messages, tools=body.chat_tools("hermes"))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert '<tool_response>\n{"temp": 21}' in text and "<tools>" in text
    # What the template wrote is what the parser reads back.
    call = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert [(c.name, json.loads(c.arguments)) for c in parse(call, "hermes")[1]] == [
        ("get_weather", {"city": "Oslo"})
    ]


def test_generic_templates_get_the_tools_and_calls_as_text() -> None:
    body = request()
    messages = body.chat_messages("generic")
    assert body.chat_tools("generic") is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert "tool_calls" not in messages[2]
    content, calls = parse(messages[2]["content"], "generic")
    assert content == "" and calls[0].name == "get_weather"
    # no tool role in such templates: the result is the user's turn, labelled
    assert messages[3] == {"role": "user", "content": 'Tool result: {"temp": 21}'}
    with_text = ChatCompletionRequest(
        messages=[{**ROUND_TRIP[2], "content": "Checking."}], tools=[TOOL]
    ).chat_messages("generic")
    assert with_text[1]["content"].startswith("Checking.\n```json\n")
    none = request(tool_choice="none")
    assert none.chat_messages("generic")[0]["content"] == "Be brief."  # tools hidden


@pytest.mark.parametrize(
    "choice, param",
    [
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ("always", "tool_choice"),
    ],
)
def test_bad_tool_choices(choice, param: str) -> None:
    with pytest.raises(ApiError) as exc:
        request(tool_choice=choice).params(Syntax("hermes"))
    assert exc.value.param == param


def test_forced_calls_and_response_format_do_not_mix() -> None:
    body = request(tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ApiError, match="not both"):
        body.params(Syntax("hermes"))
    assert request(tool_choice="required").params(Syntax("hermes")).grammar.kind == "lark"
    # auto: free text with calls held to their schema once begun (a lazy grammar), where
    # the format has a call tag of its own; the generic fence is left free
    assert "TAIL" in request().params(Syntax("hermes")).grammar.source
    assert request().params(Syntax("generic")).grammar is None
    assert request().params(Syntax("llama3")).grammar is None  # a bare JSON call: read only
    assert "TAIL" in request().params(Syntax("mistral")).grammar.source
    assert request(tool_choice="none").params(Syntax("hermes")).grammar is None
    assert (
        "(TEXT call)?" in request(parallel_tool_calls=False).params(Syntax("hermes")).grammar.source
    )


@pytest.mark.parametrize(
    "tools, choice, messages, param",
    [
        ([{"type": "function", "function": {"parameters": {}}}], None, None, "tools.0"),
        ([{"type": "function", "function": "get_weather"}], None, None, "tools.0"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, None, "tools.0"),
        ([TOOL], {"type": "function", "function": "get_weather"}, None, "tool_choice"),
        (
            [TOOL],
            None,
            [{"role": "assistant", "content": None, "tool_calls": [None]}],
            "messages.0",
        ),
        ([TOOL], None, [{"role": "assistant", "tool_calls": "call"}], "messages.0"),
    ],
)
def test_malformed_tools_are_400s_naming_the_field(tools, choice, messages, param) -> None:
    body = ChatCompletionRequest(
        messages=messages or [{"role": "user", "content": "hi"}], tools=tools, tool_choice=choice
    )
    with pytest.raises(ApiError) as exc:
        body.params(Syntax("hermes"))
        body.chat_messages("generic")
    assert exc.value.status == 400 and exc.value.param == param
