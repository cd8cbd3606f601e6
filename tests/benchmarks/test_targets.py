"""benchmarks/targets.py: which configuration each target is checked at, and its verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.targets import (
    BEST_CASE,
    EXACT,
    FETCHED,
    PREFETCH,
    TARGETS,
    configurations,
    main,
    report,
    verdicts,
)


def rec(policy: str, requests: int = 8, cache: float = 0.3, **kw) -> dict:
    base = {
        "policy": policy,
        "workload": "chat",
        "requests": requests,
        "cache_fraction": cache,
        "storage": "ssd",
        "device": "cpu",
        "eviction": "lfu",
        "tokens_per_s": 10.0,
        "compute_busy_s": 5.0,
        "link_busy_s": 5.0,
        "step_over_bound": 1.05,
        "fetched_per_step": 100.0,
        "unused_prefetch": 0.5,
        "tokens_identical_to_reference": True,
    }
    return {**base, **kw}


def config(requests: int = 8, cache: float = 0.3, bevy: float = 20.0, sync: float = 10.0,
           pf: float = 12.0, **bevy_kw) -> list[dict]:  # fmt: skip
    return [
        rec("bevy", requests, cache, tokens_per_s=bevy, **bevy_kw),
        rec("sync", requests, cache, tokens_per_s=sync, step_over_bound=1.9),
        rec("prefetch-gate", requests, cache, tokens_per_s=pf),
        rec("prefetch-history", requests, cache, tokens_per_s=pf - 1),
    ]


def missed(records: list[dict]) -> set[tuple[str, str]]:
    return {
        (v.target.split(" ")[0], v.config.split(",")[0]) for v in verdicts(records) if not v.met
    }


def test_all_met() -> None:
    text, ok = report(config() + config(requests=16))
    assert ok and "MISSED" not in text
    assert (
        "| chat 8 req, 30%, ssd, cpu, lfu | 20.00 | 10.00 | 12.00 (prefetch-gate) | 2.00 | 1.67 |"
        in text
    )


def test_each_target_can_fail() -> None:
    assert missed(config(step_over_bound=1.2)) == {("step/bound", "chat 8 req")}
    assert missed(config(bevy=9.0, pf=5.0)) == {(">", "chat 8 req"), (">=", "chat 8 req")}
    # 1.4x sync at the best case and 1.17x the best prefetcher: two ">=" targets missed
    assert {v.target for v in verdicts(config(bevy=14.0)) if not v.met} == {
        PREFETCH,
        BEST_CASE,
    }
    assert missed(config(fetched_per_step=106.0)) == {("fetched", "chat 8 req")}
    assert missed(config(fetched_per_step=104.0)) == set()
    assert missed(config(tokens_identical_to_reference=False)) == {("tokens", "chat 8 req")}


def test_prefetch_target_only_at_8_and_16_requests() -> None:
    found = verdicts(config(requests=2, pf=19.0) + config(requests=16, pf=19.0))
    pf = [v for v in found if v.target == PREFETCH]
    assert [v.config.split(",")[0] for v in pf] == ["chat 16 req"] and not pf[0].met
    assert pf[0].value == (
        "1.05x prefetch-gate (unused prefetches: prefetch-gate 50 %, prefetch-history 50 %)"
    )


def test_best_case_is_where_sync_compute_and_link_are_closest() -> None:
    near = config(requests=2, bevy=12.4)  # 1.24x sync, where sync is most balanced
    near[1].update(compute_busy_s=4.9, link_busy_s=5.4)
    far = config(requests=16, bevy=30.0)
    far[1].update(compute_busy_s=11.0, link_busy_s=7.8)
    found = [v for v in verdicts(near + far) if "closest" in v.target]
    assert len(found) == 1 and found[0].config.startswith("chat 2 req") and not found[0].met
    assert found[0].value.startswith("1.24x")
    # Another workload (or eviction) has its own best case.
    other = [dict(r, workload="agentic") for r in far]
    found = [v for v in verdicts(near + other) if "closest" in v.target]
    assert {v.config.split(",")[0] for v in found} == {"chat 2 req", "agentic 16 req"}


def test_a_policy_twice_in_one_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="bevy appears twice"):
        configurations(config() + [rec("bevy")])
    # ... unless the eviction differs: then it is another configuration.
    assert len(configurations(config() + [rec("bevy", eviction="reuse")])) == 2


def test_main_reads_files_and_exits_by_verdict(tmp_path: Path, capsys) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(config()))
    bad.write_text(json.dumps(config(requests=16, step_over_bound=1.3)))
    assert main([str(good)]) == 0 and main([str(good), "--strict"]) == 0
    assert main([str(good), str(bad)]) == 0  # reports only
    assert main([str(good), str(bad), "--strict"]) == 1
    out = capsys.readouterr().out
    assert "MISSED: step/bound <= 1.15 at chat 16 req, 30%, ssd, cpu, lfu: 1.30 (sync 1.90)" in out
    (tmp_path / "junk.json").write_text("{not json")
    assert main([str(tmp_path / "junk.json")]) == 2
    (tmp_path / "other.json").write_text(json.dumps([{"policy": "bevy"}]))
    assert main([str(tmp_path / "other.json")]) == 2


def test_exactness_covers_every_policy_and_configuration() -> None:
    rows = config()
    rows[1]["tokens_identical_to_reference"] = False  # sync's, not bevy's
    assert missed(rows) == {("tokens", "chat 8 req")}
    found = [v for v in verdicts(rows) if v.target == EXACT]
    assert [v.value for v in found] == ["sync"]
    # A configuration without bevy still has its tokens checked; what needs bevy is not.
    no_bevy = rows[1:]
    found = verdicts(no_bevy)
    assert [(v.target, v.met) for v in found if v.met is not None] == [(EXACT, False)]
    assert {v.target for v in found if v.met is None} == set(TARGETS) - {EXACT}
    text, ok = report(no_bevy)
    assert not ok and "NOT CHECKED: step/bound <= 1.15" in text


def test_no_fetches_and_no_link_time() -> None:
    rows = config(fetched_per_step=0.0)
    rows[1].update(fetched_per_step=0.0, link_busy_s=0.0)  # all experts cached
    found = {v.target: v for v in verdicts(rows)}
    assert found[FETCHED].met is True and "+0.0 %" in found[FETCHED].value
    assert found[BEST_CASE].met is None  # no balance of compute and link to speak of
    text, ok = report(rows)
    assert not ok and "1 targets not checked" in text
    rows[0]["fetched_per_step"] = 3.0  # bevy fetched where sync did not
    assert {v.target: v for v in verdicts(rows)}[FETCHED].met is False


def test_unrecorded_eviction_and_one_best_case_per_eviction() -> None:
    old = [{k: v for k, v in r.items() if k != "eviction"} for r in config()]
    assert verdicts(old)[0].config == "chat 8 req, 30%, ssd, cpu, unrecorded"
    reuse = [dict(r, eviction="reuse") for r in config(requests=16, bevy=12.0)]
    found = [v for v in verdicts(config() + reuse) if v.target == BEST_CASE]
    assert [(v.config, v.met) for v in found] == [
        ("chat 8 req, 30%, ssd, cpu, lfu", True),
        ("chat 16 req, 30%, ssd, cpu, reuse", False),
    ]
