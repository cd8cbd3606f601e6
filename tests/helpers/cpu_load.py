"""A machine's CPU counters scripted at the boundary between the engine and the OS."""

from __future__ import annotations

import time

from backend.engine.pool import CpuDomain


class Loaded(CpuDomain):
    """Other processes keep every CPU of the domain busy but the one this process runs on:
    over any span, the domain's CPUs busy throughout and this process one CPU's worth."""

    def sample(self) -> tuple[float, float, int, int, float]:
        wall = time.perf_counter()
        return wall * self.cpus, wall, 0, 0, wall * self.cpus
