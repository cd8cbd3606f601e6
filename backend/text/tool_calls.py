"""Tool calls in a model's own words: how a family writes them, and how to read them back.

- ``hermes`` (Hermes, Qwen 2.5/3 and their MoEs): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, chosen when the chat template itself speaks of ``<tool_call>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls with 9-character ids (Nemo,
  Mixtral) or, newer, ``name[ARGS]{...}`` per call (``[CALL_ID]id`` optional);
- ``llama3`` (Llama 3.x): the reply is one JSON object ``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``;
- ``generic``, for templates with no tool syntax: the tools are described in the system
  prompt (``tools_prompt``) and a call is one JSON object in a fenced ``json`` block.

``parse`` reads a finished reply; ``StreamParser`` reads one as it streams, passing text
through at once except what could still be the start of a call, and giving each call when
it closes. Output that looks like a call but is not one (an unclosed tag, invalid JSON, no
name) stays plain content: a reply is never lost to a parse error. ``call_grammar`` is the
Lark grammar that forces a call (``tool_choice`` "required" or a named tool), and
``lazy_call_grammar`` the one that leaves text free but holds a call once it opens; both
follow the model's ``Syntax`` (``tool_syntax``), whose tags may be special tokens.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from backend.text.grammar import JSON_LAYOUT

FORMATS = ("hermes", "mistral", "llama3", "generic")
# Opening and closing text of a call; None: the call runs to the end of the reply.
_TAGS: dict[str, tuple[str, str | None]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]", None),
    "llama3": ("<|python_tag|>", None),
    "generic": ("```json", "```"),
}
_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# A call's body as models write it, name first: once this much is in, the name is known
# and the arguments can stream (``StreamParser.partial``).
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template expects (as llama.cpp picks a chat format)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return "llama3"
    return "generic"


def mistral_id() -> str:
    """A call id as Mistral's templates require: 9 letters and digits."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


@dataclass(frozen=True)
class Syntax:
    """How one model writes tool calls: its format; ``special``, the tags its tokenizer
    holds as single special tokens (tag -> id), which a grammar must name by id, as the
    bytes of their text are a different token sequence; ``named``, Mistral calls written
    ``name[ARGS]{...}`` rather than as a JSON list."""

    fmt: str
    special: Mapping[str, int] = field(default_factory=dict)
    named: bool = False

    def literal(self, text: str) -> str:
        """``text`` as an item of a Lark grammar: its special token, else the string."""
        i = self.special.get(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)


def tool_syntax(chat_template: str | None, special_id: Callable[[str], int | None]) -> Syntax:
    """The call syntax of a model with ``chat_template`` whose tokenizer's
    ``special_id`` gives a special token's id (``Tokenizer.special_id``)."""
    fmt = detect_format(chat_template)
    tags = [t for t in _TAGS[fmt] if t]
    if fmt == "mistral":
        tags += ["[ARGS]", "[CALL_ID]"]
    special = {t: i for t in tags if (i := special_id(t)) is not None}
    return Syntax(fmt, special, fmt == "mistral" and "[ARGS]" in (chat_template or ""))


@dataclass(frozen=True)
class ToolCall:
    name: str
    # The arguments object as JSON text: as the model wrote it for a name-first body (the
    # text that streamed), else re-serialised.
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def text(self) -> str:
        """The call as a model writing the ``generic`` format writes it."""
        opening, closing = _TAGS["generic"]
        body = json.dumps({"name": self.name, "arguments": json.loads(self.arguments)})
        return f"{opening}\n{body}\n{closing}"

    def openai(self, index: int | None = None) -> dict:
        body = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


def _json(text: str) -> object:
    """The one JSON value ``text`` holds (whitespace aside); ValueError otherwise."""
    s = text.strip()
    obj, end = json.JSONDecoder().raw_decode(s)
    if end != len(s):
        raise ValueError("text after the JSON value")
    return obj


def _call(obj: object, make_id=None) -> ToolCall | None:
    """A call from its JSON object ({"name", "arguments" or "parameters"}), or None."""
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    given = obj.get("id")
    if isinstance(given, str) and given:
        return ToolCall(name, arguments, given)
    return ToolCall(name, arguments, make_id()) if make_id else ToolCall(name, arguments)


def _read_call(body: str) -> ToolCall | None:
    """One call's JSON body, or None if it is not a call."""
    try:
        return _call(_json(body))
    except ValueError:
        return None


