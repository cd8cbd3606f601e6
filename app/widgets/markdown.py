"""Markdown to the HTML Qt's text views show: markdown-it-py for the syntax (CommonMark,
tables, strikethrough; raw HTML in a message is shown as text), Pygments for code.

Code blocks become a one-cell table (Qt's rich text draws backgrounds reliably on table
cells) under a header with the language and a ``copy:`` link; ``Rendered.code`` holds
each block's text for that link."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from functools import cache

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound


@dataclass(frozen=True)
class CodeTheme:
    """Colours of code blocks, from the view's palette (light or dark)."""

    dark: bool = False

    @property
    def background(self) -> str:
        return "#1f2329" if self.dark else "#f3f4f6"

    @property
    def header(self) -> str:
        return "#2b3038" if self.dark else "#e5e7eb"

    @property
    def muted(self) -> str:
        return "#9aa3ad" if self.dark else "#57606a"

    @property
    def pygments_style(self) -> str:
        return "monokai" if self.dark else "default"


@dataclass
class Rendered:
    html: str
    code: list[str] = field(default_factory=list)  # each code block's text, in order


@cache
def _formatter(style: str) -> HtmlFormatter:
    return HtmlFormatter(nowrap=True, noclasses=True, style=style)


@cache
def _lexer(lang: str):
    """The lexer a fence names; none for an unnamed or unknown language (guessing picks
    odd ones for short snippets)."""
    try:
        return get_lexer_by_name(lang) if lang else None
    except ClassNotFound:
        return None


def _fence(_renderer, tokens, idx, _options, env) -> str:
    token = tokens[idx]
    theme: CodeTheme = env["theme"]
    code: list[str] = env["code"]
    text = token.content.rstrip("\n")
    lang = token.info.split()[0] if token.info and token.info.split() else ""
    code.append(text)
    lexer = _lexer(lang) if len(text) < 200_000 else None
    if lexer is not None:
        body = highlight(text, lexer, _formatter(theme.pygments_style)).rstrip("\n")
    else:
        body = html.escape(text)
    label = html.escape(lang or "code")
    return (
        '<table width="100%" cellspacing="0" cellpadding="6" '
        'style="margin-top: 4px; margin-bottom: 4px;">'
        f'<tr><td bgcolor="{theme.header}"><span style="color: {theme.muted};">{label}'
        f'</span>&nbsp;&nbsp;<a href="copy:{env["anchor"]}{len(code) - 1}">copy</a></td></tr>'
        f'<tr><td bgcolor="{theme.background}"><pre style="margin: 0;">{body}</pre>'
        "</td></tr></table>\n"
    )


_MD = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
_MD.add_render_rule("fence", _fence)
_MD.add_render_rule("code_block", _fence)


def render(markdown: str, theme: CodeTheme | None = None, anchor: str = "") -> Rendered:
    """``markdown`` as HTML for a QTextBrowser, with highlighted, copyable code blocks
    (their links: ``copy:<anchor><n>``)."""
    env = {"theme": theme or CodeTheme(), "code": [], "anchor": anchor}
    return Rendered(_MD.render(markdown, env), env["code"])
