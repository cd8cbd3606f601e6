"""One memory budget: the decoded working set is held inside the cache budget, and the
engine reports what it holds (slots, working set, KV, dense weights) against it."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest

from backend.config import EngineConfig, SamplingParams
from backend.engine.loop import Engine
from backend.kernels.quants import QType
from backend.messages import Submit
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from tests.helpers.tiny import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """Q5_1 experts: neither the native kernels nor the graphs take them, so the eager
    backend runs them."""
    root = tmp_path_factory.mktemp("memory")
    tiny = load_model(make_tiny("mixtral", root / "mixtral"))
    return load_model(write_gguf(tiny, root / "mixtral.q5_1.gguf", QType.Q5_1))


def _engine(model: LoadedModel, **kw) -> Engine:
    return Engine(model, EngineConfig(storage="host", **kw))


def test_no_working_set_unless_asked_and_never_past_the_budget(model: LoadedModel) -> None:
    n = model.config.n_routed_experts
    eng = _engine(model, cache="1.0")
    try:
        assert eng.expert_backend == "eager"
        assert eng.cache.n_slots == n and eng.working_set_bytes == 0
        assert eng.cache_budget_bytes == n * eng.slot_bytes
    finally:
        eng.close()
    # This tiny model's experts take under 1 MiB: a 1 MiB working set leaves no slot.
    with pytest.raises(ValueError, match="working set is below the legal minimum"):
        _engine(model, cache="1.0", working_set_mib=1)


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    from backend.demo.build import ensure_demo

    return load_model(ensure_demo(quiet=True))


def test_an_asked_for_working_set_comes_out_of_the_budget_and_stays_in_it(demo) -> None:
    plain = Engine(demo, EngineConfig(cache="0.3", expert_backend="eager"))
    budget, slot, n_slots = plain.cache_budget_bytes, plain.slot_bytes, plain.cache.n_slots
    plain.close()
    eng = Engine(demo, EngineConfig(cache="0.3", expert_backend="eager", working_set_mib=64))
    try:
        assert eng.cache_budget_bytes == budget and n_slots * slot <= budget
        assert 0 < eng.working_set_bytes <= 64 << 20
        assert eng.cache.n_slots == (budget - eng.working_set_bytes) // slot < n_slots
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for i in range(3):
            eng.submit(Submit(f"r{i}", params, prompt_ids=[1, 2, 3 + i, 4, 5]))
        peak_kv = 0
        while eng.has_work:
            eng.step()
            mem = eng.memory()
            assert mem["slots_bytes"] + mem["working_set_bytes"] <= mem["cache_budget_bytes"]
            peak_kv = max(peak_kv, mem["kv_bytes"])
        snap = eng.snapshot()
        assert 0 < snap.working_set_bytes <= eng.working_set_bytes  # eager kept some
        assert peak_kv > 0 and snap.kv_bytes == 0  # KV held while running, freed after
        assert snap.dense_bytes > 0 and snap.rss_bytes > snap.dense_bytes
        assert snap.cache_budget_bytes == budget
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["bevy", "prefetch-gate"])
@pytest.mark.parametrize("backend", ["native", "eager"])
def test_a_closed_engine_lets_go_of_its_slots_without_the_garbage_collector(
    demo, policy: str, backend: str
) -> None:
    """Nothing the engine builds refers back to it in a cycle once it is closed: its slots
    (the whole cache budget) go with the last reference, not at the collector's next full
    pass, which may come only after the next engine has allocated its own."""
    from backend.kernels import native

    if backend == "native" and not native.available():
        pytest.skip("no native kernels here")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    gc.collect()
    gc.disable()
    try:
        eng = Engine(demo, EngineConfig(cache="0.1", policy=policy, expert_backend=backend))
        assert eng.expert_backend == backend
        eng.submit(Submit("a", params, prompt_ids=[1, 2, 3, 4]))
        while eng.has_work:
            eng.step()
        eng.close()
        engine, slots = weakref.ref(eng), weakref.ref(eng.slots)
        del eng
        assert engine() is None and slots() is None
    finally:
        gc.enable()


def test_auto_holds_every_expert_of_a_model_that_fits(model: LoadedModel) -> None:
    eng = _engine(model)  # the default cache, "auto"; this model's experts take < 1 MiB
    try:
        assert eng.cache.n_slots == model.config.n_routed_experts
        assert "every expert" in eng.memory_plan.note
        assert eng.memory_plan.total_bytes > eng.memory()["rss_bytes"]
    finally:
        eng.close()


def test_a_memory_budget_sizes_cache_and_kv_from_what_the_process_holds(demo) -> None:
    from backend.engine.memory import rss_bytes

    budget = rss_bytes() + (400 << 20)  # a byte count: what is held now, and 400 MiB
    eng = Engine(demo, EngineConfig(memory=str(budget), expert_backend="eager"))
    try:
        n = demo.config.n_routed_experts
        assert eng.memory_plan.total_bytes == budget
        assert 0 < eng.cache.n_slots < n and "% of the experts" in eng.memory_plan.note
        # The slots and the KV fit in what the held part leaves, less the scratch.
        assert eng.cache_budget_bytes + eng.kv_budget_bytes < 400 << 20
        assert eng.kv_budget_bytes >= 64 << 20
        # A request whose KV cannot fit in that budget fails alone, saying so.
        tokens = eng.kv_budget_bytes // eng.kv_bytes_per_token + 10
        too_long = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        eng.submit(Submit("long", too_long, prompt_ids=[1, 2, 3]))
        eng.submit(Submit("ok", SamplingParams(max_tokens=2), prompt_ids=[1, 2, 3]))
        eng.run_until_idle(600)
        events = []
        while not eng.events.empty():
            events.append(eng.events.get())
        errors = [e for e in events if type(e).__name__ == "ErrorEvent"]
        assert [e.request_id for e in errors] == ["long"]
        assert "MiB budget (a larger --memory or --kv-budget" in errors[0].message
        assert any(type(e).__name__ == "Finished" and e.request_id == "ok" for e in events)
        snap = eng.snapshot()
        assert snap.memory_budget_bytes == budget and snap.kv_budget_bytes == eng.kv_budget_bytes
    finally:
        eng.close()


@pytest.mark.skipif(sys.platform != "linux", reason="slots are lent where pages can be freed")
def test_kv_room_no_request_holds_lends_the_cache_slots(demo, monkeypatch) -> None:
    """Under a total budget the KV room no running request holds holds cache slots; each
    admission takes its KV's worth back (evicting), each finish lends it again, and the
    slots plus the KV admitted never pass the cache and KV budgets together. The tokens
    are those of a cache that holds every expert."""
    from backend.engine import loop
    from backend.engine.memory import release_pages, rss_bytes

    given_back = []  # the slots whose pages the engine gave back (and gives them back)
    monkeypatch.setattr(loop, "release_pages", lambda t: given_back.append(t) or release_pages(t))
    eng = Engine(demo, EngineConfig(memory=str(rss_bytes() + (400 << 20))))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[(7 * j + i) % 400 + 1 for j in range(150 + 50 * i)] for i in range(3)]
    try:
        base, slot = eng.memory_plan.slots, eng.slot_bytes
        lent = eng.kv_budget_bytes // slot
        idle = base + lent
        assert eng.memory_plan.shared and base < idle < demo.config.n_routed_experts
        assert eng.cache.n_slots == eng.cache.n_alloc == idle
        assert f"up to {lent} experts more while requests leave KV room free" in (
            eng.memory_plan.note
        )
        # A first request fills the slots lent at idle; the next ones take them back.
        eng.submit(Submit("first", params, prompt_ids=prompts[2]))
        eng.run_until_idle(600)
        assert eng.cache.n_used > base and not given_back
        for i, ids in enumerate(prompts):
            eng.submit(Submit(f"r{i}", params, prompt_ids=ids))
        sizes = set()
        while eng.has_work:
            eng.step()
            held = eng._kv_held()
            sizes.add(eng.cache.n_slots)
            assert eng.cache.n_slots == base + (eng.kv_budget_bytes - held) // slot
            assert (
                eng.memory()["slots_bytes"] + held <= eng.cache_budget_bytes + eng.kv_budget_bytes
            )
        assert min(sizes) < idle - 3 and eng.cache.n_slots == idle  # all lent again
        assert eng.cache.stats.evictions > 0 and given_back
        assert all(t.numel() == eng.slots.shape[1] for t in given_back)
        shared = _outputs(eng)
    finally:
        eng.close()
    full = Engine(demo, EngineConfig(cache="1.0"))
    try:
        full.submit(Submit("first", params, prompt_ids=prompts[2]))
        for i, ids in enumerate(prompts):
            full.submit(Submit(f"r{i}", params, prompt_ids=ids))
        full.run_until_idle(600)
        assert _outputs(full) == shared
    finally:
        full.close()


def _outputs(eng: Engine) -> dict[str, tuple[int, ...]]:
    out = {}
    while not eng.events.empty():
        e = eng.events.get()
        if type(e).__name__ == "Finished":
            out[e.request_id] = e.token_ids
    return out


def test_the_serving_loop_gives_the_heap_back_as_it_goes_idle(model, monkeypatch) -> None:
    """What finished requests freed stays in the C heap until trimmed: the serving loop
    (``step(block=True)``) trims it once the last request has left, never while one runs,
    and not again until another finishes. The trim is spied on here; what it gives back
    is measured in docs/performance.md."""
    from backend.engine import loop

    trims: list[int] = []
    monkeypatch.setattr(loop, "trim_heap", lambda: trims.append(len(trims)) or True)
    eng = _engine(model, cache="1.0")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        for n, rid in enumerate(("a", "b"), start=1):
            eng.submit(Submit(rid, params, prompt_ids=[1, 2, 3, 4, 5]))
            eng.step(block=True)  # takes the request in
            while not eng.idle:
                assert len(trims) == n - 1
                eng.step(block=True)
            eng.step(block=True)
            assert len(trims) == n
            eng.step(block=True)  # nothing finished since
            assert len(trims) == n
    finally:
        eng.close()


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_DONTNEED) frees at once on Linux")
def test_released_pages_leave_the_resident_set_and_their_neighbours_alone() -> None:
    import torch

    from backend.engine.memory import release_pages, rss_bytes

    mib = 1 << 20
    t = torch.ones(48 * mib, dtype=torch.uint8)
    before = rss_bytes()
    assert release_pages(t[8 * mib + 100 : 40 * mib - 100])
    assert before - rss_bytes() >= 31 * mib
    assert int(t[8 * mib + 4196 : 40 * mib - 4196].sum()) == 0  # whole pages read as zeros
    # The partial pages at either end, and everything outside, keep their bytes.
    assert bool(t[: 8 * mib + 100].eq(1).all()) and bool(t[40 * mib - 100 :].eq(1).all())


def test_the_cuda_pool_cap_follows_the_newest_open_engine(monkeypatch) -> None:
    """The allocator's cap is one per process and device: closing an engine restores
    the newest remaining engine's, or none. torch.cuda's two calls are scripted here
    (no GPU on CI); tests/gpu checks the cap itself on a device."""
    import torch

    from backend.engine import loop

    calls: list[tuple[float, int]] = []
    props = type("Props", (), {"total_memory": 100 << 30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i))
    )
    monkeypatch.setattr(loop, "_POOL_CAPS", {})
    a, b, dev = object(), object(), torch.device("cuda", 1)
    loop._cap_pool(a, dev, 10 << 30)
    loop._cap_pool(b, dev, 20 << 30)
    loop._uncap_pool(a, dev)  # b's stays
    loop._uncap_pool(b, dev)
    assert calls == [(0.1, 1), (0.2, 1), (0.2, 1), (1.0, 1)]