def _read_mistral(body: str) -> list[ToolCall] | None:
    """What follows ``[TOOL_CALLS]``: a JSON list of calls, or ``name[ARGS]{...}`` calls
    each after its own ``[TOOL_CALLS]``; None if it is neither."""
    s = body.strip()
    try:
        if s.startswith("["):
            items = _json(s)
            calls = [_call(i, mistral_id) for i in items] if isinstance(items, list) else [None]
        else:
            calls = []
            for part in s.split("[TOOL_CALLS]"):
                head, sep, args = part.partition("[ARGS]")
                name, _, given = head.partition("[CALL_ID]")
                obj = {"name": name.strip(), "arguments": _json(args) if sep else None}
                if given.strip():
                    obj["id"] = given.strip()
                calls.append(_call(obj, mistral_id))
    except ValueError:
        return None
    return calls if calls and None not in calls else None


def _read_tail(fmt: str, body: str) -> list[ToolCall] | None:
    """Calls running to the end of the reply (formats without a closing tag)."""
    if fmt == "mistral":
        return _read_mistral(body)
    call = _read_call(body)
    return None if call is None else [call]


def parse(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """A finished reply -> (its content outside the calls, the calls in order)."""
    p = StreamParser(fmt)
    content, calls = p.feed(text)
    more, last = p.finish()
    return content + more, calls + last


class StreamParser:
    """Reads a reply piece by piece: ``feed`` and ``finish`` return (content to show now,
    calls completed now); ``partial`` is the call being written, for streaming its name
    and arguments before it closes."""

    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")
        self.fmt = fmt
        self.open, self.close = _TAGS[fmt]
        self._buf = ""
        self._inside = False
        self._opened = ""  # the opening held with the call (llama3: none, or the tag)
        self._start = True  # nothing but whitespace shown yet
        self._id: str | None = None  # the call being written, once ``partial`` named it

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._start and self.fmt == "llama3":
                # Llama 3 answers a call with a bare JSON object: a reply that begins with
                # "{" is held as one until it ends (leading blanks wait to see which).
                if not self._buf.strip():
                    break
                self._start = False
                if self._buf.lstrip().startswith("{"):
                    self._inside, self._opened = True, ""
            if self._inside and self.close is None:
                break  # a call to the end of the reply: read in ``finish``
            if not self._inside:
                at = self._buf.find(self.open)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.open)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                out.append(self._buf[:at])
                self._buf = self._buf[at:]
                self._inside, self._opened = True, self.open
                if self.close is None:
                    break
            end = self._buf.find(self.close, len(self.open))
            if end < 0:
                break
            raw = self._buf[: end + len(self.close)]
            call = self._closed_call(self._buf[len(self.open) : end])
            if call is None:
                out.append(raw)  # not a call after all: the text stays
            else:
                calls.append(call)
            self._buf = self._buf[end + len(self.close) :]
            self._inside = False
        return "".join(out), calls

    def partial(self) -> tuple[str, str, str] | None:
        """The call being written, as (id, name, arguments so far), once its name is in;
        the arguments are a prefix of the ones the call closes with (whatever could
        still be the end of the body is held back). None outside a call, or for a call
        that is not written name first (it comes whole when it closes)."""
        if not self._inside or self.close is None:
            return None
        body = self._buf[len(self.open) :]
        m = _NAME_FIRST.match(body)
        if m is None:
            return None
        args = body[m.end() :]
        args = args[: len(args) - _partial_suffix(args, self.close)].rstrip(" \t\r\n}")
        if self._id is None:
            self._id = ToolCall("", "").id
        return self._id, json.loads(f'"{m.group(1)}"'), args

    def _closed_call(self, body: str) -> ToolCall | None:
        """The call whose body just closed: arguments as written for a name-first body
        (the ``partial`` id with them), else as ``_read_call`` reads it."""
        given, self._id = self._id, None
        m = _NAME_FIRST.match(body)
        if m is not None:
            rest = body[m.end() :].rstrip()
            if rest.endswith("}"):
                args = rest[:-1].rstrip()
                try:
                    ok = isinstance(_json(args), dict)
                except ValueError:
                    ok = False
                if ok:
                    name = json.loads(f'"{m.group(1)}"')
                    return ToolCall(name, args, given) if given else ToolCall(name, args)
        return _read_call(body)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: a call that runs to the end is read now; anything else held
        back is content (an unclosed call included)."""
        rest, inside = self._buf, self._inside
        self._buf, self._inside = "", False
        if inside and self.close is None:
            calls = _read_tail(self.fmt, rest[len(self._opened) :])
            if calls is not None:
                return "", calls
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def tools_prompt(tools: list[dict]) -> str:
    """The system prompt's description of ``tools`` for templates with no tool syntax."""
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You can call these tools (JSON schemas of their arguments):\n"
        f"{specs}\n"
        "To call one, answer with only a JSON object in a fenced block:\n"
        '```json\n{"name": "<tool name>", "arguments": {<arguments>}}\n```\n'
        "Otherwise answer normally."
    )


