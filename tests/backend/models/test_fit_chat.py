"""A chat longer than the context: which turns are left out under each policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.errors import BevyError
from backend.models.generate import chat_prompt_ids, fit_chat
from backend.models.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_chat_moe: Path):
    return load_model(tiny_chat_moe)


def chat(n_turns: int) -> list[dict]:
    out = [{"role": "system", "content": "Be brief."}]
    for i in range(n_turns):
        out += [
            {"role": "user", "content": f"question {i} " + "river " * 40},
            {"role": "assistant", "content": f"answer {i} " + "delta " * 40},
        ]
    return out + [{"role": "user", "content": "and the last one?"}]


def test_rolling_keeps_the_system_prompt_and_the_newest_turns(model) -> None:
    messages = chat(6)
    full = len(chat_prompt_ids(model, messages))
    ids, dropped = fit_chat(model, messages, None, full // 2, "rolling")
    assert len(ids) <= full // 2 and dropped > 0 and dropped % 2 == 0  # whole turns
    kept = [messages[0], *messages[1 + dropped :]]
    assert ids == chat_prompt_ids(model, kept)
    assert kept[1]["role"] == "user" and kept[-1]["content"] == "and the last one?"


def test_truncate_middle_keeps_the_first_turn_too(model) -> None:
    messages = chat(6)
    full = len(chat_prompt_ids(model, messages))
    ids, dropped = fit_chat(model, messages, None, full // 2, "truncate_middle")
    kept = [*messages[:3], *messages[3 + dropped :]]
    assert dropped > 0 and ids == chat_prompt_ids(model, kept)
    assert kept[1]["content"].startswith("question 0")


def test_error_and_an_unfittable_last_turn_leave_everything(model) -> None:
    messages = chat(3)
    full = chat_prompt_ids(model, messages)
    assert len(full) > 100 and fit_chat(model, messages, None, 100, "error") == (full, 0)
    ids, _ = fit_chat(model, messages, None, 5, "rolling")  # the last turn alone is > 5
    assert len(ids) > 5  # the engine then refuses it as too long, as before
    with pytest.raises(BevyError, match="overflow policy"):
        fit_chat(model, messages, None, 10, "sideways")


def test_text_too_long_for_any_tokens_is_judged_before_tokenizing(model, monkeypatch) -> None:
    from backend.errors import ContextTooLong
    from backend.models import generate

    ctx = model.config.context_length
    huge = "x" * (ctx * model.tokenizer.max_token_chars + 1)  # > the context's longest tokens
    messages = [{"role": "user", "content": huge}]

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized")

    with monkeypatch.context() as m:
        m.setattr(generate, "chat_prompt_ids", refuse)
        with pytest.raises(ContextTooLong, match="characters"):
            fit_chat(model, messages, None, 100, "error")
        with pytest.raises(ContextTooLong, match="last message"):
            fit_chat(model, messages, None, 100, "rolling")
    history = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": huge},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "short"},
    ]
    ids, dropped = fit_chat(model, history, None, 100, "rolling")
    assert dropped == 2 and ids == chat_prompt_ids(model, [history[0], history[3]])


@pytest.mark.parametrize("policy", ["rolling", "truncate_middle"])
def test_the_fewest_turns_go_at_every_limit(model, policy) -> None:
    """Bisection over the turns finds what dropping them one at a time finds."""
    messages = chat(9)
    full = len(chat_prompt_ids(model, messages))
    for limit in range(full // 8, full + 1, max(1, full // 23)):
        ids, dropped = fit_chat(model, messages, None, limit, policy)
        head = 1 if policy == "rolling" else 3  # system prompt (and the first turn)
        fewest = next(
            (
                k
                for k in range(0, len(messages) - head, 2)
                if len(chat_prompt_ids(model, messages[:head] + messages[head + k :])) <= limit
            ),
            None,
        )
        if fewest is None:  # even the last turn alone does not fit: all droppable went
            assert len(ids) > limit
        else:
            assert dropped == fewest and len(ids) <= limit, (limit, dropped, fewest)
            assert ids == chat_prompt_ids(model, messages[:head] + messages[head + fewest :])


def test_a_continued_reply_ends_the_prompt_inside_its_turn(model) -> None:
    tok = model.tokenizer
    question = [{"role": "user", "content": "Name three rivers."}]
    opened = tok.decode(chat_prompt_ids(model, question))  # the reply's turn just opened
    reply = {"role": "assistant", "content": "The Nile, the"}
    ids = chat_prompt_ids(model, [*question, reply], continue_final=True)
    assert tok.decode(ids) == opened + "The Nile, the"  # no end of turn, no new turn
    closed = tok.decode(chat_prompt_ids(model, [*question, reply]))
    assert closed.startswith(opened + "The Nile, the") and len(closed) > len(tok.decode(ids))
    with pytest.raises(BevyError, match="only a reply with text"):
        chat_prompt_ids(model, question, continue_final=True)
    # Fitting to a context never drops the reply being continued (nor its question).
    long = [*chat(6)[:-1], {"role": "user", "content": "last"}, reply]
    full = len(chat_prompt_ids(model, long, continue_final=True))
    fitted, dropped = fit_chat(model, long, None, full // 2, "rolling", continue_final=True)
    kept = [long[0], *long[1 + dropped :]]
    assert 0 < dropped < len(long) - 3  # some turns went, the last two did not
    assert fitted == chat_prompt_ids(model, kept, continue_final=True)
    assert tok.decode(fitted).endswith("last<|im_end|>\n<|im_start|>assistant\nThe Nile, the")
    # Its own text stays as it was, trailing newline too: the model goes on after it.
    ids = chat_prompt_ids(
        model, [*question, {**reply, "content": "1. Nile\n"}], continue_final=True
    )
    assert tok.decode(ids) == opened + "1. Nile\n"
