from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_chat_moe: Path) -> Path:
    """An app data dir and models dir of its own; the tiny chat MoE as the model."""
    monkeypatch.setenv("BEVY_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BEVY_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("BEVY_KEYRING", "off")  # remote engines' test keys: a file in data
    (tmp_path / "models").mkdir()
    return tiny_chat_moe
