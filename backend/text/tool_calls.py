"""Tool calls in a model's own words: how a family writes them, and how to read them back.

- ``hermes`` (Hermes, Qwen 2.5/3 and their MoEs): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, chosen when the chat template itself speaks of ``<tool_call>``;
- ``generic``, for templates with no tool syntax: the tools are described in the system
  prompt (``tools_prompt``) and a call is one JSON object in a fenced ``json`` block.

``parse`` reads a finished reply; ``StreamParser`` reads one as it streams, passing text
through at once except what could still be the start of a call, and giving each call when
it closes. Output that looks like a call but is not one (an unclosed tag, invalid JSON, no
name) stays plain content: a reply is never lost to a parse error. ``call_grammar`` is the
Lark grammar that forces a call (``tool_choice`` "required" or a named tool).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from backend.text.grammar import JSON_LAYOUT

FORMATS = ("hermes", "generic")
_TAGS = {"hermes": ("<tool_call>", "</tool_call>"), "generic": ("```json", "```")}


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template expects (as llama.cpp picks a chat format)."""
    return "hermes" if chat_template and "<tool_call>" in chat_template else "generic"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as the model wrote it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def text(self, fmt: str) -> str:
        """The call as a model writing format ``fmt`` writes it."""
        opening, closing = _TAGS[fmt]
        body = json.dumps({"name": self.name, "arguments": json.loads(self.arguments)})
        return f"{opening}\n{body}\n{closing}"

    def openai(self, index: int | None = None) -> dict:
        body = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


def _read_call(body: str) -> ToolCall | None:
    """One call's JSON body, or None if it is not a call."""
    try:
        obj, end = json.JSONDecoder().raw_decode(body.strip())
    except ValueError:
        return None
    if end != len(body.strip()) or not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def parse(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """A finished reply -> (its content outside the calls, the calls in order)."""
    p = StreamParser(fmt)
    content, calls = p.feed(text)
    more, last = p.finish()
    return content + more, calls + last


class StreamParser:
    """Reads a reply piece by piece: ``feed`` and ``finish`` return (content to show now,
    calls completed now)."""

    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")
        self.open, self.close = _TAGS[fmt]
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._inside:
                at = self._buf.find(self.open)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.open)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                out.append(self._buf[:at])
                self._buf = self._buf[at:]
                self._inside = True
            end = self._buf.find(self.close, len(self.open))
            if end < 0:
                break
            raw = self._buf[: end + len(self.close)]
            call = _read_call(self._buf[len(self.open) : end])
            if call is None:
                out.append(raw)  # not a call after all: the text stays
            else:
                calls.append(call)
            self._buf = self._buf[end + len(self.close) :]
            self._inside = False
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: what was held back is content (an unclosed call included)."""
        rest, self._buf, self._inside = self._buf, "", False
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


def call_grammar(tools: list[dict], fmt: str) -> str:
    """Lark (llguidance) for one call of one of ``tools``, in format ``fmt``, with
    arguments held to each tool's JSON schema."""
    choices = []
    for t in tools:
        fn = t.get("function", t)
        choices.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    "arguments": fn.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    schema = {**schema, "x-guidance": JSON_LAYOUT}
    opening, closing = _TAGS[fmt]
    return (
        "%llguidance {}\n"
        f"start: {json.dumps(opening + chr(10))} call {json.dumps(chr(10) + closing)}\n"
        f"call: %json {json.dumps(schema)}\n"
    )
