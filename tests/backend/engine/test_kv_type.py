"""The KV cache in float16 (``EngineConfig.kv_type``, ``--kv-type f16``): keys and values
kept in half the bytes, rounded as torch rounds them wherever they are written (the
native attention kernels, the decode walk and torch's attention), so that every policy,
the walk and plain generation with the same cache type give the same tokens. The
default ("auto") keeps the activations' float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.jobs import JobRunner
from backend.engine.loop import Engine
from backend.kernels import native
from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import (
    ROUNDED_BOUND,
    assert_same_results,
    one_request,
    references,
    run_clean,
)
from tests.helpers.spy import spy
from tests.helpers.tiny import make_tiny

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no native Q4 kernels here (x86-64 with AVX2 and a C compiler)"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A Q4 model on the native kernels: its decoding products are row kernels (each row
    the same bits in any batch), so a key rounds to float16 alike on every path. (Models
    whose products round by batch shape can put a key on either side of a float16
    rounding edge: float16 is not their default, see ``EngineConfig.kv_type``.)"""
    root = tmp_path_factory.mktemp("kv")
    tiny = load_model(make_tiny("mixtral", root / "tiny", num_hidden_layers=4))
    return load_model(write_gguf(tiny, root / "tiny.q4.gguf", QType.Q4_1))


@pytest.fixture(scope="module")
def refs(model: LoadedModel) -> dict[str, list]:
    """Plain generation with a float16 cache ("f16": the native backend's rounded expert
    inputs, as the engine's runs; "f16:float", "f32:float": float expert inputs)."""
    out = {}
    try:
        model.transformer.set_kv_type("f16")
        out["f16"] = references(model, rounded=True)
        out["f16:float"] = references(model)
        model.transformer.set_kv_type("f32")
        out["f32:float"] = references(model)
    finally:
        model.transformer.set_kv_type("auto")
    return out


def _config(policy: str, cache: str, kv_type: str = "f16") -> EngineConfig:
    return EngineConfig(
        policy=policy, cache=cache, storage="host", expert_backend="native", kv_type=kv_type
    )


@pytest.mark.parametrize("cache", ["min", "1.0"])
@pytest.mark.parametrize("policy", ["bevy", "sync", "prefetch-gate", "bevy-static:3"])
def test_every_policy_matches_plain_generation_in_float16(
    model, refs, monkeypatch, policy: str, cache: str
) -> None:
    size = str(model.config.top_k) if cache == "min" else cache
    blocks = spy(monkeypatch, native, "attention_block")
    fin, logs = run_clean(model, _config(policy, size))
    # Every decoding block read and wrote float16 caches.
    assert blocks and all(args[3][0][0].dtype == torch.float16 for args, _ in blocks)
    for i, (tokens, logits) in enumerate(refs["f16"]):
        assert list(fin[f"r{i}"].token_ids) == tokens, f"r{i}"
        assert (torch.stack(logs[f"r{i}"]) - logits).abs().max().item() <= ROUNDED_BOUND


def test_the_walk_gives_the_bits_of_the_layer_jobs_in_float16(model, monkeypatch) -> None:
    """One request alone: the walk's bits are the layer jobs'. Staggered requests: the
    same tokens, logits within ``ROUNDED_BOUND``, as groups form by timing and a group's
    shape moves logits by a last bit or so (measured: ~3e-7 between bevy and
    bevy-static:3 on this model), which a rounded expert input can carry across an edge."""
    config = dataclasses.replace(_config("bevy", "1.0"), warm=False)
    tokens, logits, _, walks = one_request(model, config, monkeypatch, walk=True)
    tokens0, logits0, _, none = one_request(model, config, monkeypatch, walk=False)
    assert walks and not none
    assert tokens == tokens0 and torch.equal(logits, logits0)
    monkeypatch.undo()
    walked = run_clean(model, _config("bevy", "1.0"))
    monkeypatch.setattr(JobRunner, "run_through", lambda self, group: None)
    assert_same_results(walked, run_clean(model, _config("bevy", "1.0")), rounded=True)


def test_float16_differs_from_float32_by_its_rounding_alone(refs) -> None:
    """float16 keys and values move the logits by their rounding (a float16 step is 2^-10
    relative): here under 2^-9 of the largest logit (measured: 2-5e-4 of ~2). Compared
    while both have generated the same tokens."""
    for (tokens, half), (tokens0, full) in zip(refs["f16:float"], refs["f32:float"], strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, tokens0, strict=True)) if a != b), len(tokens)
        )
        gap = (half[: same + 1] - full[: same + 1]).abs().max().item()
        assert 0 < gap <= 2**-9 * full.abs().max().item()


def test_float16_halves_the_kv_bytes_and_auto_restores_float32(model) -> None:
    sizes = {}
    for kind in ("f16", "auto", "f32"):
        eng = Engine(model, _config("bevy", "1.0", kind))
        try:
            sizes[kind] = eng.kv_bytes_per_token
            want = torch.float16 if kind == "f16" else torch.float32
            assert model.transformer.kv_dtype == want
        finally:
            eng.close()
    assert sizes["f16"] * 2 == sizes["auto"] == sizes["f32"]
    with pytest.raises(ValueError, match="kv_type"):
        EngineConfig(kv_type="q8_0")
