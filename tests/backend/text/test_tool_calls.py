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
from backend.text.tool_calls import (
    StreamParser,
    Syntax,
    call_grammar,
    detect_format,
    lazy_call_grammar,
    parse,
    tool_syntax,
)
from tests.helpers.tools import WEATHER

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
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"},'
        ' {"name": "noop", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    ),
    (
        "mistral",
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]noop[CALL_ID]'
        "Zz9Yy8Xx7[ARGS]{}",
        "Checking.",
        [("get_weather", {"city": "Lyon"}), ("noop", {})],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}', None, []),  # cut short
    ("mistral", "[TOOL_CALLS]get_weather{}", None, []),  # no [ARGS]
    (
        "llama3",
        '  {"name": "get_weather", "parameters": {"city": "Turin"}}',
        "",
        [("get_weather", {"city": "Turin"})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Bari"}}',
        "",
        [("get_weather", {"city": "Bari"})],
    ),
    ("llama3", "It is {probably} sunny.", None, []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Bari"}} and more', None, []),
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
    assert detect_format("[AVAILABLE_TOOLS]{{ t }}[/AVAILABLE_TOOLS][TOOL_CALLS]") == "mistral"
    assert detect_format("<|start_header_id|>ipython<|python_tag|>") == "llama3"
    assert detect_format("{{ messages }}") == "generic" and detect_format(None) == "generic"


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    _, calls = parse('[TOOL_CALLS][{"name": "a", "arguments": {}}]', "mistral")
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    _, calls = parse('[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abcDEF123"}]', "mistral")
    assert calls[0].id == "abcDEF123"


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    meta = {k: f.contents() for k, f in gguf.GGUFReader(smollm2_gguf).fields.items()}
    return Tokenizer.from_gguf_metadata(meta, smollm2_gguf)


@pytest.mark.parametrize("fmt", ["hermes", "generic", "llama3"])
def test_the_call_grammar_admits_a_valid_call_only(tok: Tokenizer, fmt: str) -> None:
    other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
    spec = Grammar("lark", call_grammar([WEATHER, other], Syntax(fmt)))
    opening, closing = {
        "hermes": ("<tool_call>\n", "\n</tool_call>"),
        "generic": ("```json\n", "\n```"),
    }.get(fmt, ("", ""))
    key = "parameters" if fmt == "llama3" else "arguments"
    good = f'{opening}{{"name": "get_weather", "{key}": {{"city": "Oslo", "unit": "celsius"}}}}{closing}'
    m = Matcher(tok, tok.vocab_size, spec)
    for t in tok.encode(good, add_special=False):
        assert m.allowed()[t], tok.decode([t])
        m.accept(t)
    assert m.accepting
    content, calls = parse(good, fmt)
    assert content == "" and calls[0].name == "get_weather"
    bad = f'{opening}{{"name": "get_weather", "{key}": {{"town"'
    m = Matcher(tok, tok.vocab_size, spec)
    ids = tok.encode(bad, add_special=False)
    ok = True
    for t in ids:
        if not m.allowed()[t]:
            ok = False
            break
        m.accept(t)
    assert not ok  # "town" is not one of the tool's arguments


def _consume(m: Matcher, tok: Tokenizer, text: str) -> bool:
    """Feed ``text``; False at the first token the grammar refuses."""
    for t in tok.encode(text, add_special=False):
        if not m.allowed()[t]:
            return False
        m.accept(t)
    return True


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


def test_the_lazy_grammar_leaves_text_free_and_holds_calls_once_begun(tok: Tokenizer) -> None:
    spec = Grammar("lark", lazy_call_grammar([WEATHER], Syntax("hermes")))
    eos = next(iter(tok.eos_ids))
    for text in ["No call needed here.", f"Checking. {CALL}", f"{CALL} and {CALL} done."]:
        m = Matcher(tok, tok.vocab_size, spec)
        assert _consume(m, tok, text), text
        assert m.allowed()[eos], text  # the reply may end here
    m = Matcher(tok, tok.vocab_size, spec)
    assert not _consume(m, tok, 'Sure <tool_call>\n{"name": "rm", ')  # not a tool
    single = Grammar("lark", lazy_call_grammar([WEATHER], Syntax("hermes"), parallel=False))
    m = Matcher(tok, tok.vocab_size, single)
    assert _consume(m, tok, f"{CALL} then ")
    assert not _consume(m, tok, CALL)  # a second call is refused


@pytest.fixture(scope="module")
def special_tok(smollm2_gguf: Path) -> Tokenizer:
    """SmolLM2's tokenizer with the call tags as special tokens, as Mistral's and some
    Hermes models' tokenizers hold them: each is one token, never the bytes of its text."""
    from tokenizers import AddedToken

    meta = {k: f.contents() for k, f in gguf.GGUFReader(smollm2_gguf).fields.items()}
    base = Tokenizer.from_gguf_metadata(meta, smollm2_gguf)
    tags = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
    base.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    return Tokenizer(
        base.backend,
        bos_id=base.bos_id,
        eos_ids=base.eos_ids,
        add_bos=False,
        chat_template=base.chat_template,
    )


def _run(m: Matcher, ids: list[int]) -> bool:
    """Feed ``ids``; False at the first token the grammar refuses."""
    for t in ids:
        if not m.allowed()[t]:
            return False
        m.accept(t)
    return True


HERMES_T = "{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}"
MISTRAL_T = "[AVAILABLE_TOOLS]{{ t }}[/AVAILABLE_TOOLS][TOOL_CALLS]"
MISTRAL_NAMED_T = MISTRAL_T + "{{ c.name }}[ARGS]{{ c.arguments }}"


def test_the_syntax_names_the_tags_a_tokenizer_holds_as_special_tokens(
    tok: Tokenizer, special_tok: Tokenizer
) -> None:
    plain = tool_syntax(HERMES_T, tok.special_id)
    assert plain.fmt == "hermes" and plain.special == {}
    assert plain.literal("<tool_call>") == '"<tool_call>"'
    held = tool_syntax(HERMES_T, special_tok.special_id)
    opening = special_tok.special_id("<tool_call>")
    assert held.special == {"<tool_call>": opening, "</tool_call>": opening + 1}
    assert held.literal("<tool_call>") == f"<[{opening}]>"
    assert special_tok.special_id("hello") is None and tok.special_id("<tool_call>") is None
    assert tool_syntax(MISTRAL_T, special_tok.special_id).named is False
    named = tool_syntax(MISTRAL_NAMED_T, special_tok.special_id)
    assert named.named and set(named.special) == {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"}


def test_a_forced_call_opens_with_the_special_token_not_its_spelling(special_tok) -> None:
    syntax = tool_syntax(HERMES_T, special_tok.special_id)
    spec = Grammar("lark", call_grammar([WEATHER], syntax))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    ids = special_tok.encode(call)
    assert ids[0] == syntax.special["<tool_call>"] and ids[-1] == syntax.special["</tool_call>"]
    m = Matcher(special_tok, special_tok.vocab_size, spec)
    first = m.allowed()
    assert first.nonzero().flatten().tolist() == [ids[0]]  # "<" and friends are refused
    m.accept(ids[0])
    assert _run(m, ids[1:]) and m.done
    assert parse(special_tok.decode(ids), "hermes")[1][0].name == "get_weather"


@pytest.mark.parametrize("template", [MISTRAL_T, MISTRAL_NAMED_T])
@pytest.mark.parametrize("special", [True, False])
def test_a_forced_mistral_call_in_either_form_is_one_valid_call(
    tok: Tokenizer, special_tok: Tokenizer, template: str, special: bool
) -> None:
    t = special_tok if special else tok
    syntax = tool_syntax(template, t.special_id)
    spec = Grammar("lark", call_grammar([WEATHER], syntax))
    if syntax.named:
        good = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "celsius"}'
        bad = '[TOOL_CALLS]get_weather[ARGS]{"town"'
    else:
        good = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}, "id": "a1B2c3D4e"}]'
        bad = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, {"name"'
    m = Matcher(t, t.vocab_size, spec)
    assert _run(m, t.encode(good)) and m.done
    content, calls = parse(t.decode(t.encode(good)), "mistral")
    assert content == "" and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] == "Oslo"
    assert len(calls[0].id) == 9
    assert not _run(Matcher(t, t.vocab_size, spec), t.encode(bad))  # forced: exactly one


