"""Tool-call parsing on recorded replies: well-formed and malformed, whole and streamed
(cut at every character), and the grammar that forces a call."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from backend.config import Grammar
from backend.text.grammar import Matcher
from backend.text.tokenizer import Tokenizer
from backend.text.tool_calls import StreamParser, call_grammar, detect_format, parse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

# (format, reply, expected content, expected calls as (name, arguments object))
RECORDED = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "celsius"}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", {"city": "Oslo", "unit": "celsius"})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
        '"arguments": {"x": [1, 2]}}</tool_call>',
        "",
        [("a", {}), ("b", {"x": [1, 2]})],
    ),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", None, []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}', None, []),  # unclosed
    ("hermes", '<tool_call>{"name": "a", "arguments": {x}}</tool_call>', None, []),  # bad JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call> done', None, []),  # no name
    (
        "generic",
        'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": '
        '"celsius"}}\n```\nThat is all.',
        "Sure.\n\nThat is all.",
        [("get_weather", {"city": "Rome", "unit": "celsius"})],
    ),
    ("generic", '```json\n{"just": "data"}\n```', None, []),  # JSON, but not a call
]


@pytest.mark.parametrize("fmt, reply, content, calls", RECORDED)
def test_recorded_replies(fmt: str, reply: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse(reply, fmt)
    assert got_content == (reply if content is None else content)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("fmt, reply, content, calls", RECORDED)
def test_streaming_cut_at_every_character_gives_the_same(fmt, reply, content, calls) -> None:
    whole_content, whole_calls = parse(reply, fmt)
    for cut in range(len(reply) + 1):
        p = StreamParser(fmt)
        shown, got = [], []
        for piece in (reply[:cut], reply[cut:]):
            text, new = p.feed(piece)
            shown.append(text)
            got += new
        text, new = p.finish()
        shown.append(text)
        got += new
        assert "".join(shown) == whole_content, cut
        assert [(c.name, c.arguments) for c in got] == [
            (c.name, c.arguments) for c in whole_calls
        ], cut


def test_text_that_may_start_a_tag_is_held_back_until_it_cannot() -> None:
    p = StreamParser("hermes")
    assert p.feed("a <tool") == ("a ", [])  # could still become <tool_call>
    assert p.feed("box") == ("<toolbox", [])


def test_format_follows_the_template() -> None:
    assert detect_format("{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}") == "hermes"
    assert detect_format("{{ messages }}") == "generic" and detect_format(None) == "generic"


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    meta = {k: f.contents() for k, f in gguf.GGUFReader(smollm2_gguf).fields.items()}
    return Tokenizer.from_gguf_metadata(meta, smollm2_gguf)


@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_the_call_grammar_admits_a_valid_call_only(tok: Tokenizer, fmt: str) -> None:
    other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
    spec = Grammar("lark", call_grammar([WEATHER, other], fmt))
    opening, closing = ("<tool_call>", "</tool_call>") if fmt == "hermes" else ("```json", "```")
    good = f'{opening}\n{{"name": "get_weather", "arguments": {{"city": "Oslo", "unit": "celsius"}}}}\n{closing}'
    m = Matcher(tok, tok.vocab_size, spec)
    for t in tok.encode(good, add_special=False):
        assert m.allowed()[t], tok.decode([t])
        m.accept(t)
    assert m.accepting
    content, calls = parse(good, fmt)
    assert content == "" and calls[0].name == "get_weather"
    bad = f'{opening}\n{{"name": "get_weather", "arguments": {{"town"'
    m = Matcher(tok, tok.vocab_size, spec)
    ids = tok.encode(bad, add_special=False)
    ok = True
    for t in ids:
        if not m.allowed()[t]:
            ok = False
            break
        m.accept(t)
    assert not ok  # "town" is not one of the tool's arguments
