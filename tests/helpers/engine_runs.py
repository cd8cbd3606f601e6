"""Engine runs shared by the exactness tests: staggered arrivals, then no pins left."""

from __future__ import annotations

import dataclasses

import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.jobs import JobRunner
from backend.engine.loop import Engine
from backend.kernels import native
from backend.kernels.decode import Walk
from backend.messages import Finished, Submit
from backend.models.loader import LoadedModel
from backend.policies import POLICIES
from tests.helpers.reference import greedy_logits
from tests.helpers.spy import spy

PROMPTS = [
    [3, 17, 42, 5, 88, 9, 1],
    [4, 4, 60],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [7],
    [50, 51],
    [9, 8, 7, 6, 5],
    [33] * 9,
    [1, 2, 3, 4],
]


STEPS = 6

# Every policy, bevy-static with groups of 3.
ALL_POLICIES = [p.replace(":K", ":3") for p in POLICIES]

# The logits' bound against plain generation. The native backend's kernels multiply
# Q4_0 / Q4_1 experts in integers, reading each expert's input and inner activation
# rounded to 8 bits per block of 32, as ggml's CPU kernels do: those runs are held to
# plain generation with the same rounding (``references(rounded=True)``) within
# ``ROUNDED_BOUND``, as a value within float error of a rounding edge may round the
# other way in one and not the other (a step of 1/127 of its block's largest).
LOGITS_BOUND = 1e-4
ROUNDED_BOUND = 1e-2


def rounds_inputs(eng: Engine) -> bool:
    """Whether ``eng``'s expert products read their inputs rounded to 8 bits: the native
    backend on Q4_0 / Q4_1 experts, packed or not."""
    return eng.expert_backend == "native" and any(
        p.qtype in native.ROUNDING for layer in eng.model.experts for ex in layer for p in ex.parts
    )


def references(model: LoadedModel, rounded: bool = False) -> list[tuple[list[int], torch.Tensor]]:
    """Each of ``PROMPTS`` alone through plain greedy generation (``rounded``: with the
    native kernels' rounding of Q4 experts' inputs): (its ``STEPS`` tokens, their logits)."""
    refs = []
    for p in PROMPTS:
        ids, logits = greedy_logits(model, p, STEPS - 1, rounded=rounded)
        refs.append((ids[len(p) :] + [int(logits[-1].argmax())], logits))
    return refs


def expected_refs(refs: dict, name: str, rounded: bool) -> tuple[list, float]:
    """Model ``name``'s references in ``refs`` (rounded ones under ``name + ":rounded"``)
    that a run must match (``rounded``: one that ``rounds_inputs``), and the bound on
    its logits: see ``ROUNDED_BOUND``."""
    return (refs[f"{name}:rounded"], ROUNDED_BOUND) if rounded else (refs[name], LOGITS_BOUND)


def drain(eng: Engine) -> list:
    events = []
    while not eng.events.empty():
        events.append(eng.events.get())
    return events


def run_staggered(eng: Engine) -> dict[str, Finished]:
    """Half the requests join at once, the rest while the first half is mid-flight."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    eng.logits_log = {}
    for i, p in enumerate(PROMPTS[:4]):
        eng.submit(Submit(f"r{i}", params, prompt_ids=p))
    for _ in range(5):
        eng.step()
    for i, p in enumerate(PROMPTS[4:], start=4):
        eng.submit(Submit(f"r{i}", params, prompt_ids=p))
    eng.run_until_idle(120)
    return {e.request_id: e for e in drain(eng) if isinstance(e, Finished)}


def run_clean(model: LoadedModel, config: EngineConfig, **policy) -> tuple[dict, dict]:
    """``run_staggered`` on a fresh engine (its policy's fields replaced by ``policy``),
    which must end with no pins held. Returns (finished, logits_log)."""
    eng = Engine(model, config)
    if policy:
        eng.policy = dataclasses.replace(eng.policy, **policy)
    try:
        finished = run_staggered(eng)
        assert sum(eng.cache.refs) == 0
    finally:
        eng.close()
    return finished, eng.logits_log


def one_request(
    model: LoadedModel, config: EngineConfig, monkeypatch, walk: bool
) -> tuple[list[int], torch.Tensor, Engine, list]:
    """One request alone (``PROMPTS[2]``, 24 tokens) with decoding's walk on or off (then
    layer by layer): its tokens, its logits, the closed engine and the walks it made.
    Alone, its groups are the same in every run, so the two ways compare bit for bit."""
    monkeypatch.undo()
    walks = spy(monkeypatch, Walk, "run")
    if not walk:
        monkeypatch.setattr(JobRunner, "run_through", lambda self, group: None)
    eng = Engine(model, config)
    eng.logits_log = {}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng.submit(Submit("a", params, prompt_ids=PROMPTS[2]))
    eng.run_until_idle(120)
    (done,) = [e for e in drain(eng) if isinstance(e, Finished)]
    eng.close()
    return list(done.token_ids), torch.stack(eng.logits_log["a"]), eng, walks


def assert_same_results(a: tuple[dict, dict], b: tuple[dict, dict], rounded: bool = False) -> None:
    """Two ``run_clean`` results: the same tokens, logits within 1e-5 (groups form by
    fetch timing, and the tiny models' dense BLAS path rounds by batch shape). Where the
    experts' inputs are ``rounded``, within ``ROUNDED_BOUND``: a last-bit difference
    from that BLAS path can move an expert input across a rounding edge (the demo's and
    other GGUF models' dense products are the row-independent native kernels)."""
    (fin, logs), (fin0, logs0) = a, b
    for rid, f in fin.items():
        assert f.token_ids == fin0[rid].token_ids, rid
        ours, theirs = torch.stack(logs[rid]), torch.stack(logs0[rid])
        assert (ours - theirs).abs().max().item() <= (ROUNDED_BOUND if rounded else 1e-5), rid


def plain_references(model: LoadedModel) -> list[tuple[list[int], torch.Tensor]]:
    """Each of ``PROMPTS`` alone through plain greedy generation: (its ``STEPS`` tokens,
    their logits), what ``run_staggered``'s requests must reproduce."""
    return references(model)


def assert_matches_references(
    finished: dict[str, Finished],
    logits_log: dict,
    refs: list,
    skip: tuple[int, ...] = (),
    bound: float = LOGITS_BOUND,
) -> None:
    """Request ``r{i}``'s tokens are ``refs[i]``'s and its logits within ``bound``."""
    for i, (tokens, logits) in enumerate(refs):
        if i in skip:
            continue
        assert list(finished[f"r{i}"].token_ids) == tokens, f"r{i}"
        ours = torch.stack(logits_log[f"r{i}"])
        assert (ours - logits).abs().max().item() <= bound, f"r{i}"


def check_policy_against_plain(
    model: LoadedModel, refs: list, policy: str, cache: str, storage: str
) -> Engine:
    """``run_staggered`` under ``policy``, a cache of ``cache`` ("min": one token's
    experts) on ``storage``, prompts read two tokens at a time: every request matches
    ``refs`` (``plain_references``) and no pin is left. Returns the closed engine."""
    size = str(model.config.top_k) if cache == "min" else cache
    config = EngineConfig(policy=policy, cache=size, storage=storage, prefill_chunk=2)
    eng = Engine(model, config)
    try:
        finished = run_staggered(eng)
        assert not rounds_inputs(eng)  # (the rounded references are not made here)
        assert_matches_references(finished, eng.logits_log, refs)
        assert sum(eng.cache.refs) == 0
    finally:
        eng.close()
    return eng
