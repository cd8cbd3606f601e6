"""Warm-up: the link reads experts into the cache from the start, behind requests' own
reads, without changing a bit of any reply: every expert where each has a slot, else as
many as the free slots take, the same share of each layer, never evicting."""

from __future__ import annotations

import time

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.loop import Engine
from backend.kernels.quants import QType
from backend.messages import Finished, Submit
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import drain
from tests.helpers.tiny import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("warm")
    tiny = load_model(make_tiny("mixtral", root / "mixtral"))
    return load_model(write_gguf(tiny, root / "mixtral.q4_0.gguf", QType.Q4_0))


def _settle(eng: Engine, timeout_s: float = 60.0) -> None:
    """Step an idle engine until its warm-up reads have all landed."""
    deadline = time.monotonic() + timeout_s
    eng.step()
    while eng._warm or eng._warming:
        assert time.monotonic() < deadline, "the warm-up did not finish"
        eng.step(block=True)


def test_an_idle_engine_reads_every_expert_once(model) -> None:
    n = model.config.n_routed_experts
    eng = Engine(model, EngineConfig(cache="1.0", storage="ssd"))
    try:
        assert eng.snapshot().warm_left == n  # what the status bar and /v1/stats show
        _settle(eng)
        assert eng.snapshot().warm_left == 0
        assert sum(eng.cache.ready) == n and eng.cache.stats.fetches == n
        assert eng.cache.n_loading == 0 and sum(eng.cache.refs) == 0  # nothing pinned
        assert eng.cache.stats.prefetched == 0  # not counted as guesses
        assert len(eng.snapshot().resident) == n
    finally:
        eng.close()
    eng = Engine(model, EngineConfig(cache="1.0", warm=False))
    try:
        eng.step()
        assert not eng._warm and not eng._warming and eng.cache.stats.fetches == 0
    finally:
        eng.close()


def test_a_smaller_cache_is_filled_evenly_and_requests_evict_nothing_for_it(model) -> None:
    """Half the experts fit: the warm-up reads that many, the same count in each layer,
    and stops; a request's reads then evict warmed experts, never the other way round.
    Where a request is there from the first step, the warm-up waits for an idle engine."""
    n, layers = model.config.n_routed_experts, model.config.n_layers
    eng = Engine(model, EngineConfig(cache="0.5", storage="ssd"))
    try:
        slots = eng.cache.n_slots
        assert 0 < slots < n and eng.snapshot().warm_left == slots
        _settle(eng)
        warmed = set(eng.cache.slot_of)
        assert len(warmed) == slots == eng.cache.stats.fetches and eng.cache.stats.evictions == 0
        per_layer = [sum(1 for k in warmed if k[0] == i) for i in range(layers)]
        assert max(per_layer) - min(per_layer) <= 1
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        eng.submit(Submit("r", params, prompt_ids=[3, 9, 27, 4, 1]))
        eng.run_until_idle(120)
        assert not eng._warm and not eng._warming  # nothing more read for the warm-up
        assert sum(eng.cache.ready) == slots and sum(eng.cache.refs) == 0
        assert eng.cache.stats.fetches - slots == eng.cache.stats.evictions
    finally:
        eng.close()
    eng = Engine(model, EngineConfig(cache="0.5", storage="ssd"))
    try:
        eng.submit(Submit("r", params, prompt_ids=[3, 9, 27, 4, 1]))
        eng.step()
        assert not eng.idle and eng.snapshot().warm_left == 0  # nothing said to be read
        eng.run_until_idle(120)
        assert len(eng._warm) == slots and not eng._warming
    finally:
        eng.close()


def test_requests_during_the_warm_up_get_the_replies_of_a_cold_engine(model) -> None:
    """Requests submitted before the first step: their reads go ahead of the warm-up's,
    and an expert they claim while it is being warmed is waited for, not read twice.
    Logits within 1e-4, as the engine's other exactness checks: when reads land decides
    which rows share a split run, so the order of a sum may change by a rounding (a cold
    engine's runs differ from each other by up to 6e-7 here)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ([1, 5, 9, 14, 3], [2, 7, 7, 30, 11, 4], [8, 1])
    results = []
    for warm in (True, False):
        eng = Engine(model, EngineConfig(cache="1.0", storage="ssd", warm=warm))
        eng.logits_log = {}
        try:
            for i, ids in enumerate(prompts):
                eng.submit(Submit(f"r{i}", params, prompt_ids=ids))
            eng.run_until_idle(120)
            done = {e.request_id: e for e in drain(eng) if isinstance(e, Finished)}
            results.append(
                {k: (done[k].token_ids, torch.stack(eng.logits_log[k])) for k in sorted(done)}
            )
            if warm:
                _settle(eng)
                assert eng.cache.stats.fetches == model.config.n_routed_experts
        finally:
            eng.close()
    warm, cold = results
    assert warm.keys() == cold.keys() == {"r0", "r1", "r2"}
    for k in warm:
        assert warm[k][0] == cold[k][0]
        assert (warm[k][1] - cold[k][1]).abs().max().item() <= 1e-4
