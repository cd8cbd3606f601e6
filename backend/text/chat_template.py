"""Rendering a model's Jinja chat template into a prompt, as transformers' apply_chat_template does.

Chat templates ship inside model files, so they are untrusted code: they run in Jinja's immutable
sandbox, and everything they see is rebuilt from plain JSON-like data first.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# ChatML, for models that ship without a template. Content may be missing (a tool-call message) or
# a list of content parts; both still render.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning text goes by; templates read the first (Qwen) or "thinking" (gpt-oss).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    """Templates call this to reject a conversation (e.g. roles out of order)."""
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without Jinja's HTML escaping (tool schemas must reach the model verbatim)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """The local time, for templates that put today's date in the system prompt."""
    return datetime.now().strftime(fmt)


class _SafeNamespace(Namespace):
    """``namespace()`` that refuses underscore names, so a template cannot reach CPython internals
    by storing them as attributes."""

    # Positional-only self, like Namespace, so that namespace(self=...) stays a normal attribute.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed")


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    """``dict(...)`` for templates; a plain function, so there is no class object to climb from."""
    return dict(*args, **kwargs)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile once per distinct template string (the same one renders every turn)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = _make_dict
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """A copy built from JSON-like types only. Other objects carry methods the sandbox does not know
    to block, and templates only ever read plain data, so they become a placeholder string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str/int enums, numpy floats) carry extra methods: reduce them to the base value.
    for base, plain in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):
            return plain(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value] if isinstance(value, list) else tuple(map(_plain, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One message as templates expect it: keys set to None dropped (an API's ``content=None``
    beside tool calls would otherwise render as "None"), reasoning under every name templates use."""
    if not isinstance(message, Mapping):
        raise ValueError(f"chat template error: a message must be a dict, got {message!r}")
    prepared = {key: _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((prepared[k] for k in _REASONING_KEYS if k in prepared), None)
    if reasoning is not None:
        prepared = {"thinking": reasoning, **prepared, "reasoning_content": reasoning}
    return prepared


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render ``messages`` (and optional JSON-schema ``tools``) with a model's chat template.

    ``extra`` reaches the template as further variables (e.g. ``enable_thinking=False``).
    Any template failure, including a sandbox violation, raises ``ValueError("chat template
    error: ...")`` with the Jinja message; the Jinja exception is its ``__cause__``.
    """
    # Like transformers, the template always sees `tools` and `documents` defined (None when
    # absent), since templates test `tools is not none`.
    context = {"documents": None, **{key: _plain(value) for key, value in extra.items()}}
    context.update(
        messages=[_prepare_message(m) for m in messages],
        tools=_plain(tools),
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    try:
        return _compile(template).render(**context)
    except TemplateError as exc:
        raise ValueError(f"chat template error: {exc}") from exc
