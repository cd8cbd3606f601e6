"""Chunked prefill: long prompts read in slices of rows beside running requests give plain
generation's results, let those requests decode, and free their pins when aborted."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.jobs import longest_slice, slice_end
from backend.engine.loop import Engine
from backend.kernels.quants import QType
from backend.messages import Abort, Finished, Submit, TokenEvent
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import ALL_POLICIES, PROMPTS, drain, run_staggered
from tests.helpers.tiny import make_tiny

SLICING = [p for p in ALL_POLICIES if not p.startswith(("sync", "prefetch", "bevy-static"))]


@pytest.mark.parametrize("storage", ["ssd", "host"])
@pytest.mark.parametrize("cache", ["min", "0.3", "1.0"])
@pytest.mark.parametrize("policy", SLICING)
@pytest.mark.parametrize("model_name", ["mixtral-q8-gguf", "qwen3-hf", "qwen2-hf"])
def test_chunked_prefill_matches_plain_generation(
    models, references, model_name: str, policy: str, cache: str, storage: str
) -> None:
    """Prompts read three rows at a time (chunked prefill), beside decoding requests:
    plain generation's tokens and logits, no pins left; and the parts did run: each
    layer's MoE a few experts at a time on all of a prompt's rows, the rest in slices."""
    model = models[model_name]
    size = str(model.config.top_k) if cache == "min" else cache
    config = EngineConfig(policy=policy, cache=size, storage=storage, prefill_chunk=3)
    eng = Engine(model, config)
    try:
        finished = run_staggered(eng)
        for i, (tokens, logits) in enumerate(references[model_name]):
            assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
            ours = torch.stack(eng.logits_log[f"r{i}"])
            assert (ours - logits).abs().max().item() <= 1e-4, f"r{i}"
        assert sum(eng.cache.refs) == 0
        sliced = [e for e in eng.telemetry.compute if e.requests == ("r2",) and e.tokens <= 3]
        # r2's 12 rows go through attention of layer 0 in slices, and through each layer
        # after its MoE, at any cache size.
        assert len([e for e in sliced if e.layer == -1]) == 4
        assert len([e for e in sliced if e.layer == 0 and e.tokens == 3]) == 4
        # Its MoE layers': parts of a few experts (about a slice's routes) on all 12 rows,
        # with another long prompt's rows where one is at the same layer.
        parts = Counter(
            e.layer
            for e in eng.telemetry.compute
            if "r2" in e.requests and e.tokens >= 12 and e.layer >= 0
        )
        sparse = model.config.sparse_layers
        assert set(parts) == {i for i in range(model.config.n_layers) if sparse[i]}
        assert max(parts.values()) > 1
    finally:
        eng.close()


def _tokens_while_read(model: LoadedModel, chunk: int) -> tuple[int, Finished]:
    """A request decodes while a 96-token prompt is submitted beside it: how many tokens
    it got before the prompt's first, and the prompt's result."""
    eng = Engine(model, EngineConfig(cache="1.0", storage="host", prefill_chunk=chunk))
    try:
        run = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        eng.submit(Submit("runner", run, prompt_ids=[1, 2, 3]))
        while not any(isinstance(e, TokenEvent) for e in drain(eng)):
            eng.step()
        long = [(7 * i) % 50 + 1 for i in range(96)]
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        eng.submit(Submit("long", one, prompt_ids=long))
        got, answered, finished = 0, False, None
        while finished is None:
            eng.step()
            for e in drain(eng):
                if isinstance(e, TokenEvent) and e.request_id == "long":
                    answered = True
                elif isinstance(e, TokenEvent) and not answered:
                    got += 1
                elif isinstance(e, Finished) and e.request_id == "long":
                    finished = e
        eng.submit(Abort("runner"))
        eng.run_until_idle(60)
        assert sum(eng.cache.refs) == 0
        return got, finished
    finally:
        eng.close()


def test_a_long_prompt_read_in_slices_lets_running_requests_decode(models) -> None:
    """Unsliced, a running request moves one job per prompt layer at best; read four rows
    at a time, the prompt shares compute with it, and gives the same first token."""
    model = models["qwen3-hf"]
    whole, first = _tokens_while_read(model, 0)
    sliced, again = _tokens_while_read(model, 4)
    assert first.token_ids == again.token_ids
    assert sliced >= 5 and sliced > 2 * whole


@pytest.mark.parametrize("where", ["between slices", "mid-MoE"])
def test_aborting_a_prompt_between_parts_frees_its_pins(models, where: str) -> None:
    """Aborted between two slices of rows, or with some of its layer's experts applied and
    the rest still pinned: its pins are freed and its parts dropped."""
    eng = Engine(models["mixtral-q8-gguf"], EngineConfig(cache="0.3", prefill_chunk=2))
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        eng.submit(Submit("long", params, prompt_ids=PROMPTS[2] * 3))
        eng.step()
        (r,) = eng.running
        mid_moe = lambda: not r.entering and 0 < len(r.done) < len(r.needed)  # noqa: E731
        mid_rows = lambda: r.row > 0  # noqa: E731
        for _ in range(500):
            if (mid_moe if where == "mid-MoE" else mid_rows)():
                break
            eng.step()
        else:
            pytest.fail(f"the prompt never stood {where}")
        if where == "mid-MoE":
            assert r.claim and r.acc is not None and sum(eng.cache.refs) > 0
        eng.submit(Abort("long"))
        eng.run_until_idle(30)
        assert [e.reason for e in drain(eng) if isinstance(e, Finished)] == ["abort"]
        assert sum(eng.cache.refs) == 0 and not r.staged and r.emb is None and r.acc is None
    finally:
        eng.close()


def _top4(tmp_path, backend: str) -> LoadedModel:
    """A tiny Mixtral routing each token to four experts, its experts in Q4_1 blocks
    (with two a row, any order of a row's two additions gives the same bits, so the
    order of a prompt's sums would go untested); skips where ``backend`` cannot run."""
    from backend.engine.experts import why_not

    tiny = load_model(make_tiny("mixtral", tmp_path / "top4", num_experts_per_tok=4))
    model = load_model(write_gguf(tiny, tmp_path / "top4.q4.gguf", QType.Q4_1))
    slots = torch.empty((1, 1), dtype=torch.uint8)
    if why_not(backend, model.experts, slots, model.transformer.dtype) is not None:
        pytest.skip(f"the {backend} expert backend cannot run here")
    return model


@pytest.mark.parametrize("backend", ["native", "eager"])
def test_a_prompt_applying_its_experts_in_parts_gets_the_whole_jobs_bits(
    tmp_path, monkeypatch, backend: str
) -> None:
    """A long prompt's MoE two experts per part, against all of a layer's experts in one
    part (a whole job's MoE): each expert's products are added to the rows' sums in
    expert order either way (a part goes on from the sums, it does not add its own
    sum of two to them), so its logits are the same to the bit. Top-4 routing: with two
    experts a row, any order of its two additions gives the same bits."""
    model = _top4(tmp_path, backend)
    prompt = [(7 * i) % 50 + 1 for i in range(24)]
    real_part = Engine._experts_part
    logits, parts = {}, {}
    for mode in ("two", "all"):
        if mode == "two":
            monkeypatch.setattr(
                Engine,
                "_experts_part",
                lambda eng, r: [(q, set(sorted(s)[:2])) for q, s in real_part(eng, r)],
            )
        else:
            monkeypatch.setattr(
                Engine,
                "_part_ready",
                lambda eng, r: (
                    r.entering
                    or len(r.done) == len(r.needed)
                    or (r.claimed and all(eng.cache.is_ready(k) for k in r.claim))
                ),
            )
            monkeypatch.setattr(
                Engine, "_experts_part", lambda eng, r: [(r, {e for _, e in r.claim})]
            )
        config = EngineConfig(cache="1.0", storage="host", prefill_chunk=8, expert_backend=backend)
        eng = Engine(model, config)
        try:
            eng.logits_log = {}
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            eng.submit(Submit("p", params, prompt_ids=prompt))
            eng.run_until_idle(60)
            logits[mode] = eng.logits_log["p"][0]
            parts[mode] = Counter(
                e.layer for e in eng.telemetry.compute if e.layer >= 0 and e.tokens == 24
            )
        finally:
            eng.close()
        monkeypatch.undo()
    assert set(parts["all"].values()) == {1} and max(parts["two"].values()) > 1
    assert torch.equal(logits["two"], logits["all"])


@pytest.mark.parametrize("backend", ["native", "eager"])
def test_long_prompts_at_one_layer_share_its_parts_and_keep_their_bits(
    tmp_path, backend: str
) -> None:
    """Two long prompts read at once meet at each layer (the one behind reads first) and
    apply its experts in shared parts, each expert multiplying both prompts' rows: each
    prompt's logits are the ones it gets read alone, and no pins are left. To the bit
    on the native kernels, which work row by row; torch's BLAS picks its kernel by the
    number of rows (a few rows differ from more in the last bits), so eager's are close."""
    model = _top4(tmp_path, backend)
    prompts = {
        "a": [(7 * i) % 50 + 1 for i in range(24)],
        "b": [(5 * i) % 43 + 2 for i in range(20)],
    }
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def read(ids: list[str]) -> tuple[dict[str, torch.Tensor], list]:
        config = EngineConfig(cache="1.0", storage="host", prefill_chunk=8, expert_backend=backend)
        eng = Engine(model, config)
        try:
            eng.logits_log = {}
            for i in ids:
                eng.submit(Submit(i, params, prompt_ids=prompts[i]))
            eng.run_until_idle(60)
            assert sum(eng.cache.refs) == 0
            return {i: eng.logits_log[i][0] for i in ids}, list(eng.telemetry.compute)
        finally:
            eng.close()

    together, events = read(["a", "b"])
    shared = Counter(e.layer for e in events if e.requests == ("a", "b") and e.tokens == 44)
    sparse = model.config.sparse_layers
    assert set(shared) == {i for i in range(model.config.n_layers) if sparse[i]}
    for i in prompts:
        alone, _ = read([i])
        if backend == "native":
            assert torch.equal(together[i], alone[i]), i
        else:
            assert (together[i] - alone[i]).abs().max().item() <= 1e-5, i


def test_a_short_last_slice_joins_the_one_before() -> None:
    assert [slice_end(r, 512, 1028) for r in (0, 512)] == [512, 1028]
    assert slice_end(0, 512, 1200) == 512 and slice_end(512, 512, 1200) == 1024
    assert slice_end(0, 3, 12) == 3 and slice_end(9, 3, 12) == 12
    assert slice_end(0, 3, 4) == 3  # slices of a few rows keep their size
    assert longest_slice(512) == 639 and slice_end(0, 512, 639) == 639
    assert slice_end(0, 512, 640) == 512 and longest_slice(3) == 3


def test_a_prompt_read_in_slices_of_512_gets_the_bits_of_one_whole_job() -> None:
    """The demo MoE (its dense products through BLAS for a prompt) with a prompt of two
    512-row slices and 4 rows more: those 4 rows alone would round the router's product
    their own way; read with the slice before them, the first token's logits are the
    bits of the whole prompt's forward."""
    from backend.demo.build import ensure_demo
    from backend.models.transformer import KVCache, SeqSlice

    model = load_model(ensure_demo(quiet=True))
    prompt = [(37 * i) % 4000 + 100 for i in range(1028)]
    t = model.transformer
    whole = t.forward(
        torch.tensor(prompt),
        [SeqSlice(KVCache(model.config.n_layers), 0, len(prompt))],
        model.resident_experts(native=True).for_compute,
    )
    eng = Engine(model, EngineConfig(cache="1.0", storage="host", prefill_chunk=512))
    eng.logits_log = {}
    try:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        eng.submit(Submit("long", one, prompt_ids=prompt))
        while eng.has_work:
            eng.step()
        rows = [e.tokens for e in eng.telemetry.compute if e.layer == -1]
        assert rows == [512, 516]  # attention of layer 0 in two slices
        assert torch.equal(eng.logits_log["long"][0], whole[0])
    finally:
        eng.close()
