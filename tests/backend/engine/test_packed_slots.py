"""The native backend packs Q4 experts in their slots (``native.pack``) as they become
resident, again at each fill, and every path that reads a slot reads it as packed: the
whole-layer kernel, the per-expert kernel, the decoding walk; to the bits of the blocks
as stored."""

from __future__ import annotations

import importlib

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.loop import Engine
from backend.kernels import native
from backend.models.generate import greedy_reference
from tests.helpers.engine_runs import PROMPTS, STEPS, expected_refs, rounds_inputs, run_staggered
from tests.helpers.spy import spy


def _packs() -> bool:
    probe = torch.zeros(16 * 2 * 20, dtype=torch.uint8)
    return native.available() and native.pack(probe, native.QType.Q4_1, (16, 64))


pytestmark = pytest.mark.skipif(not _packs(), reason="no native kernels here")


@pytest.mark.parametrize("max_rows", [native.EXPERT_MAX_ROWS, 1])
@pytest.mark.parametrize("cache", ["min", "1.0"])
def test_packed_slots_match_plain_generation(models, references, monkeypatch, cache, max_rows):
    """Q4 experts take their kernel whatever their rows, packed or not (with ``max_rows``
    1, no prompt row of theirs is dequantized), and packed and as stored give the same
    bits: plain generation with the experts as stored, every prompt in one batch
    (``bevy bench``'s reference), has the run's tokens either way. ``min``: slots are
    given up and filled again, each fill packed again."""
    # (the package's ``native`` attribute is the kernels module: import the submodule)
    backend_module = importlib.import_module("backend.engine.experts.native")
    monkeypatch.setattr(backend_module, "NATIVE_MAX_ROWS", max_rows)
    model = models["mixtral-q4-gguf"]
    size = str(model.config.top_k) if cache == "min" else cache
    dequantized = spy(monkeypatch, backend_module.NativeExperts, "dequantize")
    eng = Engine(model, EngineConfig(policy="bevy", cache=size, expert_backend="native"))
    try:
        finished = run_staggered(eng)
        assert not dequantized
        assert rounds_inputs(eng)
        refs, bound = expected_refs(references, "mixtral-q4-gguf", rounded=True)
        for i, (tokens, logits) in enumerate(refs):
            assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
            assert (torch.stack(eng.logits_log[f"r{i}"]) - logits).abs().max().item() <= bound
        plain = greedy_reference(model, PROMPTS, STEPS)
        assert plain == [list(finished[f"r{i}"].token_ids) for i in range(len(PROMPTS))]
        backend = eng.jobs.experts
        resident = [k for k, s in eng.cache.slot_of.items() if eng.cache.ready[s]]
        if cache == "min":
            assert eng.cache.stats.evictions > 0
        else:
            assert len(resident) == sum(len(layer) for layer in model.experts)
        # every resident expert packed in its slot's current fill, and only those
        assert set(backend._packed) == set(resident)
        for k in resident:
            slot = eng.cache.slot_of[k]
            assert backend._packed[k] == ((slot, eng.cache.generation[slot]), (True,) * 3)
        for layer, e in resident:  # the walk's table names the packed codes
            types = backend.table[4 * (layer * backend.n_table_experts + e) + 3]
            assert {(types >> s) & 15 for s in (0, 4, 8)} <= set(native.PACKED_CODES.values())
    finally:
        eng.close()
