"""Qwen3.5-MoE against transformers: Gated DeltaNet layers (causal conv and recurrent
state), gated attention with partial RoPE, zero-centred norms, routed + shared experts;
from the Hugging Face folder (the published multimodal layout too), from our F32 GGUF
(llama.cpp's names, keys and tiled value heads) and from a Q8_0 one against transformers
running the ``gguf`` package's dequantized weights; the GGUF layouts llama.cpp writes.
The recurrent state under the engine: ``test_qwen3_5_moe_state.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backend.formats.gguf import read_gguf
from backend.kernels.quants import QType
from backend.models import rope
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from backend.models.qwen3_5_moe import reorder_value_heads
from tests.helpers.reference import (
    copy_gate_or_up,
    greedy_logits,
    transformers_logits,
    transformers_model,
)
from tests.helpers.tiny import as_multimodal, make_tiny

# Longer than one chunk of the delta rule (64), so a prompt crosses a chunk's end.
PROMPT = torch.randint(0, 96, (70,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen3_5_moe", tmp_path_factory.mktemp("qwen3.5") / "hf")


def _hf(folder: Path, weights_from: Path | None = None):
    """transformers' model of ``folder``; with ``weights_from``, its quantized tensors
    replaced by that GGUF's, dequantized by the oracle, value heads put back in
    transformers' order."""
    ours = load_model(folder).config
    linear = {
        "attn_qkv": "in_proj_qkv",
        "attn_gate": "in_proj_z",
        "ssm_beta": "in_proj_b",
        "ssm_alpha": "in_proj_a",
        "ssm_out": "out_proj",
    }
    attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    shexp = {f"ffn_{n}_shexp": f"shared_expert.{n}_proj" for n in ("gate", "up", "down")}

    def place(sd: dict, p: str, base: str, t: torch.Tensor) -> None:
        if base in linear:
            sd[p + f"linear_attn.{linear[base]}.weight"].copy_(
                reorder_value_heads(ours, base, t, to_gguf=False)
            )
        elif base in attn:
            sd[p + f"self_attn.{attn[base]}.weight"].copy_(t)
        elif base in shexp:
            sd[p + f"mlp.{shexp[base]}.weight"].copy_(t)
        elif base == "ffn_down_exps":
            sd[p + "mlp.experts.down_proj"].copy_(t)
        elif base in ("ffn_gate_exps", "ffn_up_exps"):
            copy_gate_or_up(sd[p + "mlp.experts.gate_up_proj"], base, t)
        else:
            raise AssertionError(f"the oracle does not map {base}")

    return transformers_model(folder, weights_from, place)


def test_config_from_the_hf_folder(folder: Path) -> None:
    c = load_model(folder).config
    assert c.family == "qwen3_5_moe" and c.linear_layers == (True, False, True, False)
    assert (c.rotary_dim, c.attn_gate, c.shared_expert_size, c.conv_dim) == (4, True, 48, 160)
    assert c.attention_layers == 2 and c.state_bytes == 2 * 4 * (160 * 3 + 6 * 16 * 16)


def test_matches_transformers_from_the_hf_folder(folder: Path) -> None:
    model = load_model(folder)
    ids, ours = greedy_logits(model, PROMPT, steps=8)
    ref = transformers_logits(_hf(folder), ids)[len(PROMPT) - 1 :]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0])
def test_matches_transformers_from_our_gguf(folder: Path, tmp_path: Path, qtype: QType) -> None:
    path = write_gguf(load_model(folder), tmp_path / f"q35.{qtype.name}.gguf", qtype)
    g = read_gguf(path)
    assert g.arch == "qwen35moe" and g.get("full_attention_interval") == 2
    assert (g.get("ssm.group_count"), g.get("ssm.time_step_rank"), g.get("ssm.state_size")) == (
        2,
        6,
        16,
    )
    assert g.get("rope.dimension_count") == 4
    for name in ("blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.1.post_attention_norm.weight"):
        assert name in g.tensors, name
    assert g.tensors["blk.0.ssm_conv1d.weight"].shape == (160, 4)
    model = load_model(path)
    assert model.config.linear_layers == (True, False, True, False)
    ids, ours = greedy_logits(model, PROMPT, steps=8)
    hf = _hf(folder, path if qtype != QType.F32 else None)
    ref = transformers_logits(hf, ids)[len(PROMPT) - 1 :]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_value_heads_are_stored_tiled_in_gguf(folder: Path, tmp_path: Path) -> None:
    """llama.cpp keeps value head (key head g, r-th of its group) at r * Hk + g; a file
    written grouped would load, and compute wrongly, in llama.cpp."""
    model = load_model(folder)
    g = read_gguf(write_gguf(model, tmp_path / "q35.gguf"))
    ref = g.tensors["blk.0.ssm_a"]
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        stored = np.frombuffer(f.read(ref.nbytes), np.float32)
    ours = model.transformer.w["blk.0.ssm_a"].numpy()  # grouped: g0 r0, g0 r1, g0 r2, g1 r0, ...
    assert np.array_equal(stored, ours[[0, 3, 1, 4, 2, 5]])


