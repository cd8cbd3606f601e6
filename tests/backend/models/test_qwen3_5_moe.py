"""Qwen3.5-MoE against transformers: Gated DeltaNet layers (causal conv and recurrent
state), gated attention with partial RoPE, zero-centred norms, routed + shared experts;
from the Hugging Face folder, from our F32 GGUF (llama.cpp's names, keys and tiled value
heads) and from a Q8_0 one against transformers running the ``gguf`` package's
dequantized weights; then under the offloading engine, every policy, cache size and store
against plain generation, with prompts read in slices and requests aborted mid-flight."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.loop import Engine
from backend.formats.gguf import read_gguf
from backend.kernels.quants import QType
from backend.messages import Abort, Finished, Submit
from backend.models import linear_attention, rope
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from backend.models.qwen3_5_moe import reorder_value_heads
from backend.models.transformer import KVCache, SeqSlice
from tests.helpers.engine_runs import ALL_POLICIES, PROMPTS, STEPS, drain, run_staggered
from tests.helpers.reference import greedy_logits
from tests.helpers.tiny import make_tiny

# Longer than one chunk of the delta rule (64), so a prompt crosses a chunk's end.
PROMPT = torch.randint(0, 96, (70,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen3_5_moe", tmp_path_factory.mktemp("qwen3.5") / "hf")


def _hf(folder: Path, weights_from: Path | None = None):
    """transformers' model of ``folder``; with ``weights_from``, its quantized tensors
    replaced by that GGUF's, each dequantized by the ``gguf`` package (the oracle), value
    heads put back in transformers' order."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    if weights_from is None:
        return model
    ours = load_model(folder).config
    sd = model.state_dict()
    linear = {
        "attn_qkv": "in_proj_qkv",
        "attn_gate": "in_proj_z",
        "ssm_beta": "in_proj_b",
        "ssm_alpha": "in_proj_a",
        "ssm_out": "out_proj",
    }
    attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    shexp = {f"ffn_{n}_shexp": f"shared_expert.{n}_proj" for n in ("gate", "up", "down")}
    replaced = 0
    for x in gguf.GGUFReader(weights_from).tensors:
        if x.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        t = torch.from_numpy(np.array(gguf.quants.dequantize(x.data, x.tensor_type), np.float32))
        _, layer, base, _ = x.name.split(".")
        p = f"model.layers.{layer}."
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
        elif base == "ffn_gate_exps":
            I = t.shape[1]
            sd[p + "mlp.experts.gate_up_proj"][:, :I].copy_(t)
        elif base == "ffn_up_exps":
            I = t.shape[1]
            sd[p + "mlp.experts.gate_up_proj"][:, I:].copy_(t)
        else:
            raise AssertionError(f"the oracle does not map {x.name}")
        replaced += 1
    assert replaced > 20
    return model


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_config_from_the_hf_folder(folder: Path) -> None:
    c = load_model(folder).config
    assert c.family == "qwen3_5_moe" and c.linear_layers == (True, False, True, False)
    assert (c.rotary_dim, c.attn_gate, c.shared_expert_size, c.conv_dim) == (4, True, 48, 160)
    assert c.attention_layers == 2 and c.state_bytes == 2 * 4 * (160 * 3 + 6 * 16 * 16)


def test_matches_transformers_from_the_hf_folder(folder: Path) -> None:
    model = load_model(folder)
    ids, ours = greedy_logits(model, PROMPT, steps=8)
    ref = _reference(_hf(folder), ids)[len(PROMPT) - 1 :]
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
    ref = _reference(hf, ids)[len(PROMPT) - 1 :]
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


def test_chunks_and_slices_compute_what_one_token_at_a_time_does(folder: Path) -> None:
    """The chunked delta rule, and a prompt read in uneven slices, match the recurrence
    run token by token (the state carried across every boundary)."""
    model = load_model(folder)
    t = model.transformer
    ids = torch.tensor(PROMPT)

    def run(cuts: list[int]) -> torch.Tensor:
        kv, out, start = KVCache(4), [], 0
        for end in [*cuts, len(PROMPT)]:
            seq = [SeqSlice(kv, start, end - start)]
            out.append(t.forward(ids[start:end], seq, model.resident_experts().get, False))
            start = end
        return torch.cat(out)

    whole = run([])
    assert (run([1, 5, 6, 40, 66]) - whole).abs().max().item() <= 1e-4
    assert (run(list(range(1, len(PROMPT)))) - whole).abs().max().item() <= 1e-4
    with pytest.raises(RuntimeError, match="recurrent state holds"):
        kv = KVCache(4)
        t.forward(ids[:3], [SeqSlice(kv, 0, 3)], model.resident_experts().get)
        t.forward(ids[:3], [SeqSlice(kv, 0, 3)], model.resident_experts().get)


