"""Gemma 4 against transformers: sliding and full layers with their own head widths, KV
heads and RoPE (proportional on the full layers), values from the keys' projection, the
norms around attention and FFN, the dense MLP beside the experts, the router's scales,
layer scalars, the scaled embedding and soft-capped logits; from the Hugging Face folder
(the published multimodal layout too), from our F32 GGUF (llama.cpp's names and keys) and
from a Q8_0 one against transformers running the ``gguf`` package's dequantized weights;
what is refused; and every engine policy against plain generation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from backend.errors import ModelLoadError
from backend.formats.gguf import read_gguf
from backend.kernels.quants import QType
from backend.models import rope
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from backend.models.transformer import KVCache, SeqSlice
from tests.helpers.engine_runs import ALL_POLICIES, check_policy_against_plain, plain_references
from tests.helpers.reference import (
    copy_gate_or_up,
    greedy_logits,
    transformers_logits,
    transformers_model,
)
from tests.helpers.tiny import as_multimodal, make_tiny

# Longer than the sliding window (6) several times over.
PROMPT = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(21)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("gemma4", tmp_path_factory.mktemp("gemma4") / "hf")


def _hf(folder: Path, weights_from: Path | None = None):
    """transformers' model of ``folder``; with ``weights_from``, its quantized tensors
    replaced by that GGUF's, dequantized by the oracle."""
    mapped = {
        "attn_q": "self_attn.q_proj.weight",
        "attn_k": "self_attn.k_proj.weight",
        "attn_v": "self_attn.v_proj.weight",
        "attn_output": "self_attn.o_proj.weight",
        "ffn_gate": "mlp.gate_proj.weight",
        "ffn_up": "mlp.up_proj.weight",
        "ffn_down": "mlp.down_proj.weight",
        "ffn_down_exps": "experts.down_proj",
    }

    def place(sd: dict, p: str, base: str, t: torch.Tensor) -> None:
        if base in mapped:
            sd[p + mapped[base]].copy_(t)
        elif base in ("ffn_gate_exps", "ffn_up_exps"):
            copy_gate_or_up(sd[p + "experts.gate_up_proj"], base, t)
        else:
            raise AssertionError(f"the oracle does not map {base}")

    return transformers_model(folder, weights_from, place)


def test_config_from_the_hf_folder(folder: Path) -> None:
    c = load_model(folder).config
    assert c.family == "gemma4" and c.window_layers == (True, False, True, False)
    assert [c.attn_dims(i) for i in range(4)] == [(2, 16), (1, 32)] * 2
    assert (c.sliding_window, c.k_eq_v, c.attn_scale, c.logit_softcap) == (6, True, 1.0, 3.0)
    assert c.rope_freq_factors == (1.0,) * 4 + (1e30,) * 12  # a quarter of 16 pairs turn
    assert (c.rope_theta, c.swa_rope_theta, c.embed_scale) == (1e6, 1e4, 8.0)
    assert c.expert_act == "gelu" and c.tie_embeddings and all(c.sparse_layers)
    # Keys and values per position: 2 x (2 x 16 + 1 x 32 + 2 x 16 + 1 x 32), as the
    # caches of a forward hold them.
    assert c.kv_values_per_token == 256
    kv = KVCache(4)
    model = load_model(folder)
    model.transformer.forward(
        torch.tensor(PROMPT), [SeqSlice(kv, 0, 30)], model.resident_experts().get
    )
    held = [2 * k.shape[0] * k.shape[2] for k in kv.k]
    assert held == [64, 64, 64, 64] and sum(held) == c.kv_values_per_token


def test_matches_transformers_from_the_hf_folder(folder: Path) -> None:
    model = load_model(folder)
    ids, ours = greedy_logits(model, PROMPT, steps=8)
    ref = transformers_logits(_hf(folder), ids)[len(PROMPT) - 1 :]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0])
def test_matches_transformers_from_our_gguf(folder: Path, tmp_path: Path, qtype: QType) -> None:
    path = write_gguf(load_model(folder), tmp_path / f"g4.{qtype.name}.gguf", qtype)
    g = read_gguf(path)
    assert g.arch == "gemma4"
    assert g.get("attention.head_count_kv") == [2, 1, 2, 1]
    assert (g.get("attention.key_length"), g.get("attention.key_length_swa")) == (32, 16)
    assert g.get("attention.sliding_window_pattern") == [True, False, True, False]
    assert (g.get("rope.freq_base"), g.get("rope.freq_base_swa")) == (1e6, 1e4)
    assert g.get("final_logit_softcapping") == 3.0
    names = ("blk.1.ffn_gate_inp.scale", "blk.1.ffn_down_exps.scale", "blk.1.pre_ffw_norm_2.weight")
    for name in (*names, "blk.1.layer_output_scale.weight", "rope_freqs.weight"):
        assert name in g.tensors, name
    assert "blk.1.attn_v.weight" not in g.tensors and "blk.0.attn_v.weight" in g.tensors
    model = load_model(path)
    assert model.config.k_eq_v and model.config.attn_dims(0) == (2, 16)
    ids, ours = greedy_logits(model, PROMPT, steps=8)
    ref = transformers_logits(_hf(folder, path if qtype != QType.F32 else None), ids)[
        len(PROMPT) - 1 :
    ]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_each_piece_matters(folder: Path) -> None:
    """The router's and experts' scales, the layer scalar, the norms after the MLP, the
    unscaled scores, the soft cap, proportional RoPE and the sliding layers' own RoPE base
    each change the logits, so the parity above checks them."""
    model = load_model(folder)
    _, ours = greedy_logits(model, PROMPT, steps=2)
    t = model.transformer
    config, saved = model.config, dict(t.w)
    for name, change in (
        ("blk.1.ffn_gate_inp.scale", lambda x: torch.ones_like(x)),
        ("blk.1.ffn_down_exps.scale", lambda x: torch.ones_like(x)),
        ("blk.2.layer_output_scale", lambda x: torch.ones_like(x)),
        ("blk.0.post_ffw_norm_1", lambda x: x * 2),
    ):
        t.w = dict(saved)
        t.w[name] = change(saved[name])
        _, other = greedy_logits(model, PROMPT, steps=2)
        assert (other - ours).abs().max().item() > 1e-3, name
    t.w = saved
    for changed in (
        dict(attn_scale=0.0),
        dict(logit_softcap=0.0),
        dict(rope_freq_factors=(1.0,) * 16),
        dict(swa_rope_theta=1e6),
    ):
        t.config = dataclasses.replace(config, **changed)
        t._rope_tables.clear()
        t._inv_freq, _ = rope.inv_freq(t.config, t.device)
        t._swa_tables.clear()
        t._swa_inv_freq = rope.base_inv_freq(t.config.swa_rope_theta, 16)
        _, other = greedy_logits(model, PROMPT, steps=2)
        assert (other - ours).abs().max().item() > 1e-3, changed