def _call_schema(tools: list[dict], key: str = "arguments", call_id: bool = False) -> dict:
    """JSON schema of one call of one of ``tools``: its name and, under ``key``, its
    arguments' schema (with ``call_id``, an optional Mistral ``id`` after them)."""
    choices = []
    for t in tools:
        fn = t.get("function", t)
        props = {"name": {"const": fn["name"]}, key: fn.get("parameters") or {"type": "object"}}
        if call_id:
            props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        choices.append(
            {
                "type": "object",
                "properties": props,
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return {**schema, "x-guidance": JSON_LAYOUT}


def _mistral_calls(tools: list[dict], syntax: Syntax, parallel: bool) -> str:
    """Lark rules ``calls`` for what follows ``[TOOL_CALLS]``: one call, or with
    ``parallel`` one or more, in the model's form of them."""
    if not syntax.named:
        items = _call_schema(tools, call_id=True)
        bounds = {"minItems": 1} if parallel else {"minItems": 1, "maxItems": 1}
        return f"calls: %json {json.dumps({'type': 'array', 'items': items, **bounds})}\n"
    alternatives = " | ".join(
        f"{json.dumps(fn['name'])} {syntax.literal('[ARGS]')} "
        f"%json {json.dumps({**(fn.get('parameters') or {'type': 'object'}), 'x-guidance': JSON_LAYOUT})}"
        for fn in (t.get("function", t) for t in tools)
    )
    more = f" ({syntax.literal('[TOOL_CALLS]')} call)*" if parallel else ""
    return f"calls: call{more}\ncall: {alternatives}\n"


def call_grammar(tools: list[dict], syntax: Syntax) -> str:
    """Lark (llguidance) for exactly one call of one of ``tools`` as the model writes it
    (``tool_syntax``): ``tool_choice`` "required" or a named tool."""
    head = "%llguidance {}\n"
    if syntax.fmt == "llama3":
        return head + f"start: %json {json.dumps(_call_schema(tools, 'parameters'))}\n"
    if syntax.fmt == "mistral":
        opening = syntax.literal("[TOOL_CALLS]")
        return head + f"start: {opening} calls\n" + _mistral_calls(tools, syntax, False)
    opening, closing = _TAGS[syntax.fmt]
    return (
        head
        + f'start: {syntax.literal(opening)} "\\n" call "\\n" {syntax.literal(closing)}\n'
        + f"call: %json {json.dumps(_call_schema(tools))}\n"
    )


def lazy_call_grammar(tools: list[dict], syntax: Syntax, parallel: bool = True) -> str:
    """Lark for free text in which a call, once its opening tag is written, must be a
    valid call of one of ``tools`` (a lazy grammar: the tag is its trigger). Text that
    never opens a call is unconstrained and may end anywhere; with ``parallel`` False, at
    most one call. For Hermes and Mistral, whose calls open with a tag of their own."""
    if syntax.fmt not in ("hermes", "mistral"):
        raise ValueError(f"no lazy call grammar for the {syntax.fmt} format")
    opening, closing = _TAGS[syntax.fmt]
    if syntax.fmt == "mistral":
        body, rules = "calls", _mistral_calls(tools, syntax, parallel)
    else:
        body = "call"
        rules = (
            f'call: "\\n" %json {json.dumps(_call_schema(tools))} "\\n" {syntax.literal(closing)}\n'
        )
    mistral = syntax.fmt == "mistral"
    # Text that never spells the opening tag: the reply may stop anywhere in it.
    free = f"/(.|\\n)*/ & ~/(.|\\n)*{_regex_literal(opening)}(.|\\n)*/"
    if opening in syntax.special:
        # The tag is one special token, which free text (bytes) cannot contain: free text
        # runs up to it, and the token itself is the trigger.
        tag = syntax.literal(opening)
        if mistral:  # Mistral's calls run to the end of the reply: nothing after them
            start = f"start: TEXT? ({tag} {body})?\n"
        else:
            start = f"start: (TEXT? {tag} {body}){'*' if parallel else '?'} TEXT?\n"
        return "%llguidance {}\n" + start + f"TEXT: {free}\n" + rules
    # Text up to and including the first opening tag, which ends it (the tag's text
    # stays in the reply); a token may run on past it into the call.
    tag = _regex_literal(opening)
    if mistral:
        start = f"start: TAIL | TEXT {body}\n"
    else:
        start = f"start: (TEXT {body}){'*' if parallel else '?'} TAIL\n"
    return (
        "%llguidance {}\n"
        + start
        + f"TEXT: /(.|\\n)*{tag}/ & ~/(.|\\n)*{tag}(.|\\n)+/\n"
        + f"TAIL: {free}\n"
        + rules
    )


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)
