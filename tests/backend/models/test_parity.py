"""Our model code against transformers (the reference), and GGUF against HF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backend.kernels import native
from backend.kernels.quants import QType
from backend.models import registry
from backend.models import transformer as transformer_mod
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from backend.models.transformer import KVCache, SeqSlice
from tests.helpers.engine_runs import ROUNDED_BOUND
from tests.helpers.reference import greedy_logits
from tests.helpers.spy import spy
from tests.helpers.tiny import FAMILY_CONFIGS, hf_logits, make_tiny

# gpt-oss loads from GGUF only: its parity is in test_gpt_oss.py.
FAMILIES = [f for f in FAMILY_CONFIGS if f != "gpt_oss"]
PROMPT = [3, 17, 42, 5, 88, 9, 1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(f, root / f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_matches_transformers(tiny_dir: dict[str, Path], family: str) -> None:
    model = load_model(tiny_dir[family])
    assert model.config.family == family
    ids, ours = greedy_logits(model, PROMPT, steps=8)
    ref = hf_logits(tiny_dir[family], ids)[len(PROMPT) - 1 :]
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    # The greedy path transformers would take is the same one.
    assert ref.argmax(-1).tolist() == ids[len(PROMPT) :] + [int(ours[-1].argmax())]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_positions_past_the_first_rope_table(tiny_dir: dict[str, Path], family: str) -> None:
    """The RoPE angles come from a table of 256 positions that doubles when a sequence
    outgrows it (here while decoding): the logits still match transformers, which
    computes the angles for each position."""
    model = load_model(tiny_dir[family])
    prompt = torch.randint(0, 96, (250,), generator=torch.Generator().manual_seed(1)).tolist()
    ids, ours = greedy_logits(model, prompt, steps=10)
    assert model.transformer._rope_tables[torch.float32][0].shape[0] == 512
    ref = hf_logits(tiny_dir[family], ids)[len(prompt) - 1 :]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_mixed_dense_and_sparse_layers(tiny_dir: dict[str, Path]) -> None:
    model = load_model(tiny_dir["qwen3_moe"])
    assert model.config.sparse_layers == (True, False, True)
    assert [len(r) for r in model.experts] == [8, 0, 8]


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_f32_matches_hf(tiny_dir: dict[str, Path], tmp_path: Path, family: str) -> None:
    hf = load_model(tiny_dir[family])
    path = write_gguf(hf, tmp_path / "m.gguf", QType.F32)
    g = load_model(path)
    assert g.config.family == family
    assert g.config.rope_interleaved == (family in ("llama", "mixtral"))
    _, ref = greedy_logits(hf, PROMPT, steps=8)
    _, ours = greedy_logits(g, PROMPT, steps=8)
    assert (ours - ref).abs().max().item() <= 1e-4


def _oracle(ref) -> torch.Tensor:
    raw = np.fromfile(ref.path, dtype=np.uint8, count=ref.nbytes, offset=ref.offset)
    return torch.from_numpy(
        gguf.quants.dequantize(raw, ref.qtype).reshape(ref.shape).astype(np.float32)
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q5_1, QType.MXFP4])
def test_gguf_quantized_matches_oracle_dequantizer(
    tiny_dir: dict[str, Path], tmp_path: Path, monkeypatch, family: str, qtype: QType
) -> None:
    path = write_gguf(load_model(tiny_dir[family]), tmp_path / "q.gguf", qtype)
    model = load_model(path)
    assert model.quant == qtype.name
    calls = spy(monkeypatch, transformer_mod, "dense_linear")
    blocks = spy(monkeypatch, native, "attention_block")
    _, ours = greedy_logits(model, PROMPT, steps=8)
    ran = {(w.qtype, out is not None) for (w, _), out in calls}
    whole = any(out is not None for _, out in blocks)
    # Decoding went through the head's kernel, and for Q4_0 attention (Q8_0 too where the
    # native kernels build) through the native attention block (families without q/k
    # norms or biases, where the kernels build) or the kernels of its projections' blocks.
    read_from_blocks = {QType.Q4_0} | ({QType.Q8_0} if native.available() else set())
    assert (QType.F32, True) in ran
    assert ((qtype, True) in ran or whole) == (qtype in read_from_blocks)
    c = model.config
    if qtype in read_from_blocks and native.available() and not (c.qk_norm or c.attn_bias):
        assert whole
    elif c.qk_norm or c.attn_bias:
        assert not whole  # the block has no q/k norms or biases: the ops below run them
    # The same file, every weight dequantized by the gguf package's numpy code instead,
    # and every product by float32 BLAS.
    model.transformer.fused = {}
    fix = registry.family(model.config.family).fix_tensor  # (a layout, not a dequantizer)
    for name, ref in model.dense_refs.items():
        w = _oracle(ref)
        model.transformer.w[name] = w if fix is None else fix(model.config, name, w, True)

    def oracle_expert(layer: int, e: int):
        x = model.experts[layer][e]
        return _oracle(x.gate), _oracle(x.up), _oracle(x.down)

    before = len(blocks)
    _, ref = greedy_logits(model, PROMPT, steps=8, get_expert=oracle_expert)
    # The reference's attention ran the ops on the oracle's weights, not the native block
    # on the file's (which the transformer keeps only while they are its weights).
    assert not any(out is not None for _, out in blocks[before:])
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("max_len", [None, 70])
def test_native_decoding_block_equals_the_ops(
    tiny_dir: dict[str, Path], tmp_path: Path, monkeypatch, max_len: int | None
) -> None:
    """Decoding a Q4_0 llama past its cache's first 64 positions (the buffers grow, up to a
    cap when the sequence has one) through the native attention block: the same tokens as
    the torch ops on the same weights, logits within 1e-5. A batch holding one sequence
    twice does not go to the kernels."""
    model = load_model(write_gguf(load_model(tiny_dir["llama"]), tmp_path / "q.gguf", QType.Q4_0))
    t, get = model.transformer, model.resident_experts().get

    def decode() -> tuple[list[int], torch.Tensor]:
        kv = KVCache(model.config.n_layers, max_len=max_len)
        ids = [(7 * i) % 90 + 3 for i in range(60)]
        out = [t.forward(torch.tensor(ids), [SeqSlice(kv, 0, len(ids))], get)[0]]
        for _ in range(9):
            ids.append(int(out[-1].argmax()))
            out.append(t.forward(torch.tensor(ids[-1:]), [SeqSlice(kv, len(ids) - 1, 1)], get)[0])
        if max_len is not None:
            assert kv.k[0].shape[1] == max_len
        return ids, torch.stack(out)

    blocks = spy(monkeypatch, native, "attention_block")
    ids, ours = decode()
    assert sum(out is not None for _, out in blocks) == 9 * model.config.n_layers
    monkeypatch.setattr(native, "attention_block", lambda *a: None)
    monkeypatch.setattr(native, "attention", lambda *a: None)
    ref_ids, ref = decode()
    assert ids == ref_ids
    assert (ours - ref).abs().max().item() <= 1e-5

    kv = KVCache(model.config.n_layers)
    t.forward(torch.tensor([3, 4, 5]), [SeqSlice(kv, 0, 3)], get)
    seen = spy(monkeypatch, native, "attention"), spy(monkeypatch, native, "attention_block")
    t.forward(torch.tensor([6, 7]), [SeqSlice(kv, 3, 1), SeqSlice(kv, 4, 1)], get)
    assert seen == ([], [])


def test_decoding_row_beside_a_prompt_gets_its_bits_alone(
    tiny_dir: dict[str, Path], tmp_path: Path
) -> None:
    """A decoding row batched with a prompt (a prompt's group takes one-token riders) goes
    through the native block as if alone: its hidden state, FFN input and routing are the
    same bits as alone; the prompt's within 1e-5 of running it alone through the ops."""
    if not native.available():
        pytest.skip("no native kernels here (x86-64 with AVX2 and a C compiler)")
    for family in ("mixtral", "llama"):  # sparse and dense layers
        model = load_model(
            write_gguf(load_model(tiny_dir[family]), tmp_path / f"{family}.gguf", QType.Q4_0)
        )
        t, get = model.transformer, model.resident_experts().get
        a, b = KVCache(model.config.n_layers), KVCache(model.config.n_layers)
        t.forward(torch.tensor(PROMPT), [SeqSlice(a, 0, len(PROMPT))], get)
        t.forward(torch.tensor(PROMPT[:3]), [SeqSlice(b, 0, 3)], get)
        n = len(PROMPT)
        h = t.embed(torch.tensor([11, *PROMPT[3:]]))
        with torch.inference_mode():
            mixed = t.attention_route(0, h, [SeqSlice(a, n, 1), SeqSlice(b, 3, n - 3)])
            alone = t.attention_route(0, h[:1], [SeqSlice(a, n, 1)])
            prompt = t.attention_route(0, h[1:], [SeqSlice(b, 3, n - 3)])
        for m, one, rest in zip(mixed, alone, prompt, strict=True):
            if m is None:  # a dense layer: no routing
                assert one is None and rest is None
                continue
            assert torch.equal(m[:1], one)
            assert (m[1:].double() - rest.double()).abs().max().item() <= 1e-5


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_plain_generation_applies_q4_experts_from_their_bytes(
    tiny_dir: dict[str, Path], tmp_path: Path, monkeypatch, qtype: QType
) -> None:
    """``bevy generate`` and the bench's reference (``resident_experts(native=True)``)
    apply Q4 experts with the native kernel on their mapped bytes, however many rows (the
    rounding of their inputs is the same for a prompt's rows as for decoding's): the
    logits of dequantizing every expert with those inputs rounded, within the bound of
    ``engine_runs.ROUNDED_BOUND``."""
    from backend.models.weights import StoredExpert

    if not native.available():
        pytest.skip("no native Q4 kernels here (x86-64 with AVX2 and a C compiler)")
    model = load_model(write_gguf(load_model(tiny_dir["mixtral"]), tmp_path / "q.gguf", qtype))
    monkeypatch.setattr(native, "EXPERT_MAX_ROWS", 4)  # the 7-token prompt: some past it
    kernel = spy(monkeypatch, native, "expert_mlp")
    resident = model.resident_experts(native=True)
    assert isinstance(resident.for_compute(0, 0), StoredExpert)
    ids, ours = greedy_logits(model, PROMPT, steps=8, get_expert=resident.for_compute)
    ids0, ref = greedy_logits(model, PROMPT, steps=8, rounded=True)  # dequantized, rounded
    assert ids == ids0
    assert (ours - ref).abs().max().item() <= ROUNDED_BOUND
    rows = [args[1].shape[0] for args, out in kernel if out is not None]
    assert max(rows) > 4  # past EXPERT_MAX_ROWS, still the kernel
    assert resident.n_cached == 0  # nothing dequantized
