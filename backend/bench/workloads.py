"""Bundled prompt sets (``resources/workloads/*.jsonl``): one conversation per line."""

from __future__ import annotations

import json
from pathlib import Path

RESOURCES = Path(__file__).resolve().parents[2] / "resources"


def workload_path(name: str) -> Path:
    return RESOURCES / "workloads" / f"{name}.jsonl"


def load_workload(name: str) -> list[dict]:
    """Records with ``id`` and ``messages`` (and optionally ``tools``)."""
    path = workload_path(name)
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.jsonl"))
        raise ValueError(f"unknown workload {name!r} (bundled: {', '.join(known)})")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
