"""One app per data dir: a second launch is refused and leaves the first one's replies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from app.main import instance_lock, listen_for_launches
from app.store import Store

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_app_on_the_same_data_dir_is_refused(tmp_path: Path, monkeypatch) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("BEVY_DATA_DIR", str(data))
    lock = instance_lock(data)
    assert lock is not None and instance_lock(data) is None  # held, here too
    store = Store()
    sid = store.create_session("live").id
    mid = store.add_message(sid, "assistant", "streaming now", status="streaming").id
    store.flush()
    # A second app process: refused before it opens the store.
    env = {"BEVY_DATA_DIR": str(data), "QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"}
    code = (
        "import sys; from PySide6.QtWidgets import QMessageBox; "
        "QMessageBox.warning = lambda *a, **k: None; from app.main import main; sys.exit(main([]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "already running" in done.stderr
    assert [m.status for m in store.messages(sid) if m.id == mid] == ["streaming"]
    store.close()
    lock.unlock()
    again = instance_lock(data)  # free once the first one ends
    assert again is not None
    again.unlock()


def test_a_second_launch_brings_the_first_window_to_the_front(
    tmp_path: Path, monkeypatch, qtbot
) -> None:
    from PySide6.QtWidgets import QMainWindow

    data, run = tmp_path / "data", tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("BEVY_DATA_DIR", str(data))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    lock = instance_lock(data)
    window = QMainWindow()  # the first app's window, hidden (minimised, on another desktop)
    qtbot.addWidget(window)
    server = listen_for_launches(data, window)
    assert not window.isVisible()
    # The socket is in the user's runtime folder, not in the shared /tmp.
    assert Path(server.fullServerName()).parent == run and list(run.glob("bevy-desktop-*.sock"))
    env = {
        "BEVY_DATA_DIR": str(data),
        "XDG_RUNTIME_DIR": str(run),
        "QT_QPA_PLATFORM": "offscreen",
        "PATH": "/usr/bin:/bin",
    }
    code = "import sys; from app.main import main; sys.exit(main([]))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "already running" in done.stderr, done.stderr
    qtbot.waitUntil(window.isVisible, timeout=5000)
    server.close()
    lock.unlock()
