"""How many threads the engine computes with: the CPUs that other processes leave it.

The kernels split each product over an OpenMP team that meets at a barrier several times a
layer. When another process keeps a core busy, the OS shares that core between it and one
member of the team, and every barrier waits for the member set aside: on a 2-core VM one
busy loop beside the engine cut decoding to a fifth, where a team of one thread on the
free core decoded at nearly the quiet machine's speed (docs/performance.md).

``ComputePool`` reads how much CPU the rest of the machine used over the last seconds (the
whole machine's busy time less this process's own, so that the engine's link thread and
spinning team count as its own) and sizes the team to the CPUs left: one thread fewer for
each CPU's worth that others keep busy, never more than the engine started with nor fewer
than one. A thread is given up once others use ``SHRINK_AT`` of a CPU beyond a whole
number, and taken back only once they use less than ``GROW_BELOW`` of it: apart, so that the
size does not flip on noise. An engine started with fewer threads than the machine has
CPUs keeps them all while enough CPUs are free. Pure Python: tested without an engine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import psutil

SHRINK_AT = 0.4  # others' use of a CPU, beyond whole ones, that costs the team a thread
GROW_BELOW = 0.15  # ... and below which a thread comes back
WINDOW_S = 2.0  # the machine's history each decision reads
EVERY_S = 0.5  # how often it decides


def cpu_use() -> tuple[float, float]:
    """(Seconds every CPU of the machine has been busy, seconds this process has run),
    both since some fixed point: their differences over a window give others' use."""
    t = psutil.cpu_times()
    # Guest time is already counted in user time on Linux; waiting for I/O is idle.
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total - idle, time.process_time()


def machine_cpus() -> int:
    """The machine's logical CPUs, the unit of ``cpu_use``'s busy time."""
    return psutil.cpu_count() or 1


def _threads_for(others: float, cpus: int, most: int, margin: float) -> int:
    return max(1, min(most, cpus - math.ceil(others - margin)))


@dataclass
class ComputePool:
    """The compute team's size for a machine of ``cpus`` CPUs, at most ``most`` threads."""

    most: int
    cpus: int
    threads: int = 0
    changes: int = 0
    others: float = 0.0  # CPUs the other processes kept busy over the last window
    _samples: deque = field(default_factory=deque)
    _last: float = float("-inf")

    def __post_init__(self) -> None:
        self.threads = self.threads or self.most

    def due(self, now: float) -> bool:
        return now - self._last >= EVERY_S

    def update(self, now: float, busy_s: float, own_s: float) -> int:
        """Take a sample of ``cpu_use`` at ``now``; returns the threads to compute with.
        Decides once the samples span ``EVERY_S``, over at most ``WINDOW_S`` of them (a
        window reaching into an idle spell would read an old load)."""
        self._last = now
        samples = self._samples
        samples.append((now, busy_s, own_s))
        while now - samples[0][0] > WINDOW_S + EVERY_S / 2:
            samples.popleft()
        t0, busy0, own0 = samples[0]
        if now <= t0 or now - t0 < EVERY_S:
            return self.threads
        self.others = max(0.0, (busy_s - busy0) - (own_s - own0)) / (now - t0)
        fewer = _threads_for(self.others, self.cpus, self.most, SHRINK_AT)
        more = _threads_for(self.others, self.cpus, self.most, GROW_BELOW)
        want = fewer if fewer < self.threads else max(more, self.threads)
        if want != self.threads:
            self.threads = want
            self.changes += 1
        return self.threads