@pytest.mark.parametrize(
    "template, call",
    [
        (
            HERMES_T,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
        ),
        (
            MISTRAL_T,
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
        ),
        (MISTRAL_NAMED_T, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "celsius"}'),
    ],
)
@pytest.mark.parametrize("special", [True, False])
def test_a_lazy_grammar_triggers_on_the_tag_as_the_model_writes_it(
    tok: Tokenizer, special_tok: Tokenizer, template: str, call: str, special: bool
) -> None:
    t = special_tok if special else tok
    syntax = tool_syntax(template, t.special_id)
    assert bool(syntax.special) == special
    spec = Grammar("lark", lazy_call_grammar([WEATHER], syntax))
    eos = next(iter(t.eos_ids))
    m = Matcher(t, t.vocab_size, spec)
    assert _run(m, t.encode("No call needed, 2 < 3 [sic].")) and m.allowed()[eos]
    m = Matcher(t, t.vocab_size, spec)
    assert _run(m, t.encode(f"Let me look. {call}"))
    assert m.allowed()[eos] or m.done
    content, calls = parse(t.decode(t.encode(f"Let me look. {call}")), syntax.fmt)
    assert content.strip() == "Let me look." and calls[0].name == "get_weather"
    opening = call[: call.index("get_weather") if syntax.named else call.index("{")]
    m = Matcher(t, t.vocab_size, spec)
    assert not _run(m, t.encode(f'Sure {opening}{{"name": "rm"'))


