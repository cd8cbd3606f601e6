"""The Debian package end to end: built from this checkout with `make package`, installed
with apt, run from the installed copy (headless and GUI), removed.

It installs and removes a system package as root, so it runs only where asked:
BEVY_TEST_PACKAGE=1, which .ci/run sets on its throwaway machine. Asked for there, a
missing prerequisite is a failure, not a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = "bevy-desktop"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("BEVY_TEST_PACKAGE") != "1",
        reason="installs a system package: set BEVY_TEST_PACKAGE=1 (as root, on Debian)",
    ),
]


def sh(*cmd: str, timeout: float = 900, env: dict | None = None, cwd=None):
    return subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


def user_env(home: Path, **extra: str) -> dict:
    """A login's environment, nothing of this test run's: the installed app must not lean
    on the venv, PYTHONPATH or the developer's caches."""
    return {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **extra}


def as_root() -> list[str]:
    """The prefix that runs apt as root: none for root, else sudo without a password."""
    if os.geteuid() == 0:
        return []
    assert shutil.which("sudo") and sh("sudo", "-n", "true").returncode == 0, (
        "apt-get install needs root, or sudo without a password"
    )
    return ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]


def test_deb_builds_installs_runs_and_removes_cleanly(tmp_path):
    assert shutil.which("apt-get"), "needs a Debian or Ubuntu machine"
    root = as_root()

    for old in (ROOT / "dist").glob(f"{APP}_*.deb"):
        old.unlink()
    built = sh("make", "package", cwd=ROOT, timeout=1800)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    (deb,) = (ROOT / "dist").glob(f"{APP}_*.deb")

    installed = sh(
        *root,
        "apt-get",
        "install",
        "-y",
        "--reinstall",
        str(deb),
        timeout=600,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    try:
        assert shutil.which(APP, path="/usr/bin") == f"/usr/bin/{APP}"
        assert Path(f"/usr/share/applications/org.bevy-desktop.{APP}.desktop").is_file()
        assert Path(f"/usr/share/icons/hicolor/256x256/apps/org.bevy-desktop.{APP}.png").is_file()
        assert Path(f"/usr/share/man/man1/{APP}.1.gz").is_file()

        home = tmp_path / "home"
        home.mkdir()
        version = sh(APP, "--version", env=user_env(home), timeout=60)
        assert version.returncode == 0 and version.stdout.strip() == f"{APP} 0.1.0", version

        # First run with an empty home: the demo MoE is built into the user's cache dir.
        answer = sh(
            APP,
            "generate",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "Name the capital of France.",  # (see tests/backend/demo/test_demo.py)
            env=user_env(home),
            timeout=900,
        )
        assert answer.returncode == 0, answer.stderr[-3000:]
        assert "Paris" in answer.stdout, answer.stdout
        assert list((home / ".cache" / APP / "demo").glob("*.gguf"))
        assert not list(Path(f"/usr/lib/{APP}").rglob("*.gguf"))

        # No display at all: the headless demo instead of the window.
        headless = sh(
            APP, "demo", "--sessions", "2", "--max-tokens", "8", env=user_env(home), timeout=600
        )
        assert headless.returncode == 0, headless.stderr[-3000:]
        assert "2 concurrent sessions" in headless.stdout, headless.stdout[-2000:]

        # The GUI, offscreen, stays up for 30 s (timeout ends it: 124).
        gui = sh("timeout", "30", APP, env=user_env(home, QT_QPA_PLATFORM="offscreen"), timeout=120)
        assert gui.returncode == 124, gui.stdout[-2000:] + gui.stderr[-3000:]
        assert "Traceback" not in gui.stderr, gui.stderr[-3000:]

        # Running it (as root here) wrote nothing into the installed tree.
        owned = set(sh("dpkg", "-L", APP).stdout.splitlines())
        present = {str(p) for p in Path(f"/usr/lib/{APP}").rglob("*")}
        assert present <= owned, sorted(present - owned)[:10]
    finally:
        removed = sh(
            *root,
            "apt-get",
            "remove",
            "-y",
            APP,
            timeout=600,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    assert removed.returncode == 0, removed.stderr[-3000:]
    assert shutil.which(APP, path="/usr/bin:/usr/local/bin:/bin") is None
    assert shutil.which("bevy", path="/usr/bin:/bin") is None
    assert not Path(f"/usr/lib/{APP}").exists()
    assert not Path(f"/usr/share/applications/org.bevy-desktop.{APP}.desktop").exists()
