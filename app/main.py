"""Start the desktop app: ``bevy`` with no arguments, or ``python -m app``."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

# The app's id where it is installed: its .desktop file's name and its icon's.
DESKTOP_ID = "org.bevy-desktop.bevy-desktop"


def has_display() -> bool:
    """Whether Qt can open a window here (Linux without X11/Wayland cannot)."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(
        os.environ.get("DISPLAY")
        or os.environ.get("WAYLAND_DISPLAY")
        or os.environ.get("QT_QPA_PLATFORM") in ("offscreen", "minimal", "vnc")
    )


def instance_lock(folder):
    """The data dir's lock, held while this app runs; None if another app holds it.

    One app per data dir: a second one would mark the first one's streaming replies
    interrupted at start and write beside it. QLockFile stores the holder's PID and
    takes over a lock whose holder died."""
    from PySide6.QtCore import QLockFile

    folder.mkdir(parents=True, exist_ok=True)
    lock = QLockFile(str(folder / "bevy.lock"))
    lock.setStaleLockTime(0)  # stale only when its process is gone, however old
    return lock if lock.tryLock(0) else None


def _launch_socket(folder) -> str:
    """The local socket the app on ``folder`` listens on for later launches: in the
    user's own runtime folder ($XDG_RUNTIME_DIR, mode 0700) where there is one, not in
    the shared /tmp Qt uses for a bare name."""
    digest = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:16]
    name = f"bevy-desktop-{digest}"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if sys.platform.startswith("linux") and runtime and Path(runtime).is_dir():
        return str(Path(runtime) / f"{name}.sock")
    return name


def listen_for_launches(folder, window):
    """While this app holds ``folder``'s lock: a later launch on it brings ``window`` to
    the front, as a second click on a desktop app's icon does."""
    from PySide6.QtNetwork import QLocalServer

    name = _launch_socket(folder)
    server = QLocalServer(window)
    server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
    QLocalServer.removeServer(name)  # left by an app that crashed: we hold the lock now

    def bring_to_front() -> None:
        while (conn := server.nextPendingConnection()) is not None:
            conn.disconnectFromServer()
            conn.deleteLater()
        if window.isMinimized():
            window.showNormal()
        window.show()
        window.raise_()
        window.activateWindow()

    server.newConnection.connect(bring_to_front)
    server.listen(name)
    return server


def raise_running_app(folder, timeout_ms: int = 2000) -> bool:
    """Ask the app holding ``folder`` to show its window; False if none answers."""
    from PySide6.QtNetwork import QLocalSocket

    sock = QLocalSocket()
    sock.connectToServer(_launch_socket(folder))
    answered = sock.waitForConnected(timeout_ms)
    sock.abort()
    return answered


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication, QMessageBox

    from app.main_window import MainWindow
    from app.store import Store, StoreError, data_dir

    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setApplicationName("Bevy")
    app.setOrganizationName("Bevy Desktop")
    # The installed menu entry's name (packaging/linux-system): Wayland compositors match
    # the window to it, and its icon is in the icon theme.
    app.setDesktopFileName(DESKTOP_ID)
    icon = QIcon.fromTheme(DESKTOP_ID)
    if not icon.isNull():
        app.setWindowIcon(icon)
    lock = instance_lock(data_dir())
    if lock is None and raise_running_app(data_dir()):
        print(
            f"bevy: Bevy is already running with {data_dir()}; showing its window", file=sys.stderr
        )
        return 0
    if lock is None:
        text = (
            f"Bevy is already running with this data folder ({data_dir()}). "
            "Switch to its window; a second copy would write into the same conversations."
        )
        print(f"bevy: error: {text}", file=sys.stderr)
        QMessageBox.warning(None, "Bevy is already running", text)
        return 1
    try:
        store = Store()
    except StoreError as exc:
        print(f"bevy: error: {exc}", file=sys.stderr)
        lock.unlock()
        return 2
    window = MainWindow(store)
    launches = listen_for_launches(data_dir(), window)
    window.show()
    window.start_engine()
    code = app.exec()
    launches.close()
    store.close()
    lock.unlock()
    return code


def entry(argv: list[str] | None = None) -> int:
    """The ``bevy`` command: the app with no arguments, else the command line."""
    from backend.api import run_cli as cli_main

    argv = sys.argv[1:] if argv is None else argv
    if argv:
        return cli_main(argv)
    if not has_display():
        print("bevy: no display found; running the headless demo instead", file=sys.stderr)
        return cli_main([])
    return main()


if __name__ == "__main__":
    sys.exit(main())
