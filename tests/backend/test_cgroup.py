"""This process's cgroup limits (``backend.cgroup``), which psutil does not see: from
``/proc/self/cgroup`` and the cgroup files written here as a container's would be (v2 or
v1, the group at its path or mounted as the root), and, where this test may make a cgroup,
a real CPU quota seen from a process inside it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from backend import cgroup

GiB = 1 << 30


def test_a_memory_cgroup_limit_is_what_a_container_has(tmp_path) -> None:
    """ "auto" budgets must see a container's limit, not the host's RAM."""
    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "app").mkdir(parents=True)
    proc.write_text("0::/app\n")
    (v2 / "app" / "memory.max").write_text("4294967296\n")
    (v2 / "app" / "memory.current").write_text("1073741824\n")
    assert cgroup.memory_limit(str(proc), str(v2)) == (4 * GiB, GiB)
    (v2 / "app" / "memory.max").write_text("max\n")
    assert cgroup.memory_limit(str(proc), str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)  # the group mounted as the root
    proc.write_text("12:cpu,cpuacct:/x\n11:memory:/docker/abc\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 * GiB))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(GiB // 2))
    assert cgroup.memory_limit(str(proc), str(v1)) == (2 * GiB, GiB // 2)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # no limit
    assert cgroup.memory_limit(str(proc), str(v1)) is None
    assert cgroup.memory_limit(str(tmp_path / "absent"), str(v1)) is None


def test_a_cpu_quota_and_the_groups_cpu_time_v2(tmp_path) -> None:
    proc, v2 = tmp_path / "cgroup", tmp_path / "v2"
    group = v2 / "system.slice" / "bevy.service"
    group.mkdir(parents=True)
    proc.write_text("0::/system.slice/bevy.service\n")
    args = (str(proc), str(v2))
    assert cgroup.cpu_quota(*args) is None  # no cpu controller in the group
    (group / "cpu.max").write_text("150000 100000\n")
    assert cgroup.cpu_quota(*args) == 1.5
    (group / "cpu.max").write_text("max 100000\n")
    assert cgroup.cpu_quota(*args) is None
    (group / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 5\n")
    usage = cgroup.cpu_usage_file(*args)
    assert usage == group / "cpu.stat" and cgroup.cpu_usage_s(usage) == 2.5
    assert cgroup.cpu_stat_file(*args) is None  # no quota's counters in it
    (group / "cpu.stat").write_text(
        "usage_usec 2500000\nnr_periods 40\nnr_throttled 7\nthrottled_usec 9000\n"
    )
    stat = cgroup.cpu_stat_file(*args)
    assert stat == group / "cpu.stat" and cgroup.cpu_throttling(stat) == (40, 7)


def test_a_cpu_quota_and_the_groups_cpu_time_v1(tmp_path) -> None:
    """v1: the quota in the cpu hierarchy, the time in cpuacct's (here mounted apart, as
    on some hosts; a container sees its group as each hierarchy's root)."""
    proc, v1 = tmp_path / "cgroup", tmp_path / "v1"
    for name in ("cpu", "cpuacct"):
        (v1 / name).mkdir(parents=True)
    proc.write_text("3:memory:/docker/abc\n2:cpuacct:/docker/abc\n1:cpu:/docker/abc\n0::/\n")
    args = (str(proc), str(v1))
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup.cpu_quota(*args) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert cgroup.cpu_quota(*args) == 2.0
    (v1 / "cpuacct" / "cpuacct.usage").write_text("3000000000\n")
    usage = cgroup.cpu_usage_file(*args)
    assert usage == v1 / "cpuacct" / "cpuacct.usage" and cgroup.cpu_usage_s(usage) == 3.0
    (v1 / "cpu" / "cpu.stat").write_text("nr_periods 12\nnr_throttled 3\nthrottled_time 5\n")
    stat = cgroup.cpu_stat_file(*args)
    assert stat == v1 / "cpu" / "cpu.stat" and cgroup.cpu_throttling(stat) == (12, 3)
    assert cgroup.cpu_quota(str(tmp_path / "absent"), str(v1)) is None


def _cpu_group(quota_us: int) -> list[Path]:
    """A real cgroup of this machine with a CPU quota (v2, else v1's cpu and cpuacct
    hierarchies); skips where none can be made (not root, no writable hierarchy)."""
    name = f"bevy-test-{uuid.uuid4().hex[:8]}"
    root = Path(cgroup.MOUNT)
    if (root / "cgroup.controllers").is_file():  # v2: a child of this process's group
        own = Path(cgroup.PROC).read_text().strip().split("::")[-1].lstrip("/")
        group = root / own / name
        try:
            # Enabling the controller for the group's children would change this machine.
            if "cpu" not in (group.parent / "cgroup.subtree_control").read_text().split():
                pytest.skip(f"the cpu controller is not enabled below {group.parent}")
            group.mkdir()
            (group / "cpu.max").write_text(f"{quota_us} 100000")
        except OSError as exc:
            _remove([group])
            pytest.skip(f"cannot make a cgroup v2 with a CPU quota here: {exc}")
        return [group]
    groups = [root / "cpu" / name, root / "cpuacct" / name]
    try:
        for g in groups:
            g.mkdir()
        (groups[0] / "cpu.cfs_period_us").write_text("100000")
        (groups[0] / "cpu.cfs_quota_us").write_text(str(quota_us))
    except OSError as exc:
        _remove(groups)
        pytest.skip(f"cannot make a cgroup with a CPU quota here: {exc}")
    return groups


def _remove(groups: list[Path]) -> None:
    for g in groups:
        with contextlib.suppress(OSError):  # a process still in it: left behind
            g.rmdir()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cgroups are Linux's")
def test_a_process_in_a_real_cgroup_sees_its_quota_and_its_fellows_cpu(tmp_path) -> None:
    """A process started inside a cgroup limited to half a CPU (as ``docker run --cpus
    0.5`` would) sizes its team to one CPU, half of it withheld, and a busy loop in the
    same group counts as another process's use of the half it gets, read from the group's
    counter, and runs the quota out."""
    groups = _cpu_group(50000)
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, subprocess, sys, time\n"
        "from backend.engine.pool import cpu_domain, usable_cpus\n"
        "dom = cpu_domain()\n"
        "loop = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "time.sleep(0.3)\n"
        "t0, (busy0, own0, p0, n0, _) = time.perf_counter(), dom.sample()\n"
        "time.sleep(1.0)\n"
        "t1, (busy1, own1, p1, n1, _) = time.perf_counter(), dom.sample()\n"
        "loop.kill()\n"
        "loop.wait()\n"
        "others = ((busy1 - busy0) - (own1 - own0)) / (t1 - t0)\n"
        "print(json.dumps([usable_cpus(), dom.cpus, dom.withheld, str(dom.usage), others,\n"
        "                  (n1 - n0) / max(1, p1 - p0)]))\n"
    )
    enter = "".join(f"echo $$ > {g}/cgroup.procs; " for g in groups)
    try:
        out = subprocess.run(
            ["sh", "-c", f'{enter}exec "$0" "$1"', sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        assert out.returncode == 0, out.stderr
        usable, cpus, withheld, usage, others, throttled = json.loads(out.stdout)
    finally:
        _remove(groups)
    assert (usable, cpus, withheld) == (1, 1, 0.5)
    assert usage.startswith(str(groups[-1]))
    # The quota lets the loop take at most half a CPU, and runs out in most periods;
    # the probe sleeps.
    assert 0.3 <= others <= 0.6
    assert throttled >= 0.5
