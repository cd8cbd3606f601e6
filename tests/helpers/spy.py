"""Record the calls a function gets, through pytest's monkeypatch."""

from __future__ import annotations

from typing import Any


def spy(monkeypatch, owner: Any, name: str) -> list[tuple[tuple, Any]]:
    """Replace ``owner.name`` by a wrapper that calls it and records (args, result)."""
    real = getattr(owner, name)
    calls: list[tuple[tuple, Any]] = []

    def wrapper(*args):
        out = real(*args)
        calls.append((args, out))
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls
