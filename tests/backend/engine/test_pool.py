"""The compute team sized to the CPUs other processes leave (``backend.engine.pool``): the
decisions, that the machine's counters see another process's load, and an engine that
computes with fewer threads while others keep CPUs busy, with unchanged results."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import pool as pool_module
from backend.engine.jobs import JobRunner
from backend.engine.loop import Engine
from backend.engine.pool import EVERY_S, WINDOW_S, ComputePool, CpuDomain, cpu_domain
from tests.helpers.cpu_load import Loaded
from tests.helpers.engine_runs import assert_same_results, run_clean, run_staggered


def feed(pool: ComputePool, others: list[float], t: float = 0.0) -> list[int]:
    """Samples ``EVERY_S`` apart in which other processes kept ``others[i]`` CPUs busy
    (this process one CPU throughout); the team size after each."""
    busy = own = 0.0
    pool.update(t, busy, own)
    sizes = []
    for load in others:
        t += EVERY_S
        own += EVERY_S
        busy += EVERY_S * (1.0 + load)
        sizes.append(pool.update(t, busy, own))
    return sizes


def test_gives_up_a_thread_per_busy_cpu_and_takes_it_back_once_they_idle() -> None:
    pool = ComputePool(most=2, cpus=2)
    assert pool.threads == 2
    assert feed(pool, [0.0, 0.1, 0.3]) == [2, 2, 2]  # a little work elsewhere: no change
    pool = ComputePool(most=2, cpus=2)
    # One busy process: one thread. Its use falling within the band between the two
    # margins keeps one; well below it, the thread comes back.
    sizes = feed(pool, [1.0, 1.0, 1.0, 1.0, 0.3, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0])
    assert sizes[3] == 1 and sizes[4:8] == [1, 1, 1, 1] and sizes[-1] == 2
    assert pool.changes == 2
    assert pool.others == pytest.approx(0.0)


def test_never_fewer_than_one_nor_more_than_it_started_with() -> None:
    pool = ComputePool(most=4, cpus=4)
    assert feed(pool, [8.0] * 6)[-1] == 1  # oversubscribed: still one
    pool = ComputePool(most=4, cpus=4)
    assert feed(pool, [2.0] * 6)[-1] == 2  # two busy CPUs of four: two threads
    # Fewer threads than CPUs (one a core on an SMT machine): a load on one CPU leaves
    # it all of them.
    pool = ComputePool(most=8, cpus=16)
    assert feed(pool, [1.0] * 6)[-1] == 8


def test_a_quotas_withheld_share_counts_once_the_team_runs_the_quota_out() -> None:
    """A quota of 1.5 CPUs: a team whose compute comes in bursts (the quota seldom runs
    out) keeps two threads; one that runs it out in most periods computes with one, and
    keeps one while it uses more than half a CPU; idle, it gets two back."""
    pool = ComputePool(most=2, cpus=2, withheld=0.5)
    t = busy = own = 0.0
    periods = throttled = 0

    def feed(steps: int, use: float, share: float) -> list[int]:
        nonlocal t, busy, own, periods, throttled
        sizes = []
        for _ in range(steps):
            t, busy, own = t + EVERY_S, busy + use * EVERY_S, own + use * EVERY_S
            periods, throttled = periods + 5, throttled + round(5 * share)
            sizes.append(pool.update(t, busy, own, periods, throttled))
        return sizes

    pool.update(t, busy, own, periods, throttled)
    assert pool.threads == 2
    assert feed(6, use=1.2, share=0.0) == [2] * 6  # bursts within the quota
    assert feed(2, use=1.5, share=1.0)[-1] == 1 and pool.throttled
    assert feed(6, use=1.1, share=0.0) == [1] * 6  # on one thread the quota holds
    assert feed(6, use=0.05, share=0.0)[-1] == 2 and not pool.throttled
    assert pool.changes == 2
    # Without a quota, throttling counters are zeros and nothing is withheld.
    plain = ComputePool(most=2, cpus=2)
    assert plain.update(0.0, 0.0, 0.0) == 2 and plain.update(1.0, 1.0, 1.0) == 2


def test_a_quota_on_a_host_busy_outside_it_leaves_the_team_what_the_host_leaves() -> None:
    """Inside a quota the group's counter sees no one else; the machine's does: a busy
    loop outside the group on a 2-CPU machine with a quota of 1.5 CPUs (not run out: the
    loop leaves too little) costs a thread, as it would without a quota. On an 8-CPU
    machine with a 2-CPU quota, others busy on five CPUs leave enough; on seven, not."""

    def run(pool: ComputePool, outside: float) -> int:
        busy = own = machine = 0.0
        pool.update(0.0, busy, own, 0, 0, machine)
        for i in range(1, 7):
            busy, own, machine = busy + 0.5, own + 0.5, machine + 0.5 * (1.0 + outside)
            size = pool.update(i * EVERY_S, busy, own, 5 * i, 0, machine)
        return size

    assert run(ComputePool(most=2, cpus=2, withheld=0.5, machine_cpus=2), 1.0) == 1
    assert run(ComputePool(most=2, cpus=2, withheld=0.5, machine_cpus=2), 0.0) == 2
    assert run(ComputePool(most=2, cpus=2, machine_cpus=8), 5.0) == 2
    assert run(ComputePool(most=2, cpus=2, machine_cpus=8), 7.0) == 1


def test_decides_over_a_recent_window_only() -> None:
    pool = ComputePool(most=2, cpus=2)
    assert pool.due(0.0)
    pool.update(0.0, 0.0, 0.0)
    assert not pool.due(EVERY_S / 2) and pool.due(EVERY_S)
    # Samples under EVERY_S apart decide nothing, even under a heavy load.
    assert pool.update(EVERY_S / 2, 2.0 * EVERY_S / 2, 0.0) == 2
    assert feed(pool, [1.0] * 6, t=10.0)[-1] == 1
    # After an idle spell (no samples for a minute) the old load is not read: the first
    # sample after it decides nothing, the next reads only the time since.
    t = 100.0
    assert pool.update(t, 0.0, 0.0) == 1
    assert pool.update(t + EVERY_S, 0.1 * EVERY_S, 0.1 * EVERY_S) == 2
    assert len(pool._samples) <= WINDOW_S / EVERY_S + 2


def test_a_longer_window_decides_between_steps_longer_than_the_engines() -> None:
    """The bench's plain-decoding reference polls between steps that take seconds on a
    full team beside a busy program: the engine's window holds only the newest of such
    samples and decides nothing; a window of a minute decides at each."""

    def every_3_s(pool: ComputePool) -> list[int]:  # others keep one of two CPUs busy
        return [pool.update(t, 2.0 * t, t) for t in (0.0, 3.0, 6.0, 9.0)]

    assert every_3_s(ComputePool(most=2, cpus=2)) == [2, 2, 2, 2]
    assert every_3_s(ComputePool(most=2, cpus=2, window_s=60.0)) == [2, 1, 1, 1]


def test_the_counters_see_another_process_keep_a_cpu_busy() -> None:
    """``CpuDomain.sample`` reads the machine (or this process's CPU cgroup, which a child
    shares): a busy loop beside this (sleeping) process counts as others' use of about one
    CPU."""
    domain = cpu_domain()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started
        t0, (busy0, own0, *_) = time.perf_counter(), domain.sample()
        time.sleep(1.0)
        t1, (busy1, own1, *_) = time.perf_counter(), domain.sample()
    finally:
        busy.kill()
        busy.wait()
    others = ((busy1 - busy0) - (own1 - own0)) / (t1 - t0)
    assert 0.7 <= others <= domain.cpus


def team_sizes(monkeypatch) -> list[int]:
    """The compute team's size at each job the engine runs, as they run."""
    seen: list[int] = []
    real = JobRunner.run

    def run(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JobRunner, "run", run)
    return seen