def test_each_piece_matters(folder: Path) -> None:
    """The conv, the decay, the output gate and partial RoPE each change the logits, so
    the parity above checks them."""
    model = load_model(folder)
    _, ours = greedy_logits(model, PROMPT, steps=2)
    t = model.transformer
    saved = dict(t.w)
    for name, change in (
        ("blk.0.ssm_conv1d", lambda x: torch.zeros_like(x).index_fill_(1, torch.tensor([3]), 1)),
        ("blk.2.ssm_a", torch.zeros_like),
        ("blk.1.attn_q", lambda x: x.view(4, 2, 16, -1).index_fill(1, torch.tensor([1]), 0)),
    ):
        t.w = dict(saved)
        t.w[name] = change(saved[name]).reshape(saved[name].shape)
        _, other = greedy_logits(model, PROMPT, steps=2)
        assert (other - ours).abs().max().item() > 1e-3, name
    t.w = saved
    t.config = dataclasses.replace(model.config, rotary_dim=16)
    t._rope_tables.clear()
    t._inv_freq, t._rope_scale = rope.inv_freq(t.config, t.device)
    _, other = greedy_logits(model, PROMPT, steps=2)
    assert (other - ours).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", ["attn_qkv", "attn_gate", "ssm_out"])
def test_quantized_blocks_reorder_as_the_weights_do(folder: Path, name: str) -> None:
    """The compiled kernels read a GGUF's blocks: moved so that they hold what the
    dequantized, reordered weight holds (rows whole, ``ssm_out``'s columns a block of 32
    at a time, here with value heads 32 wide)."""
    from backend.kernels.quants import dequantize
    from backend.models.qwen3_5_moe import fix_tensor, untiled_blocks

    c = dataclasses.replace(load_model(folder).config, linear_k_dim=32, linear_v_dim=32)
    v = c.linear_v_heads * c.linear_v_dim
    rows, cols = {"attn_qkv": (c.conv_dim, 64), "attn_gate": (v, 64), "ssm_out": (64, v)}[name]
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(w, QType.Q4_0).reshape(-1).copy())
    moved = untiled_blocks(c, name, raw, rows)
    want = fix_tensor(c, f"blk.0.{name}", dequantize(raw, QType.Q4_0, (rows, cols)), True)
    assert torch.equal(dequantize(moved, QType.Q4_0, (rows, cols)), want)
    assert not torch.equal(want, dequantize(raw, QType.Q4_0, (rows, cols)))


def test_the_hub_checkpoint_layout_loads(folder: Path, tmp_path: Path) -> None:
    """The published checkpoints are Qwen3_5MoeForConditionalGeneration: the text model
    under model.language_model with its config in text_config, experts as transformers'
    fused [E, 2I, D] / [E, D, I] tensors, a vision tower and an MTP head beside it (not
    read). The same weights give the same logits as the text-only folder."""
    from safetensors.torch import load_file

    text = load_file(folder / "model.safetensors")
    towers = {"model.visual.patch_embed.proj.weight": torch.ones(8, 3)}
    towers["mtp.fc.weight"] = torch.ones(4, 4)
    for layer in range(4):
        p = f"model.layers.{layer}.mlp.experts."
        gate, up, down = (
            torch.stack([text.pop(f"{p}{e}.{n}_proj.weight") for e in range(8)])
            for n in ("gate", "up", "down")
        )
        text[p + "gate_up_proj"] = torch.cat((gate, up), 1).to(torch.bfloat16)
        text[p + "down_proj"] = down.to(torch.bfloat16)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    out = as_multimodal(folder, tmp_path / "hub", text, towers, config)
    hub_model = load_model(out)
    assert hub_model.experts[0][3].gate.qtype == QType.BF16
    # The reference: the text-only folder with its experts rounded to bf16 as well.
    model = load_model(folder)
    rounded = {
        (layer, e): tuple(
            t.to(torch.bfloat16).float() for t in model.resident_experts().get(layer, e)
        )
        for layer in range(4)
        for e in range(8)
    }
    _, ours = greedy_logits(hub_model, PROMPT, steps=4)
    _, ref = greedy_logits(model, PROMPT, steps=4, get_expert=lambda l, e: rounded[(l, e)])
    assert torch.equal(ours, ref)


