"""The dense few-row kernels compute what float32 BLAS computes on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.kernels import dense as dense_kernels
from backend.kernels import native, qmatmul
from backend.kernels.quants import QType, block_shape, dequantize
from backend.models import transformer as transformer_mod
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from tests.helpers.qblocks import HIDDEN, random_blocks
from tests.helpers.reference import greedy_logits
from tests.helpers.spy import spy
from tests.helpers.tiny import make_tiny

pytestmark = pytest.mark.usefixtures("kernels")


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0, QType.F32], ids=["q4_1", "q4_0", "f32"])
@pytest.mark.parametrize("rows", [1, 3, qmatmul.MAX_ROWS])
def test_dense_kernel_equals_float_matmul(qtype: QType, rows: int) -> None:
    n, k = 160, HIDDEN
    if qtype == QType.F32:
        w = dense_kernels.FusedWeight(torch.randn(n, k), qtype, (n, k))
        ref_w = w.data
    else:
        raw = random_blocks(qtype, n, k, seed=rows)
        w = dense_kernels.FusedWeight(raw, qtype, (n, k))
        ref_w = dequantize(raw, qtype, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = dense_kernels.dense_linear(w, x)
    assert got is not None, "the compiled path did not run (no C++ compiler?)"
    ref = F.linear(x, ref_w)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # Each row is reduced on its own: alone or in any batch, bit for bit the same.
    for i in range(rows):
        assert torch.equal(dense_kernels.dense_linear(w, x[i : i + 1])[0], got[i])


def test_stacked_weights_are_one_product() -> None:
    parts = [
        (random_blocks(QType.Q4_1, n, HIDDEN, seed=n), QType.Q4_1, (n, HIDDEN))
        for n in (64, 32, 32)
    ]
    w = dense_kernels.FusedWeight.stacked(parts)
    assert w is not None and w.shape == (128, HIDDEN)
    x = torch.randn(2, HIDDEN)
    got = dense_kernels.dense_linear(w, x)
    ref = torch.cat([F.linear(x, dequantize(raw, q, s)) for raw, q, s in parts], -1)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # Types or widths that differ, or a type without a block kernel: no stacked weight.
    mixed = [parts[0], (random_blocks(QType.Q4_0, 32, HIDDEN, seed=1), QType.Q4_0, (32, HIDDEN))]
    assert dense_kernels.FusedWeight.stacked(mixed) is None
    q2 = [(random_blocks(QType.Q2_K, 32, 256, seed=1), QType.Q2_K, (32, 256))]
    assert dense_kernels.FusedWeight.stacked(q2) is None
    floats = [(torch.randn(32, HIDDEN), QType.F32, (32, HIDDEN))]
    assert dense_kernels.FusedWeight.stacked(floats) is None
    with pytest.raises(ValueError):
        dense_kernels.FusedWeight(parts[0][0][:-1], QType.Q4_1, (64, HIDDEN))


NATIVE_BLOCK_TYPES = [QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.Q5_K, QType.Q3_K, QType.IQ4_XS]


@pytest.mark.parametrize("qtype", NATIVE_BLOCK_TYPES, ids=lambda q: q.name)
def test_weights_of_the_native_types_are_read_from_their_blocks(qtype: QType) -> None:
    """A weight stored as Q8_0 (a GGUF LM head) or a K-quant (a Q4_K_M file's attention)
    is multiplied from its blocks by the native kernel: within 1e-5 of float32 BLAS on the
    decoded weight, each row the same alone as in any batch. Without the native kernels
    there is no such weight (the model keeps a float copy). Bytes of the wrong size are
    refused."""
    n, k = 1001, 512
    raw = random_blocks(qtype, n, k, seed=8)
    if not native.available():
        with pytest.raises(ValueError):
            dense_kernels.FusedWeight(raw, qtype, (n, k))
        return
    w = dense_kernels.FusedWeight(raw, qtype, (n, k))
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(8))
    got = dense_kernels.dense_linear(w, x)
    assert got is not None
    assert torch.equal(got, native.linear(raw, qtype, (n, k), x))
    ref = F.linear(x, dequantize(raw, qtype, (n, k)))
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for lo, hi in ((0, 1), (3, 4), (20, 21), (5, 8), (9, 20)):
        assert torch.equal(dense_kernels.dense_linear(w, x[lo:hi]), got[lo:hi])
    with pytest.raises(ValueError):
        dense_kernels.FusedWeight(raw[: -block_shape(qtype)[1]], qtype, (n, k))


def test_gguf_head_stored_as_q8_keeps_its_blocks(smollm2_gguf, monkeypatch) -> None:
    """SmolLM2's GGUF stores its (tied) head as Q8_0: with the native kernels, the model
    keeps those blocks alone (no float copy) and decodes from them; either way its logits
    stay within 1e-4 of float32 BLAS on the decoded head."""
    calls = spy(monkeypatch, native, "linear")
    model = load_model(smollm2_gguf)
    t = model.transformer
    head = t.fused["head"]
    if native.available():
        assert head.qtype == QType.Q8_0
        assert head.data.numel() == head.shape[0] * head.shape[1] // 32 * 34
        assert t.w.in_blocks("token_embd")
    else:
        assert head.qtype == QType.F32 and not t.w.in_blocks("token_embd")
    h = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(3))
    x = transformer_mod.rms_norm(h, t.w["output_norm"], t.config.rms_eps)
    ref = F.linear(x, t.w["token_embd"])
    assert (t.logits(h) - ref).abs().max().item() <= 1e-4
    assert any(a[1] == QType.Q8_0 and y is not None for a, y in calls) == native.available()


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.F32], ids=["q4_1", "f32"])
def test_decoding_batches_are_chunked_and_rows_stay_independent(qtype: QType) -> None:
    """Up to DENSE_MAX_ROWS rows go through the kernel in chunks: any row comes out bit
    for bit as it does alone, in a batch of any size (a wide weight whose n is not a
    multiple of the vector width, like a vocabulary)."""
    n, k = 1001, 576
    g = torch.Generator().manual_seed(5)
    if qtype == QType.F32:
        w = dense_kernels.FusedWeight(torch.randn(n, k, generator=g), qtype, (n, k))
        ref_w = w.data
    else:
        raw = random_blocks(qtype, n, k, seed=5)
        w = dense_kernels.FusedWeight(raw, qtype, (n, k))
        ref_w = dequantize(raw, qtype, (n, k))
    x = torch.randn(21, k, generator=g)
    whole = dense_kernels.dense_linear(w, x)
    assert whole is not None and whole.shape == (21, n)
    ref = F.linear(x, ref_w)
    assert (whole - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for lo, hi in ((0, 1), (3, 4), (20, 21), (5, 8), (9, 20)):
        assert torch.equal(dense_kernels.dense_linear(w, x[lo:hi]), whole[lo:hi])


def test_other_dense_cases_are_left_to_blas(monkeypatch) -> None:
    """Without the native kernels (which take any rows of a float32 CPU tensor): more rows
    than the graphs take, other dtypes or widths, and a graph that fails, which leaves
    only its own kind of weight to BLAS."""
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_lib", None)
    dense = dense_kernels._Dense()
    monkeypatch.setattr(dense_kernels, "_DENSE", dense)
    w = dense_kernels.FusedWeight(torch.randn(64, HIDDEN), QType.F32, (64, HIDDEN))
    assert (
        dense_kernels.dense_linear(w, torch.randn(dense_kernels.DENSE_MAX_ROWS + 1, HIDDEN)) is None
    )
    assert dense_kernels.dense_linear(w, torch.randn(2, HIDDEN, dtype=torch.float64)) is None
    assert dense_kernels.dense_linear(w, torch.randn(2, HIDDEN + 32)) is None  # wrong width
    assert dense_kernels.dense_linear(w, torch.randn(2, HIDDEN)) is not None
    # A kernel that fails leaves its own kind of weight to BLAS, not the others.
    other = dense_kernels.FusedWeight(torch.randn(96, HIDDEN), QType.F32, (96, HIDDEN))
    with monkeypatch.context() as m:
        m.setitem(dense_kernels._KERNELS, QType.F32, None)  # calling None raises
        assert dense_kernels.dense_linear(other, torch.randn(2, HIDDEN)) is None
    assert (QType.F32, (96, HIDDEN)) in dense.broken
    assert dense_kernels.dense_linear(w, torch.randn(2, HIDDEN)) is not None
    assert dense_kernels.dense_linear(other, torch.randn(2, HIDDEN)) is None


def test_native_kernels_take_any_number_of_rows() -> None:
    """With the native kernels, decoding batches of any size (more than the graphs'
    ``DENSE_MAX_ROWS``) stay off BLAS and off a weight's float values, each row the same
    as alone."""
    if not native.available():
        pytest.skip("no native kernels here")
    raw = random_blocks(QType.Q4_1, 96, HIDDEN, seed=2)
    x = torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(2))
    for w in (
        dense_kernels.FusedWeight(raw, QType.Q4_1, (96, HIDDEN)),
        dense_kernels.FusedWeight(torch.randn(96, HIDDEN), QType.F32, (96, HIDDEN)),
    ):
        many = dense_kernels.dense_linear(w, x)
        assert many is not None
        assert torch.equal(dense_kernels.dense_linear(w, x[7:8]), many[7:8])


def test_loaded_q4_model_decodes_through_the_dense_kernels(tmp_path, monkeypatch) -> None:
    """A Q4_1 file gets stacked q/k/v, output and head kernels; decoding through them
    gives what float32 BLAS on the same weights gives."""
    path = write_gguf(
        load_model(make_tiny("llama", tmp_path / "llama")), tmp_path / "m.gguf", QType.Q4_1
    )
    model = load_model(path)
    t = model.transformer
    c = model.config
    assert set(t.fused) == {
        f"blk.{i}.{n}" for i in range(c.n_layers) for n in ("attn_qkv", "attn_output")
    } | {"head"}
    assert t.fused["blk.0.attn_qkv"].shape == (
        (c.n_heads + 2 * c.n_kv_heads) * c.head_dim,
        c.hidden_size,
    )
    assert t.warm_up()
    calls = spy(monkeypatch, transformer_mod, "dense_linear")
    blocks = spy(monkeypatch, native, "attention_block")
    _, fused = greedy_logits(model, [3, 17, 42, 5], steps=6)
    ran = sum(out is not None for _, out in calls)
    # Every decode step: the head, and each layer's qkv and output projections, by the
    # kernels or inside the native attention block (one call reading both).
    ran += 2 * sum(out is not None for _, out in blocks)
    assert ran >= 6 * (2 * c.n_layers + 1)
    assert any(out is not None for _, out in blocks) == native.available()
    t.fused = {}
    before = len(blocks)
    _, plain = greedy_logits(model, [3, 17, 42, 5], steps=6)
    assert not any(out is not None for _, out in blocks[before:])  # the ops, not the block
    assert (fused - plain).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, F.softplus])
def test_rowwise_gives_a_row_the_same_bits_in_any_batch(fn) -> None:
    """``rowwise`` (the gates of Qwen3.5 and the shared experts): a row alone, among a
    few, and among thousands (taken a block at a time) is the same bits."""
    from backend.kernels.dense import ROWWISE_BLOCK, rowwise

    x = torch.randn(2 * ROWWISE_BLOCK + 37, 7, generator=torch.Generator().manual_seed(0)) * 4
    whole = rowwise(fn, x)
    assert torch.equal(whole, fn(x.double()).float())
    for rows in (slice(0, 1), slice(5, 12), slice(ROWWISE_BLOCK - 3, ROWWISE_BLOCK + 40)):
        assert torch.equal(rowwise(fn, x[rows]), whole[rows])


@pytest.mark.parametrize("k", [40, 100, 577])
def test_float_weights_of_any_width(k: int) -> None:
    """A float32 weight whose width is not a multiple of the vector width (the kernel's
    tail): within 1e-5 of BLAS, each row the same alone as in the batch."""
    g = torch.Generator().manual_seed(k)
    w = dense_kernels.FusedWeight(torch.randn(33, k, generator=g), QType.F32, (33, k))
    x = torch.randn(11, k, generator=g)
    got = dense_kernels.dense_linear(w, x)
    assert got is not None
    ref = F.linear(x, w.data)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for i in range(11):
        assert torch.equal(dense_kernels.dense_linear(w, x[i : i + 1])[0], got[i])