def test_an_engine_under_load_computes_with_fewer_threads_and_the_same_results(
    models, monkeypatch
) -> None:
    """The machine's counters scripted (at the boundary between the engine and the OS) to
    say that other processes keep every CPU but one busy: the engine's jobs run with one
    thread, its snapshots say so, and tokens and logits are those of an engine with all
    its threads. A caller that stepped the engine gets its own team size back."""
    model = models["mixtral-q8-gguf"]
    config = EngineConfig(policy="bevy", cache="0.5", storage="host")
    torch.set_num_threads(2)
    try:
        quiet = run_clean(model, config)
        # two CPUs: this process on one, another on the other
        monkeypatch.setattr("backend.engine.loop.cpu_domain", lambda: Loaded(2))
        monkeypatch.setattr(pool_module, "EVERY_S", 0.0)  # a decision at every step
        seen = team_sizes(monkeypatch)
        eng = Engine(model, config)
        try:
            busy = run_staggered(eng), eng.logits_log
            snap = eng.snapshot()
            assert (snap.compute_threads, snap.compute_threads_max) == (1, 2)
            assert eng.pool.changes == 1
        finally:
            eng.close()
        assert seen[-1] == 1  # from 2 (one change, above)
        assert torch.get_num_threads() == 2
        assert_same_results(busy, quiet)
    finally:
        torch.set_num_threads(2)


