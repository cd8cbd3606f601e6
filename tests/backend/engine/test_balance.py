"""``bevy`` holds its requests together while compute is the bottleneck and the link idles,
or a CPU quota starves it (``backend.engine.balance``): the decisions, and that held runs
give plain generation's results, with chunked prefill going on beside them."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.balance import EVERY_S, WINDOW_S, Balancer
from backend.engine.loop import Engine
from backend.engine.scheduler import Policy, make_policy
from backend.messages import Submit, TokenEvent
from tests.helpers.engine_runs import (
    PROMPTS,
    drain,
    expected_refs,
    rounds_inputs,
    run_staggered,
)
from tests.helpers.spy import spy


def test_holds_while_compute_bound_and_lets_go_when_the_link_is_busy() -> None:
    b = Balancer()
    assert not b.update(0.0, link_busy=0.95, compute_busy=0.9, n_running=8)  # link-bound
    assert not b.update(1.0, link_busy=0.3, compute_busy=0.7, n_running=8)  # neither
    assert b.update(2.0, link_busy=0.26, compute_busy=0.95, n_running=8)  # compute-bound
    # Held, compute does less and waits more; a busy link lets them run ahead.
    assert b.update(3.0, link_busy=0.45, compute_busy=0.6, n_running=8)
    assert not b.update(4.0, link_busy=0.65, compute_busy=0.3, n_running=8)
    assert b.switches == 2
    # Held while the load lasts; once it is gone compute waits on the link half the time.
    assert b.update(4.5, link_busy=0.3, compute_busy=0.95, n_running=8)
    assert b.update(4.7, link_busy=0.45, compute_busy=0.55, n_running=8)
    assert not b.update(4.9, link_busy=0.45, compute_busy=0.45, n_running=8)
    assert b.switches == 4
    assert not b.update(5.0, link_busy=0.0, compute_busy=1.0, n_running=1)  # nothing to hold
    assert b.due(5.0 + EVERY_S) and not b.due(5.0 + EVERY_S / 2)


def test_a_starved_engine_holds_whatever_the_lanes_say() -> None:
    b = Balancer(starved=True)
    assert b.update(0.0, link_busy=0.95, compute_busy=0.3, n_running=8)  # link-bound
    assert b.update(1.0, link_busy=0.3, compute_busy=0.4, n_running=2)
    assert not b.update(2.0, link_busy=0.0, compute_busy=1.0, n_running=1)  # nothing to hold


def test_decisions_after_a_change_read_only_the_time_since() -> None:
    """After a prompt's prefill ends, a decision reads the lanes only from then on (at
    least ``EVERY_S`` of them), so a held prefill does not keep its decoding held."""
    b = Balancer()
    assert b.window_start(10.0) == 10.0 - WINDOW_S
    b.changed(9.8)
    assert b.window_start(10.0) == 10.0 - EVERY_S  # not yet EVERY_S since: the last EVERY_S
    assert b.window_start(10.5) == 9.8
    assert b.window_start(9.8 + WINDOW_S + 1.0) == 9.8 + 1.0  # the whole window after it


def test_the_engine_marks_each_prompt_read(models) -> None:
    """Each request's first token tells the balancer that what runs changed."""
    model = models["mixtral-q8-gguf"]
    eng = Engine(model, EngineConfig(policy="bevy", cache="1.0", storage="host"))
    marks: list[float] = []
    eng.balancer.changed = marks.append
    try:
        run_staggered(eng)
    finally:
        eng.close()
    assert len(marks) == len(PROMPTS)


def test_only_bevy_balances() -> None:
    assert make_policy("bevy").balance
    assert not any(make_policy(p).balance for p in ("bevy-nobalance", "sync", "bevy-fifo"))


def _held(eng: Engine) -> Engine:
    """The engine's balancer decides "together" whatever the lanes say."""

    def update(now: float, *_: object) -> bool:
        eng.balancer._last, eng.balancer.together = now, True
        return True

    eng.balancer.update = update
    eng.balancer.together = True
    return eng


@pytest.mark.parametrize("storage", ["ssd", "host"])
@pytest.mark.parametrize("cache", ["min", "0.3", "1.0"])
@pytest.mark.parametrize("model_name", ["mixtral-q8-gguf", "mixtral-q4-gguf", "qwen3-hf"])
def test_held_requests_match_plain_generation(
    models, references, monkeypatch, model_name: str, cache: str, storage: str
) -> None:
    model = models[model_name]
    size = str(model.config.top_k) if cache == "min" else cache
    config = EngineConfig(policy="bevy", cache=size, storage=storage, prefill_chunk=3)
    groups = spy(monkeypatch, Policy, "compute_group")
    eng = _held(Engine(model, config))
    try:
        assert eng.runahead_state() == "held"
        finished = run_staggered(eng)
        refs, bound = expected_refs(references, model_name, rounds_inputs(eng))
        for i, (tokens, logits) in enumerate(refs):
            assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
            ours = torch.stack(eng.logits_log[f"r{i}"])
            assert (ours - logits).abs().max().item() <= bound, f"r{i}"
        assert sum(eng.cache.refs) == 0
        # Every group was chosen held: the lowest layer's batch, or the lowest ready layer
        # where the cache's pins kept that batch from claiming.
        assert groups and all(args[3] is True for args, _ in groups)
        assert any(len(group) > 1 for _, group in groups)
    finally:
        eng.close()


def test_a_long_prompt_does_not_hold_up_held_requests(models) -> None:
    """Held together, running requests still decode while a long prompt is read in slices
    beside them (the slices are not part of the batch that waits for everyone)."""
    eng = _held(
        Engine(models["qwen3-hf"], EngineConfig(cache="1.0", storage="host", prefill_chunk=4))
    )
    try:
        run = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for name in ("a", "b"):
            eng.submit(Submit(name, run, prompt_ids=[1, 2, 3]))
        while sum(isinstance(e, TokenEvent) for e in drain(eng)) < 2:
            eng.step()
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        eng.submit(Submit("long", one, prompt_ids=[(7 * i) % 50 + 1 for i in range(64)]))
        got = 0
        for _ in range(2000):
            eng.step()
            events = drain(eng)
            got += sum(isinstance(e, TokenEvent) and e.request_id != "long" for e in events)
            if any(isinstance(e, TokenEvent) and e.request_id == "long" for e in events):
                break
        assert got >= 4  # decoding went on while the 16 slices per layer were read
    finally:
        eng.close()


def test_held_requests_make_no_split_runs(models, references, monkeypatch) -> None:
    """Held together, a waiting job does not apply its cached experts early: those smaller
    batches are the compute that holding saves. Runahead on the same run does split."""
    model = models["mixtral-q8-gguf"]
    config = EngineConfig(policy="bevy", cache=str(model.config.top_k), storage="ssd")
    counts = {}
    for held in (False, True):
        splits = spy(monkeypatch, Engine, "_run_split")
        eng = Engine(model, config)
        eng.balancer.update = lambda now, *a: False  # runahead unless forced
        eng = _held(eng) if held else eng
        try:
            finished = run_staggered(eng)
            for i, (tokens, _) in enumerate(references["mixtral-q8-gguf"]):
                assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
        finally:
            eng.close()
        counts[held] = len(splits)
    assert counts[False] > 0 and counts[True] == 0
