"""Where every expert has a slot, the native backend packs Q4 experts in their slots
(``native.pack``) as they become resident, and every path that reads a slot reads it as
packed: the whole-layer kernel, the per-expert kernel, the dequantized product for many
rows, the decoding walk. With fewer slots they stay as stored."""

from __future__ import annotations

import importlib

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.loop import Engine
from backend.kernels import native
from tests.helpers.engine_runs import ROUNDED_BOUND, expected_refs, packed_experts, run_staggered


def _packs() -> bool:
    probe = torch.zeros(16 * 2 * 20, dtype=torch.uint8)
    return native.available() and native.pack(probe, native.QType.Q4_1, (16, 64))


pytestmark = pytest.mark.skipif(not _packs(), reason="no native kernels here")


@pytest.mark.parametrize("max_rows", [native.EXPERT_MAX_ROWS, 1])
@pytest.mark.parametrize("cache", ["min", "1.0"])
def test_packed_slots_match_plain_generation(models, references, monkeypatch, cache, max_rows):
    """With ``max_rows`` 1 every prompt row past the first goes through the dequantized
    product, which must unpack the slot first, and which multiplies its rows as they are
    (float): the logits then lie between plain generation's and the packed kernels'
    rounded one. ``min``: slots are given up and filled again, and nothing is packed."""
    # (the package's ``native`` attribute is the kernels module: import the submodule)
    backend_module = importlib.import_module("backend.engine.experts.native")
    monkeypatch.setattr(backend_module, "NATIVE_MAX_ROWS", max_rows)
    model = models["mixtral-q4-gguf"]
    size = str(model.config.top_k) if cache == "min" else cache
    eng = Engine(model, EngineConfig(policy="bevy", cache=size, expert_backend="native"))
    try:
        finished = run_staggered(eng)
        refs, bound = expected_refs(references, "mixtral-q4-gguf", packed_experts(eng))
        assert packed_experts(eng) == (cache == "1.0")
        for i, (tokens, logits) in enumerate(refs):
            assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
            if cache == "1.0" and max_rows == 1:
                bound = ROUNDED_BOUND + (logits - references["mixtral-q4-gguf"][i][1]).abs().max()
            assert (torch.stack(eng.logits_log[f"r{i}"]) - logits).abs().max().item() <= bound
        backend = eng.jobs.experts
        resident = [k for k, s in eng.cache.slot_of.items() if eng.cache.ready[s]]
        if cache == "min":
            assert eng.cache.stats.evictions > 0 and not backend.packs
            assert not any(any(p) for _, p in backend._packed.values())
            return
        assert backend.packs and len(resident) == sum(len(layer) for layer in model.experts)
        assert all(backend._packed[k][1] == (True, True, True) for k in resident)
        for layer, e in resident:  # the walk's table names the packed codes
            types = backend.table[4 * (layer * backend.n_table_experts + e) + 3]
            assert {(types >> s) & 15 for s in (0, 4, 8)} <= set(native.PACKED_CODES.values())
    finally:
        eng.close()
