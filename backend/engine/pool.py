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
CPUs keeps them all while enough CPUs are free. Inside a cgroup with a CPU quota (a
container's ``--cpus``) the machine's counters see the host: there the CPUs are the
quota's, rounded up, others' use is the group's counter less this process's
(``CpuDomain``), together with what the rest of the machine takes beyond the CPUs the
quota leaves unused, and the part of a CPU the quota withholds counts as others' use
while the team runs the quota out. ``sized_team`` keeps torch's team to such a pool where
it computes outside the engine (plain generation). The decisions are pure Python: tested
without an engine.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from backend import cgroup

SHRINK_AT = 0.4  # others' use of a CPU, beyond whole ones, that costs the team a thread
GROW_BELOW = 0.15  # ... and below which a thread comes back
WINDOW_S = 2.0  # the machine's history each decision reads
EVERY_S = 0.5  # how often it decides
THROTTLED_AT = 0.2  # share of a quota's periods that ran out from which its withheld part counts


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity masks
        return psutil.cpu_count() or 1


def usable_cpus() -> int:
    """The CPUs this process may compute on: the machine's, within its affinity mask
    (``taskset``, a container's ``--cpuset-cpus``) and its cgroup's CPU quota (a container's
    ``--cpus``, rounded up), which ``os.cpu_count`` does not see. A team larger than the
    quota is throttled as a whole each period and waits at its barriers for members the
    quota stopped."""
    cpus, quota = _affinity_cpus(), cgroup.cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def machine_busy_s() -> float:
    """Seconds every CPU of the machine has been busy since some fixed point."""
    t = psutil.cpu_times()
    # Guest time is already counted in user time on Linux; waiting for I/O is idle.
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0) - idle


def machine_cpus() -> int:
    """The machine's logical CPUs, the unit of ``machine_busy_s``."""
    return psutil.cpu_count() or 1


@dataclass(frozen=True)
class CpuDomain:
    """The CPUs the engine's team competes for: the machine's, or, where a cgroup's quota
    bounds this process, the quota, shared with the group's other processes (the rest of a
    container), read from the group's own counter since the machine's sees the host. The
    machine's CPUs are read as well: a host busy outside the group leaves fewer."""

    cpus: int
    usage: Path | None = None  # the cgroup's CPU time (``cgroup.cpu_usage_file``)
    withheld: float = 0.0  # the part of the last CPU a quota of 1.5 CPUs, say, withholds
    stat: Path | None = None  # the quota's periods and throttled ones (``cgroup.cpu_stat_file``)

    @property
    def starved(self) -> bool:
        """A quota short of one CPU by at least the share that costs the team a thread
        (``SHRINK_AT``): all the engine's threads get at most 0.6 of a CPU's time, however
        long they are ready to run, so the CPU time a token takes bounds decoding, and
        ``bevy`` holds its requests together (``Balancer``): under half a CPU, held
        requests decoded as sync's do and faster than runahead's smaller groups; under
        three quarters runahead's overlap still paid (docs/performance.md). Other
        processes' load is not a quota: a thread ready to run more of the time gets more
        of a shared CPU, and there runahead stayed ahead."""
        return self.cpus - self.withheld <= 1.0 - SHRINK_AT

    def sample(self) -> tuple[float, float, int, int, float]:
        """For ``ComputePool.update``: (seconds the domain's CPUs have been busy, seconds
        this process has run, quota periods, periods in which the quota ran out, seconds
        the machine's CPUs have been busy), all since some fixed point: their differences
        over a window give others' use. Without a quota: zero periods, and the machine's
        busy time is the domain's."""
        own, machine = time.process_time(), machine_busy_s()
        if self.usage is None:
            return machine, own, 0, 0, machine
        periods, throttled = cgroup.cpu_throttling(self.stat) if self.stat else (0, 0)
        return cgroup.cpu_usage_s(self.usage), own, periods, throttled, machine


def cpu_domain() -> CpuDomain:
    """This process's ``CpuDomain``: its cgroup's where a quota binds (is less than the
    CPUs it may run on), else the machine's."""
    quota, usage = cgroup.cpu_quota(), cgroup.cpu_usage_file()
    if quota is not None and quota < _affinity_cpus() and usage is not None:
        cpus = usable_cpus()
        return CpuDomain(cpus, usage, max(0.0, cpus - quota), cgroup.cpu_stat_file())
    return CpuDomain(machine_cpus())


def _threads_for(others: float, cpus: int, most: int, margin: float) -> int:
    return max(1, min(most, cpus - math.ceil(others - margin)))


