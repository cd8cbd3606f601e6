"""benchmarks/kv_type.py: its summary takes each policy's medians per cache type, their
ratio, the larger peak, and calls a policy exact only if every run of it was."""

from __future__ import annotations

import pytest

from benchmarks.kv_type import summarize


def _run(policy: str, kind: str, tok_s: float, mib: float, exact: bool = True) -> dict:
    return {
        "policy": policy,
        "kv_type": kind,
        "tokens_per_s": tok_s,
        "peak_engine_mib": mib,
        "exact": exact,
    }


def test_summary_per_policy_and_cache_type() -> None:
    runs = [
        _run("bevy", "auto", 40.0, 900),
        _run("bevy", "f16", 44.0, 700),
        _run("bevy", "auto", 42.0, 910),
        _run("bevy", "f16", 48.0, 705),
        _run("bevy", "auto", 30.0, 905),
        _run("bevy", "f16", 46.0, 702),
        _run("sync", "auto", 30.0, 880),
        _run("sync", "f16", 33.0, 690, exact=False),
    ]
    bevy, sync = summarize(runs)
    assert (bevy["policy"], bevy["auto"], bevy["f16"]) == ("bevy", 40.0, 46.0)
    assert bevy["ratio"] == pytest.approx(1.15)
    assert (bevy["auto_mib"], bevy["f16_mib"]) == (910, 705)
    assert bevy["exact"] and not sync["exact"]
    assert sync["ratio"] == pytest.approx(1.1)
