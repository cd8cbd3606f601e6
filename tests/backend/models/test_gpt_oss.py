"""gpt-oss against transformers: attention sinks, biases, alternating sliding layers, YaRN,
the top-k-softmax router and the clamped SwiGLU, from our GGUF of a tiny random model
(F32, and MXFP4 experts against transformers running the same dequantized weights); then
under the offloading engine, every policy and cache size against plain generation."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backend.config import EngineConfig
from backend.engine.loop import Engine
from backend.errors import ModelLoadError
from backend.formats.gguf import read_gguf
from backend.kernels.quants import QType
from backend.models.gguf_export import convert_gpt_oss
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import (
    ALL_POLICIES,
    assert_matches_references,
    plain_references,
    run_staggered,
)
from tests.helpers.reference import greedy_logits
from tests.helpers.tiny import make_tiny

# Longer than the window of 5, so the sliding layers see only part of it.
PROMPT = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("gpt_oss", tmp_path_factory.mktemp("gpt-oss") / "hf")


def _hf(folder: Path, weights_from: Path | None = None):
    """transformers' model of ``folder``; with ``weights_from``, its tensors replaced by
    that GGUF's, each dequantized by the ``gguf`` package (the oracle)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    if weights_from is not None:
        r = gguf.GGUFReader(weights_from)
        t = {
            x.name: torch.from_numpy(
                np.array(gguf.quants.dequantize(x.data, x.tensor_type), dtype=np.float32)
            )
            for x in r.tensors
        }
        sd = model.state_dict()
        for i in range(model.config.num_hidden_layers):
            p, q = f"model.layers.{i}.", f"blk.{i}."
            gate, up = t[q + "ffn_gate_exps.weight"], t[q + "ffn_up_exps.weight"]
            gate_up = torch.stack((gate, up), 2).flatten(1, 2).transpose(1, 2)  # [E, D, 2I]
            sd[p + "mlp.experts.gate_up_proj"].copy_(gate_up)
            sd[p + "mlp.experts.down_proj"].copy_(t[q + "ffn_down_exps.weight"].transpose(1, 2))
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                sd[p + f"self_attn.{theirs}.weight"].copy_(t[q + ours + ".weight"])
            sd[p + "self_attn.o_proj.weight"].copy_(t[q + "attn_output.weight"])
    return model


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("qtype", [QType.F32, QType.MXFP4])
def test_matches_transformers_from_our_gguf(folder: Path, tmp_path: Path, qtype: QType) -> None:
    path = convert_gpt_oss(folder, tmp_path / f"gpt-oss.{qtype.name}.gguf", qtype)
    g = read_gguf(path)
    assert g.arch == "gpt-oss" and "blk.0.post_attention_norm.weight" in g.tensors
    assert "blk.0.attn_sinks.weight" in g.tensors and "blk.1.ffn_up_exps.bias" in g.tensors
    assert g.tensors["blk.0.ffn_gate_exps.weight"].qtype == qtype
    model = load_model(path)
    c = model.config
    assert (c.family, c.sliding_window, c.window_layers) == ("gpt_oss", 5, (True, False, True))
    assert c.rope_scaling is not None and c.rope_scaling.kind == "yarn"
    ids, ours = greedy_logits(model, PROMPT, steps=8)
    hf = _hf(folder, path if qtype != QType.F32 else None)
    ref = _reference(hf, ids)[len(PROMPT) - 1 :]
    assert (ours - ref).abs().max().item() <= 1e-4
    # Plain generation's default (experts applied from their bytes where a kernel takes
    # them) computes the same.
    _, plain = greedy_logits(
        model, PROMPT, steps=8, get_expert=model.resident_experts(native=True).for_compute
    )
    assert (plain - ours).abs().max().item() <= 1e-5


def test_each_piece_matters(folder: Path, tmp_path: Path) -> None:
    """The sinks, the SwiGLU's clamp and the window each change the logits here, so the
    parity above checks them."""
    import dataclasses

    model = load_model(convert_gpt_oss(folder, tmp_path / "g.gguf"))
    _, ours = greedy_logits(model, PROMPT, steps=2)
    t = model.transformer
    for change in (
        {"swiglu_limit": 1e9},
        {"sliding_window": 0, "window_layers": (False,) * 3},
    ):
        t.config = dataclasses.replace(model.config, **change)
        _, other = greedy_logits(model, PROMPT, steps=2)
        assert (other - ours).abs().max().item() > 1e-3, change
    t.config = model.config
    t.w = {k: v for k, v in t.w.items() if "attn_sinks" not in k}
    _, other = greedy_logits(model, PROMPT, steps=2)
    assert (other - ours).abs().max().item() > 1e-3


def test_hf_folder_is_refused_with_the_way_to_a_gguf(folder: Path) -> None:
    with pytest.raises(ModelLoadError, match="gpt-oss loads from GGUF"):
        load_model(folder)


@pytest.fixture(scope="module")
def engine_model(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("gpt-oss-engine")
    model = load_model(convert_gpt_oss(folder, root / "mxfp4.gguf", QType.MXFP4))
    return model, plain_references(model)


@pytest.mark.parametrize("storage", ["ssd", "host"])
@pytest.mark.parametrize("cache", ["min", "0.3", "1.0"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_matches_plain_generation(
    engine_model: tuple[LoadedModel, list], policy: str, cache: str, storage: str
) -> None:
    model, refs = engine_model
    size = str(model.config.top_k) if cache == "min" else cache
    eng = Engine(model, EngineConfig(policy=policy, cache=size, storage=storage))
    try:
        assert eng.expert_backend == "eager"  # the only one with the clamped SwiGLU
        assert_matches_references(run_staggered(eng), eng.logits_log, refs)
        assert sum(eng.cache.refs) == 0
    finally:
        eng.close()


def test_long_prompts_attend_a_block_of_rows_at_a_time(folder, tmp_path, monkeypatch) -> None:
    """Under sinks a prompt's scores are computed a block of query rows at a time (a long
    prompt would need [heads, rows, keys] at once): one row per block gives the same."""
    from backend.models import transformer as transformer_mod

    model = load_model(convert_gpt_oss(folder, tmp_path / "g.gguf"))
    _, whole = greedy_logits(model, PROMPT, steps=2)
    monkeypatch.setattr(transformer_mod, "SINK_SCORES", 1)
    _, blocks = greedy_logits(model, PROMPT, steps=2)
    assert (blocks - whole).abs().max().item() <= 1e-5