@dataclass
class ComputePool:
    """The compute team's size for a machine of ``cpus`` CPUs, at most ``most`` threads.

    ``withheld``: the share of a CPU a quota keeps back (a quota of 1.5 CPUs: 0.5). A team
    that computes throughout runs the quota out each period and is stopped as a whole, so
    under 1.5 CPUs bevy decoded faster on one thread than on two; a team whose compute
    comes in bursts between fetches fits the quota with both, and sync decoded slower on
    one (docs/performance.md). So the withheld share counts as others' use once the
    quota ran out in ``THROTTLED_AT`` of the window's periods, and until the group's use
    leaves a whole CPU of the quota free (``GROW_BELOW`` short of it). ``machine_cpus``:
    inside a quota, what the rest of the machine takes beyond the CPUs the quota leaves
    unused counts too (a program busy outside the container).
    """

    most: int
    cpus: int
    withheld: float = 0.0
    machine_cpus: int = 0  # the machine's CPUs, where its load is read beside the domain's
    threads: int = 0
    changes: int = 0
    others: float = 0.0  # CPUs the other processes kept busy over the last window
    throttled: bool = False  # the quota ran out: its withheld share counts as others' use
    domain: CpuDomain | None = None  # what ``poll`` samples
    window_s: float = WINDOW_S  # the history each decision reads (and its samples' most apart)
    _samples: deque = field(default_factory=deque)
    _last: float = float("-inf")

    def __post_init__(self) -> None:
        self.threads = self.threads or min(self.most, self.cpus)

    @classmethod
    def of(cls, domain: CpuDomain, most: int, window_s: float = WINDOW_S) -> ComputePool:
        """The pool of ``domain``'s CPUs for a team of at most ``most`` threads."""
        cpus = domain.cpus
        return cls(
            min(most, cpus), cpus, domain.withheld, machine_cpus(), domain=domain, window_s=window_s
        )

    def due(self, now: float) -> bool:
        return now - self._last >= EVERY_S

    def poll(self, now: float) -> int | None:
        """Between pieces of work: once a decision is due, ``update`` with a sample of the
        pool's ``domain`` and the threads to compute with; None until then."""
        return self.update(now, *self.domain.sample()) if self.due(now) else None

    def update(
        self,
        now: float,
        busy_s: float,
        own_s: float,
        periods: int = 0,
        throttled: int = 0,
        machine_s: float | None = None,
    ) -> int:
        """Take a ``CpuDomain.sample`` at ``now``; returns the threads to compute with.
        Decides once the samples span ``EVERY_S``, over at most ``window_s`` of them (a
        window reaching into an idle spell would read an old load)."""
        self._last = now
        machine_s = busy_s if machine_s is None else machine_s
        samples = self._samples
        samples.append((now, busy_s, own_s, periods, throttled, machine_s))
        while now - samples[0][0] > self.window_s + EVERY_S / 2:
            samples.popleft()
        t0, busy0, own0, periods0, throttled0, machine0 = samples[0]
        if now <= t0 or now - t0 < EVERY_S:
            return self.threads
        span = now - t0
        self.others = max(0.0, (busy_s - busy0) - (own_s - own0)) / span
        if self.withheld:
            ran_out = (throttled - throttled0) / max(1, periods - periods0)
            if ran_out >= THROTTLED_AT:
                self.throttled = True
            elif (busy_s - busy0) / span <= self.cpus - self.withheld - 1.0 + GROW_BELOW:
                self.throttled = False
        others = self.others + (self.withheld if self.throttled else 0.0)
        if self.machine_cpus:  # the CPUs the rest of the machine leaves may be fewer
            beyond = max(0.0, (machine_s - machine0) - (own_s - own0)) / span
            others = max(others, beyond - (self.machine_cpus - self.cpus))
        fewer = _threads_for(others, self.cpus, self.most, SHRINK_AT)
        more = _threads_for(others, self.cpus, self.most, GROW_BELOW)
        want = fewer if fewer < self.threads else max(more, self.threads)
        if want != self.threads:
            self.threads = want
            self.changes += 1
        return self.threads


@contextmanager
def sized_team(on_cpu: bool = True) -> Iterator[Callable[[], None]]:
    """For torch computing outside the engine (plain generation: ``bevy generate``,
    ``bevy chat``, ``bevy bench``'s reference): a callable for between forward passes
    that keeps the calling thread's team to the CPUs other processes leave, as the
    engine's pool keeps its own; the caller's team size comes back at the end. Beside a
    busy program a full team waits at every barrier for the member the OS set aside
    (docs/performance.md).

    One forward pass there (a prompt's whole prefill; on a full team beside a busy
    program, even one token) may take seconds, longer than the engine's window: the
    pool reads the last minute instead. Its first reading is taken on entry, and the
    first call waits until it is ``EVERY_S`` old, so that even the first pass runs on a
    decided team (entered before a model loads, nothing waits)."""
    import torch

    threads = torch.get_num_threads()
    if not on_cpu or threads == 1:
        yield lambda: None
        return
    pool = ComputePool.of(cpu_domain(), threads, window_s=60.0)
    pool.poll(started := time.perf_counter())
    first = True

    def resize() -> None:
        nonlocal first
        if first:
            time.sleep(max(0.0, started + EVERY_S - time.perf_counter()))
            first = False
        if (n := pool.poll(time.perf_counter())) and n != torch.get_num_threads():
            torch.set_num_threads(n)

    try:
        yield resize
    finally:
        torch.set_num_threads(threads)
