from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The dense SmolLM2-135M-Instruct Q4_1 GGUF (downloaded once into the cache dir)."""
    from backend.demo.source import ensure_base_gguf

    return ensure_base_gguf(quiet=True)


@pytest.fixture(scope="session")
def tiny_chat_moe(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """A tiny random Mixtral (HF folder) with SmolLM2's real tokenizer and chat template."""
    from tests.helpers.tiny import make_tiny_chat

    return make_tiny_chat("mixtral", tmp_path_factory.mktemp("chat") / "tiny-moe", smollm2_gguf)
