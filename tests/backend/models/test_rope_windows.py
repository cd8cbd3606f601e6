"""RoPE scaling (linear, llama3, yarn) and sliding-window attention against transformers,
from the HF folder and from our GGUF of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.kernels.quants import QType
from backend.models import transformer as transformer_mod
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from tests.helpers.reference import greedy_logits
from tests.helpers.tiny import hf_logits, make_tiny

# Long enough that a window of 5 hides most of the prompt from its last tokens.
PROMPT = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(7)).tolist()
STEPS = 8

ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.3,
        "beta_fast": 16.0,
    },
}
CASES = [
    ("llama", "linear"),
    ("llama", "llama3"),
    ("llama", "yarn"),
    ("qwen3_moe", "yarn-attention-factor"),
]
WINDOWS = {
    "mixtral": {"sliding_window": 5},
    "qwen3_moe": {"use_sliding_window": True, "sliding_window": 5},
    # Qwen2-MoE slides on its even layers below max_window_layers: layers 0 of 3 here.
    "qwen2_moe": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2},
}


def _check(folder: Path, tmp_path: Path, qtype: QType = QType.F32) -> torch.Tensor:
    """Ours from the HF folder against transformers, then from our GGUF against that."""
    hf = load_model(folder)
    ids, ours = greedy_logits(hf, PROMPT, steps=STEPS)
    ref = hf_logits(folder, ids)[len(PROMPT) - 1 :]
    assert (ours - ref).abs().max().item() <= 1e-4
    g = load_model(write_gguf(hf, tmp_path / "m.gguf", QType.F32))
    s, gs = hf.config.rope_scaling, g.config.rope_scaling
    if s is not None and s.kind == "llama3":  # llama.cpp stores it as rope_freqs divisors
        assert gs is None and len(g.config.rope_freq_factors) == hf.config.head_dim // 2
    elif s is not None:  # (the file's keys are float32)
        assert (gs.kind, gs.factor, gs.original_context) == (s.kind, s.factor, s.original_context)
        assert gs.attention_factor == pytest.approx(s.attention_factor)
    assert g.config.sliding_window == hf.config.sliding_window
    assert g.config.window_layers == hf.config.window_layers
    _, from_gguf = greedy_logits(g, PROMPT, steps=STEPS)
    assert (from_gguf - ours).abs().max().item() <= 1e-4
    return ours


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_rope_scaling_matches_transformers(tmp_path: Path, family: str, kind: str) -> None:
    folder = make_tiny(family, tmp_path / kind, rope_parameters={"rope_theta": 1e4, **ROPE[kind]})
    ours = _check(folder, tmp_path)
    assert load_model(folder).config.rope_scaling.kind == kind.split("-")[0]
    # The scaling matters here: the same weights with plain RoPE give other logits.
    plain = make_tiny(family, tmp_path / "plain", rope_parameters={"rope_theta": 1e4})
    _, unscaled = greedy_logits(load_model(plain), PROMPT, steps=0)
    assert (unscaled[0] - ours[0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", list(WINDOWS))
def test_sliding_windows_match_transformers(tmp_path: Path, family: str) -> None:
    folder = make_tiny(family, tmp_path / "windowed", **WINDOWS[family])
    c = load_model(folder).config
    assert c.sliding_window == 5
    assert c.window_layers == ((True, False, False) if family == "qwen2_moe" else (True,) * 3)
    ours = _check(folder, tmp_path)
    full = make_tiny(family, tmp_path / "full")
    _, unwindowed = greedy_logits(load_model(full), PROMPT, steps=0)
    assert (unwindowed[0] - ours[0]).abs().max().item() > 1e-3


def test_native_decoding_block_slides_as_the_ops_do(tmp_path: Path, monkeypatch) -> None:
    """A Q4_0 GGUF decodes through the native attention block, which takes the window
    itself; with that block refused, the same tokens come from the torch ops."""
    folder = make_tiny("mixtral", tmp_path / "windowed", sliding_window=5)
    model = load_model(write_gguf(load_model(folder), tmp_path / "m.q4.gguf", QType.Q4_0))
    assert model.config.sliding_window == 5
    calls = []
    real = transformer_mod.native.attention_block

    def counted(*args, **kwargs):
        calls.append(args[1].window)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformer_mod.native, "attention_block", counted)
    ids, native_logits = greedy_logits(model, PROMPT, steps=STEPS)
    if not calls:
        pytest.skip("the native kernels do not build here")
    assert set(calls) == {5}
    monkeypatch.setattr(transformer_mod.native, "attention_block", lambda *a, **k: None)
    monkeypatch.setattr(transformer_mod.native, "attention", lambda *a, **k: None)
    ids2, ops_logits = greedy_logits(model, PROMPT, steps=STEPS)
    assert ids2 == ids
    assert (ops_logits - native_logits).abs().max().item() <= 1e-4


def test_unsupported_rope_scaling_is_named(tmp_path: Path) -> None:
    from backend.errors import ModelLoadError

    folder = make_tiny("llama", tmp_path / "m")
    cfg = (folder / "config.json").read_text()
    (folder / "config.json").write_text(
        cfg.replace('"rope_type": "default"', '"rope_type": "longrope"')
    )
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'longrope'"):
        load_model(folder)


def test_windows_are_read_as_each_family_reads_them() -> None:
    from backend.models.registry import family

    base = {
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "sliding_window": 5,
    }
    # Mixtral has no flag: a window is a window.
    assert family("mixtral").config_from_hf(base).window_layers == (True,) * 4
    # Qwen's flag defaults to false, as in transformers.
    assert family("qwen3_moe").config_from_hf(base).sliding_window == 0
    on = {**base, "use_sliding_window": True}
    assert family("qwen3_moe").config_from_hf(on).window_layers == (True,) * 4
    # Qwen2-MoE configs without layer_types: even layers below max_window_layers.
    old = {**on, "max_window_layers": 3}
    assert family("qwen2_moe").config_from_hf(old).window_layers == (True, False, True, False)


def test_gguf_rope_keys_read_as_llama_cpp_reads_them(tmp_path: Path) -> None:
    from backend.errors import ModelLoadError
    from backend.formats.gguf import GGUFFile
    from backend.models import rope

    def fields(meta: dict) -> dict:
        g = GGUFFile(tmp_path / "m.gguf", {"general.architecture": "llama", **meta}, {})
        return rope.from_gguf(g, 16)

    assert fields({}) == {}
    # A factor without a type is linear; so is the key before rope.scaling.*.
    assert fields({"llama.rope.scaling.factor": 4.0})["rope_scaling"].kind == "linear"
    assert fields({"llama.rope.scale_linear": 2.0})["rope_scaling"].factor == 2.0
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'longrope'"):
        fields({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0})
