"""The workspace's file tools on a real temp folder: every way out is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backend.agent import workspace as ws_mod
from backend.agent.workspace import ToolError, Workspace


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "README.md").write_text("hello\n")
    return Workspace(root)


@pytest.mark.parametrize("path", ["../outside.txt", "pkg/../../outside.txt", "/etc/passwd", "~/x"])
def test_paths_that_lead_out_are_refused(ws: Workspace, path: str) -> None:
    (ws.root.parent / "outside.txt").write_text("secret")
    with pytest.raises(ToolError, match="outside the workspace"):
        ws.read_file(path)
    with pytest.raises(ToolError, match="outside the workspace"):
        ws.write_file(path, "x")
    assert (ws.root.parent / "outside.txt").read_text() == "secret"


def test_a_symlink_out_is_refused_by_name(ws: Workspace, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("key")
    os.symlink(tmp_path / "secret.txt", ws.root / "link.txt")
    os.symlink(tmp_path, ws.root / "up")
    with pytest.raises(ToolError, match="symlink that leads outside"):
        ws.read_file("link.txt")
    with pytest.raises(ToolError, match="symlink that leads outside"):
        ws.write_file("up/new.txt", "x")
    assert not (tmp_path / "new.txt").exists()


def test_paths_inside_are_fine_however_written(ws: Workspace) -> None:
    assert ws.read_file("pkg/../README.md") == "hello\n"
    assert ws.read_file(str(ws.root / "README.md")) == "hello\n"
    os.symlink(ws.root / "README.md", ws.root / "alias.md")
    assert ws.read_file("alias.md") == "hello\n"


def test_list_and_read_ranges(ws: Workspace) -> None:
    listing = ws.list_dir(".", recursive=True)
    assert listing.splitlines() == ["README.md  (6 bytes)", "pkg/", "pkg/mod.py  (32 bytes)"]
    assert "is not a folder" in _error(ws.list_dir, "README.md")
    assert ws.read_file("pkg/mod.py", 2, 2) == "pkg/mod.py (lines 2-2 of 2)\n    return a - b\n"
    assert "past the end" in _error(ws.read_file, "pkg/mod.py", 9)
    (ws.root / "blob.bin").write_bytes(b"\0\1\2" * 10)
    assert "binary file" in _error(ws.read_file, "blob.bin")


def test_a_long_file_is_cut_with_where_to_go_on(ws: Workspace) -> None:
    (ws.root / "long.txt").write_text("".join(f"line {i}\n" for i in range(1, 5001)))
    out = ws.read_file("long.txt")
    assert out.startswith(f"long.txt (lines 1-{ws_mod.MAX_READ_LINES} of 5000)")
    assert out.rstrip().endswith(f"start_line={ws_mod.MAX_READ_LINES + 1} for more]")
    assert ws.read_file("long.txt", 4999).endswith("line 4999\nline 5000\n")


@pytest.mark.parametrize("ripgrep", [True, False])
def test_search_finds_lines_with_or_without_ripgrep(ws: Workspace, monkeypatch, ripgrep) -> None:
    if ripgrep and ws_mod.shutil.which("rg") is None:
        pytest.skip("ripgrep is not installed")
    if not ripgrep:
        monkeypatch.setattr(ws_mod.shutil, "which", lambda name: None)
    assert ws.search(r"return a [-+] b") == "pkg/mod.py:2:    return a - b"
    assert ws.search("hello", glob="*.md") == "README.md:1:hello"
    assert ws.search("nothing-like-this").startswith("no matches")
    assert "invalid regex" in _error(ws.search, "(")


def test_write_then_edit_shows_diffs(ws: Workspace) -> None:
    msg, diff = ws.write_file("new/dir/a.txt", "one\ntwo\n")
    assert msg == "created new/dir/a.txt (8 bytes)" and "+one" in diff and "/dev/null" in diff
    msg, diff = ws.edit_file("pkg/mod.py", "a - b", "a + b")
    assert msg == "edited pkg/mod.py (1 replacement)"
    assert "-    return a - b" in diff and "+    return a + b" in diff
    assert (ws.root / "pkg/mod.py").read_text().endswith("return a + b\n")


def test_writes_replace_the_whole_file_at_once_and_keep_its_mode(
    ws: Workspace, monkeypatch
) -> None:
    """A write goes to a temporary file renamed over the old one: a reader never sees it
    half written, a failed write leaves the old content, and nothing is left behind."""
    script = ws.root / "run.sh"
    script.write_text("echo old\n")
    script.chmod(0o750)
    ws.write_file("run.sh", "echo new\n")
    ws.edit_file("run.sh", "new", "newer")
    assert script.read_text() == "echo newer\n" and script.stat().st_mode & 0o777 == 0o750
    import os

    real = os.replace

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        ws.write_file("run.sh", "echo lost\n")
    monkeypatch.setattr(os, "replace", real)
    assert script.read_text() == "echo newer\n"
    assert sorted(p.name for p in ws.root.iterdir() if p.name.startswith(".run.sh")) == []


def test_edits_that_are_not_exact_and_unique_change_nothing(ws: Workspace) -> None:
    (ws.root / "x.txt").write_text("a a a\n")
    assert "occurs 3 times" in _error(ws.edit_file, "x.txt", "a", "b")
    assert "not found" in _error(ws.edit_file, "x.txt", "zzz", "b")
    assert "differs in whitespace" in _error(ws.edit_file, "x.txt", "a  a", "b")
    assert "use write_file" in _error(ws.edit_file, "missing.txt", "a", "b")
    assert (ws.root / "x.txt").read_text() == "a a a\n"
    assert ws.edit_file("x.txt", "a", "b", replace_all=True)[0].endswith("(3 replacements)")


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ToolError) as exc:
        fn(*args, **kwargs)
    return str(exc.value)


@pytest.mark.parametrize("root", ["", "relative/dir", "/", "~"])
def test_a_workspace_must_be_a_real_project_folder(root: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "relative" / "dir").mkdir(parents=True)
    with pytest.raises(ToolError):
        Workspace(root)


def test_edits_keep_line_endings_and_refuse_text_that_is_not_utf8(ws: Workspace) -> None:
    (ws.root / "dos.txt").write_bytes(b"one\r\ntwo\r\n")
    ws.edit_file("dos.txt", "two", "2")
    assert (ws.root / "dos.txt").read_bytes() == b"one\r\n2\r\n"
    (ws.root / "latin1.txt").write_bytes(b"caf\xe9\n")
    assert "not UTF-8" in _error(ws.edit_file, "latin1.txt", "caf", "tea")
    assert (ws.root / "latin1.txt").read_bytes() == b"caf\xe9\n"


def test_the_python_search_does_not_follow_symlinks_out(
    ws: Workspace, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(ws_mod.shutil, "which", lambda name: None)
    (tmp_path / "key").write_text("SECRET-KEY\n")
    os.symlink(tmp_path / "key", ws.root / "k")
    assert ws.search("SECRET").startswith("no matches")
