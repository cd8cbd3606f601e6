"""The fused quantized expert MLP computes what dequantize-then-matmul computes."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.loop import Engine
from backend.kernels import native, qmatmul
from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from tests.helpers.engine_runs import (
    LOGITS_BOUND,
    PROMPTS,
    ROUNDED_BOUND,
    STEPS,
    run_staggered,
)
from tests.helpers.qblocks import HIDDEN, expert_reference, random_blocks, random_expert
from tests.helpers.reference import greedy_logits
from tests.helpers.spy import spy
from tests.helpers.tiny import make_tiny

pytestmark = pytest.mark.usefixtures("kernels")


def _reference(parts: tuple, x: torch.Tensor) -> torch.Tensor:
    """The expert dequantized; where the native kernels run, on its Q4 parts' inputs
    rounded to 8 bits as they read them."""
    return expert_reference(parts, x, rounded=native.library() is not None)


# (the rounded inputs' last bits may differ between the kernel and torch, and so round
# to another integer now and then: the packed tests' bound)
BOUND = 1e-4


@pytest.mark.parametrize(
    "qtypes",
    [(QType.Q4_1,) * 3, (QType.Q4_0,) * 3, (QType.Q4_0, QType.Q4_0, QType.Q4_1)],
    ids=["q4_1", "q4_0", "mixed"],
)
@pytest.mark.parametrize("rows", [1, 3, qmatmul.MAX_ROWS])
def test_fused_equals_dequantize_then_matmul(qtypes, rows: int) -> None:
    parts = random_expert(qtypes, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    got = qmatmul.expert_mlp(parts, x)
    assert got is not None, "the fused path did not run (no C++ compiler?)"
    ref = _reference(parts, x)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= BOUND * ref.abs().max().item()


def test_rows_do_not_depend_on_their_batch_mates() -> None:
    parts = random_expert((QType.Q4_1,) * 3)
    x = torch.randn(qmatmul.MAX_ROWS, HIDDEN, generator=torch.Generator().manual_seed(7))
    whole = qmatmul.expert_mlp(parts, x)
    for i in range(qmatmul.MAX_ROWS):
        assert torch.equal(qmatmul.expert_mlp(parts, x[i : i + 1])[0], whole[i])
    assert torch.equal(qmatmul.expert_mlp(parts, x[2:5]), whole[2:5])
    assert torch.equal(qmatmul.expert_mlp(parts, x[6:8]), whole[6:8])  # the 2-row bucket


def test_other_cases_are_left_to_the_caller(kernels: str) -> None:
    parts = random_expert((QType.Q4_1,) * 3)
    assert qmatmul.expert_mlp(parts, torch.randn(qmatmul.MAX_ROWS + 1, HIDDEN)) is None
    assert qmatmul.expert_mlp(parts, torch.randn(2, HIDDEN, dtype=torch.float64)) is None
    q8 = tuple((raw, QType.Q8_0, s) for raw, _, s in parts)
    assert qmatmul.expert_mlp(q8, torch.randn(2, HIDDEN)) is None
    short = ((parts[0][0][:-1], *parts[0][1:]), *parts[1:])
    assert qmatmul.expert_mlp(short, torch.randn(2, HIDDEN)) is None
    x = torch.randn(2, HIDDEN)
    assert qmatmul.expert_mlp(parts, x) is not None
    # The graphs read the scales through an f16 view, which needs an even byte offset;
    # the native kernel reads them bytewise.
    odd = tuple((torch.cat([raw[:1], raw])[1:], q, s) for raw, q, s in parts)
    got = qmatmul.expert_mlp(odd, x)
    if kernels == "graphs":
        assert got is None
    else:
        assert torch.equal(got, qmatmul.expert_mlp(parts, x))


def test_warm_up_compiles_what_engine_calls_use(monkeypatch, kernels: str) -> None:
    """Engine calls (slot views at odd offsets, 1..MAX_ROWS rows, inference mode) never
    compile again after the warm-up, nor fall back to running the graph eagerly (with
    the native kernels, ``expert_mlp`` consults no graph)."""
    fused = qmatmul._Fused()
    monkeypatch.setattr(qmatmul, "_FUSED", fused)
    parts = random_expert((QType.Q4_0, QType.Q4_1, QType.Q4_1), seed=11)
    assert qmatmul.warm_up(tuple((torch.zeros_like(raw), q, s) for raw, q, s in parts))
    kinds = dict(fused.fns)
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
            assert (got - ref).abs().max().item() <= BOUND * ref.abs().max().item()
    assert qmatmul._Compiled.compiles == compiles
    assert not fused.failed
    if kernels == "native":
        assert fused.fns == kinds, "the graphs were consulted although the native kernel runs"


def test_kinds_beyond_the_bound_are_left_to_the_caller(monkeypatch, kernels: str) -> None:
    if kernels == "native":
        pytest.skip("the native kernel compiles nothing per kind: no bound")
    fused = qmatmul._Fused()
    monkeypatch.setattr(qmatmul, "_FUSED", fused)
    shapes = [(32 * (i + 2), 64) for i in range(qmatmul.MAX_KINDS + 1)]
    for i, (inner, hidden) in enumerate(shapes):
        parts = (
            (random_blocks(QType.Q4_1, inner, hidden, i), QType.Q4_1, (inner, hidden)),
            (random_blocks(QType.Q4_1, inner, hidden, i + 1), QType.Q4_1, (inner, hidden)),
            (random_blocks(QType.Q4_1, hidden, inner, i + 2), QType.Q4_1, (hidden, inner)),
        )
        got = qmatmul.expert_mlp(parts, torch.randn(1, hidden))
        assert (got is None) == (i >= qmatmul.MAX_KINDS)


@pytest.mark.parametrize("policy", ["bevy", "sync"])
@pytest.mark.parametrize("cache", ["min", "0.3"])
def test_engine_on_q4_experts_matches_plain_generation(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch, policy: str, cache: str, kernels: str
) -> None:
    """Q4 experts take the native backend where the kernels build, else the compiled
    graphs (chosen at start), and decode from their stored bytes: plain generation's tokens
    (the native kernels' with the experts' inputs rounded as they read them)."""
    root = tmp_path_factory.mktemp("q4")
    path = write_gguf(
        load_model(make_tiny("mixtral", root / "mixtral")), root / "mixtral.q4_1.gguf", QType.Q4_1
    )
    model = load_model(path)
    assert {p.qtype for p in model.experts[0][0].parts} == {QType.Q4_1}
    size = str(model.config.top_k) if cache == "min" else cache
    eng = Engine(model, EngineConfig(policy=policy, cache=size, storage="ssd"))
    assert eng.expert_backend == ("native" if kernels == "native" else "compiled")
    calls = spy(
        monkeypatch, *((native, "moe") if kernels == "native" else (qmatmul, "compiled_mlp"))
    )
    try:
        finished = run_staggered(eng)
        for i, p in enumerate(PROMPTS):
            ids, logits = greedy_logits(model, p, STEPS - 1, rounded=kernels == "native")
            assert list(finished[f"r{i}"].token_ids) == ids[len(p) :] + [int(logits[-1].argmax())]
            ours = torch.stack(eng.logits_log[f"r{i}"])
            bound = ROUNDED_BOUND if kernels == "native" else LOGITS_BOUND
            assert (ours - logits).abs().max().item() <= bound
        assert sum(eng.cache.refs) == 0
    finally:
        eng.close()
    assert any(out is not None for _, out in calls), "decode steps never took the quantized path"
