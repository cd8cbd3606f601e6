"""The desktop app end to end, offscreen, with the real engine on a tiny MoE."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QElapsedTimer, Qt, QTimer
from PySide6.QtGui import QKeySequence

from app.main_window import MainWindow
from app.settings import DEFAULTS
from app.store import Store
from backend.config import EngineConfig, SamplingParams
from backend.messages import Finished, Submit
from backend.serving.service import EngineService

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PROMPTS = ["Tell me about rivers.", "Write a haiku on caches.", "What is 12 times 7?"]
TOKENS = 120


def settings_for(model: Path, **overrides) -> dict:
    return {
        **DEFAULTS,
        "model": str(model),
        "device": "cpu",
        "cache": "50%",
        "temperature": 0.0,
        "max_tokens": TOKENS,
        **overrides,
    }


def open_window(qtbot, settings: dict | None = None) -> MainWindow:
    store = Store()
    if settings is not None:
        store.set_setting("app", settings)
    w = MainWindow(store)
    qtbot.addWidget(w)
    w.show()
    w.start_engine()
    qtbot.waitUntil(lambda: w.bridge.ready, timeout=60_000)
    return w


def close_window(w: MainWindow) -> None:
    w.close()
    w.store.close()


def reference_replies(model: Path, histories: list[list[dict]], max_tokens: int) -> list[str]:
    """Each history alone through its own engine: what every reply must read."""
    svc = EngineService.open(model, EngineConfig(cache="50%"))
    try:
        out = []
        for i, h in enumerate(histories):
            q: queue.Queue = queue.Queue()
            svc.submit(
                Submit(
                    f"ref{i}", SamplingParams(temperature=0.0, max_tokens=max_tokens), messages=h
                ),
                q.put,
            )
            ev = q.get(timeout=120)
            while not isinstance(ev, Finished):
                ev = q.get(timeout=120)
            out.append(ev.text)
        return out
    finally:
        svc.close()


def test_three_sessions_stream_at_once_into_their_own_views(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env))
    ids = [w.new_session("chat") for _ in PROMPTS]
    # A long conversation is open the whole time (issue #28: 2,000 messages).
    long = w.new_session("chat")
    for i in range(1000):
        w.store.add_message(long, "user", f"question {i}: how do I sort a list?")
        w.store.add_message(
            long, "assistant", f"Use `sorted()`:\n\n```python\nxs = sorted(xs)\n```\n\nanswer {i}"
        )
    w.controller.messages.pop(long, None)  # written behind the controller: read them again
    w.sessions.select(long)
    w.show_session(long)
    assert len(w.controller.shown(long)) == 2000 and "answer 999" in w.view.toPlainText()
    first_token: dict[int, float] = {}
    finished_at: list[float] = []

    def on_token(rid: str, _text: str) -> None:
        reply = w.controller.by_request.get(rid)
        if reply is not None:
            first_token.setdefault(reply.session_id, time.perf_counter())

    w.bridge.token.connect(on_token)
    w.bridge.finished.connect(lambda _ev: finished_at.append(time.perf_counter()))
    # The GUI thread's worst stall while three replies stream: a 5 ms timer's largest gap.
    gaps: list[float] = []
    clock = QElapsedTimer()
    clock.start()
    ticker = QTimer()
    ticker.setInterval(5)
    last = [clock.elapsed()]

    def tick() -> None:
        now = clock.elapsed()
        gaps.append(now - last[0])
        last[0] = now

    ticker.timeout.connect(tick)
    ticker.start()
    for sid, prompt in zip(ids, PROMPTS, strict=True):
        w.send(prompt, session_id=sid)
    qtbot.waitUntil(lambda: len(first_token) == 3 and w.panels["Layer progress"].isVisible())
    qtbot.wait(300)  # a few panel refreshes with all three requests live
    ARTIFACTS.mkdir(exist_ok=True)
    ticker.stop()  # switching sessions and the screenshot render whole views: not stalls
    w.sessions.select(ids[1])
    w._render_dirty()
    assert w.grab().save(str(ARTIFACTS / "main_window.png"))
    w.sessions.select(long)
    last[0] = clock.elapsed()
    ticker.start()
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=120_000)
    ticker.stop()
    worst = max(gaps)
    over = sum(g > 50 for g in gaps)
    p99 = sorted(gaps)[int(0.99 * (len(gaps) - 1))]
    report = (
        f"GUI timer (5 ms) while 3 sessions streamed beside an open 2,000-message "
        f"conversation: {len(gaps)} ticks, "
        f"p99 gap {p99} ms, worst {worst} ms, gaps over 50 ms: {over}"
    )
    (ARTIFACTS / "gui_latency.txt").write_text(report + "\n")
    print(report)
    # Issue #28's bounds (measured here: p99 23-24 ms, worst 32-41 ms); real blocking work
    # on the GUI thread, or another thread holding the interpreter, breaks them.
    assert p99 <= 30 and worst < 100
    assert w.current_id == long
    # All three were generating at the same time: every first token came before any finish.
    assert max(first_token.values()) < min(finished_at)

    histories = [w.store.history(sid)[:-1] for sid in ids]
    expected = reference_replies(env, histories, TOKENS)
    assert len(set(expected)) == 3  # distinct replies, so a mix-up would show
    for sid, text in zip(ids, expected, strict=True):
        last_msg = w.store.messages(sid)[-1]
        assert (last_msg.role, last_msg.status, last_msg.content) == ("assistant", "done", text)
        w.sessions.select(sid)
        qtbot.waitUntil(
            lambda sid=sid, last_msg=last_msg: (
                f"{last_msg.content}\n\n*{last_msg.completion_tokens} token"
                in w.view.shown_markdown
            )
        )
    # Panels received snapshots and drew them.
    assert w.panels["Cache"].hit_rate_history
    for name, panel in w.panels.items():
        assert not panel.grab().isNull(), name
    close_window(w)


def test_escape_stops_only_the_current_session(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=3000))
    assert QKeySequence("Ctrl+,") in w.settings_action.shortcuts()
    a, b = w.new_session("chat"), w.new_session("chat")
    w.send("first", session_id=a)
    w.send("second", session_id=b)
    qtbot.waitUntil(lambda: all(w.controller.replies[s].tokens > 2 for s in (a, b)), timeout=60_000)
    w.sessions.select(a)
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow)
    w.sessions.view.setFocus()  # Esc works wherever the focus is, not only in the input
    qtbot.keyClick(w.sessions.view, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: a not in w.controller.replies, timeout=30_000)
    assert b in w.controller.replies  # still generating
    stopped = w.store.messages(a)[-1]
    assert stopped.status == "stopped" and stopped.content
    before = w.controller.replies[b].tokens
    qtbot.waitUntil(lambda: w.controller.replies[b].tokens > before + 3, timeout=30_000)
    w.controller.stop(b)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=30_000)
    assert w.store.messages(b)[-1].status == "stopped"
    # Every cache pin was released.
    qtbot.waitUntil(lambda: (s := w.bridge.service.latest) is not None and s.cache_pinned == 0)
    close_window(w)


def test_settings_change_reloads_the_engine_and_keeps_conversations(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=6))
    sid = w.new_session("chat")
    w.send("hello", session_id=sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    old_service = w.bridge.service
    w.apply_settings({**w.settings, "policy": "sync", "cache": "4"})
    qtbot.waitUntil(lambda: w.bridge.ready and w.bridge.service is not old_service, timeout=60_000)
    assert w.bridge.config.policy == "sync" and w.bridge.service.engine.cache.n_slots == 4
    assert "sync" in w.status_engine.text()
    # how the engine computes experts: the tiny model's are float32, which only eager takes
    assert "experts eager" in w.status_engine.text()
    w.send("again", session_id=sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    roles = [m.role for m in w.store.messages(sid)]
    assert roles == ["user", "assistant", "user", "assistant"]
    # A bad setting is refused with an error, the running engine stays.
    service = w.bridge.service
    w.apply_settings({**w.settings, "cache": "lots"})
    assert w.error_box is not None and "cache size" in w.error_box.text()
    assert w.bridge.service is service
    close_window(w)


def test_corrupt_model_shows_an_error_and_the_app_stays_usable(
    qtbot, env: Path, tmp_path: Path
) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=4))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    manager = w.open_model_manager()
    rows = manager.table.rowCount()
    assert manager.add_path(bad) is False
    assert manager.error_box is not None and manager.error_box.isVisible()
    assert "broken.gguf" in manager.error_box.text()
    assert manager.table.rowCount() == rows
    assert manager.add_path(env) is True
    assert str(env) in manager.paths()
    manager.error_box.close()
    manager.close()
    w.send("still there?")
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    assert w.store.messages(w.current_id)[-1].status == "done"
    close_window(w)


def test_restart_restores_sessions_and_messages(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=5))
    a = w.new_session("chat")
    w.send("remember me", session_id=a)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    w.rename_session(a, "Kept")
    b = w.new_session("agent", str(env.parent / "agent-ws"))
    reply = w.store.messages(a)[-1].content
    close_window(w)

    w2 = open_window(qtbot)  # settings come from the database this time
    assert w2.settings["model"] == str(env)
    assert sorted(w2.sessions.titles()) == sorted(["Kept", "New agent session"])
    w2.sessions.select(a)
    assert [m["content"] for m in w2.controller.messages[a]] == ["remember me", reply]
    # The reply and its footer, read back from the store.
    n = w2.store.messages(a)[-1].completion_tokens
    assert f"{reply}\n\n*{n} token" in w2.view.shown_markdown
    assert w2.store.session(b).kind == "agent"
    w2.sessions.search.setText("kep")
    assert w2.sessions.titles() == ["Kept"]
    out = w2.export_session(a, str(env.parent / "kept.md"))
    assert "remember me" in out.read_text()
    close_window(w2)


def test_compare_view_runs_policies_side_by_side_and_reopens(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env))
    view = w.open_compare()
    for p, box in view.policy_boxes.items():
        box.setChecked(p in ("bevy", "sync"))
    view.requests.setValue(3)
    view.tokens.setValue(6)
    steps: list = []
    w.bridge.compare_progress.connect(lambda done, total: steps.append((done, total)))
    with qtbot.waitSignal(w.bridge.compare_done, timeout=120_000):
        assert view.run()
        assert not view.progress.isHidden() and view.cancel_button.isEnabled()
    # One reference decode, then a run per policy: steps counted up to the total.
    assert steps[0] == (0, 3) and steps[-1] == (3, 3)
    assert view.progress.isHidden() and not view.cancel_button.isEnabled()
    assert view.table.rowCount() == 2
    assert {view.table.item(r, 0).text() for r in range(2)} == {"bevy", "sync"}
    assert all(view.table.item(r, 6).text() == "yes" for r in range(2))  # exact tokens
    assert all(r["lanes"]["compute"] for r in view.records)
    qtbot.wait(100)
    ARTIFACTS.mkdir(exist_ok=True)
    assert view.grab().save(str(ARTIFACTS / "compare_view.png"))
    assert view.saved.count() == 1
    records = view.records
    view.show_records([])
    view._open_saved(view.saved.item(0))
    assert [r["policy"] for r in view.records] == [r["policy"] for r in records]
    # Cancel: the comparison stops after the step in progress, and nothing is saved.
    w.bridge.compare_progress.connect(lambda done, _total: done == 1 and view.cancel())
    with qtbot.waitSignal(w.bridge.compare_done, timeout=120_000) as done:
        assert view.run()
    assert done.args == [None, "cancelled"] and view.log.text() == "Cancelled."
    assert view.saved.count() == 1 and view.run_button.isEnabled()
    close_window(w)


def test_api_toggle_serves_the_apps_own_engine(qtbot, env: Path) -> None:
    import threading

    import httpx

    w = open_window(qtbot, settings_for(env, max_tokens=3000))
    w.apply_settings({**w.settings, "api_enabled": True, "api_port": 0})
    qtbot.waitUntil(lambda: w.status_api.text().startswith("API: http"), timeout=30_000)
    url = w.status_api.text().removeprefix("API: ")
    sid = w.new_session("chat")
    w.send("from the app", session_id=sid)
    qtbot.waitUntil(lambda: w.controller.replies[sid].tokens > 0, timeout=60_000)
    result: dict = {}

    def client() -> None:
        body = {
            "messages": [{"role": "user", "content": "from the API"}],
            "max_tokens": 6,
            "temperature": 0,
        }
        # /stats serves the engine's newest periodic snapshot, which can predate the
        # app's request by one interval: poll (bounded) instead of reading it once.
        for _ in range(100):
            result["stats"] = httpx.get(f"{url}/stats", timeout=30).json()
            if any(r["session"] == "from the app" for r in result["stats"]["requests"]):
                break
            time.sleep(0.1)
        result["reply"] = httpx.post(f"{url}/chat/completions", json=body, timeout=120)

    t = threading.Thread(target=client)
    t.start()
    qtbot.waitUntil(lambda: "reply" in result, timeout=120_000)
    t.join()
    assert result["reply"].status_code == 200
    assert result["reply"].json()["usage"]["completion_tokens"] == 6
    # One engine: the API saw the app's reply (3000 tokens, still running) in flight on it.
    assert sid in w.controller.replies
    assert any(r["session"] == "from the app" for r in result["stats"]["requests"])
    w.controller.stop(sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=30_000)
    w.apply_settings({**w.settings, "api_enabled": False})
    assert w.status_api.text() == ""
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/stats", timeout=5)
    close_window(w)


def test_message_sent_while_loading_is_answered_once_ready(qtbot, env: Path) -> None:
    store = Store()
    store.set_setting("app", settings_for(env, max_tokens=8))
    w = MainWindow(store)
    qtbot.addWidget(w)
    w.show()
    w.start_engine()
    assert not w.bridge.ready
    phases: list = []
    w.controller.token.connect(
        lambda sid, _t: phases.append(w.controller.messages[sid][-1].get("phase"))
    )
    # Loading shows inside the window (a separate dialog fell behind it).
    assert not w.loading.isHidden() and w.loading_label.text() == f"Loading {env.name}…"
    w.send("asked during loading")  # queued until the engine is up
    # The reply says what it waits for, not "generating…" with no model loaded.
    w._render_dirty()
    assert "waiting for the model to load" in w.view.toPlainText()
    assert "generating" not in w.view.toPlainText()
    qtbot.waitUntil(lambda: w.bridge.ready and not w.controller.replies, timeout=60_000)
    seen = [p for p in phases if p]
    assert seen[0].startswith("waiting for the model to load") and "queued" in seen
    assert phases[-1] is None and "phase" not in w.controller.messages[w.current_id][-1]
    assert w.loading.isHidden()
    sid = w.current_id
    history = w.store.history(sid)[:-1]
    assert history[-1] == {"role": "user", "content": "asked during loading"}
    expected = reference_replies(env, [history], 8)[0]
    assert w.store.messages(sid)[-1].content == expected
    close_window(w)


# The engine thread re-raises after reporting, so its traceback reaches stderr (expected).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_failure_ends_replies_and_a_restart_recovers(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=2000))
    sid = w.new_session("chat")
    w.send("keep going", session_id=sid)
    qtbot.waitUntil(lambda: w.controller.replies[sid].tokens > 0, timeout=60_000)
    engine = w.bridge.service.engine

    def broken_step(block: bool = False) -> bool:
        raise RuntimeError("simulated kernel failure")

    engine.step = broken_step  # fault injection on the real engine thread
    qtbot.waitUntil(lambda: w.bridge.state == "failed", timeout=30_000)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=30_000)
    last = w.store.messages(sid)[-1]
    assert last.status == "error" and "simulated kernel failure" in last.content
    assert w.error_box is not None and "simulated kernel failure" in w.error_box.text()
    w.send("and now?", session_id=sid)  # no engine: a clear error, not a reply stuck forever
    assert not w.controller.replies and "No model is loaded" in w.store.messages(sid)[-1].content
    w.error_box.close()
    # Settings -> OK restarts the engine. The reply after it need not be long: 2,000
    # tokens of the tiny model took 42-60 s on a slow 2-core CI machine.
    w.apply_settings({**w.settings, "max_tokens": 64})
    qtbot.waitUntil(lambda: w.bridge.ready, timeout=60_000)
    w.send("back?", session_id=sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    assert w.store.messages(sid)[-1].status == "done"
    close_window(w)


def test_reload_frees_the_old_engine_and_delete_mid_stream_is_clean(qtbot, env: Path) -> None:
    import gc
    import weakref

    w = open_window(qtbot, settings_for(env, max_tokens=3000))
    sid = w.new_session("chat")
    w.send("stream for a while", session_id=sid)
    qtbot.waitUntil(lambda: w.controller.replies[sid].tokens > 3, timeout=60_000)
    w.delete_session(sid)  # tokens still queued for it must go nowhere, quietly
    qtbot.wait(200)
    assert sid not in w.sessions.titles() and not w.undo_button.isHidden()
    w.commit_delete()  # what the undo's time running out does
    assert sid not in [s.id for s in w.store.list_sessions()] and not w.controller.replies
    old = weakref.ref(w.bridge.service.engine)
    w.apply_settings({**w.settings, "cache": "6"})
    qtbot.waitUntil(lambda: w.bridge.ready, timeout=60_000)
    gc.collect()
    assert old() is None  # the previous engine (and its model and slots) was freed
    close_window(w)


def test_session_system_prompt_and_sampling_reach_the_engine(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=50))
    sid = w.new_session("chat")
    dialog = w.edit_session_settings()
    dialog.prompt.setPlainText("Answer in one word.")
    dialog.overrides["max_tokens"].setChecked(True)
    dialog.fields["max_tokens"].setValue(3)
    dialog.accept()
    s = w.store.session(sid)
    assert s.system_prompt == "Answer in one word." and s.sampling == {"max_tokens": 3}
    w.send("Name a colour.", session_id=sid)
    reply = w.controller.replies[sid]
    assert reply.history[0] == {"role": "system", "content": "Answer in one word."}
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    assert w.store.messages(sid)[-1].completion_tokens <= 3  # the session's own limit
    dialog = w.edit_session_settings()
    dialog.overflow.setCurrentIndex(dialog.overflow.findData("error"))
    dialog.accept()  # a policy other than the default rolling is kept with the session
    assert w.store.session(sid).sampling == {"max_tokens": 3, "context_overflow": "error"}
    close_window(w)


def test_a_chat_that_outgrows_the_context_goes_on_and_says_so(qtbot, env: Path) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=4))
    sid = w.new_session("chat")
    ctx = w.bridge.service.model.config.context_length
    long = "river " * (ctx // 5)  # five of these overflow the context
    for i in range(6):
        w.send(f"{i}: {long}", session_id=sid)
        qtbot.waitUntil(lambda: not w.controller.replies, timeout=120_000)
    last = w.store.messages(sid)[-1]
    assert last.status == "done" and last.data.get("dropped", 0) >= 2  # whole turns
    qtbot.waitUntil(lambda: "no longer fit the model's context" in w.view.shown_markdown)
    close_window(w)


def test_a_reply_reading_its_prompt_says_how_far_it_is(qtbot, env: Path) -> None:
    """The engine's snapshot (scripted here, as the engine would send it) drives the label
    of a reply that has no token yet."""
    from dataclasses import replace

    from backend.messages import RequestProgress
    from tests.app.test_panels import EMPTY

    w = open_window(qtbot, settings_for(env, max_tokens=8))
    w.send("hello there")
    sid = w.current_id
    reply = w.controller.replies[sid]
    assert w.controller.messages[sid][-1]["phase"] == "queued"
    n = w.controller.bridge.service.model.config.n_layers
    reading = RequestProgress(reply.request_id, "hello", 2, n, "computing", 0, 1234, 0.375)
    w.controller._on_metrics(replace(EMPTY, requests=(reading,)))
    w._render_dirty()
    assert "reading the prompt (1,234 tokens): 37 %…" in w.view.toPlainText()
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    w._render_dirty()
    text = w.view.toPlainText()
    assert "reading the prompt" not in text
    # The footer under the reply: what it cost and why it ended, kept with the message.
    stats = w.store.messages(sid)[-1].data["stats"]
    n = w.store.messages(sid)[-1].completion_tokens
    assert stats["tokens"] == n and stats["ttft_s"] > 0 and stats["policy"] == "bevy"
    reason = "hit the token limit" if n == 8 else "finished"
    assert f"{n} tokens · " in text and " tok/s · first token " in text and reason in text
    close_window(w)


def test_a_deleted_session_can_be_brought_back_until_its_undo_runs_out(
    qtbot, env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.main_window.UNDO_MS", 800)  # 10 s in use
    w = open_window(qtbot, settings_for(env, max_tokens=4))
    keep = w.new_session("chat")
    w.send("first", session_id=keep)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    other = w.new_session("chat")
    w.rename_session(keep, "Worth keeping")
    before = [m.content for m in w.store.messages(keep)]
    order = w.sessions.titles()
    assert order.index("Worth keeping") > 0  # below the newer session
    w.delete_session(keep)
    assert "Worth keeping" not in w.sessions.titles()
    assert "Undo" in w.undo_button.text() and not w.undo_button.isHidden()
    w.undo_button.click()
    assert "Worth keeping" in w.sessions.titles() and w.current_id == keep
    assert w.sessions.titles() == order  # back where it was in the list
    assert [m.content for m in w.store.messages(keep)] == before and w.undo_button.isHidden()
    w.delete_session(other)
    qtbot.waitUntil(lambda: w.undo_button.isHidden(), timeout=5_000)  # it ran out
    assert other not in [s.id for s in w.store.list_sessions()]
    assert keep in [s.id for s in w.store.list_sessions()]
    close_window(w)


def test_regenerate_replaces_the_last_reply_and_copy_takes_its_text(qtbot, env: Path) -> None:
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    w = open_window(qtbot, settings_for(env, max_tokens=6))
    sid = w.new_session("chat")
    w.send("first question", session_id=sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    w.send("second question", session_id=sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    first, old = w.store.messages(sid)[1], w.store.messages(sid)[-1]
    w._render_dirty()
    md = w.view.shown_markdown
    assert f"msg:regenerate:{old.id}" in md and f"msg:regenerate:{first.id}" not in md
    assert not w.controller.regenerate(sid, first.id)  # not the last reply: kept
    assert len(w.store.messages(sid)) == 4
    w.view.anchorClicked.emit(QUrl(f"msg:regenerate:{old.id}"))
    assert w.controller.is_busy(sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    stored = w.store.messages(sid)
    assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
    new = stored[-1]
    assert new.status == "done" and new.data["stats"] != old.data["stats"]  # a new run
    assert new.content == old.content  # greedy: the same history gives the same reply
    assert new.branches == (old.id, new.id)  # the old reply stays, a click away
    w._render_dirty()
    assert f"[‹](msg:branch:{old.id}) 2/2 ›" in w.view.shown_markdown
    assert "2/2" in w.view.toPlainText()
    w.view.anchorClicked.emit(QUrl(f"msg:branch:{old.id}"))
    assert w.store.messages(sid)[-1].id == old.id
    w.view.anchorClicked.emit(QUrl(f"msg:copy:{first.id}"))
    assert QGuiApplication.clipboard().text() == first.content
    close_window(w)


def test_continue_extends_a_reply_cut_at_its_token_limit(qtbot, env: Path) -> None:
    from PySide6.QtCore import QUrl

    w = open_window(qtbot, settings_for(env, max_tokens=6))
    sid = w.new_session("chat")
    w.send("Tell me about rivers.", session_id=sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    cut = w.store.messages(sid)[-1]
    assert cut.data["stats"]["reason"] == "length" and cut.completion_tokens == 6
    w._render_dirty()
    assert f"msg:continue:{cut.id}" in w.view.shown_markdown
    w.view.anchorClicked.emit(QUrl(f"msg:continue:{cut.id}"))
    assert w.controller.is_busy(sid)
    history = w.controller.replies[sid].history
    assert history[-1] == {"role": "assistant", "content": cut.content}
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    stored = w.store.messages(sid)
    assert len(stored) == 2 and stored[-1].id == cut.id  # the same reply, longer
    done = stored[-1]
    # What the engine writes on from inside the reply's turn, asked for directly.
    q: queue.Queue = queue.Queue()
    w.bridge.service.submit(
        Submit(
            "ref",
            SamplingParams(temperature=0.0, max_tokens=6),
            messages=history,
            continue_final=True,
        ),
        q.put,
    )
    ev = q.get(timeout=60)
    while not isinstance(ev, Finished):
        ev = q.get(timeout=60)
    assert ev.text and done.content == cut.content + ev.text
    assert done.completion_tokens == 6 + ev.completion_tokens
    assert done.data["stats"]["tokens"] == done.completion_tokens
    close_window(w)


def test_edit_and_resend_starts_a_branch_and_the_old_one_stays(qtbot, env: Path) -> None:
    from PySide6.QtCore import QUrl

    w = open_window(qtbot, settings_for(env, max_tokens=4))
    sid = w.new_session("chat")
    for text in ("first question", "second question"):
        w.send(text, session_id=sid)
        qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    old = w.store.messages(sid)
    w._render_dirty()
    assert f"msg:edit:{old[2].id}" in w.view.shown_markdown
    w.view.anchorClicked.emit(QUrl(f"msg:edit:{old[0].id}"))
    assert w.input.toPlainText() == "first question" and w.edit_note.isVisible()
    qtbot.keyClick(w.input, Qt.Key.Key_Escape)  # Esc cancels the edit
    assert not w.edit_note.isVisible() and not w.input.toPlainText()
    w.view.anchorClicked.emit(QUrl(f"msg:edit:{old[2].id}"))
    w.input.setPlainText("second question, put better")
    qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert w.controller.is_busy(sid) and not w.edit_note.isVisible()
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    new = w.store.messages(sid)
    assert [m.content for m in new[:3]] == ["first question", old[1].content, new[2].content]
    assert new[2].content == "second question, put better"
    assert new[2].branches == (old[2].id, new[2].id) and new[3].status == "done"
    assert w.controller.replies == {}
    w._render_dirty()
    assert f"msg:branch:{old[2].id}" in w.view.shown_markdown and "2/2" in w.view.toPlainText()
    w.view.anchorClicked.emit(QUrl(f"msg:branch:{old[2].id}"))  # back to the first version
    w._render_dirty()
    assert [m.id for m in w.store.messages(sid)] == [m.id for m in old]
    assert "second question, put better" not in w.view.toPlainText()
    assert "1/2" in w.view.toPlainText()
    ARTIFACTS.mkdir(exist_ok=True)
    w.view.anchorClicked.emit(QUrl(f"msg:edit:{old[0].id}"))  # the edit state, for a look
    w.grab().save(str(ARTIFACTS / "chat-branches.png"))
    close_window(w)


def test_a_deleted_message_can_be_undone_and_is_gone_once_the_undo_runs_out(
    qtbot, env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtCore import QUrl

    monkeypatch.setattr("app.main_window.UNDO_MS", 800)  # 10 s in use
    w = open_window(qtbot, settings_for(env, max_tokens=4))
    sid = w.new_session("chat")
    for text in ("first question", "second question"):
        w.send(text, session_id=sid)
        qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    q1, a1, q2, a2 = w.store.messages(sid)
    w._render_dirty()
    assert f"msg:delete:{q1.id}" in w.view.shown_markdown
    w.view.anchorClicked.emit(QUrl(f"msg:delete:{a2.id}"))
    w._render_dirty()
    assert w.undo_button.isVisible() and "the reply" in w.undo_button.text()
    assert a2.content not in w.view.toPlainText() and q2.content in w.view.toPlainText()
    w.undo_button.click()  # back where it was
    w._render_dirty()
    assert [m["id"] for m in w.controller.shown(sid)] == [q1.id, a1.id, q2.id, a2.id]
    w.view.anchorClicked.emit(QUrl(f"msg:delete:{a2.id}"))
    qtbot.waitUntil(lambda: not w.undo_button.isVisible(), timeout=5_000)
    assert [m.id for m in w.store.messages(sid)] == [q1.id, a1.id, q2.id]  # gone for good
    # A reply started while a deletion can still be undone reads the chat without it.
    w.view.anchorClicked.emit(QUrl(f"msg:delete:{q1.id}"))
    w.send("third question", session_id=sid)
    assert not w.undo_button.isVisible()
    history = w.controller.replies[sid].history
    assert [m["content"] for m in history][:2] == [a1.content, q2.content]
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    assert q1.id not in [m.id for m in w.store.messages(sid)]
    close_window(w)


def test_model_manager_marks_the_model_in_use_and_removes_others_after_asking(
    qtbot, env: Path, tmp_path: Path
) -> None:
    import shutil

    from PySide6.QtWidgets import QMessageBox

    w = open_window(qtbot, settings_for(env, max_tokens=4))
    other = tmp_path / "other-moe"
    shutil.copytree(env, other)
    manager = w.open_model_manager()
    assert manager.add_path(env) and manager.add_path(other)
    status = {
        manager.table.item(r, 7).text(): manager.table.item(r, 1).text()
        for r in range(manager.table.rowCount())
    }
    assert status[str(env)] == "in use" and status[str(other)] == ""
    # The model in use is refused; another is removed only once the user says yes.
    assert manager.remove_path(env) is False and "runs this model" in manager.error_box.text()
    manager.error_box.close()
    manager.table.selectRow(manager.paths().index(str(other)))
    manager.remove_selected()
    box = manager.confirm_box
    assert box.isVisible() and str(other) in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert str(other) in manager.paths()
    manager.remove_selected()
    manager.confirm_box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: str(other) not in manager.paths(), timeout=5_000)
    assert other.exists() and "untouched" in manager.status.text()  # the folder itself stays
    manager.close()
    close_window(w)


def test_the_status_bar_says_when_experts_are_still_being_read(qtbot, env: Path) -> None:
    """After a load the link reads every expert in (the warm-up): the disk is busy and
    the first replies may wait on it, so the status bar says so until none is left."""
    from dataclasses import replace

    from backend.messages import MetricsSnapshot

    w = MainWindow(Store())
    qtbot.addWidget(w)
    zero = dict.fromkeys(("fetched", "cache_slots", "cache_used", "cache_pinned"), 0)
    rates = ("tokens_per_s", "hit_rate", "both_busy_frac", "compute_wait_frac")
    zero |= dict.fromkeys((*rates, "compute_busy_frac", "link_busy_frac", "t"), 0.0)
    idle = MetricsSnapshot(**zero, runahead="on")
    try:
        w._update_status(replace(idle, warm_left=412))
        assert w.status_speed.text().startswith("reading experts into memory, 412 left · ")
        w._update_status(idle)
        assert "reading experts" not in w.status_speed.text()
    finally:
        close_window(w)
