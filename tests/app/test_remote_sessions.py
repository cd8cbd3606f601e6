"""Sessions on a remote engine: the app against a second, real `bevy serve` process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PySide6.QtCore import Qt

from app.engines import save_engines
from app.main_window import MainWindow
from app.store import Store
from backend.api import Endpoint
from tests.app.test_app import ARTIFACTS, close_window, open_window, reference_replies, settings_for
from tests.helpers.serve import server_process

KEY = "lab-key"
MODEL = "tiny-moe"


@pytest.fixture(scope="module")
def remote(tiny_chat_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("remote-app")
    with server_process(tiny_chat_moe, logs, "--api-key", KEY) as (url, _proc):
        yield url


def remote_stats(url: str) -> dict:
    r = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    return r.json()


def on_engine(w: MainWindow, url: str, key: str = KEY, name: str = "lab", workspace=None) -> int:
    """A new session on the remote engine ``name`` (set up at ``url``): an agent session
    working in ``workspace`` when one is given, else a chat."""
    save_engines(w.store, [Endpoint(name, url, MODEL, key)], w.controller.keys)
    sid = w.new_session("agent" if workspace else "chat", workspace=workspace)
    w.controller.update_session(sid, "", {}, None, name)
    return sid


def bare_window(qtbot) -> MainWindow:
    """A window with no local model loaded: remote sessions need none."""
    w = MainWindow(Store())
    qtbot.addWidget(w)
    w.show()
    return w


def test_a_remote_session_streams_while_a_local_one_does(qtbot, env: Path, remote: str) -> None:
    w = open_window(qtbot, settings_for(env, max_tokens=24))
    far = on_engine(w, remote)
    w.controller.update_session(far, "", {"max_tokens": 300}, None, "lab")  # a long one
    near = w.new_session("chat")
    first: dict[str, float] = {}
    ends: dict[str, float] = {}
    w.bridge.token.connect(lambda rid, _t: first.setdefault(rid, time.monotonic()))
    w.bridge.finished.connect(lambda ev: ends.setdefault(ev.request_id, time.monotonic()))
    w.send("Tell me about rivers.", session_id=far)
    far_id = w.controller.replies[far].request_id
    assert far_id.startswith("app-lab-")
    qtbot.waitUntil(lambda: far_id in first, timeout=60_000)
    w.send("Write a haiku on caches.", session_id=near)  # while the remote streams
    near_id = w.controller.replies[near].request_id
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=120_000)
    assert first[near_id] < ends[far_id]  # the local reply streamed beside the remote one
    got = w.store.messages(far)[-1]
    client = openai.OpenAI(base_url=f"{remote}/v1", api_key=KEY, max_retries=0)
    same = client.chat.completions.create(
        model=MODEL, messages=w.store.history(far)[:-1], temperature=0, top_p=0.95, max_tokens=300
    )
    assert got.status == "done" and got.content == same.choices[0].message.content
    assert got.data["stats"]["model"] == f"{MODEL} on lab"
    local = w.store.messages(near)[-1]
    assert local.content == reference_replies(env, [w.store.history(near)[:-1]], 24)[0]
    w.sessions.select(far)
    w._render_dirty()
    assert "(chat · on lab)" in w.title_label.text()
    assert f"{MODEL} on lab" in w.view.toPlainText()
    close_window(w)


def test_stop_aborts_on_the_server_and_a_wrong_key_says_so(qtbot, env: Path, remote: str) -> None:
    w = bare_window(qtbot)
    sid = on_engine(w, remote)
    w.controller.update_session(sid, "", {"max_tokens": 3000}, None, "lab")
    w.send("Tell me about rivers.", session_id=sid)
    assert w.controller.messages[sid][-1]["phase"] == "waiting for lab"
    qtbot.waitUntil(lambda: w.controller.replies[sid].tokens >= 3, timeout=60_000)
    w.controller.stop(sid)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=30_000)
    stopped = w.store.messages(sid)[-1]
    assert stopped.status == "stopped" and stopped.content  # what came is kept
    assert stopped.completion_tokens >= 3  # counted here: a stopped stream sends no usage
    deadline = time.monotonic() + 10
    while remote_stats(remote)["active_requests"]:
        assert time.monotonic() < deadline, "the server kept generating after Stop"
        time.sleep(0.1)
    bad = on_engine(w, remote, key="wrong", name="lab")
    w.send("hello", session_id=bad)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=30_000)
    failed = w.store.messages(bad)[-1]
    assert failed.status == "error" and "refused the API key" in failed.content
    close_window(w)


def test_a_remote_server_killed_mid_reply_fails_it_with_the_text_kept(
    qtbot, env: Path, tiny_chat_moe: Path, tmp_path: Path
) -> None:
    w = bare_window(qtbot)
    with server_process(tiny_chat_moe, tmp_path) as (url, proc):
        sid = on_engine(w, url, key="")
        w.controller.update_session(sid, "", {"max_tokens": 3000}, None, "lab")
        w.send("Tell me about rivers.", session_id=sid)
        qtbot.waitUntil(lambda: w.controller.replies[sid].tokens >= 3, timeout=60_000)
        proc.kill()
        qtbot.waitUntil(lambda: not w.controller.replies, timeout=30_000)
    failed = w.store.messages(sid)[-1]
    head, _, error = failed.content.partition("> **Error:**")
    assert failed.status == "error" and head.strip() and "lab" in error
    close_window(w)


def test_an_agent_session_runs_its_loop_on_a_remote_engine(
    qtbot, env: Path, remote: str, tmp_path: Path
) -> None:
    w = bare_window(qtbot)
    before = remote_stats(remote)["api"]["completion_tokens"]
    sid = on_engine(w, remote, workspace=str(tmp_path))
    w.controller.update_session(sid, "", {"max_tokens": 16}, [], "lab")
    w.send("List the files here.", session_id=sid)
    assert w.controller.is_busy(sid)
    qtbot.waitUntil(lambda: not w.controller.is_busy(sid), timeout=120_000)
    assert remote_stats(remote)["api"]["completion_tokens"] > before  # the remote answered
    roles = [m.role for m in w.store.messages(sid)]
    assert roles[0] == "user" and "assistant" in roles
    close_window(w)


def test_the_panels_draw_the_shown_sessions_engine(qtbot, env: Path, remote: str) -> None:
    w = bare_window(qtbot)  # no local engine: whatever the panels draw came from the remote
    far = on_engine(w, remote)
    w.controller.update_session(far, "", {"max_tokens": 24}, None, "lab")
    w.show_session(far)  # as Session settings' OK does
    assert w.docks["Cache"].windowTitle() == "Cache — lab"
    w.send("Tell me about rivers.", session_id=far)
    qtbot.waitUntil(lambda: not w.controller.replies, timeout=60_000)
    qtbot.waitUntil(lambda: bool(w.panels["Cache"].hit_rate_history), timeout=10_000)
    assert w.feed.reports and not w.feed.notes["Cache"].isVisible()
    # An engine that reports nothing (here: it refuses the key to its stats too).
    closed = on_engine(w, remote, key="wrong", name="closed")
    w.show_session(closed)
    qtbot.waitUntil(lambda: w.feed.notes["Overlap"].isVisible(), timeout=10_000)
    assert "closed does not report this" in w.feed.notes["Overlap"].text()
    assert w.panels["Throughput"].isVisible()  # measured here instead, from nothing yet
    summary = w.panels["Throughput"].summary_label
    qtbot.waitUntil(lambda: "· 0 tokens generated" in summary.text(), timeout=5_000)
    ARTIFACTS.mkdir(exist_ok=True)
    w.grab().save(str(ARTIFACTS / "remote_panels.png"))
    home = w.new_session("chat")  # a local session: this computer's panels again
    w.sessions.select(home)
    assert w.docks["Cache"].windowTitle() == "Cache" and w.panels["Cache"].isVisible()
    assert not w.panels["Cache"].hit_rate_history  # the remote's history is not mixed in
    close_window(w)


def test_throughput_of_a_server_that_reports_nothing_is_measured_here(qtbot) -> None:
    """PanelFeed alone, given token counts as the controller would report them."""
    from PySide6.QtWidgets import QDockWidget, QMainWindow

    from app.panels import CachePanel, OverlapPanel, ProgressPanel, ThroughputPanel
    from app.panels.feed import PanelFeed

    window = QMainWindow()
    qtbot.addWidget(window)
    panels = {
        "Overlap": OverlapPanel(),
        "Layer progress": ProgressPanel(),
        "Cache": CachePanel(),
        "Throughput": ThroughputPanel(),
    }
    docks = {}
    for name in panels:
        docks[name] = QDockWidget(name, window)
        window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, docks[name])
    counts = {"r1": ("rivers", 0)}
    feed = PanelFeed(panels, docks, lambda engine: dict(counts), window)
    window.show()
    feed.show_engine(Endpoint("vllm-box", "http://gpu:8000/v1", "qwen"))
    feed.remote("vllm-box", None, False)  # what the bridge says of a non-Bevy server
    assert not feed.reports and feed.notes["Layer progress"].isVisible()
    for n in (0, 10, 25, 40):
        counts["r1"] = ("rivers", n)
        feed._client_tick()
        qtbot.wait(60)
    text = panels["Throughput"].summary_label.text()
    assert "40 tokens generated" in text and not text.startswith("0.0")
    assert panels["Throughput"].session_rates()["rivers"] > 0
