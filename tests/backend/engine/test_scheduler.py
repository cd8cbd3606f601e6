from __future__ import annotations

import pytest

from backend.config import SamplingParams
from backend.engine.request import Request
from backend.engine.scheduler import make_policy, progress, prompt_part, riders, split
from backend.policies import POLICIES


def req(i: int, layer: int, claimed: bool = True) -> Request:
    r = Request(f"r{i}", [1], SamplingParams(), arrival=i)
    r.layer, r.claimed = layer, claimed
    return r


def test_bevy_runs_all_ready_jobs_at_the_lowest_ready_layer() -> None:
    p = make_policy("bevy")
    rs = [req(0, 5), req(1, 2), req(2, 2), req(3, 1)]
    ready = rs[:3]  # r3 (layer 1) waits for experts
    assert p.compute_group(rs, ready) == [rs[1], rs[2]]


def test_bevy_claims_lowest_layer_then_fewest_missing() -> None:
    p = make_policy("bevy")
    rs = [req(0, 3), req(1, 1), req(2, 1), req(3, 0)]
    missing = {"r0": 0, "r1": 4, "r2": 1, "r3": 9}
    order = p.claim_order(rs, lambda r: missing[r.id])
    assert [r.id for r in order] == ["r3", "r2", "r1", "r0"]


def test_srtf_ignores_layers() -> None:
    p = make_policy("bevy-srtf")
    rs = [req(0, 3), req(1, 0)]
    assert [r.id for r in p.claim_order(rs, lambda r: 1 if r.id == "r0" else 5)] == ["r0", "r1"]


def test_fifo_computes_the_longest_ready_job_first() -> None:
    p = make_policy("bevy-fifo")
    a, b = req(0, 7), req(1, 2)
    a.ready_since, b.ready_since = 3, 9
    assert p.compute_group([a, b], [a, b]) == [a]


def test_sync_moves_the_whole_batch_only_when_all_claimed_jobs_are_ready() -> None:
    p = make_policy("sync")
    rs = [req(0, 4), req(1, 4), req(2, 4)]
    assert p.compute_group(rs, rs[:2]) == []
    assert p.compute_group(rs, rs) == rs
    # A job the cache could not take yet (unclaimed) does not block the others.
    rs[2].claimed = False
    assert p.compute_group(rs, rs[:2]) == rs[:2]
    # Nobody claims ahead of the batch's lowest layer.
    ahead = req(3, 5, claimed=False)
    assert p.claim_order([rs[2], ahead], lambda r: 0, low_layer=4) == [rs[2]]


def test_bevy_held_together_waits_for_the_lowest_layer_unless_it_cannot_claim() -> None:
    p = make_policy("bevy")
    rs = [req(0, 2), req(1, 2), req(2, 5)]
    # Runahead: the ready job at layer 5 would go while r1 waits for its experts.
    assert p.compute_group(rs, [rs[0], rs[2]]) == [rs[0]]
    assert p.compute_group(rs, [rs[2]]) == [rs[2]]
    # Held: r1's experts are on their way, so everyone waits for it ...
    assert p.compute_group(rs, [rs[0], rs[2]], together=True) == []
    assert p.compute_group(rs, rs, together=True) == [rs[0], rs[1]]
    # ... but where the lowest layer cannot claim (the cache's slots pinned by jobs
    # further on), those jobs run and release them.
    rs[0].claimed = rs[1].claimed = False
    assert p.compute_group(rs, [rs[2]], together=True) == [rs[2]]


def test_static_groups_advance_together() -> None:
    p = make_policy("bevy-static:2")
    rs = [req(0, 3), req(1, 3), req(2, 1), req(3, 1)]
    assert p.compute_group(rs, [rs[0], rs[1], rs[2]]) == [rs[0], rs[1]]
    assert p.compute_group(rs, rs) == [rs[2], rs[3]]
    assert p.static_claimable([rs[0], rs[1], rs[2], req(3, 2)]) == {id(rs[0]), id(rs[1]), id(rs[2])}


def test_a_static_group_never_waits_on_pins_its_own_member_holds() -> None:
    """r0 claimed at layer 1 when it was its group's lowest; r1 joined its group behind it,
    at layer 0, and cannot claim (all its experts would need r0's pinned slots too). r0 is
    ready and runs, so its pins go; otherwise nothing could ever move."""
    p = make_policy("bevy-static:2")
    rs = [req(0, 1), req(1, 0, claimed=False)]
    assert p.compute_group(rs, [rs[0]]) == [rs[0]]
    assert p.compute_group(rs, []) == []


