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
