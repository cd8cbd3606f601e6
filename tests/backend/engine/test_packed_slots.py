"""The native backend packs Q4 experts in their slots (``native.pack``) once routed to again
after their fill (or for a product of ``PACK_ROWS`` rows or more, or as they land where
every expert has a slot), again at each fill, and every path that reads a slot reads it
as its slot holds it, packed or as stored: the whole-layer kernel, the per-expert
kernel, the decoding walk; to the same bits."""

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
@pytest.mark.parametrize("cache", ["min", "0.5", "1.0"])
def test_packed_slots_match_plain_generation(models, references, monkeypatch, cache, max_rows):
    """Q4 experts take their kernel whatever their rows, packed or not (with ``max_rows``
    1, no prompt row of theirs is dequantized), and packed and as stored give the same
    bits: plain generation with the experts as stored, every prompt in one batch
    (``bevy bench``'s reference), has the run's tokens either way. ``min``: slots are
    given up and filled again after each use, none packed; ``0.5``: given up and filled
    again, a fill packed once used again."""
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
        if cache == "1.0":
            assert len(resident) == sum(len(layer) for layer in model.experts)
        else:
            assert eng.cache.stats.evictions > 0
        # Each resident expert is packed in its slot's current fill if routed to since
        # the fill, else left as stored: every run has run, each packing what it used.
        assert set(backend._packed) | set(backend._unpacked) == set(resident)
        assert not set(backend._packed) & set(backend._unpacked)
        # a slot per expert of one token: each fill is evicted for the next token's
        if cache == "min":
            assert backend._unpacked and not backend._packed
        else:
            assert backend._packed, "no fill was used twice"
        packed_codes = set(native.PACKED_CODES.values())
        for k in resident:
            slot = eng.cache.slot_of[k]
            types = backend.table[4 * (k[0] * backend.n_table_experts + k[1]) + 3]
            codes = {(types >> s) & 15 for s in (0, 4, 8)}
            if k in backend._packed:
                assert backend._packed[k] == ((slot, eng.cache.generation[slot]), (True,) * 3)
                assert codes <= packed_codes  # the walk's table names the packed codes
            else:
                assert eng.cache.uses(k) == backend._unpacked[k], k
                assert not codes & packed_codes
    finally:
        eng.close()
