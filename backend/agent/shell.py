"""Running an agent's shell commands: in the workspace, time-limited, with their whole
process group killed on timeout or stop, output cut to its head and tail.

Commands get a minimal environment (none of the app's variables: no API keys or tokens
reach them). On Linux with bubblewrap (``bwrap``) installed they run in it: the network
off, the system read-only, the home folder hidden and only the workspace writable.
Elsewhere they run as the user, in the workspace folder; ``isolation()`` says which.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DEFAULT_TIMEOUT_S = 60.0
MAX_OUTPUT_CHARS = 10_000  # head and tail halves of this are kept
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt")
_SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None  # None when the command was killed (timeout or stop)
    output: str  # stdout and stderr as they interleaved, cut to head + tail
    cut: int  # characters cut from the middle of the output
    seconds: float
    timed_out: bool = False
    stopped: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    def for_model(self) -> str:
        """The result as the model reads it."""
        if self.timed_out:
            status = f"killed at its {self.timeout_s:g} s timeout"
        elif self.stopped:
            status = "stopped by the user"
        else:
            status = f"exit code {self.exit_code}"
        return (
            f"{self.output.rstrip()}\n[{status}]"
            if self.output.strip()
            else f"[no output; {status}]"
        )


@cache
def isolation() -> str:
    """ "bwrap" when commands run in bubblewrap (network off, only the workspace
    writable), else "none" (they run as the user, in the workspace folder)."""
    if os.name != "posix" or shutil.which("bwrap") is None:
        return "none"
    probe = subprocess.run(
        [*_bwrap_args(Path("/tmp")), "true"], capture_output=True, timeout=10, check=False
    )
    return "bwrap" if probe.returncode == 0 else "none"


def describe_isolation(kind: str | None = None) -> str:
    """One line for the UI: what a command can reach."""
    if (kind or isolation()) == "bwrap":
        return "sandboxed (bubblewrap): no network, only the workspace is writable"
    return "not sandboxed: commands run as you, starting in the workspace folder"


def _bwrap_args(workspace: Path) -> list[str]:
    args = ["bwrap", "--die-with-parent", "--unshare-all"]
    for d in _SYSTEM_DIRS:
        p = Path(d)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            args += ["--ro-bind", d, d]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    ws = str(workspace)
    args += ["--bind", ws, ws]
    git = workspace / ".git"
    if git.is_dir():  # hooks or config written there would run on the host, in git
        args += ["--ro-bind", str(git), str(git)]
    return [*args, "--chdir", ws]


def _env(workspace: Path, sandboxed: bool) -> dict[str, str]:
    env = {
        "PATH": _SANDBOX_PATH if sandboxed else os.environ.get("PATH", _SANDBOX_PATH),
        "HOME": str(workspace) if sandboxed else os.path.expanduser("~"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if not sandboxed and "USER" in os.environ:
        env["USER"] = os.environ["USER"]
    return env


class _Output:
    """Keeps the first and last ``limit // 2`` characters of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.half = limit // 2
        self.head: list[str] = []
        self.head_len = 0
        self.tail: deque[str] = deque()
        self.tail_len = 0
        self.total = 0

    def add(self, text: str) -> None:
        self.total += len(text)
        if self.head_len < self.half:
            take = text[: self.half - self.head_len]
            self.head.append(take)
            self.head_len += len(take)
            text = text[len(take) :]
        if text:
            self.tail.append(text)
            self.tail_len += len(text)
            while self.tail_len - len(self.tail[0]) >= self.half:
                self.tail_len -= len(self.tail.popleft())

    def text(self) -> tuple[str, int]:
        head, tail = "".join(self.head), "".join(self.tail)[-self.half :] if self.half else ""
        cut = self.total - len(head) - len(tail)
        if cut <= 0:
            return head + "".join(self.tail), 0
        return f"{head}\n[... {cut} characters cut ...]\n{tail}", cut


def run_command(
    command: str,
    workspace: str | Path,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stop: threading.Event | None = None,
    sandbox: bool | None = None,
    max_chars: int = MAX_OUTPUT_CHARS,
) -> CommandResult:
    """Run ``command`` with bash in ``workspace``. ``sandbox``: None uses
    bubblewrap when it works here. The command's process group (its background jobs
    too) is killed when it ends, times out, or ``stop`` is set."""
    ws = Path(workspace).resolve()
    sandboxed = isolation() == "bwrap" if sandbox is None else sandbox
    # No profile or rc files: a user's ~/.profile exports secrets, and in the sandbox
    # (HOME = the workspace) a repository's own .profile would run before every command.
    argv = ["bash", "--noprofile", "--norc", "-c", command]
    if sandboxed:
        argv = [*_bwrap_args(ws), *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=ws,
        env=_env(ws, sandboxed),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, to kill it whole
    )
    out = _Output(max_chars)
    reader = threading.Thread(target=_read, args=(proc, out), daemon=True)
    reader.start()
    timed_out = stopped = False
    try:
        while True:
            try:
                proc.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                pass
            if stop is not None and stop.is_set():
                stopped = True
            elif time.monotonic() - t0 > timeout_s:
                timed_out = True
            if timed_out or stopped:
                _kill_group(proc, grace_s=1.0)
                proc.wait()
                break
    except BaseException:  # Ctrl+C in a terminal: the command's own session never sees it
        _kill_group(proc, grace_s=0.0)
        raise
    # Whatever it left running in the background goes with it.
    _kill_group(proc, grace_s=0.0)
    reader.join(timeout=2.0)
    if proc.stdout is not None:
        proc.stdout.close()
    text, cut = out.text()
    return CommandResult(
        None if timed_out or stopped else proc.returncode,
        text,
        cut,
        time.monotonic() - t0,
        timed_out,
        stopped,
        timeout_s,
    )


def _read(proc: subprocess.Popen, out: _Output) -> None:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (OSError, ValueError):
            break
        if not chunk:
            break
        pending += chunk
        # Decode whole characters only; a multibyte one cut by the read waits.
        try:
            out.add(pending.decode("utf-8"))
            pending = b""
        except UnicodeDecodeError as exc:
            if exc.start < len(pending) - 4:
                out.add(pending.decode("utf-8", errors="replace"))
                pending = b""
            else:
                out.add(pending[: exc.start].decode("utf-8"))
                pending = pending[exc.start :]
    if pending:
        out.add(pending.decode("utf-8", errors="replace"))


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL what is left after ``grace_s``
    (at once when 0)."""
    pgid = proc.pid
    try:
        if grace_s > 0:
            os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                time.sleep(0.02)
                proc.poll()  # reap the leader, or the group never looks empty
                if not _group_running(pgid):
                    return
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    # SIGKILL is delivered asynchronously: wait (briefly) until the group's members
    # have really died, so that nothing the command started is still running when the
    # agent reads its result and runs the next command.
    deadline = time.monotonic() + 2.0
    while _group_running(pgid) and time.monotonic() < deadline:
        time.sleep(0.005)


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: an
    orphan's zombie waits for init to reap it, which may never come in a container."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():  # macOS: the group's zombies count as members
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for p in proc_dir.iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
