"""Local models: the demo MoE plus whatever the user added (``bevy models add``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from backend.errors import BevyError, ModelLoadError
from backend.paths import models_dir


def format_size(n: int) -> str:
    """A model's size for listings: GiB above one GiB, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    family: str
    experts_per_layer: int
    top_k: int
    size_bytes: int
    quant: str
    error: str | None = None  # set when the file no longer loads


def describe(path: Path) -> ModelEntry:
    from backend.models.loader import inspect_model  # torch: only once a model is read

    try:
        info = inspect_model(path)
    except ModelLoadError as exc:
        return ModelEntry(path.name, path, "?", 0, 0, 0, "?", exc.problem)
    c = info.config
    return ModelEntry(
        info.name, info.path, c.family, c.n_experts, c.top_k, info.size_bytes, info.quant
    )


def list_models() -> list[ModelEntry]:
    from backend.demo.build import demo_path

    paths = []
    if demo_path().exists():
        paths.append(demo_path())
    for entry in sorted(models_dir().iterdir()):
        target = entry.resolve() if entry.is_symlink() else entry
        if entry.suffix == ".gguf" or (target.is_dir() and (target / "config.json").exists()):
            paths.append(target)
    return [describe(p) for p in paths]


def add_model(path: str | os.PathLike) -> ModelEntry:
    """Validate a GGUF file or HF folder and link it into the models dir."""
    src = Path(path).expanduser().resolve()
    entry = describe(src)
    if entry.error:
        raise ModelLoadError(src, entry.error)
    link = models_dir() / (
        src.name if src.is_dir() or src.suffix == ".gguf" else src.name + ".gguf"
    )
    if link.exists() or link.is_symlink():
        if link.resolve() == src:
            return entry
        raise BevyError(f"a model named {link.name} is already registered ({link.resolve()})")
    link.symlink_to(src, target_is_directory=src.is_dir())
    return entry
