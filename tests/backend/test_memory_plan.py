"""The memory plan: what the cache and KV get from an explicit cache size, a total
``--memory`` budget, or "auto" (what is free less a headroom)."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig, parse_size, plan_memory

MiB, GiB = 1 << 20, 1 << 30


def plan(config: EngineConfig, *, free: int = 16 * GiB, total: int = 32 * GiB, **kw):
    args = dict(
        n_experts=1000,
        slot_bytes=MiB,
        min_slots=8,
        held_bytes=300 * MiB,
        scratch_bytes=100 * MiB,
        free_bytes=free,
        total_bytes=total,
    )
    return plan_memory(config, **{**args, **kw})


def test_sizes_parse_and_bad_ones_say_what_a_size_is() -> None:
    assert parse_size("1.5GiB") == 3 * GiB // 2
    assert parse_size("800MB") == 800 * 10**6
    assert parse_size("60%", 10 * GiB) == 6 * GiB
    assert parse_size(4096) == 4096
    for bad in ("lots", "0GiB", "-1MiB", "150%", "0", "nanGiB"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad, 10 * GiB)


def test_config_takes_a_cache_or_a_memory_budget_not_both() -> None:
    assert EngineConfig().cache == "auto" and not EngineConfig().memory
    EngineConfig(memory="4GiB")
    EngineConfig(cache="30%")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(cache="0.3", memory="4GiB")
    with pytest.raises(ValueError, match="is not auto, a fraction"):
        EngineConfig(cache="most")
    with pytest.raises(ValueError, match="is not a size"):
        EngineConfig(memory="4 gigs")


def test_an_explicit_cache_is_taken_as_given() -> None:
    p = plan(EngineConfig(cache="30%"), free=0)  # even with nothing free: the user asked
    assert (p.slots, p.kv_bytes, p.total_bytes) == (300, 2048 * MiB, 0)
    assert plan(EngineConfig(cache="2000")).slots == 1000  # at most every expert
    assert plan(EngineConfig(cache="0.3", kv_budget_mib=100)).kv_bytes == 100 * MiB


def test_auto_holds_every_expert_where_they_fit_and_leaves_a_headroom() -> None:
    p = plan(EngineConfig(), free=16 * GiB, total=32 * GiB)
    assert p.slots == 1000 and p.kv_bytes == 2048 * MiB
    assert "every expert" in p.note
    # 2 GiB free on a 32 GiB machine: a tenth of the RAM (3.2 GiB) stays free, so
    # nothing is left above the held part; the smallest cache, said so.
    short = plan(EngineConfig(), free=2 * GiB, total=32 * GiB)
    assert short.slots == 8 and "memory is short" in short.note
    # 2 GiB free on 8 GiB: 1 GiB stays free; the rest, after the scratch and a quarter
    # for KV, is the cache.
    p = plan(EngineConfig(), free=2 * GiB, total=8 * GiB, held_bytes=0)
    room = GiB - 100 * MiB
    assert p.slots == (room - room // 4) // MiB < 1000
    assert p.slots * MiB + p.kv_bytes <= room and p.kv_bytes >= room // 4
    assert "% of the experts" in p.note


def test_a_memory_budget_bounds_held_scratch_kv_and_cache_together() -> None:
    for budget in ("700MiB", "1GiB", "1.2GiB"):
        total = parse_size(budget)
        p = plan(EngineConfig(memory=budget))
        assert p.total_bytes == total
        assert 300 * MiB + 100 * MiB + p.kv_bytes + p.slots * MiB <= total
        assert p.kv_bytes >= 64 * MiB and p.slots >= 8
    # The budget is the budget whatever is free: the user chose it.
    assert (
        plan(EngineConfig(memory="1GiB"), free=0).slots == plan(EngineConfig(memory="1GiB")).slots
    )
    # Room for every expert: the KV gets the rest, up to its cap.
    p = plan(EngineConfig(memory="2GiB"))
    assert p.slots == 1000 and p.kv_bytes == 2 * GiB - 400 * MiB - 1000 * MiB
    # A share of the RAM.
    assert plan(EngineConfig(memory="50%"), total=4 * GiB).total_bytes == 2 * GiB
    # A KV budget given: taken as is, the cache gets the rest.
    p = plan(EngineConfig(memory="1GiB", kv_budget_mib=300))
    assert p.kv_bytes == 300 * MiB and p.slots == (GiB - 700 * MiB) // MiB


def test_a_memory_budget_too_small_says_what_it_needs() -> None:
    with pytest.raises(ValueError, match=r"needs at least 472 MiB") as err:
        plan(EngineConfig(memory="400MiB"))
    assert "budget of 400 MiB" in str(err.value) and "8 experts" in str(err.value)
    assert "300 MiB already held" in str(err.value)