def test_policy_names() -> None:
    for name in POLICIES:
        make_policy(name.replace(":K", ":4"))
    assert make_policy("prefetch-gate").prefetch == "gate" and make_policy("prefetch-gate").lockstep
    assert (
        make_policy("bevy+prefetch-gate").prefetch == "gate"
        and not make_policy("bevy+prefetch-gate").lockstep
    )
    # Only runahead policies split a waiting job: lockstep batches and static groups
    # compute each layer's experts once for the whole batch.
    split = {n: make_policy(n.replace(":K", ":4")).split for n in POLICIES}
    assert split == {
        n: n.startswith("bevy") and n not in ("bevy-static:K", "bevy-nosplit") for n in POLICIES
    }
    for bad in ("fastest", "bevy-static:0", "bevy-static:x"):
        with pytest.raises(ValueError, match="policy|group size"):
            make_policy(bad)


def test_fetch_priority_follows_the_policy() -> None:
    a, b = req(0, 9), req(1, 2)
    bevy, srtf, sync = make_policy("bevy"), make_policy("bevy-srtf"), make_policy("sync")
    # A low-layer job claimed later still fetches before a high-layer one queued earlier.
    assert bevy.fetch_priority(b, 5, tick=10) < bevy.fetch_priority(a, 1, tick=3)
    assert srtf.fetch_priority(a, 1, tick=10) < srtf.fetch_priority(b, 5, tick=3)
    assert sync.fetch_priority(a, 1, tick=3) < sync.fetch_priority(b, 1, tick=10)


def job(i: int, layer: int, needed: tuple[int, ...], claim=(), done=(), n: int = 1) -> Request:
    """A request before the MoE of ``layer``, routed to ``needed``, holding ``claim``."""
    r = req(i, layer, claimed=bool(claim))
    r.n, r.needed, r.done = n, needed, set(done)
    r.claim = [(layer, e) for e in claim]
    return r


def test_riders_take_the_group_experts_they_still_need() -> None:
    group = [job(0, 3, (1, 2), claim=(1, 2))]
    claimed = job(1, 3, (2, 5), claim=(2, 5))  # rides on 2; 5 is its own
    unclaimed = job(2, 3, (1, 4, 6), done=(6,))  # rides on 1
    other_layer = job(3, 4, (1, 2))
    prompt = job(4, 3, (1, 2), n=5)  # a prompt's rows stay in their own job
    unrelated = job(5, 3, (7,))
    running = [*group, claimed, unclaimed, other_layer, prompt, unrelated]
    assert [(r.id, s) for r, s in riders(running, group)] == [("r1", {2}), ("r2", {1})]


def test_split_applies_ready_experts_at_the_lowest_waiting_layer() -> None:
    ready = {(2, 1), (2, 2), (5, 3)}.__contains__
    a = job(0, 2, (1, 9), claim=(1, 9))  # 1 ready, 9 loading
    b = job(1, 5, (3, 8), claim=(3, 8))  # a higher layer waits its turn
    whole = job(2, 2, (2,), claim=(2,))  # all ready: a job, not a split
    unclaimed = job(3, 2, (4,))
    assert [(r.id, s) for r, s in split([a, b, whole, unclaimed], ready)] == [("r0", {1})]
    assert split([whole], ready) == []


def test_split_leaves_an_expert_another_request_still_needs() -> None:
    ready = {(2, 1), (2, 2)}.__contains__
    a = job(0, 2, (1, 2, 9), claim=(1, 2, 9))
    b = job(1, 2, (1, 7))  # needs 1 too but cannot apply it now: 1 waits to run once
    assert [(r.id, s) for r, s in split([a, b], ready)] == [("r0", {2})]
    c = job(2, 2, (1, 8), claim=(1, 8))  # both needers apply 1 in this split: it stays
    assert sorted((r.id, sorted(s)) for r, s in split([a, c], ready)) == [
        ("r0", [1, 2]),
        ("r2", [1]),
    ]


