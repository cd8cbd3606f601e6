"""The engine on CUDA: pinned host tier, copy stream. Skipped where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine import Engine
from backend.formats.gguf_export import write_gguf
from backend.formats.quants import QType
from backend.messages import Finished, Submit
from backend.models.loader import load_model
from tests.backend.models.test_parity import greedy_logits
from tests.backend.models.tiny import make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[3, 17, 42, 5, 88, 9, 1], [4, 4, 60], [10, 11, 12, 13, 14, 15], [7]]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cuda")
    return write_gguf(load_model(make_tiny("mixtral", root / "m")), root / "m.q8.gguf", QType.Q8_0)


@pytest.mark.parametrize("policy", ["bevy", "sync", "prefetch-gate"])
@pytest.mark.parametrize("slot_format", ["stored", "decoded"])
@pytest.mark.parametrize("storage", ["host", "ssd"])
def test_cuda_matches_cpu_reference(gguf_path, policy: str, slot_format: str, storage: str) -> None:
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
    finally:
        eng.close()


def test_copies_overlap_kernels() -> None:
    """A host->device copy on a side stream runs while a long kernel runs on the default stream."""
    big = torch.randn(8192, 8192, device="cuda")
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(8):
        big = big @ big / 8192
    end.record()
    torch.cuda.synchronize()
    compute_ms = start.elapsed_time(end)
    copy_start, copy_end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    with torch.cuda.stream(side):
        copy_start.record()
        dev.copy_(host, non_blocking=True)
        copy_end.record()
    torch.cuda.synchronize()
    copy_ms = copy_start.elapsed_time(copy_end)
    both_start = torch.cuda.Event(enable_timing=True)
    both_end = torch.cuda.Event(enable_timing=True)
    both_start.record()
    for _ in range(8):
        big = big @ big / 8192
    with torch.cuda.stream(side):
        dev.copy_(host, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    both_end.record()
    torch.cuda.synchronize()
    both_ms = both_start.elapsed_time(both_end)
    # Serial would take compute + copy; overlapped, clearly less.
    assert both_ms < 0.9 * (compute_ms + copy_ms), (compute_ms, copy_ms, both_ms)
