"""The terminal demo: concurrent sample chats, live progress, replies and a stats table."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import pytest

from backend.config import EngineConfig, SamplingParams
from backend.messages import Finished, MetricsSnapshot, RequestProgress, TokenEvent
from backend.models.generate import chat_prompt_ids
from backend.models.loader import load_model
from backend.serving.headless import (
    EXIT_INTERRUPTED,
    LiveView,
    SessionRun,
    progress_lines,
    run_headless,
    sample_sessions,
)

CONFIG = EngineConfig(cache="0.5", metrics_interval_s=0.05)


class TtyOut(io.StringIO):
    """A text stream that says it is a terminal, so the in-place redraw path runs."""

    def isatty(self) -> bool:
        return True


def _table_rows(text: str) -> dict[str, list[str]]:
    """The stats table's rows by first column (the block after the header line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("session "))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip() or line.startswith("cache hit rate"):
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


def test_every_session_finishes_and_the_table_counts_its_tokens(tiny_chat_moe: Path) -> None:
    n, max_tokens = 5, 12
    out = io.StringIO()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rc = run_headless(tiny_chat_moe, CONFIG, n_sessions=n, out=out, params=params)
    text = out.getvalue()
    assert rc == 0, text
    sessions = sample_sessions(n)
    model = load_model(tiny_chat_moe)
    rows = _table_rows(text)
    assert set(rows) == {name for name, _ in sessions} | {"total"}
    for name, messages in sessions:
        prompt, completion, _first, seconds, tok_s, finish = rows[name]
        assert int(prompt) == len(chat_prompt_ids(model, messages))
        assert int(completion) == max_tokens and finish == "length"
        assert float(seconds) > 0 and float(tok_s) > 0
        assert f"== {name}: {messages[-1]['content']}\n" in text
    total_prompt, total_completion, *_ = rows["total"]
    assert int(total_completion) == n * max_tokens
    assert int(total_prompt) == sum(int(rows[name][0]) for name, _ in sessions)
    assert re.search(
        r"cache hit rate \d+\.\d%  ·  both busy \d+\.\d%  ·  fetched experts \d+", text
    )
    # Plain progress lines (not a terminal): timestamped, one per session per draw, and the
    # last draw shows every session done with all its tokens.
    progress = [line for line in text.splitlines() if re.match(r"\[\s*\d+\.\d s\] ", line)]
    for name, _ in sessions:
        mine = [line for line in progress if line.split("] ", 1)[1].startswith(name + " ")]
        assert mine and re.search(rf"done\s+{max_tokens} tok$", mine[-1]), mine
    assert any("hit rate" in line for line in progress)
    assert "\x1b[" not in text


class InterruptOnFirstDraw(io.StringIO):
    """Raises KeyboardInterrupt (what Ctrl+C delivers to the main thread) while the first
    progress block is printed, i.e. with every session submitted and in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def write(self, s: str) -> int:
        if not self.fired and " tok\n" in s:
            self.fired = True
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_closes_the_engine_and_exits_130(tiny_chat_moe: Path) -> None:
    before = set(threading.enumerate())
    out = InterruptOnFirstDraw()
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    rc = run_headless(tiny_chat_moe, CONFIG, n_sessions=3, out=out, params=params)
    assert out.fired and rc == EXIT_INTERRUPTED
    assert "Interrupted" in out.getvalue() and "session " not in out.getvalue()
    started = [t for t in threading.enumerate() if t not in before]
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in started) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [t.name for t in started if t.is_alive()]


def _run(name: str, rid: str) -> SessionRun:
    return SessionRun(name, rid, [{"role": "user", "content": "hi"}], submitted=0.0)


def _snapshot(requests: tuple[RequestProgress, ...]) -> MetricsSnapshot:
    return MetricsSnapshot(
        t=1.0,
        tokens_per_s=12.5,
        hit_rate=0.541,
        both_busy_frac=0.3,
        compute_wait_frac=0.2,
        compute_busy_frac=0.8,
        link_busy_frac=0.5,
        fetched=40,
        cache_slots=10,
        cache_used=10,
        cache_pinned=2,
        runahead="on",
        requests=requests,
    )


def test_progress_lines_show_layer_state_tokens_and_engine_numbers() -> None:
    a, b, c = _run("alpha", "r1"), _run("b", "r2"), _run("c", "r3")
    for _ in range(3):
        a.apply(TokenEvent("r1", 5, "x"), now=0.5)
    c.apply(Finished("r3", "stop", "ok", 9, 2), now=1.0)
    snap = _snapshot(
        (
            RequestProgress("r1", "alpha", 2, 30, "waiting", 3),
            RequestProgress("r2", "b", 0, 30, "queued", 0),
        )
    )
    lines = progress_lines([a, b, c], snap, elapsed=1.5)
    assert len(lines) == 4
    assert re.fullmatch(r"alpha  layer   2/30   waiting\s+3 tok", lines[0])
    assert re.fullmatch(r"b      layer   0/30   queued\s+0 tok", lines[1])
    assert re.fullmatch(r"c      layer       -  done\s+2 tok", lines[2])
    assert "hit rate  54%" in lines[3] and "both busy  30%" in lines[3]
    assert "tok/s  12.5" in lines[3]
    assert "hit rate   -" in progress_lines([a], None, elapsed=0.0)[-1]


def test_live_view_redraws_in_place_on_a_terminal() -> None:
    out = TtyOut()
    view = LiveView(out, tty=True)
    assert view.due(0.0)
    view.draw(["one", "two", "three"], now=0.0, elapsed=0.0)
    assert not view.due(0.1) and view.due(0.25)  # ~4 Hz
    mark = len(out.getvalue())
    view.draw(["uno", "dos", "tres"], now=0.3, elapsed=0.3)
    second = out.getvalue()[mark:]
    # Back up over the three lines drawn before, then clear and rewrite each.
    assert out.getvalue().startswith("\x1b[?25l\x1b[2Kone\n")
    assert second == "\x1b[3F\x1b[2Kuno\n\x1b[2Kdos\n\x1b[2Ktres\n"
    view.close()
    assert out.getvalue().endswith("\x1b[?25h")


def test_live_view_prints_timestamped_lines_into_a_pipe() -> None:
    out = io.StringIO()
    view = LiveView(out, tty=False)
    view.draw(["one", "two"], now=10.0, elapsed=1.0)
    assert not view.due(11.0) and view.due(12.0)
    view.draw(["three"], now=12.0, elapsed=3.0)
    view.close()
    assert out.getvalue() == "[   1.0 s] one\n[   1.0 s] two\n[   3.0 s] three\n"


def test_sample_sessions_reuse_prompts_past_the_workload_end() -> None:
    few = sample_sessions(2)
    assert [name for name, _ in few] == ["chat-00", "chat-01"]
    assert few[0][1][-1]["content"] == "What is the capital of France?"
    many = sample_sessions(60)
    assert len({name for name, _ in many}) == 60 and many[54][0] == "chat-00#2"
    assert many[54][1] == few[0][1]
    with pytest.raises(ValueError):
        sample_sessions(0)
