"""The engine on CUDA: pinned host tier, copy stream. Skipped where no CUDA device exists."""

from __future__ import annotations

import threading

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.fetcher import Fetcher
from backend.engine.loop import Engine
from backend.engine.store import open_store
from backend.engine.telemetry import Telemetry
from backend.kernels.quants import QType
from backend.messages import Finished, Submit
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from tests.helpers.reference import greedy_logits
from tests.helpers.tiny import make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[3, 17, 42, 5, 88, 9, 1], [4, 4, 60], [10, 11, 12, 13, 14, 15], [7]]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cuda")
    return write_gguf(load_model(make_tiny("mixtral", root / "m")), root / "m.q8.gguf", QType.Q8_0)


@pytest.mark.parametrize("policy", ["bevy", "sync", "prefetch-gate"])
@pytest.mark.parametrize("slot_format", ["stored", "decoded"])
@pytest.mark.parametrize("storage", ["host", "ssd"])
def test_cuda_matches_cpu_reference(
    gguf_path, monkeypatch, policy: str, slot_format: str, storage: str
) -> None:
    """Stored slots take the grouped backend (``GroupedExperts``); decoded ones eager."""
    from backend.engine.experts.grouped import GroupedExperts
    from tests.helpers.spy import spy

    grouped = spy(monkeypatch, GroupedExperts, "grouped")
    cpu = load_model(gguf_path)
    refs = [greedy_logits(cpu, p, 5) for p in PROMPTS]
    model = load_model(gguf_path, device="cuda")
    eng = Engine(
        model,
        EngineConfig(
            device="cuda", policy=policy, cache="0.3", storage=storage, slot_format=slot_format
        ),
    )
    try:
        assert eng.slots.device.type == "cuda"
        assert eng.expert_backend == ("grouped" if slot_format == "stored" else "eager")
        eng.logits_log = {}
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            eng.submit(Submit(f"r{i}", params, prompt_ids=p))
        eng.run_until_idle(120)
        done = {}
        while not eng.events.empty():
            e = eng.events.get()
            if isinstance(e, Finished):
                done[e.request_id] = e
        for i, (ids, logits) in enumerate(refs):
            assert list(done[f"r{i}"].token_ids) == ids[len(PROMPTS[i]) :] + [
                int(logits[-1].argmax())
            ]
            ours = torch.stack(eng.logits_log[f"r{i}"]).cpu()
            assert (
                ours - logits
            ).abs().max().item() <= 1e-3  # TF32/cuBLAS reductions differ from CPU
        assert sum(eng.cache.refs) == 0
        assert bool(grouped) == (slot_format == "stored")
    finally:
        eng.close()


def _long_kernels() -> torch.cuda.Event:
    """Queue ~100+ ms of matrix products on the default stream; the event marks their end."""
    big = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(8):
        big = big @ big / 8192
    done = torch.cuda.Event(enable_timing=True)
    done.record()
    return done


def test_copies_overlap_kernels() -> None:
    """A host->device copy on a side stream finishes while kernels on the default stream run.

    Measured on an H200: 8 products take ~180 ms, the 256 MiB copy ~5 ms. Were the copy
    serialised behind the kernels, it would end after them."""
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    side = torch.cuda.Stream()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    compute_end = _long_kernels()
    copy_end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        dev.copy_(host, non_blocking=True)
        copy_end.record()
    torch.cuda.synchronize()
    assert torch.equal(dev[:4096].cpu(), host[:4096])
    copy_at, compute_at = start.elapsed_time(copy_end), start.elapsed_time(compute_end)
    assert copy_at < compute_at, (copy_at, compute_at)


def test_fetcher_copies_while_kernels_run(gguf_path) -> None:
    """The engine's link: a fetch lands in its device slot (right bytes) before kernels that
    were already queued on the compute stream have finished."""
    model = load_model(gguf_path, device="cuda")
    store = open_store("host", model.experts, pin_memory=True)
    slots = torch.zeros((2, store.slot_bytes), dtype=torch.uint8, device="cuda")
    landed = threading.Event()
    seen: dict = {}

    def on_done(key, layout, err) -> None:
        seen.update(key=key, layout=layout, err=err, kernels_done=compute_end.query())
        landed.set()

    fetcher = Fetcher(store, slots, Telemetry(), on_done)
    try:
        ref = model.experts[0][1]
        compute_end = _long_kernels()
        fetcher.submit((0,), (0, 1), ref, 1)
        assert landed.wait(30)
        assert seen["err"] is None and seen["key"] == (0, 1)
        assert not seen["kernels_done"], "the fetch waited for the compute stream"
        torch.cuda.synchronize()
        want = torch.zeros(store.slot_bytes, dtype=torch.uint8)
        store.read_into(ref, want)
        assert torch.equal(slots[1, : ref.nbytes].cpu(), want[: ref.nbytes])
    finally:
        fetcher.close()
        store.close()


def test_cuda_auto_cache_warms_every_expert_and_matches_cpu(gguf_path) -> None:
    """The default cache ("auto") on a GPU with room for every expert: the plan counts the
    device's memory, the link reads every expert once from the first step, and requests
    submitted before it get the CPU reference's replies."""
    cpu = load_model(gguf_path)
    refs = [greedy_logits(cpu, p, 5) for p in PROMPTS]
    model = load_model(gguf_path, device="cuda")
    eng = Engine(model, EngineConfig(device="cuda", storage="host"))
    try:
        n = model.config.n_routed_experts
        assert eng.memory_plan.slots == n and "every expert" in eng.memory_plan.note
        eng.logits_log = {}
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            eng.submit(Submit(f"r{i}", params, prompt_ids=p))
        eng.run_until_idle(120)
        while eng._warm or eng._warming:
            eng.step(block=True)
        assert eng.cache.stats.fetches == n  # each expert read once: demand or warm-up
        for i, (_, logits) in enumerate(refs):
            ours = torch.stack(eng.logits_log[f"r{i}"]).cpu()
            assert (ours - logits).abs().max().item() <= 1e-3
    finally:
        eng.close()


def test_cuda_memory_budget_is_the_devices(gguf_path) -> None:
    """``--memory`` on a GPU plans the device's memory and holds torch's pool there to
    it while the engine is open (an allocation past it fails; after close it does not);
    the requests all finish within it, and a budget too small for one token's experts is
    refused with what it needs."""
    model = load_model(gguf_path, device="cuda")
    eng = Engine(model, EngineConfig(device="cuda", storage="host", memory="1GiB"))
    try:
        assert eng.memory_plan.total_bytes == 1 << 30
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            eng.submit(Submit(f"r{i}", params, prompt_ids=p))
        eng.run_until_idle(120)
        done = set()
        while not eng.events.empty():
            e = eng.events.get()
            if isinstance(e, Finished):
                done.add(e.request_id)
        assert done == {f"r{i}" for i in range(len(PROMPTS))}
        assert eng.snapshot().device_bytes <= 1 << 30
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    finally:
        eng.close()
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # the cap went with the engine
    with pytest.raises(ValueError, match="needs at least"):
        Engine(model, EngineConfig(device="cuda", storage="host", memory="1MiB"))
