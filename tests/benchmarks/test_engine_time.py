"""benchmarks/engine_time.py: its timers count only once decoding has begun, hand back
what they wrap (``measure`` puts it back), and split a run's time into its kernels and
the rest."""

from __future__ import annotations

import time
from types import SimpleNamespace

from benchmarks.engine_time import Timers


def test_timers_count_kernels_inside_runs_apart_from_the_rest() -> None:
    def kernel() -> str:
        time.sleep(0.01)
        return "k"

    def run() -> str:
        time.sleep(0.02)
        return owner.kernel()

    owner = SimpleNamespace(kernel=kernel, run=run)
    timers = Timers()
    real_kernel = timers.wrap(owner, "kernel", "kernel", kernel=True)
    real_run = timers.wrap(owner, "run", "run", run=True)
    assert (real_kernel, real_run) == (kernel, run)
    assert owner.run() == "k"  # before decoding: not counted
    assert not timers.calls and timers.in_runs == 0.0
    timers.on = True
    assert owner.run() == "k"
    assert owner.kernel() == "k"  # outside a run: its own row, not the runs' kernels
    assert timers.calls == {"run": 1, "kernel": 2}
    assert timers.seconds["run"] >= 0.03
    assert 0.01 <= timers.in_runs < timers.seconds["kernel"]
    assert timers.in_runs < timers.seconds["run"] - 0.015
    assert timers.depth == 0
