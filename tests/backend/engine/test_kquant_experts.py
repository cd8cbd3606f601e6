"""K-quant experts (as Q4_K_M and Q3_K_M files hold them) on the native kernels: the engine
picks the native backend for them, and its tokens and logits are plain generation's,
where the experts are dequantized then multiplied."""

from __future__ import annotations

import pytest
import torch

from backend.engine.experts.native import NativeExperts
from backend.kernels import native
from backend.kernels.decode import Walk
from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import (
    ALL_POLICIES,
    check_policy_against_plain,
    plain_references,
)
from tests.helpers.qblocks import with_k_quant_experts
from tests.helpers.reference import greedy_logits
from tests.helpers.spy import spy
from tests.helpers.tiny import make_tiny

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no native kernels here (x86-64 with AVX2 and a C compiler)"
)


# (gate and up, down) as Q4_K_M and Q3_K_M files store many of their experts
MIXES = {"q4_k_m": (QType.Q4_K, QType.Q6_K), "q3_k_m": (QType.Q3_K, QType.Q5_K)}


@pytest.fixture(scope="module", params=sorted(MIXES))
def kquant(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LoadedModel, list]:
    """A tiny Mixtral (rows of 256: a K-quant super-block) with Q4_0 attention, which the
    decode walk takes, and K-quant experts; plain generation's results for the engine
    tests' prompts."""
    root = tmp_path_factory.mktemp("kquant")
    folder = make_tiny("mixtral", root / "hf", hidden_size=256, intermediate_size=256)
    q4 = write_gguf(load_model(folder), root / "q4_0.gguf", QType.Q4_0)
    gate_up, down = MIXES[request.param]
    model = load_model(with_k_quant_experts(q4, root / f"{request.param}.gguf", gate_up, down))
    assert {p.qtype for layer in model.experts for e in layer for p in e.parts} == {gate_up, down}
    return model, plain_references(model)


def test_stored_experts_compute_what_dequantized_ones_do(kquant) -> None:
    """Plain generation with the experts applied from their stored blocks by the kernels
    (``ResidentExperts(native=True)``) against the same with them dequantized."""
    model, _ = kquant
    prompt = [3, 17, 42, 5, 88, 9, 1, 60, 61, 62]
    stored = model.resident_experts(native=True)
    assert stored.stored(0, 0) is not None
    ids, ours = greedy_logits(model, prompt, steps=6, get_expert=stored.for_compute)
    ref_ids, ref = greedy_logits(model, prompt, steps=6)
    assert ids == ref_ids and (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("cache", ["min", "1.0"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_on_the_native_backend(
    kquant, monkeypatch: pytest.MonkeyPatch, policy: str, cache: str
) -> None:
    walks = spy(monkeypatch, Walk, "run")
    eng = check_policy_against_plain(*kquant, policy, cache, "ssd")
    assert isinstance(eng.jobs.experts, NativeExperts)  # "auto" picks it for these blocks
    if cache == "1.0":  # every expert resident: decoding groups walk through layers
        assert any(reached - args[1] >= 2 for args, (reached, _) in walks)


def test_rows_not_a_whole_super_block_are_refused() -> None:
    """A K-quant row holds whole super-blocks of 256: a 704-wide one is not taken (Gemma
    4's files store those down experts as Q5_0 or Q8_0, which are); the activation is a
    bit of the types."""
    kinds = ((QType.Q4_K, (704, 2816), 704 * 11 * 144),) * 2 + ((QType.Q6_K, (2816, 704), 0),)
    assert native.mlp_types(kinds) is None
    good = ((QType.Q4_K, (768, 2048), 768 * 8 * 144),) * 2 + (
        (QType.Q6_K, (2048, 768), 2048 * 3 * 210),
    )
    assert native.mlp_types(good) == 2 | 2 << 4 | 3 << 8
    assert native.mlp_types(good, "gelu") == 2 | 2 << 4 | 3 << 8 | 1 << 12
    assert native.mlp_types(good, "swiglu_oai") is None


def test_experts_with_biases_never_reach_the_native_kernels() -> None:
    """Not SiLU-plain and not GELU: gpt-oss's biased, clamped experts, whatever ``act``
    a caller passes or leaves out."""
    from backend.engine.experts import why_not

    experts = [[]]
    slots = torch.empty((1, 1), dtype=torch.uint8)
    for act in ("silu", None):
        assert "biases" in why_not("native", experts, slots, torch.float32, plain=False, act=act)
    assert why_not("native", experts, slots, torch.float32, plain=False, act="gelu") is None
