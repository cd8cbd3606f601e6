"""Start the desktop app: ``bevy`` with no arguments, or ``python -m app``."""

from __future__ import annotations

import os
import sys


def has_display() -> bool:
    """Whether Qt can open a window here (Linux without X11/Wayland cannot)."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(
        os.environ.get("DISPLAY")
        or os.environ.get("WAYLAND_DISPLAY")
        or os.environ.get("QT_QPA_PLATFORM") in ("offscreen", "minimal", "vnc")
    )


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.store import Store, StoreError

    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setApplicationName("Bevy")
    app.setOrganizationName("Bevy Desktop")
    try:
        store = Store()
    except StoreError as exc:
        print(f"bevy: error: {exc}", file=sys.stderr)
        return 2
    window = MainWindow(store)
    window.show()
    window.start_engine()
    code = app.exec()
    store.close()
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
