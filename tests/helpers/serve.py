"""`bevy serve` as a real process for the API tests: started on a free port, waited
for, stopped."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bevy(*args: str, **kw) -> subprocess.Popen:
    """The ``bevy`` command line of this checkout, as a process."""
    return subprocess.Popen([sys.executable, "-m", "backend.serving.cli", *args], cwd=ROOT, **kw)


@contextlib.contextmanager
def serving(model: Path, logs: Path, *args: str) -> Iterator[str]:
    """``bevy serve --model model *args`` on a free port until the block ends; yields
    its base URL once it answers and has announced itself. Its output goes to ``logs``."""
    with server_process(model, logs, *args) as (url, _proc):
        yield url


@contextlib.contextmanager
def server_process(model: Path, logs: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``serving``, yielding the process too (for tests that kill it)."""
    port = free_port()
    out, err = logs / "stdout.txt", logs / "stderr.txt"
    with out.open("w") as o, err.open("w") as e:
        proc = bevy("serve", "--model", str(model), "--port", str(port), *args, stdout=o, stderr=e)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the server exited: {err.read_text()}"
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        # The one line announcing the server: printed just after it starts answering.
        while f"{url}/v1" not in out.read_text():
            assert time.monotonic() < deadline, f"no announcement: {out.read_text()!r}"
            time.sleep(0.05)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