def test_the_hub_checkpoint_layout_loads(folder: Path, tmp_path: Path) -> None:
    """The published checkpoints are Gemma4ForConditionalGeneration: the text model under
    model.language_model with its config in text_config, vision and audio towers beside
    it (not read). The same weights give the same logits as the text-only folder."""
    from safetensors.torch import load_file

    towers = {"model.vision_tower.patch_embedder.input_proj.weight": torch.ones(8, 3)}
    towers["model.embed_vision.embedding_projection.weight"] = torch.ones(4, 4)
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "vision_config": {"hidden_size": 8},
        "tie_word_embeddings": True,
    }
    text = load_file(folder / "model.safetensors")
    out = as_multimodal(folder, tmp_path / "hub", text, towers, config)
    _, ours = greedy_logits(load_model(out), PROMPT, steps=3)
    _, ref = greedy_logits(load_model(folder), PROMPT, steps=3)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size_per_layer_input", 64, "per-layer embeddings"),
        ("num_kv_shared_layers", 2, "reuse another layer's keys and values"),
        ("use_bidirectional_attention", "all", "bidirectional attention"),
    ],
)
def test_what_is_not_taken_is_refused_by_name(
    folder: Path, tmp_path: Path, field: str, value: object, message: str
) -> None:
    out = tmp_path / "refused"
    out.mkdir()
    (out / "model.safetensors").symlink_to(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(out)


@pytest.fixture(scope="module")
def engine_model(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("gemma4-engine")
    model = load_model(write_gguf(load_model(folder), root / "q8.gguf", QType.Q8_0))
    return model, plain_references(model)


@pytest.mark.parametrize("storage", ["ssd", "host"])
@pytest.mark.parametrize("cache", ["min", "0.3", "1.0"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_matches_plain_generation(
    engine_model: tuple[LoadedModel, list], policy: str, cache: str, storage: str
) -> None:
    from backend.kernels import native

    eng = check_policy_against_plain(*engine_model, policy, cache, storage)
    # Q8_0 GELU-gated experts: the native kernels take them where they build
    assert eng.expert_backend == ("native" if native.available() else "eager")


def test_the_published_26b_a4b_metadata() -> None:
    """llama.cpp ships the header of the Gemma 4 26B-A4B GGUF (its vocabulary test file,
    no tensors): its keys give the model's two kinds of layer as published."""
    from backend.models.gemma4 import from_gguf
    from tests.helpers.llama_vocab import llama_cpp_vocab

    c = from_gguf(read_gguf(llama_cpp_vocab("gemma-4")))
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_experts, c.top_k) == (30, 2816, 16, 128, 8)
    assert c.window_layers == ((True,) * 5 + (False,)) * 5 and c.sliding_window == 1024
    assert c.attn_dims(0) == (8, 256) and c.attn_dims(5) == (2, 512)
    assert (c.rope_theta, c.swa_rope_theta, c.logit_softcap) == (1e6, 1e4, 30.0)
    assert (c.intermediate_size, c.expert_intermediate_size) == (2112, 704)
    # 25 sliding layers x 2 x 8 x 256 + 5 full x 2 x 2 x 512 values per position
    assert c.kv_values_per_token == 112_640


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("embedding_length_per_layer_input", "per-layer embeddings"),
        ("attention.shared_kv_layers", "reuse another layer's keys and values"),
        (None, "no rope_freqs tensor"),
    ],
)
def test_gguf_refusals(folder: Path, tmp_path: Path, key: str | None, message: str) -> None:
    """What a GGUF has that is not taken, and a file without the full layers' RoPE
    divisors (llama.cpp requires them), are refused by name."""
    from backend.models.gemma4 import from_gguf

    g = read_gguf(write_gguf(load_model(folder), tmp_path / "g4.gguf"))
    from_gguf(g)  # as written, it loads
    if key is None:
        del g.tensors["rope_freqs.weight"]
    else:
        g.metadata[f"gemma4.{key}"] = 2
    with pytest.raises(ValueError, match=message):
        from_gguf(g)
