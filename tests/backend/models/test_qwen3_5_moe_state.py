"""Qwen3.5-MoE's recurrent state: the chunked delta rule against the recurrence, prompts
read in slices, every policy, cache size and store of the offloading engine against plain
generation (prompts in slices, requests aborted mid-flight), and a request's bits the same
alone as batched, prompts and decoding steps alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.loop import Engine
from backend.kernels.quants import QType
from backend.messages import Abort, Finished, Submit
from backend.models import linear_attention
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from backend.models.transformer import KVCache, SeqSlice
from tests.helpers.engine_runs import (
    ALL_POLICIES,
    PROMPTS,
    STEPS,
    assert_matches_references,
    check_policy_against_plain,
    drain,
    plain_references,
)
from tests.helpers.tiny import make_tiny

# Longer than one chunk of the delta rule (64), so a prompt crosses a chunk's end.
PROMPT = torch.randint(0, 96, (70,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen3_5_moe", tmp_path_factory.mktemp("qwen3.5-state") / "hf")


def test_chunks_and_slices_compute_what_one_token_at_a_time_does(folder: Path) -> None:
    """The chunked delta rule, and a prompt read in uneven slices, match the recurrence
    run token by token (the state carried across every boundary)."""
    model = load_model(folder)
    t = model.transformer
    ids = torch.tensor(PROMPT)

    def run(cuts: list[int]) -> torch.Tensor:
        kv, out, start = KVCache(4), [], 0
        for end in [*cuts, len(PROMPT)]:
            seq = [SeqSlice(kv, start, end - start)]
            out.append(t.forward(ids[start:end], seq, model.resident_experts().get, False))
            start = end
        return torch.cat(out)

    whole = run([])
    assert (run([1, 5, 6, 40, 66]) - whole).abs().max().item() <= 1e-4
    assert (run(list(range(1, len(PROMPT)))) - whole).abs().max().item() <= 1e-4
    with pytest.raises(RuntimeError, match="recurrent state holds"):
        kv = KVCache(4)
        t.forward(ids[:3], [SeqSlice(kv, 0, 3)], model.resident_experts().get)
        t.forward(ids[:3], [SeqSlice(kv, 0, 3)], model.resident_experts().get)


def test_delta_rule_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1, 3 and 64 give the same outputs and final state."""
    gen = torch.Generator().manual_seed(3)
    H, n, Dk, Dv = 3, 20, 8, 5
    q, k = (
        torch.nn.functional.normalize(torch.randn(H, n, Dk, generator=gen), dim=-1) for _ in "qk"
    )
    v = torch.randn(H, n, Dv, generator=gen)
    g = -torch.rand(H, n, generator=gen) * 2
    beta = torch.rand(H, n, generator=gen)
    results = []
    for chunk in (1, 3, 64):
        monkeypatch.setattr(linear_attention, "CHUNK", chunk)
        mem = torch.randn(H, Dk, Dv, generator=torch.Generator().manual_seed(5))
        results.append((linear_attention.delta_rule(q, k, v, g, beta, mem), mem))
    for out, mem in results[1:]:
        assert (out - results[0][0]).abs().max().item() <= 1e-5
        assert (mem - results[0][1]).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def engine_model(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("qwen3.5-engine")
    model = load_model(write_gguf(load_model(folder), root / "q8.gguf", QType.Q8_0))
    return model, plain_references(model)


@pytest.mark.parametrize("storage", ["ssd", "host"])
@pytest.mark.parametrize("cache", ["min", "0.3", "1.0"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_matches_plain_generation(
    engine_model: tuple[LoadedModel, list], policy: str, cache: str, storage: str
) -> None:
    # Prompts read two tokens at a time: the state crosses slices and other requests' jobs.
    check_policy_against_plain(*engine_model, policy, cache, storage)


@pytest.mark.parametrize("policy", ["bevy", "sync", "prefetch-gate"])
def test_aborts_leave_the_others_exact(engine_model: tuple, policy: str) -> None:
    """Requests aborted mid-prompt and mid-reply take their state with them; the rest
    still match plain generation, and the budget counts each request's state."""
    model, refs = engine_model
    eng = Engine(model, EngineConfig(policy=policy, cache="0.3", storage="ssd", prefill_chunk=2))
    try:
        assert eng._kv_need(type("R", (), {"budget_tokens": 10})()) == (
            10 * eng.kv_bytes_per_token + model.config.state_bytes
        )
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
        eng.logits_log = {}
        for i, p in enumerate(PROMPTS):
            eng.submit(Submit(f"r{i}", params, prompt_ids=p))
        for step in range(6):
            if step == 1:
                eng.submit(Abort("r2"))  # 12-token prompt: still being read
            if step == 5:
                eng.submit(Abort("r5"))
            eng.step()
        eng.run_until_idle(120)
        finished = {e.request_id: e for e in drain(eng) if isinstance(e, Finished)}
        assert_matches_references(finished, eng.logits_log, refs, skip=(2, 5))
        assert finished["r2"].reason == "abort" and finished["r5"].reason == "abort"
        assert sum(eng.cache.refs) == 0 and not eng.running
    finally:
        eng.close()


def test_a_prompt_gets_the_same_bits_alone_as_batched(folder: Path, tmp_path: Path) -> None:
    """The engine groups prompts as its policy schedules them; plain generation batches
    them all. A prompt of a few dozen tokens must compute the same bits either way: BLAS
    rounds such products alike, and the flat [T, Hv] gates (sigmoid, softplus) round in
    float64 so that the vectorized loop's scalar tail, which moves with T, cannot change
    a row (found on a random model whose flat logits turned that into other tokens)."""
    model = load_model(write_gguf(load_model(folder), tmp_path / "q8.gguf", QType.Q8_0))
    t, get = model.transformer, model.resident_experts(native=True).for_compute
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (41, 37, 50, 45)]

    def last_logits(ps: list[list[int]]) -> torch.Tensor:
        seqs = [SeqSlice(KVCache(4), 0, len(p)) for p in ps]
        return t.forward(torch.tensor([i for p in ps for i in p]), seqs, get)

    batched = last_logits(prompts)
    for i, p in enumerate(prompts):
        assert torch.equal(last_logits([p])[0], batched[i]), i


def test_a_decoding_step_gets_the_same_bits_alone_as_batched(folder: Path, tmp_path: Path) -> None:
    """Decoding rows of several requests move their states in one stacked step
    (``linear_attention._decode_step``): each request's logits are the bits it gets
    decoding alone, as the engine's groups of any size need."""
    # Q4_0: its experts run on the native kernels, a row at a time (BLAS would round the
    # rows an expert gets by how many there are).
    model = load_model(write_gguf(load_model(folder), tmp_path / "q4.gguf", QType.Q4_0))
    t, get = model.transformer, model.resident_experts(native=True).for_compute
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (41, 9, 50)]

    def prefilled() -> list[KVCache]:
        kvs = [KVCache(4) for _ in prompts]
        for kv, p in zip(kvs, prompts, strict=True):
            t.forward(torch.tensor(p), [SeqSlice(kv, 0, len(p))], get)
        return kvs

    nxt = [5, 17, 33]
    kvs = prefilled()
    seqs = [SeqSlice(kv, len(p), 1) for kv, p in zip(kvs, prompts, strict=True)]
    batched = t.forward(torch.tensor(nxt), seqs, get)
    for i, (kv, p) in enumerate(zip(prefilled(), prompts, strict=True)):
        alone = t.forward(torch.tensor([nxt[i]]), [SeqSlice(kv, len(p), 1)], get)
        assert torch.equal(alone[0], batched[i]), i
