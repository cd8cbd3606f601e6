"""The folder an agent works in, and the file tools that read and change it.

Every path a model gives is resolved (symlinks followed) and must stay inside the
workspace: a path that leads out — ``../x``, ``/etc/passwd``, a symlink to elsewhere — is
refused with a message the model can act on, never followed.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

MAX_READ_BYTES = 256 * 1024  # a file larger than this is read by line ranges
MAX_READ_LINES = 2000
MAX_LIST_ENTRIES = 500
MAX_MATCHES = 200
_SKIP_DIRS = {".git", "__pycache__", ".venv", "node_modules", ".mypy_cache", ".pytest_cache"}


class ToolError(Exception):
    """A tool could not do what was asked; the message goes back to the model."""


class Workspace:
    def __init__(self, root: str | Path) -> None:
        if not str(root).strip():
            raise ToolError("no workspace folder is set")
        root = Path(root).expanduser()
        if not root.is_absolute():
            raise ToolError(f"the workspace {root} must be an absolute path")
        if not root.is_dir():
            raise ToolError(f"the workspace {root} is not a folder")
        self.root = root.resolve()
        if self.root == Path(self.root.anchor) or self.root == Path.home().resolve():
            raise ToolError(f"{self.root} is too broad for a workspace: pick a project folder")

    def resolve(self, path: str | None) -> Path:
        """``path`` (relative to the workspace, or absolute inside it) as a real path
        inside the workspace; ToolError if it leads out."""
        given = (path or ".").strip() or "."
        full = Path(given).expanduser()
        if not full.is_absolute():
            full = self.root / full
        real = full.resolve()
        if real != self.root and self.root not in real.parents:
            how = "a symlink that leads" if _through_symlink(self.root, full) else "a path"
            raise ToolError(
                f"{given!r} is {how} outside the workspace; use paths inside {self.root}"
            )
        return real

    def show(self, path: Path) -> str:
        """``path`` as the model should write it: relative to the workspace."""
        rel = path.relative_to(self.root)
        return str(rel) if str(rel) != "." else "."

    # --- reading ------------------------------------------------------------------------

    def list_dir(self, path: str = ".", recursive: bool = False) -> str:
        folder = self.resolve(path)
        if not folder.is_dir():
            raise ToolError(f"{path!r} is not a folder")
        lines: list[str] = []
        cut = False
        for entry in _walk(folder, recursive):
            if len(lines) >= MAX_LIST_ENTRIES:
                cut = True
                break
            rel = entry.relative_to(folder)
            if entry.is_dir() and not entry.is_symlink():
                lines.append(f"{rel}/")
            else:
                size = entry.lstat().st_size
                lines.append(
                    f"{rel}  ({size} bytes)" + (" -> symlink" if entry.is_symlink() else "")
                )
        if not lines:
            return f"{self.show(folder)} is empty"
        if cut:
            lines.append("... (more entries; list a subfolder to see them)")
        return "\n".join(lines)

    def read_file(
        self, path: str, start_line: int | None = None, end_line: int | None = None
    ) -> str:
        file = self.resolve(path)
        if not file.is_file():
            raise ToolError(
                f"{path!r} is not a file" + (" (it is a folder)" if file.is_dir() else "")
            )
        with file.open("rb") as f:
            data = f.read(MAX_READ_BYTES + 1)
        if b"\0" in data[:8192]:
            raise ToolError(f"{path!r} is a binary file ({file.stat().st_size} bytes)")
        if len(data) > MAX_READ_BYTES:
            data = file.read_bytes()  # ranges of a large file: read it whole, show a part
        text = data.decode("utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        n = len(lines)
        first = max(1, start_line or 1)
        last = min(n, end_line or n)
        if first > max(n, 1):
            raise ToolError(f"{path!r} has {n} lines; start_line {first} is past the end")
        shown = lines[first - 1 : last]
        note = ""
        if len(shown) > MAX_READ_LINES or sum(map(len, shown)) > MAX_READ_BYTES:
            shown = _fit(shown)
            last = first + len(shown) - 1
            note = f"\n[... cut at line {last}; read from start_line={last + 1} for more]"
        header = (
            f"{self.show(file)} (lines {first}-{last} of {n})" if (first, last) != (1, n) else ""
        )
        body = "".join(shown)
        return (header + "\n" if header else "") + body + note

    def search(self, pattern: str, path: str = ".", glob: str | None = None) -> str:
        """Lines matching the regex ``pattern`` under ``path``: "file:line: text"."""
        where = self.resolve(path)
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ToolError(f"invalid regex {pattern!r}: {exc}") from None
        rg = shutil.which("rg")
        hits = self._rg(rg, pattern, where, glob) if rg else self._grep(compiled, where, glob)
        if not hits:
            return f"no matches for {pattern!r}"
        out = hits[:MAX_MATCHES]
        if len(hits) > MAX_MATCHES:
            out.append(f"... ({len(hits) - MAX_MATCHES} more matches; narrow the pattern or path)")
        return "\n".join(out)

    def _rg(self, rg: str, pattern: str, where: Path, glob: str | None) -> list[str]:
        cmd = [
            rg,
            "--line-number",
            "--with-filename",
            "--no-heading",
            "--color",
            "never",
            "--max-columns",
            "300",
        ]
        if glob:
            cmd += ["--glob", glob]
        cmd += ["-e", pattern, "--", str(where)]
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                encoding="utf-8",
                errors="replace",
                timeout=60,
                cwd=self.root,
            )
        except subprocess.TimeoutExpired:
            raise ToolError("the search took over 60 s; narrow the path or pattern") from None
        if done.returncode == 2 and not done.stdout:
            raise ToolError(f"search failed: {done.stderr.strip()[:300]}")
        root = f"{self.root}{os.sep}"
        return [line.removeprefix(root) for line in done.stdout.splitlines()]

    def _grep(self, rx: re.Pattern, where: Path, glob: str | None) -> list[str]:
        hits: list[str] = []
        # Symlinks are not followed (rg does not follow them either): one made by a command
        # could point anywhere.
        files = (
            [where]
            if where.is_file()
            else [p for p in _walk(where, True) if p.is_file() and not p.is_symlink()]
        )
        for file in files:
            if glob and not file.match(glob):
                continue
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # binary or unreadable: rg skips these too
            for i, line in enumerate(text.splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{self.show(file)}:{i}:{line[:300]}")
                    if len(hits) > MAX_MATCHES:
                        return hits
        return hits

    # --- writing ------------------------------------------------------------------------

    def write_file(self, path: str, content: str) -> tuple[str, str]:
        """Write ``content``; returns (message, unified diff against what was there)."""
        file = self.resolve(path)
        if file.is_dir():
            raise ToolError(f"{path!r} is a folder")
        before = _text(file) if file.exists() else None
        file.parent.mkdir(parents=True, exist_ok=True)
        _write_whole(file, content)
        name = self.show(file)
        diff = _diff(name, before or "", content, new=before is None)
        verb = "created" if before is None else "replaced"
        return f"{verb} {name} ({len(content.encode())} bytes)", diff

    def edit_file(
        self, path: str, old: str, new: str, replace_all: bool = False
    ) -> tuple[str, str]:
        """Replace the exact text ``old`` by ``new``: once (it must occur exactly once) or,
        with ``replace_all``, everywhere. Returns (message, unified diff)."""
        file = self.resolve(path)
        if not file.is_file():
            raise ToolError(f"{path!r} does not exist; use write_file to create it")
        if not old:
            raise ToolError("old must not be empty")
        before = _text(file)
        count = before.count(old)
        if count == 0:
            hint = " (it differs in whitespace)" if _squash(old) in _squash(before) else ""
            raise ToolError(
                f"the old text was not found in {self.show(file)}{hint}; read the file and copy it exactly"
            )
        if count > 1 and not replace_all:
            raise ToolError(
                f"the old text occurs {count} times in {self.show(file)}; include more "
                "surrounding lines to make it unique, or set replace_all"
            )
        after = before.replace(old, new) if replace_all else before.replace(old, new, 1)
        _write_whole(file, after)
        name = self.show(file)
        n = count if replace_all else 1
        return f"edited {name} ({n} replacement{'s' if n > 1 else ''})", _diff(name, before, after)


def _write_whole(file: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``file``, then rename it over ``file``:
    anyone reading it (an editor, a build, the user) sees the old content or the new,
    never a half-written file, and a failed write leaves the old one. Keeps an existing
    file's permissions; a new one gets open()'s (0o666 less the umask, applied by the
    kernel, so no thread changes the process's umask)."""
    mode = file.stat().st_mode & 0o7777 if file.exists() else None
    tmp = file.parent / f".{file.name}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _text(file: Path) -> str:
    """A text file's content as it is (line endings kept); ToolError if it is not UTF-8,
    as rewriting it would change bytes the edit never touched."""
    try:
        with file.open(encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError:
        raise ToolError(f"{file.name} is not UTF-8 text; it is left as it is") from None


def _through_symlink(root: Path, full: Path) -> bool:
    """Whether some part of ``full`` (under ``root``) is a symlink."""
    p = full
    while p != p.parent:
        if p.is_symlink():
            return True
        if p == root:
            return False
        p = p.parent
    return False


def _walk(folder: Path, recursive: bool):
    """Entries of ``folder`` in name order (folders' contents after them, when
    ``recursive``), skipping tool caches; symlinked folders are listed, not entered."""
    try:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError:
        return
    for entry in entries:
        if entry.name in _SKIP_DIRS and entry.is_dir():
            continue
        yield entry
        if recursive and entry.is_dir() and not entry.is_symlink():
            yield from _walk(entry, True)


def _fit(lines: list[str]) -> list[str]:
    out, size = [], 0
    for line in lines:
        if len(out) >= MAX_READ_LINES or size + len(line) > MAX_READ_BYTES:
            break
        out.append(line)
        size += len(line)
    return out or lines[:1]


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _diff(name: str, before: str, after: str, new: bool = False) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile="/dev/null" if new else f"a/{name}",
            tofile=f"b/{name}",
        )
    )
