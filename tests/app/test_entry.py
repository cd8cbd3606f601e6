"""`bevy` with no arguments: the app where a display exists, else the headless demo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.main import has_display

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="display detection is Linux's")
def test_has_display(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    assert not has_display()
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    assert has_display()
    monkeypatch.delenv("WAYLAND_DISPLAY")
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    assert has_display()


def test_bevy_demo_runs_headless_sessions(tiny_chat_moe: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    done = subprocess.run(
        [sys.executable, "-m", "backend.serving.cli", "demo", "--model", str(tiny_chat_moe), "--sessions", "3", "--max-tokens", "5", "--cache", "0.5"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("length") >= 3  # each session's finish reason in the table


def test_bevy_demo_bad_cache_is_one_clear_error(tiny_chat_moe: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "backend.serving.cli", "demo", "--model", str(tiny_chat_moe), "--cache", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("bevy: error:") and "legal minimum" in done.stderr
    assert "Traceback" not in done.stderr


def test_importing_the_app_and_its_backend_surface_loads_no_torch() -> None:
    """The window must appear before torch loads: every app module and ``backend.api``
    import without it (the engine comes in on the loader thread, through api calls)."""
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "app").rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {['backend.api', *modules]!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_version_names_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from app.main import entry

    with pytest.raises(SystemExit) as exit_info:
        entry(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"bevy {version('bevy-desktop')}"
