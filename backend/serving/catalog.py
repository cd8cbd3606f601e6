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
    # The routed experts as the cache sees them: how many, the largest one's bytes (a
    # cache slot, near enough) and all of them together.
    n_experts: int = 0
    expert_bytes: int = 0
    experts_total_bytes: int = 0

    def cache_bytes(self, spec: str) -> int:
        """About what a cache of ``spec`` ("30%", "288", "512MiB") holds for this model;
        ValueError for a spec that is none of those."""
        from backend.config import parse_cache_size

        if not self.n_experts:
            return 0
        slots = min(parse_cache_size(spec, self.n_experts, self.expert_bytes), self.n_experts)
        return slots * self.expert_bytes


def describe(path: Path) -> ModelEntry:
    from backend.models.loader import inspect_model  # torch: only once a model is read

    try:
        info = inspect_model(path)
    except ModelLoadError as exc:
        return ModelEntry(path.name, path, "?", 0, 0, 0, "?", exc.problem)
    c = info.config
    sizes = [sum(p.nbytes for p in e.parts) for layer in info.experts for e in layer]
    return ModelEntry(
        info.name,
        info.path,
        c.family,
        c.n_experts,
        c.top_k,
        info.size_bytes,
        info.quant,
        n_experts=len(sizes),
        expert_bytes=max(sizes, default=0),
        experts_total_bytes=sum(sizes),
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


def remove_model(path: str | os.PathLike) -> str:
    """Take a model off the list; returns what was done. A registered model's link goes
    and its file stays where it is; the demo MoE's built file is deleted (it can be
    built again)."""
    from backend.demo.build import demo_path

    target = Path(path).expanduser().resolve()
    if target == demo_path().resolve():
        demo_path().unlink(missing_ok=True)
        return f"Deleted the demo MoE's file ({target}); Get demo MoE builds it again"
    for entry in sorted(models_dir().iterdir()):
        if entry.resolve() != target:
            continue
        if not entry.is_symlink():
            raise BevyError(
                f"{entry} is a model stored in the models folder itself; delete it there"
            )
        entry.unlink()
        return f"Removed {entry.name} from the list; {target} itself is untouched"
    raise BevyError(f"{target} is not in the model list")
