"""User-facing errors: one line that names the file and the problem."""

from __future__ import annotations

from pathlib import Path


class BevyError(Exception):
    """An error a user can act on. The CLI prints it as one line and exits 2."""


class ModelLoadError(BevyError):
    """A model file or folder that cannot be loaded."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ContextTooLong(BevyError):
    """A prompt that cannot fit the model's context (APIs answer
    ``context_length_exceeded``)."""