class Quiet(CpuDomain):
    """Nothing but this process uses the domain's CPUs."""

    def sample(self) -> tuple[float, float, int, int, float]:
        own = time.process_time()
        return own, own, 0, 0, own


def test_an_engine_in_a_one_cpu_quota_computes_with_one_thread_from_the_start(
    models, monkeypatch
) -> None:
    """A container's quota of one CPU (the domain scripted at the boundary with the OS;
    the real cgroup is read in tests/backend/test_cgroup.py): the engine started with two
    threads computes every job with one, its snapshots say 1 of 1 (nothing reduced), and
    a caller that stepped it gets its two back."""
    model = models["mixtral-q8-gguf"]
    config = EngineConfig(policy="bevy", cache="0.5", storage="host")
    monkeypatch.setattr("backend.engine.loop.cpu_domain", lambda: Quiet(1, Path("/quota")))
    seen = team_sizes(monkeypatch)
    torch.set_num_threads(2)
    try:
        eng = Engine(model, config)
        try:
            run_staggered(eng)
            snap = eng.snapshot()
            assert (snap.compute_threads, snap.compute_threads_max) == (1, 1)
            assert eng.pool.changes == 0
        finally:
            eng.close()
        assert set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(2)


def test_a_quota_of_at_most_six_tenths_of_a_cpu_starves_the_engine() -> None:
    """Only a quota leaves the engine's threads less CPU however long they are ready to
    run: at most ``1 - SHRINK_AT`` of a CPU starves the engine; a busy machine does not."""
    quota = Path("/quota")
    assert CpuDomain(1, quota, withheld=0.5).starved  # --cpus 0.5
    assert CpuDomain(1, quota, withheld=0.4).starved  # 0.6
    assert not CpuDomain(1, quota, withheld=0.25).starved  # 0.75
    assert not CpuDomain(2, quota, withheld=0.5).starved  # 1.5
    assert not CpuDomain(1).starved and not CpuDomain(2).starved  # no quota


def test_a_bevy_engine_in_half_a_cpu_holds_its_requests_together(models, monkeypatch) -> None:
    """A quota of half a CPU (scripted at the boundary with the OS): ``bevy``'s balancer
    holds the running requests together from its first decision, whatever the lanes
    say, and the results are those of a quiet machine's runahead."""
    from backend.engine import balance
    from backend.engine.scheduler import Policy
    from tests.helpers.spy import spy

    model = models["mixtral-q8-gguf"]
    config = EngineConfig(policy="bevy", cache="0.5", storage="host")
    torch.set_num_threads(2)
    try:
        quiet = run_clean(model, config)
        monkeypatch.setattr(
            "backend.engine.loop.cpu_domain", lambda: Quiet(1, Path("/quota"), withheld=0.5)
        )
        monkeypatch.setattr(balance, "EVERY_S", 0.0)  # a decision at every step
        groups = spy(monkeypatch, Policy, "compute_group")
        eng = Engine(model, config)
        try:
            assert eng.balancer.starved
            held = run_staggered(eng), eng.logits_log
        finally:
            eng.close()
        assert_same_results(held, quiet)
        # Held from the first decision with two running: every group chosen after it.
        chose = [args[3] for args, _ in groups]
        assert True in chose and False not in chose[chose.index(True) :]
    finally:
        torch.set_num_threads(2)


def test_plain_generation_from_the_cli_computes_on_the_threads_a_busy_machine_leaves(
    tiny_chat_moe: Path, monkeypatch, capsys
) -> None:
    """`bevy generate` decodes outside the engine (``sized_team``): with the machine's
    counters scripted to say another process keeps one of two CPUs busy, every forward
    pass, the prompt's first, runs on one thread, and it prints what it prints with the
    machine's own counters."""
    from backend.models.transformer import Transformer
    from backend.serving import cli

    args = ["generate", "--model", str(tiny_chat_moe), "--max-tokens", "4"]
    args += ["--temperature", "0", "Hello there."]
    before = torch.get_num_threads()
    try:
        assert cli.main(args) == 0
        plain = capsys.readouterr().out
        monkeypatch.setattr(pool_module, "cpu_domain", lambda: Loaded(2))
        seen: list[int] = []
        forward = Transformer.forward

        def counted(self, *a):
            seen.append(torch.get_num_threads())
            return forward(self, *a)

        monkeypatch.setattr(Transformer, "forward", counted)
        assert cli.main(args) == 0
        assert capsys.readouterr().out == plain
        assert len(seen) >= 2 and set(seen) == {1}
    finally:
        torch.set_num_threads(before)
