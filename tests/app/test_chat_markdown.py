"""The conversation as Markdown: a reply cut inside a code block does not swallow the
messages after it, and tool cards fence whatever their output holds."""

from __future__ import annotations

from app.widgets.chat import conversation_markdown, tool_card


def test_a_reply_cut_inside_a_code_block_is_closed() -> None:
    md = conversation_markdown(
        [
            {"role": "assistant", "content": '```json\n{"name": "ls", "arg', "status": "stopped"},
            {"role": "assistant", "content": "next", "status": "done"},
        ]
    )
    first, second = md.split("\n\n---\n\n")
    assert first.endswith("```") and first.count("```") == 2
    assert second == "**Assistant**\n\nnext"


def test_closed_blocks_are_left_alone() -> None:
    text = "see:\n~~~~\ncode\n~~~~\nand ```inline``` too"
    md = conversation_markdown([{"role": "assistant", "content": text, "status": "done"}])
    assert md.endswith(text)


def test_a_card_fences_output_that_holds_fences() -> None:
    card = tool_card(
        {
            "id": 1,
            "role": "tool",
            "content": "a\n```\nb",
            "status": "done",
            "data": {
                "name": "read_file",
                "arguments": {"path": "x.md"},
                "state": "done",
                "ok": True,
                "approval": "rules",
                "seconds": 0.1,
            },
        }
    )
    assert "````\na\n```\nb\n````" in card and "`x.md`" in card


def test_reply_footer_says_cost_and_why_it_ended() -> None:
    from app.widgets.chat import reply_footer

    stats = {
        "tokens": 42,
        "tok_s": 17.25,
        "ttft_s": 0.4,
        "reason": "length",
        "model": "demo",
        "policy": "bevy",
    }
    assert reply_footer(stats) == (
        "*42 tokens · 17.2 tok/s · first token 0.40 s · hit the token limit · demo · policy bevy*"
    )
    assert reply_footer({"tokens": 1, "tok_s": None, "ttft_s": None, "reason": "abort"}) == (
        "*1 token · stopped*"
    )
    assert reply_footer(None) == ""


CONVERSATION = [
    {
        "role": "user",
        "content": "Add two numbers in Python, and show it in a shell.",
        "status": "done",
    },
    {
        "role": "assistant",
        "content": (
            "Here is a **function**:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
            "Run it:\n\n```bash\npython -c 'print(add(2, 3))'\n```\n\n<b>raw html</b> stays text."
        ),
        "status": "done",
        "data": {
            "stats": {
                "tokens": 48,
                "tok_s": 21.4,
                "ttft_s": 0.31,
                "reason": "stop",
                "model": "SmolLM2-135M-Instruct-MoE-32x4.Q4_1",
                "policy": "bevy",
            }
        },
    },
]


def test_code_blocks_are_highlighted_labelled_and_copyable() -> None:
    from app.widgets.markdown import CodeTheme, render

    out = render(conversation_markdown(CONVERSATION), CodeTheme())
    assert out.code == ["def add(a, b):\n    return a + b", "python -c 'print(add(2, 3))'"]
    assert ">python<" in out.html and ">bash<" in out.html  # the language labels
    assert 'href="copy:0"' in out.html and 'href="copy:1"' in out.html
    assert 'style="color: #008000; font-weight: bold">def<' in out.html  # Pygments' colours
    assert "&lt;b&gt;raw html&lt;/b&gt;" in out.html  # a message's HTML is not run
    dark = render("```python\nx = 1\n```", CodeTheme(dark=True)).html
    assert CodeTheme(dark=True).background in dark and CodeTheme().background not in dark


def test_the_copy_link_puts_the_block_on_the_clipboard(qtbot) -> None:
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    from app.widgets.chat import ConversationView
    from tests.app.test_panels import ARTIFACTS

    view = ConversationView()
    qtbot.addWidget(view)
    view.show_messages(CONVERSATION)
    assert "def add(a, b):" in view.toPlainText() and "21.4 tok/s" in view.toPlainText()
    view.anchorClicked.emit(QUrl("copy:1.1"))  # the reply (part 1), its second block
    assert QGuiApplication.clipboard().text() == "python -c 'print(add(2, 3))'"
    view.resize(640, 520)
    view.show()
    qtbot.waitExposed(view)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    view.grab().save(str(ARTIFACTS / "conversation_code_and_footer.png"))


def test_a_streaming_reply_re_renders_alone(qtbot, monkeypatch) -> None:
    from PySide6.QtGui import QTextFormat

    import app.widgets.chat as chat

    calls = []
    real = chat.render
    monkeypatch.setattr(chat, "render", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    history = [dict(m) for m in CONVERSATION] * 25  # 50 messages
    view = chat.ConversationView()
    qtbot.addWidget(view)
    reply = {"role": "assistant", "content": "", "status": "streaming"}
    view.show_messages([*history, reply])
    assert len(calls) == 50 + 1  # every part once
    for word in ("Partial", " answer", " with", " `code`"):
        reply = {**reply, "content": reply["content"] + word}
        view.show_messages([*history, reply])
    assert len(calls) == 51 + 4  # then only the streaming reply, once per update
    view.show_messages([*history, reply])
    assert len(calls) == 55  # nothing changed: nothing rendered
    fresh = chat.ConversationView()
    qtbot.addWidget(fresh)
    fresh.show_messages([*history, reply])
    assert view.toPlainText() == fresh.toPlainText()  # the same document as a full render
    # ... with the rule between messages as its own line, not under the reply's label.
    rulers = []
    block = view.document().begin()
    while block.isValid():
        if block.blockFormat().hasProperty(QTextFormat.Property.BlockTrailingHorizontalRulerWidth):
            rulers.append(block.text())
        block = block.next()
    assert rulers == [""] * 50
    assert view.toPlainText().rstrip().endswith("Partial answer with code")


def test_links_in_a_message_cannot_act_on_the_app() -> None:
    text = "[again](msg:regenerate:7) <msg:copy:7> [code](copy:0.0)\n\n[ref]: card:3\n"
    from app.widgets.chat import conversation_parts

    (md,) = conversation_parts(
        [{"id": 7, "role": "assistant", "content": text, "status": "done"}], regenerate=True
    )
    body, _, footer = md.rpartition("\n\n")
    import re

    assert re.search(r"(?<![#\w:])(msg|copy|card):", body) is None  # each made a # link
    assert "(#msg:regenerate:7)" in body and "<#msg:copy:7>" in body
    # The view's own links, in its footer, still work.
    assert "(msg:copy:7)" in footer and "(msg:regenerate:7)" in footer
