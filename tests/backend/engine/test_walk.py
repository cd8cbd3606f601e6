"""Decoding groups walk on through the layers in one native call while every expert they
route to is resident (``JobRunner.run_through``, ``kernels/decode.c``): the results are
those of plain generation and of the layer-by-layer jobs it replaces, under every policy,
cache size and store, with requests joining mid-flight."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.jobs import JobRunner
from backend.engine.loop import Engine
from backend.kernels import native
from backend.kernels.decode import Walk
from backend.kernels.quants import QType
from backend.messages import Submit
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import (
    ALL_POLICIES,
    PROMPTS,
    assert_same_results,
    expected_refs,
    one_request,
    references,
    run_clean,
)
from tests.helpers.spy import spy
from tests.helpers.tiny import make_tiny

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no native Q4 kernels here (x86-64 with AVX2 and a C compiler)"
)


@pytest.fixture(scope="module")
def walk_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """Q4 models the walk takes: six layers, and four sliding ones (window 5, shorter than
    the longer prompts with their decoding)."""
    root = tmp_path_factory.mktemp("walk")
    deep = load_model(make_tiny("mixtral", root / "deep", num_hidden_layers=6))
    swa = load_model(make_tiny("mixtral", root / "swa", num_hidden_layers=4, sliding_window=5))
    return {
        "deep": load_model(write_gguf(deep, root / "deep.q4.gguf", QType.Q4_1)),
        "swa": load_model(write_gguf(swa, root / "swa.q4_0.gguf", QType.Q4_0)),
    }


@pytest.fixture(scope="module")
def walk_refs(walk_models) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    out = {name: references(m) for name, m in walk_models.items()}
    out.update({f"{name}:rounded": references(m, rounded=True) for name, m in walk_models.items()})
    return out


def _run(model, config, monkeypatch, walk: bool):
    """``run_clean`` with the walk on or off; the walks it made (args, (reached, trail))."""
    monkeypatch.undo()
    calls = spy(monkeypatch, Walk, "run")
    if not walk:
        monkeypatch.setattr(JobRunner, "run_through", lambda self, group: None)
    return run_clean(model, config), calls


@pytest.mark.parametrize(
    "policy,cache,storage",
    [(p, c, "ssd") for p in ALL_POLICIES for c in ("min", "1.0")]
    + [(p, "0.3", "host") for p in ("bevy", "sync", "prefetch-gate", "bevy-static:3")],
)
def test_walks_match_plain_generation_and_layer_jobs(
    walk_models, walk_refs, monkeypatch, policy: str, cache: str, storage: str
) -> None:
    model = walk_models["deep"]
    size = str(model.config.top_k) if cache == "min" else cache
    config = EngineConfig(policy=policy, cache=size, storage=storage, expert_backend="native")
    out, walks = _run(model, config, monkeypatch, walk=True)
    fin, logs = out
    refs, bound = expected_refs(walk_refs, "deep", rounded=True)
    for i, (tokens, logits) in enumerate(refs):
        rid = f"r{i}"
        assert list(fin[rid].token_ids) == tokens, rid
        assert (torch.stack(logs[rid]) - logits).abs().max().item() <= bound, rid
    if cache == "1.0":
        # Once every expert is in and the requests are at one layer (under bevy-fifo,
        # only near the end), their group goes through several layers per call.
        assert any(reached - args[1] >= 2 for args, (reached, _) in walks)
    layer_by_layer, none = _run(model, config, monkeypatch, walk=False)
    assert not none
    assert_same_results(out, layer_by_layer, rounded=True)


@pytest.mark.parametrize("cache", ["min", "0.5", "1.0"])
def test_walks_with_sliding_windows(walk_models, walk_refs, monkeypatch, cache: str) -> None:
    model = walk_models["swa"]
    size = str(model.config.top_k) if cache == "min" else cache
    config = EngineConfig(policy="bevy", cache=size, storage="host", expert_backend="native")
    (fin, logs), walks = _run(model, config, monkeypatch, walk=True)
    assert walks
    refs, bound = expected_refs(walk_refs, "swa", rounded=True)
    for i, (tokens, logits) in enumerate(refs):
        assert list(fin[f"r{i}"].token_ids) == tokens
        assert (torch.stack(logs[f"r{i}"]) - logits).abs().max().item() <= bound


def test_a_walk_gives_the_bits_of_the_layer_jobs_and_counts_their_uses(
    walk_models, monkeypatch
) -> None:
    """One request alone, its prompt's experts resident: the same bits either way, and the
    cache counts the same uses and hits (layers a walk passed count as their jobs would)."""
    model = walk_models["deep"]
    config = EngineConfig(policy="bevy", cache="1.0", storage="host", warm=False)
    tokens, logits, eng, walks = one_request(model, config, monkeypatch, walk=True)
    tokens0, logits0, eng0, none = one_request(model, config, monkeypatch, walk=False)
    assert walks and not none
    assert tokens == tokens0
    assert torch.equal(logits, logits0)
    assert eng.cache._uses == eng0.cache._uses
    assert eng.cache._passes == eng0.cache._passes
    s, s0 = eng.cache.stats, eng0.cache.stats
    assert (s.hits, s.misses, s.fetches) == (s0.hits, s0.misses, s0.fetches)
    assert eng.cache.n_loading == 0 and sum(eng.cache.refs) == 0


def _at_layer_one(model) -> tuple[Engine, object]:
    """An engine with every expert its request needs resident, and that request decoding,
    before layer 1's MoE with its experts claimed (as ``_run`` would find it)."""
    eng = Engine(model, EngineConfig(policy="bevy", cache="1.0", storage="host", warm=False))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.submit(Submit("a", params, prompt_ids=PROMPTS[0]))
    eng.run_until_idle(60)  # loads every expert the same prompt needs again
    eng.jobs.run_through = lambda group: None  # layer by layer up to there
    eng.submit(Submit("b", params, prompt_ids=PROMPTS[0]))
    while not (eng.running and eng.running[0].out_ids and eng.running[0].layer == 1):
        eng.step()
    del eng.jobs.run_through
    (r,) = eng.running
    eng._claim()
    assert eng._ready(r)
    return eng, r


def test_a_walk_stops_before_a_missing_expert_and_when_told(walk_models) -> None:
    model = walk_models["deep"]
    eng, r = _at_layer_one(model)
    try:
        table = eng.jobs.experts.table
        E = eng.jobs.experts.n_table_experts
        kept = list(table)
        # Layer 3's experts gone from the table: the walk ends before its MoE.
        for e in range(E):
            table[4 * (3 * E + e) : 4 * (3 * E + e) + 4] = [0, 0, 0, 0]
        done, logits = eng.jobs.run_through([r])
        assert logits is None and r.layer == 3 and r.route_ids.shape == (1, 2)
        eng.claims.release(r)
        table[:] = kept
        # Told to stop: one layer, then it hands back.
        eng.claims.claim(r, r.pending_keys(eng.cache.n_slots))
        eng.jobs.stop.value = 1
        eng.jobs.run_through([r])
        assert r.layer == 4
        eng.claims.release(r)
    finally:
        eng.close()