def test_split_gives_a_short_prompt_its_ready_experts_in_expert_order() -> None:
    """A prompt adds each expert's products into its rows as they come, so a split gives
    it only the ready experts before its first one still loading; a prompt longer than
    ``max_rows`` (read in parts of its own) gets none."""
    ready = {(2, 1), (2, 2), (2, 5), (2, 7)}.__contains__
    prompt = job(0, 2, (1, 2, 4, 5, 7), claim=(1, 2, 4, 5, 7), n=40)  # 4 loading
    assert split([prompt], ready, max_rows=512) == [(prompt, {1, 2})]
    assert split([prompt], ready) == []  # no max_rows: prompts never split
    assert split([prompt], ready, max_rows=39) == []
    applied = job(1, 2, (1, 2, 4, 5, 7), claim=(4, 5, 7), done=(1, 2), n=40)
    assert split([applied], ready, max_rows=512) == []  # 4 comes first and is loading
    late = job(2, 2, (0, 1, 2), claim=(0, 1, 2), n=3)  # its first expert is loading
    assert split([late], ready, max_rows=512) == []
    # Another request at the layer still needs 2 and cannot apply it now: the prompt
    # stops before it, as it cannot apply 5 ahead of 2.
    other = job(3, 2, (2, 9))
    assert split([prompt, other], ready, max_rows=512) == [(prompt, {1})]
    # Beside a decoding job: the prompt applies its first experts; the token applies the
    # ready one the prompt does not need, and leaves 5, which the prompt cannot apply
    # yet, to run once for both.
    token = job(4, 2, (5, 6, 8), claim=(5, 6, 8))  # 8 loading
    ready = {(2, 1), (2, 2), (2, 5), (2, 6), (2, 7)}.__contains__
    assert sorted((r.id, sorted(s)) for r, s in split([prompt, token], ready, 512)) == [
        ("r0", [1, 2]),
        ("r4", [6]),
    ]


def test_split_leaves_an_expert_a_prompt_cut_short_still_needs() -> None:
    """A prompt that stops before an expert another request needs also stops before its
    later ones; a decoding job that needs one of those leaves it to run once for both."""
    ready = {(2, 1), (2, 5), (2, 7)}.__contains__
    prompt = job(0, 2, (1, 5, 7, 9), claim=(1, 5, 7, 9), n=40)  # 9 loading
    token = job(1, 2, (7, 8), claim=(7, 8))  # 8 loading
    unclaimed = job(2, 2, (5,))  # needs 5, cannot apply it now
    assert split([prompt, token, unclaimed], ready, 512) == [(prompt, {1})]
    # A prompt longer than max_rows reads its own parts: it holds no decoding job back.
    long = job(3, 2, (7,), claim=(7,), n=600)
    assert split([token, long], ready, 512) == [(token, {7})]


def _prompt(i: int, layer: int, left: list[int], done: tuple[int, ...] = ()) -> Request:
    """A long prompt before the MoE of ``layer`` with ``left`` claimed, ``done`` applied."""
    r = req(i, layer)
    r.n, r.needed, r.done = 40, tuple(sorted([*left, *done])), set(done)
    r.claim = [(layer, e) for e in left]
    return r


def test_long_prompts_furthest_behind_read_first() -> None:
    entering = _prompt(0, 0, [])
    entering.emb = object()  # its embeddings, until layer 0's attention is read
    moe_early = _prompt(1, 0, [3, 4], done=(1,))
    moe_late = _prompt(2, 0, [5], done=(1, 3))
    rows = _prompt(3, 0, [], done=(1, 2))
    rows.row = 16
    next_layer = _prompt(4, 1, [0])
    order = sorted([next_layer, rows, moe_late, moe_early, entering], key=progress)
    assert [r.id for r in order] == ["r0", "r1", "r2", "r3", "r4"]


def test_a_prompt_part_takes_a_prefix_of_each_members_experts() -> None:
    """Each member takes the experts it has left in expert order, as far as the part
    goes: one whose next expert comes before the part's first stays out, and one whose
    next expert is loading stops there while the others go on."""
    leader = _prompt(0, 2, [1, 2, 3, 5])
    behind = _prompt(1, 2, [0, 1])
    stalls = _prompt(2, 2, [1, 3, 4, 5])
    skips = _prompt(3, 2, [2, 5])
    loading = {(2, 4)}
    part = prompt_part(
        leader, [behind, stalls, skips], lambda k: k not in loading, lambda r: [1] * 8, 100
    )
    assert [(r.id, s) for r, s in part] == [
        ("r0", {1, 2, 3, 5}),
        ("r2", {1, 3}),
        ("r3", {2, 5}),
    ]
    # The leader's own expert loading ends the part: nobody goes past it.
    loading = {(2, 3)}
    part = prompt_part(leader, [stalls, skips], lambda k: k not in loading, lambda r: [1] * 8, 100)
    assert [(r.id, s) for r, s in part] == [("r0", {1, 2}), ("r2", {1}), ("r3", {2})]


def test_a_prompt_part_keeps_to_its_routes_budget_but_takes_one_expert() -> None:
    leader, other = _prompt(0, 2, [1, 2, 3]), _prompt(1, 2, [1, 2])
    ten = lambda r: [10] * 4  # noqa: E731
    part = prompt_part(leader, [other], lambda k: True, ten, 45)
    assert [(r.id, s) for r, s in part] == [("r0", {1, 2}), ("r1", {1, 2})]
    part = prompt_part(leader, [other], lambda k: True, ten, 5)
    assert [(r.id, s) for r, s in part] == [("r0", {1}), ("r1", {1})]
