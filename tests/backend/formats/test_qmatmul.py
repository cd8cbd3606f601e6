"""The fused quantized expert MLP and the dense few-row kernels compute what
dequantize-then-matmul (or float32 BLAS) computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.config import EngineConfig
from backend.engine import Engine
from backend.formats import qmatmul
from backend.formats.gguf_export import write_gguf
from backend.formats.quants import QType, block_shape, dequantize
from backend.models import transformer as transformer_mod
from backend.models.loader import load_model
from tests.backend.models.test_parity import greedy_logits
from tests.backend.models.tiny import make_tiny
from tests.backend.test_engine import PROMPTS, STEPS, run_staggered

HIDDEN, INNER = 64, 96


def _raw(qtype: QType, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    _, bb = block_shape(qtype)
    n = rows * cols // 32
    raw = torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)
    n_scales = 2 if qtype == QType.Q4_1 else 1
    scales = (torch.randn((n, n_scales), generator=g) * 0.05).half()
    raw[:, : 2 * n_scales] = scales.view(torch.uint8).view(n, 2 * n_scales)
    return raw.reshape(-1)


def _expert(qtypes: tuple[QType, QType, QType], seed: int = 0) -> tuple:
    shapes = ((INNER, HIDDEN), (INNER, HIDDEN), (HIDDEN, INNER))
    return tuple(
        (_raw(q, *s, seed + i), q, s) for i, (q, s) in enumerate(zip(qtypes, shapes, strict=True))
    )


def _reference(parts: tuple, x: torch.Tensor) -> torch.Tensor:
    g, u, d = (dequantize(raw, q, s) for raw, q, s in parts)
    return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)


@pytest.mark.parametrize(
    "qtypes",
    [(QType.Q4_1,) * 3, (QType.Q4_0,) * 3, (QType.Q4_0, QType.Q4_0, QType.Q4_1)],
    ids=["q4_1", "q4_0", "mixed"],
)
@pytest.mark.parametrize("rows", [1, 3, qmatmul.MAX_ROWS])
def test_fused_equals_dequantize_then_matmul(qtypes, rows: int) -> None:
    parts = _expert(qtypes, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    got = qmatmul.expert_mlp(parts, x)
    assert got is not None, "the fused path did not run (no C++ compiler?)"
    ref = _reference(parts, x)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_rows_do_not_depend_on_their_batch_mates() -> None:
    parts = _expert((QType.Q4_1,) * 3)
    x = torch.randn(qmatmul.MAX_ROWS, HIDDEN, generator=torch.Generator().manual_seed(7))
    whole = qmatmul.expert_mlp(parts, x)
    for i in range(qmatmul.MAX_ROWS):
        assert torch.equal(qmatmul.expert_mlp(parts, x[i : i + 1])[0], whole[i])
    assert torch.equal(qmatmul.expert_mlp(parts, x[2:5]), whole[2:5])
    assert torch.equal(qmatmul.expert_mlp(parts, x[6:8]), whole[6:8])  # the 2-row bucket


def test_other_cases_are_left_to_the_caller() -> None:
    parts = _expert((QType.Q4_1,) * 3)
    assert qmatmul.expert_mlp(parts, torch.randn(qmatmul.MAX_ROWS + 1, HIDDEN)) is None
    assert qmatmul.expert_mlp(parts, torch.randn(2, HIDDEN, dtype=torch.float64)) is None
    q8 = tuple((raw, QType.Q8_0, s) for raw, _, s in parts)
    assert qmatmul.expert_mlp(q8, torch.randn(2, HIDDEN)) is None
    # The scales are read through an f16 view, which needs an even byte offset.
    assert qmatmul.expert_mlp(parts, torch.randn(2, HIDDEN)) is not None
    odd = tuple((torch.cat([raw[:1], raw])[1:], q, s) for raw, q, s in parts)
    assert qmatmul.expert_mlp(odd, torch.randn(2, HIDDEN)) is None


def test_warm_up_compiles_what_engine_calls_use(monkeypatch) -> None:
    """Engine calls (slot views at odd offsets, 1..MAX_ROWS rows, inference mode) never
    compile again after the warm-up, nor fall back to running the graph eagerly."""
    fused = qmatmul._Fused()
    monkeypatch.setattr(qmatmul, "_FUSED", fused)
    parts = _expert((QType.Q4_0, QType.Q4_1, QType.Q4_1), seed=11)
    assert qmatmul.warm_up(tuple((torch.zeros_like(raw), q, s) for raw, q, s in parts))
    size = sum(raw.numel() for raw, _, _ in parts)
    slot = torch.zeros(size + 4096 + 20, dtype=torch.uint8)
    at = 4096 + 20
    views = []
    for raw, q, s in parts:
        slot[at : at + raw.numel()] = raw
        views.append((slot[at : at + raw.numel()], q, s))
        at += raw.numel()
    views = tuple(views)
    compiles = qmatmul._Compiled.compiles
    with torch.inference_mode():
        for rows in range(1, qmatmul.MAX_ROWS + 1):
            x = torch.randn(rows, HIDDEN)
            got = qmatmul.expert_mlp(views, x)
            assert got is not None, f"{rows} rows needed a new compile"
            ref = _reference(parts, x)
            assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert qmatmul._Compiled.compiles == compiles
    assert not fused.failed


def test_kinds_beyond_the_bound_are_left_to_the_caller(monkeypatch) -> None:
    fused = qmatmul._Fused()
    monkeypatch.setattr(qmatmul, "_FUSED", fused)
    shapes = [(32 * (i + 2), 64) for i in range(qmatmul.MAX_KINDS + 1)]
    for i, (inner, hidden) in enumerate(shapes):
        parts = (
            (_raw(QType.Q4_1, inner, hidden, i), QType.Q4_1, (inner, hidden)),
            (_raw(QType.Q4_1, inner, hidden, i + 1), QType.Q4_1, (inner, hidden)),
            (_raw(QType.Q4_1, hidden, inner, i + 2), QType.Q4_1, (hidden, inner)),
        )
        got = qmatmul.expert_mlp(parts, torch.randn(1, hidden))
        assert (got is None) == (i >= qmatmul.MAX_KINDS)


@pytest.mark.parametrize("policy", ["bevy", "sync"])
@pytest.mark.parametrize("cache", ["min", "0.3"])
def test_engine_on_q4_experts_matches_plain_generation(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch, policy: str, cache: str
) -> None:
    root = tmp_path_factory.mktemp("q4")
    path = write_gguf(
        load_model(make_tiny("mixtral", root / "mixtral")), root / "mixtral.q4_1.gguf", QType.Q4_1
    )
    model = load_model(path)
    assert {p.qtype for p in model.experts[0][0].parts} == {QType.Q4_1}
    fused = []
    real = qmatmul.expert_mlp

    def counting(parts, x):
        out = real(parts, x)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(qmatmul, "expert_mlp", counting)
    size = str(model.config.top_k) if cache == "min" else cache
    eng = Engine(model, EngineConfig(policy=policy, cache=size, storage="ssd"))
    fused.clear()  # the engine's compile warm-up calls it too
    try:
        finished = run_staggered(eng)
        for i, p in enumerate(PROMPTS):
            ids, logits = greedy_logits(model, p, STEPS - 1)
            assert list(finished[f"r{i}"].token_ids) == ids[len(p) :] + [int(logits[-1].argmax())]
            ours = torch.stack(eng.logits_log[f"r{i}"])
            assert (ours - logits).abs().max().item() <= 1e-4
        assert sum(eng.cache.refs) == 0
    finally:
        eng.close()
    assert any(fused), "decode steps never took the fused path"


# --- dense weights --------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0, QType.F32], ids=["q4_1", "q4_0", "f32"])
@pytest.mark.parametrize("rows", [1, 3, qmatmul.MAX_ROWS])
def test_dense_kernel_equals_float_matmul(qtype: QType, rows: int) -> None:
    n, k = 160, HIDDEN
    if qtype == QType.F32:
        w = qmatmul.FusedWeight(torch.randn(n, k), qtype, (n, k))
        ref_w = w.data
    else:
        raw = _raw(qtype, n, k, seed=rows)
        w = qmatmul.FusedWeight(raw, qtype, (n, k))
        ref_w = dequantize(raw, qtype, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = qmatmul.dense_linear(w, x)
    assert got is not None, "the compiled path did not run (no C++ compiler?)"
    ref = F.linear(x, ref_w)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # Each row is reduced on its own: alone or in any batch, bit for bit the same.
    for i in range(rows):
        assert torch.equal(qmatmul.dense_linear(w, x[i : i + 1])[0], got[i])


def test_stacked_weights_are_one_product() -> None:
    parts = [(_raw(QType.Q4_1, n, HIDDEN, seed=n), QType.Q4_1, (n, HIDDEN)) for n in (64, 32, 32)]
    w = qmatmul.FusedWeight.stacked(parts)
    assert w is not None and w.shape == (128, HIDDEN)
    x = torch.randn(2, HIDDEN)
    got = qmatmul.dense_linear(w, x)
    ref = torch.cat([F.linear(x, dequantize(raw, q, s)) for raw, q, s in parts], -1)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # Types or widths that differ, or a type without a kernel: no stacked weight.
    mixed = [parts[0], (_raw(QType.Q4_0, 32, HIDDEN, seed=1), QType.Q4_0, (32, HIDDEN))]
    assert qmatmul.FusedWeight.stacked(mixed) is None
    q8 = [(torch.zeros(32 * HIDDEN // 32 * 34, dtype=torch.uint8), QType.Q8_0, (32, HIDDEN))]
    assert qmatmul.FusedWeight.stacked(q8) is None
    with pytest.raises(ValueError):
        qmatmul.FusedWeight(parts[0][0][:-1], QType.Q4_1, (64, HIDDEN))


def test_dense_products_with_many_rows_are_left_to_blas() -> None:
    w = qmatmul.FusedWeight(torch.randn(64, HIDDEN), QType.F32, (64, HIDDEN))
    assert qmatmul.dense_linear(w, torch.randn(qmatmul.MAX_ROWS + 1, HIDDEN)) is None
    assert qmatmul.dense_linear(w, torch.randn(2, HIDDEN, dtype=torch.float64)) is None


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
    calls = []
    real = qmatmul.dense_linear

    def counting(w, x):
        out = real(w, x)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(transformer_mod, "dense_linear", counting)
    _, fused = greedy_logits(model, [3, 17, 42, 5], steps=6)
    assert sum(calls) >= 6 * (2 * c.n_layers + 1)  # every decode step: qkv, output, head
    t.fused = {}
    _, plain = greedy_logits(model, [3, 17, 42, 5], steps=6)
    assert (fused - plain).abs().max().item() <= 1e-4