@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_a_call_streams_its_name_then_arguments_that_add_up_to_the_call(fmt: str) -> None:
    opening, closing = ("<tool_call>", "</tool_call>") if fmt == "hermes" else ("```json", "```")
    reply = (
        f'Looking. {opening}\n{{"name": "get_weather", "arguments": {{"city": "Oslo", '
        f'"when": {{"day": "mon", "hours": [9, 12]}}}}}}\n{closing} Done.'
    )
    p = StreamParser(fmt)
    seen: list[tuple[str, str, str]] = []
    calls = []
    for ch in reply:  # one character at a time, as the worst case of tokens
        calls += p.feed(ch)[1]
        if (part := p.partial()) is not None:
            seen.append(part)
    calls += p.finish()[1]
    (call,) = calls
    assert seen and {(i, n) for i, n, _ in seen} == {(call.id, "get_weather")}
    fragments = [a for _, _, a in seen]
    assert all(b.startswith(a) for a, b in zip(fragments, fragments[1:], strict=False))
    assert call.arguments.startswith(fragments[-1])
    assert json.loads(call.arguments) == {"city": "Oslo", "when": {"day": "mon", "hours": [9, 12]}}
    # the whole reply parses to the same arguments text, as the model wrote it
    assert parse(reply, fmt)[1][0].arguments == call.arguments


def test_a_body_not_written_name_first_comes_whole() -> None:
    p = StreamParser("hermes")
    p.feed('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}')
    assert p.partial() is None
    _, calls = p.feed("\n</tool_call>")
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}


@pytest.mark.parametrize("special", [True, False])
def test_a_mistral_reply_ends_with_its_calls(tok, special_tok, special: bool) -> None:
    t = special_tok if special else tok
    syntax = tool_syntax(MISTRAL_T, t.special_id)
    spec = Grammar("lark", lazy_call_grammar([WEATHER], syntax))
    call = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'
    m = Matcher(t, t.vocab_size, spec)
    assert _run(m, t.encode(call))
    assert m.done or not _run(m, t.encode(" and more"))  # the parser would drop the call