def test_delta_rule_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1, 3 and 64 give the same outputs and final state."""
    gen = torch.Generator().manual_seed(3)
    H, n, Dk, Dv = 3, 20, 8, 5
    q, k = (
        torch.nn.functional.normalize(torch.randn(H, n, Dk, generator=gen), dim=-1) for _ in "qk"
    )
    v = torch.randn(H, n, Dv, generator=gen)
    g = -torch.rand(H, n, generator=gen) * 2
    beta = torch.rand(H, n, generator=gen)
    results = []
    for chunk in (1, 3, 64):
        monkeypatch.setattr(linear_attention, "CHUNK", chunk)
        mem = torch.randn(H, Dk, Dv, generator=torch.Generator().manual_seed(5))
        results.append((linear_attention.delta_rule(q, k, v, g, beta, mem), mem))
    for out, mem in results[1:]:
        assert (out - results[0][0]).abs().max().item() <= 1e-5
        assert (mem - results[0][1]).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def engine_model(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("qwen3.5-engine")
    model = load_model(write_gguf(load_model(folder), root / "q8.gguf", QType.Q8_0))
    refs = []
    for p in PROMPTS:
        ids, logits = greedy_logits(model, p, STEPS - 1)
        refs.append((ids[len(p) :] + [int(logits[-1].argmax())], logits))
    return model, refs


@pytest.mark.parametrize("storage", ["ssd", "host"])
@pytest.mark.parametrize("cache", ["min", "0.3", "1.0"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_matches_plain_generation(
    engine_model: tuple[LoadedModel, list], policy: str, cache: str, storage: str
) -> None:
    model, refs = engine_model
    size = str(model.config.top_k) if cache == "min" else cache
    # Prompts read two tokens at a time: the state crosses slices and other requests' jobs.
    config = EngineConfig(policy=policy, cache=size, storage=storage, prefill_chunk=2)
    eng = Engine(model, config)
    try:
        finished = run_staggered(eng)
        for i, (tokens, logits) in enumerate(refs):
            assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
            ours = torch.stack(eng.logits_log[f"r{i}"])
            assert (ours - logits).abs().max().item() <= 1e-4, f"r{i}"
        assert sum(eng.cache.refs) == 0
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["bevy", "sync", "prefetch-gate"])
def test_aborts_leave_the_others_exact(engine_model: tuple, policy: str) -> None:
    """Requests aborted mid-prompt and mid-reply take their state with them; the rest
    still match plain generation, and the budget counts each request's state."""
    model, refs = engine_model
    eng = Engine(model, EngineConfig(policy=policy, cache="0.3", storage="ssd", prefill_chunk=2))
    try:
        assert eng._kv_need(type("R", (), {"budget_tokens": 10})()) == (
            10 * eng.kv_bytes_per_token + model.config.state_bytes
        )
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
        eng.logits_log = {}
        for i, p in enumerate(PROMPTS):
            eng.submit(Submit(f"r{i}", params, prompt_ids=p))
        for step in range(6):
            if step == 1:
                eng.submit(Abort("r2"))  # 12-token prompt: still being read
            if step == 5:
                eng.submit(Abort("r5"))
            eng.step()
        eng.run_until_idle(120)
        finished = {e.request_id: e for e in drain(eng) if isinstance(e, Finished)}
        for i, (tokens, logits) in enumerate(refs):
            if i in (2, 5):
                continue
            assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
            ours = torch.stack(eng.logits_log[f"r{i}"])
            assert (ours - logits).abs().max().item() <= 1e-4, f"r{i}"
        assert finished["r2"].reason == "abort" and finished["r5"].reason == "abort"
        assert sum(eng.cache.refs) == 0 and not eng.running
    finally:
        eng.close()


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
    import json

    from safetensors.torch import load_file, save_file

    flat = load_file(folder / "model.safetensors")
    hub: dict[str, torch.Tensor] = {"model.visual.patch_embed.proj.weight": torch.ones(8, 3)}
    hub["mtp.fc.weight"] = torch.ones(4, 4)
    for layer in range(4):
        p = f"model.layers.{layer}.mlp.experts."
        gate, up, down = (
            torch.stack([flat.pop(f"{p}{e}.{n}_proj.weight") for e in range(8)])
            for n in ("gate", "up", "down")
        )
        q = f"model.language_model.layers.{layer}.mlp.experts."
        hub[q + "gate_up_proj"] = torch.cat((gate, up), 1).to(torch.bfloat16)
        hub[q + "down_proj"] = down.to(torch.bfloat16)
    for name, t in flat.items():
        hub[name.replace("model.", "model.language_model.", 1)] = t
    out = tmp_path / "hub"
    out.mkdir()
    save_file(hub, out / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(config))
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


