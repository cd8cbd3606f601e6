"""Commands as an agent runs them: real bash, real process groups, real bubblewrap."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from backend.agent import shell
from backend.agent.shell import run_command

needs_bwrap = pytest.mark.skipif(
    shell.isolation() != "bwrap", reason="bubblewrap (bwrap) is not installed or cannot run here"
)


def test_output_and_exit_code(tmp_path: Path) -> None:
    r = run_command("echo out; echo err >&2; exit 3", tmp_path, sandbox=False)
    assert r.exit_code == 3 and r.output == "out\nerr\n" and r.cut == 0
    assert r.for_model() == "out\nerr\n[exit code 3]"
    assert run_command("pwd", tmp_path, sandbox=False).output.strip() == str(tmp_path.resolve())


def test_long_output_keeps_its_head_and_tail(tmp_path: Path) -> None:
    r = run_command("seq 1 100000", tmp_path, sandbox=False, max_chars=1000)
    total = sum(len(f"{i}\n") for i in range(1, 100001))
    assert r.output.startswith("1\n2\n3\n") and r.output.endswith("99999\n100000\n")
    assert r.cut == total - 1000
    assert f"[... {r.cut} characters cut ...]" in r.output


def test_a_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    t0 = time.monotonic()
    r = run_command(
        f"sleep 600 & echo $$ $! > {pid_file}; sleep 600", tmp_path, timeout_s=1, sandbox=False
    )
    assert r.timed_out and r.exit_code is None and time.monotonic() - t0 < 10
    assert "killed at its 1 s timeout" in r.for_model()
    group, child = map(int, pid_file.read_text().split())
    assert not shell._group_running(group) and not _pid_alive(child)


def test_background_jobs_do_not_outlive_their_command(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    r = run_command(f"(sleep 600 & echo $! > {pid_file}); echo done", tmp_path, sandbox=False)
    assert r.exit_code == 0 and r.output == "done\n"
    assert not _pid_alive(int(pid_file.read_text()))


def test_stop_ends_a_running_command(tmp_path: Path) -> None:
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    r = run_command("sleep 600", tmp_path, stop=stop, sandbox=False)
    assert r.stopped and r.exit_code is None and r.seconds < 10


def test_commands_get_none_of_the_apps_secrets(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("BEVY_API_KEY", "secret2")
    r = run_command("env", tmp_path, sandbox=False)
    assert "secret" not in r.output and "PATH=" in r.output


@needs_bwrap
def test_under_bubblewrap_only_the_workspace_is_writable(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    outside = tmp_path / "outside.txt"
    r = run_command(
        f"echo x > {outside}; echo y > inside.txt; cat /etc/hostname >/dev/null", ws, sandbox=True
    )
    assert not outside.exists()
    assert (ws / "inside.txt").read_text() == "y\n"
    home = Path.home()
    r = run_command(f"ls {home} 2>&1; touch /usr/x 2>&1", ws, sandbox=True)
    assert "Read-only file system" in r.output


@needs_bwrap
def test_under_bubblewrap_there_is_no_network(tmp_path: Path) -> None:
    r = run_command(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"",
        tmp_path,
        sandbox=True,
    )
    assert r.exit_code != 0 and "Network is unreachable" in r.output


@needs_bwrap
def test_a_sandboxed_timeout_leaves_nothing_running(tmp_path: Path) -> None:
    marker = f"bevy-test-{os.getpid()}-{time.monotonic_ns()}"
    r = run_command(f"sleep 600 & exec -a {marker} sleep 600", tmp_path, timeout_s=1, sandbox=True)
    assert r.timed_out
    time.sleep(0.3)
    assert marker not in _all_cmdlines()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for its parent counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _all_cmdlines() -> str:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                out.append((p / "cmdline").read_bytes().replace(b"\0", b" ").decode())
    return "\n".join(out)


def test_no_profile_runs_before_a_command(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    for name in (".bash_profile", ".profile", ".bashrc"):
        (home / name).write_text("echo PROFILE_RAN\n")
    monkeypatch.setenv("HOME", str(home))
    assert "PROFILE_RAN" not in run_command("echo hi", home, sandbox=False).output
    if shell.isolation() == "bwrap":  # there HOME is the workspace: its own files
        assert "PROFILE_RAN" not in run_command("echo hi", home, sandbox=True).output


@needs_bwrap
def test_under_bubblewrap_the_workspace_git_folder_is_read_only(tmp_path: Path) -> None:
    (tmp_path / ".git" / "hooks").mkdir(parents=True)
    r = run_command("echo evil > .git/hooks/pre-commit; echo ok > file.txt", tmp_path, sandbox=True)
    assert not (tmp_path / ".git" / "hooks" / "pre-commit").exists()
    assert (tmp_path / "file.txt").read_text() == "ok\n" and "Read-only" in r.output
