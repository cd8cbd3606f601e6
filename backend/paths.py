"""Where Bevy keeps its files: the platform's app dirs; BEVY_CACHE_DIR and BEVY_MODELS_DIR
override them (tests, portable installs)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "bevy-desktop"


def cache_dir() -> Path:
    base = os.environ.get("BEVY_CACHE_DIR")
    path = Path(base) if base else Path(platformdirs.user_cache_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """Models built or registered by Bevy (the demo MoE lives here)."""
    base = os.environ.get("BEVY_MODELS_DIR")
    path = Path(base) if base else Path(platformdirs.user_data_dir(APP_NAME)) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
