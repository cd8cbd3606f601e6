from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.pagecache import fs_type

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder on a real disk: tmpfs *is* the page cache, so the proof means nothing there."""
    if fs_type(tmp_path.resolve()) not in ("tmpfs", "ramfs"):
        yield tmp_path
        return
    folder = ROOT / "tests" / "artifacts" / f"store-{os.getpid()}"
    if fs_type(folder.parent.resolve()) in ("tmpfs", "ramfs", ""):
        pytest.skip("no disk-backed folder to test page-cache bypass on")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