def test_rope_sections_turn_every_pair_by_the_text_position(folder: Path, tmp_path: Path) -> None:
    """llama.cpp's interleaved M-RoPE turns pair i by the t, h or w position as i % 3 is 0,
    1 or 2 while i < 3 x that one's count, else by a fourth position that is 0 for text:
    the sections written must leave no pair to it (found against llama.cpp's server,
    whose logits matched ours only then)."""
    g = read_gguf(write_gguf(load_model(folder), tmp_path / "q35.gguf"))
    sections = list(g.get("rope.dimension_sections"))
    pairs = g.get("rope.dimension_count") // 2
    assert sum(sections) == pairs
    for i in range(pairs):
        assert i < 3 * sections[i % 3], (i, sections)


def _rewritten(src: Path, out: Path, drop: tuple[str, ...], tensors, keys=None) -> Path:
    """``src``'s GGUF as ``out``: its metadata less ``drop`` (plus what ``keys(writer)``
    adds), each tensor ``t`` as the (name, data) pairs ``tensors(t)`` gives."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, "qwen35moe")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", *drop):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    if keys is not None:
        keys(w)
    for t in r.tensors:
        for name, data in tensors(t):
            w.add_tensor(name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _same_logits(a: Path, b: Path) -> None:
    _, ours = greedy_logits(load_model(a), PROMPT, steps=2)
    _, ref = greedy_logits(load_model(b), PROMPT, steps=2)
    assert torch.equal(ours, ref)


def test_the_multi_token_prediction_block_is_not_run(folder: Path, tmp_path: Path) -> None:
    """llama.cpp's converter keeps the MTP head as one more block (blk.N, named like the
    others, ``nextn_predict_layers`` 1, ``recurrent_layers`` padded with False): the file
    has 4 layers to run, not 5."""
    plain = write_gguf(load_model(folder), tmp_path / "plain.gguf")

    def keys(w: gguf.GGUFWriter) -> None:
        w.add_block_count(5)
        w.add_uint32("qwen35moe.nextn_predict_layers", 1)
        w.add_array("qwen35moe.attention.recurrent_layers", [True, False, True, False, False])

    def tensors(t):  # the MTP block: a copy of the last attention layer's tensors
        return [(t.name, t.data)] + (
            [("blk.4." + t.name[6:], t.data)] if t.name.startswith("blk.3.") else []
        )

    drop = ("qwen35moe.block_count", "qwen35moe.full_attention_interval")
    mtp = _rewritten(plain, tmp_path / "mtp.gguf", drop, tensors, keys)
    config = load_model(mtp).config
    assert config.n_layers == 4 and config.linear_layers == (True, False) * 2
    _same_logits(mtp, plain)


def test_fused_gate_up_experts_in_gguf(folder: Path, tmp_path: Path) -> None:
    """llama.cpp's converter can write each layer's gate and up experts as one
    ``ffn_gate_up_exps`` [E, 2I, D] (``--fuse-gate-up-exps``): each expert's gate and up
    are cut from it as byte ranges, quantized rows included."""
    plain = write_gguf(load_model(folder), tmp_path / "plain.gguf", QType.Q8_0)
    ups = {t.name: t.data for t in gguf.GGUFReader(plain).tensors if "ffn_up_exps" in t.name}

    def tensors(t):
        if "ffn_up_exps" in t.name:
            return []
        if "ffn_gate_exps" in t.name:
            both = np.concatenate((t.data, ups[t.name.replace("gate", "up")]), axis=1)
            return [(t.name.replace("gate_exps", "gate_up_exps"), both)]
        return [(t.name, t.data)]

    fused = _rewritten(plain, tmp_path / "fused.gguf", (), tensors)
    assert "blk.0.ffn_gate_up_exps.weight" in read_gguf(fused).tensors
    _same_logits(fused, plain)


def test_the_parameter_count_the_apis_report(folder: Path) -> None:
    """Ollama's /api/show and /api/tags report the parameter count: from the shapes the
    config implies, linear attention layers and the q gate included."""
    import transformers

    from backend.serving.ollama_schema import parameter_count

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert parameter_count(load_model(folder).config) == hf.num_parameters()
