"""render_chat must print exactly what transformers' apply_chat_template prints, inside the sandbox."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from jinja2.exceptions import SecurityError

from backend.text import chat_template
from backend.text.chat_template import DEFAULT_TEMPLATE, render_chat

MESSAGES = [
    {"role": "user", "content": "Hi! Wie geht's? 你好 🦫"},
    {"role": "assistant", "content": "Fine."},
    {"role": "user", "content": "Line one\nline two"},
]
SYSTEM = [{"role": "system", "content": "Answer in one word."}, *MESSAGES]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city (°C)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,  # as OpenAI-style clients send it beside tool calls
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "name": "get_weather", "content": '{"temp": 21, "sky": "☀"}'},
    {"role": "tool", "name": "get_weather", "content": '{"humidity": 40}'},
]

# A Qwen2.5-style template written for this test: tools via tojson (also with indent), tool calls,
# grouped tool responses, loop controls and namespace().
QWEN_STYLE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\nFirst tool, pretty:\\n' + tools[0].function.parameters | tojson(indent=2) }}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(seen_tool=false) %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}
{%- if loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- set ns.seen_tool = true %}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is defined %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls | default([]) %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
{%- if ns.seen_tool %}{{ '' }}{% endif %}
"""


@pytest.fixture(scope="module")
def smollm_template(smollm2_gguf: Path) -> str:
    return gguf.GGUFReader(smollm2_gguf).fields["tokenizer.chat_template"].contents()


@pytest.fixture(scope="module")
def oracle():
    """A transformers tokenizer, only for its apply_chat_template (the tokens do not matter)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(BPE()), bos_token="<s>", eos_token="</s>"
    )


def _expected(oracle, template: str, messages: list[dict], **kwargs) -> str:
    return oracle.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


@pytest.mark.parametrize("messages", [MESSAGES, SYSTEM], ids=["no-system", "system"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(
    smollm_template, oracle, messages, generation_prompt
) -> None:
    expected = _expected(oracle, smollm_template, messages, add_generation_prompt=generation_prompt)
    rendered = render_chat(smollm_template, messages, add_generation_prompt=generation_prompt)
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n") == generation_prompt


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_tool_template_matches_transformers(oracle, tools) -> None:
    expected = _expected(oracle, QWEN_STYLE, TOOL_CHAT, tools=tools, add_generation_prompt=True)
    rendered = render_chat(QWEN_STYLE, TOOL_CHAT, tools=tools)
    assert rendered == expected
    assert ('"description": "e.g. Zürich"' in rendered) == (tools is not None)  # ensure_ascii off
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in rendered
    assert "None" not in rendered  # the None content was dropped, not printed


def test_special_tokens_and_extra_variables(oracle) -> None:
    template = "{{ bos_token }}{{ greeting }}{% if enable_thinking is false %}/no_think{% endif %}"
    template += "{{ eos_token }}{{ tools is none }}{{ documents is none }}"
    kwargs = {"greeting": "hey", "enable_thinking": False}
    expected = _expected(oracle, template, MESSAGES, **kwargs)
    assert render_chat(template, MESSAGES, bos_token="<s>", eos_token="</s>", **kwargs) == expected


def test_default_template_is_chatml(oracle) -> None:
    assert render_chat(DEFAULT_TEMPLATE, SYSTEM) == _expected(
        oracle, DEFAULT_TEMPLATE, SYSTEM, add_generation_prompt=True
    )
    assert render_chat(DEFAULT_TEMPLATE, [{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_reasoning_is_visible_under_every_name() -> None:
    template = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}"
    messages = [{"role": "assistant", "reasoning": "hmm", "content": "ok"}]
    assert render_chat(template, messages) == "hmm|hmm;"


def test_raise_exception_becomes_value_error() -> None:
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}"
    with pytest.raises(ValueError, match="^chat template error: need a system turn$"):
        render_chat(template, MESSAGES)


def test_syntax_error_becomes_value_error() -> None:
    with pytest.raises(ValueError, match="chat template error: "):
        render_chat("{% for m in messages %}", MESSAGES)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
        "{{ messages.append(1) }}",  # the sandbox is immutable too
    ],
)
def test_sandbox_blocks_escapes(template: str) -> None:
    with pytest.raises(ValueError, match="chat template error") as info:
        render_chat(template, MESSAGES)
    assert isinstance(info.value.__cause__, SecurityError)


def test_templates_are_compiled_once() -> None:
    template = "{{ messages | length }} cached"
    render_chat(template, MESSAGES)
    before = chat_template._compile.cache_info()
    assert render_chat(template, MESSAGES) == "3 cached"
    after = chat_template._compile.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)


def test_strftime_now_is_available() -> None:
    assert render_chat("{{ strftime_now('%Y') | length }}", []) == "4"