def test_a_prompt_gets_the_same_bits_alone_as_batched(folder: Path, tmp_path: Path) -> None:
    """The engine groups prompts as its policy schedules them; plain generation batches
    them all. A prompt of a few dozen tokens must compute the same bits either way: BLAS
    rounds such products alike, and the flat [T, Hv] gates (sigmoid, softplus) round in
    float64 so that the vectorized loop's scalar tail, which moves with T, cannot change
    a row (found on a random model whose flat logits turned that into other tokens)."""
    model = load_model(write_gguf(load_model(folder), tmp_path / "q8.gguf", QType.Q8_0))
    t, get = model.transformer, model.resident_experts(native=True).for_compute
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (41, 37, 50, 45)]

    def last_logits(ps: list[list[int]]) -> torch.Tensor:
        seqs = [SeqSlice(KVCache(4), 0, len(p)) for p in ps]
        return t.forward(torch.tensor([i for p in ps for i in p]), seqs, get)

    batched = last_logits(prompts)
    for i, p in enumerate(prompts):
        assert torch.equal(last_logits([p])[0], batched[i]), i


def test_the_multi_token_prediction_block_is_not_run(folder: Path, tmp_path: Path) -> None:
    """llama.cpp's converter keeps the MTP head as one more block (blk.N, named like the
    others, ``nextn_predict_layers`` 1, ``recurrent_layers`` padded with False): the file
    has 4 layers to run, not 5."""
    plain = write_gguf(load_model(folder), tmp_path / "plain.gguf")
    r = gguf.GGUFReader(plain)
    w = gguf.GGUFWriter(tmp_path / "mtp.gguf", "qwen35moe")
    skip = ("general.architecture", "qwen35moe.block_count", "qwen35moe.full_attention_interval")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    w.add_block_count(5)
    w.add_uint32("qwen35moe.nextn_predict_layers", 1)
    w.add_array("qwen35moe.attention.recurrent_layers", [True, False, True, False, False])
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        if t.name.startswith("blk.3."):  # the MTP block: an attention layer's tensors
            w.add_tensor("blk.4." + t.name[6:], t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = load_model(tmp_path / "mtp.gguf")
    assert model.config.n_layers == 4 and model.config.linear_layers == (True, False) * 2
    _, ours = greedy_logits(model, PROMPT, steps=2)
    _, ref = greedy_logits(load_model(plain), PROMPT, steps=2)
    assert torch.equal(ours, ref)


def test_fused_gate_up_experts_in_gguf(folder: Path, tmp_path: Path) -> None:
    """llama.cpp's converter can write each layer's gate and up experts as one
    ``ffn_gate_up_exps`` [E, 2I, D] (``--fuse-gate-up-exps``): each expert's gate and up
    are cut from it as byte ranges, quantized rows included."""
    plain = write_gguf(load_model(folder), tmp_path / "plain.gguf", QType.Q8_0)
    r = gguf.GGUFReader(plain)
    w = gguf.GGUFWriter(tmp_path / "fused.gguf", "qwen35moe")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if t.name.endswith("ffn_up_exps.weight"):
            continue
        if t.name.endswith("ffn_gate_exps.weight"):
            up = tensors[t.name.replace("gate", "up")]
            both = np.concatenate((t.data, up.data), axis=1)
            w.add_tensor(t.name.replace("gate_exps", "gate_up_exps"), both, raw_dtype=t.tensor_type)
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fused = load_model(tmp_path / "fused.gguf")
    assert "blk.0.ffn_gate_up_exps.weight" in read_gguf(tmp_path / "fused.gguf").tensors
    _, ours = greedy_logits(fused, PROMPT, steps=2)
    _, ref = greedy_logits(load_model(plain), PROMPT, steps=2)
    assert torch.equal(ours, ref)


def test_the_parameter_count_the_apis_report(folder: Path) -> None:
    """Ollama's /api/show and /api/tags report the parameter count: from the shapes the
    config implies, linear attention layers and the q gate included."""
    import transformers

    from backend.serving.ollama_schema import parameter_count

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert parameter_count(load_model(folder).config) == hf.num_parameters()


def test_a_decoding_step_gets_the_same_bits_alone_as_batched(folder: Path, tmp_path: Path) -> None:
    """Decoding rows of several requests move their states in one stacked step
    (``linear_attention._decode_step``): each request's logits are the bits it gets
    decoding alone, as the engine's groups of any size need."""
    # Q4_0: its experts run on the native kernels, a row at a time (BLAS would round the
    # rows an expert gets by how many there are).
    model = load_model(write_gguf(load_model(folder), tmp_path / "q4.gguf", QType.Q4_0))
    t, get = model.transformer, model.resident_experts(native=True).for_compute
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (41, 9, 50)]

    def prefilled() -> list[KVCache]:
        kvs = [KVCache(4) for _ in prompts]
        for kv, p in zip(kvs, prompts, strict=True):
            t.forward(torch.tensor(p), [SeqSlice(kv, 0, len(p))], get)
        return kvs

    nxt = [5, 17, 33]
    kvs = prefilled()
    seqs = [SeqSlice(kv, len(p), 1) for kv, p in zip(kvs, prompts, strict=True)]
    batched = t.forward(torch.tensor(nxt), seqs, get)
    for i, (kv, p) in enumerate(zip(prefilled(), prompts, strict=True)):
        alone = t.forward(torch.tensor([nxt[i]]), [SeqSlice(kv, len(p), 1)], get)
        assert torch.equal(alone[0], batched[i]), i
