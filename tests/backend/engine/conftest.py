"""The engine tests' tiny models and their plain-generation references, built once per
run for every module here."""

from __future__ import annotations

import pytest
import torch

from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import references as plain
from tests.helpers.tiny import make_tiny


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = tmp_path_factory.mktemp("engine")
    tiny = load_model(make_tiny("mixtral", root / "mixtral"))
    # Two of the four slide (windows shorter than the longer prompts plus their decoding),
    # so every policy and path is checked with sliding-window attention too: the Q8_0
    # Mixtral on every layer, Qwen2-MoE on layer 0 (its ``layer_types``).
    windowed = load_model(make_tiny("mixtral", root / "mixtral-swa", sliding_window=6))
    mixtral = write_gguf(windowed, root / "mixtral.q8.gguf", QType.Q8_0)
    mixtral_q4 = write_gguf(tiny, root / "mixtral.q4.gguf", QType.Q4_1)
    qwen2 = make_tiny(
        "qwen2_moe", root / "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2
    )
    return {
        "mixtral-q8-gguf": load_model(mixtral),
        "mixtral-q4-gguf": load_model(mixtral_q4),
        "qwen3-hf": load_model(make_tiny("qwen3_moe", root / "qwen3")),
        "qwen2-hf": load_model(qwen2),
    }


@pytest.fixture(scope="session")
def references(models: dict[str, LoadedModel]) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """Plain generation's, and for the Q4 model with the packed kernels' rounding as well
    (``engine_runs.expected_refs``)."""
    out = {name: plain(m) for name, m in models.items()}
    out["mixtral-q4-gguf:rounded"] = plain(models["mixtral-q4-gguf"], rounded=True)
    return out
