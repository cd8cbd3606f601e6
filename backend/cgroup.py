"""This process's cgroup: the limits a container (``docker run --memory --cpus``) or a
systemd unit sets, which psutil and ``os.cpu_count`` do not see.

Both kinds of hierarchy are read: v2's single one (its line in ``/proc/self/cgroup`` names
no controllers) and v1's, one per controller, under ``/sys/fs/cgroup/<controller>``. Only
the process's own group is read, not its ancestors': a container's limits are set on its
own group.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

PROC = "/proc/self/cgroup"
MOUNT = "/sys/fs/cgroup"


def group_dirs(controller: str, proc: str = PROC, mount: str = MOUNT) -> Iterator[tuple[Path, int]]:
    """Directories that may hold this process's group's files for ``controller``, each with
    its cgroup version, in ``proc``'s order: in each hierarchy that has the controller, the
    group's own directory, then the mount's root (a container often has its own group
    mounted as the root while ``proc`` names the path the host sees)."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, version = Path(mount), 2
        elif controller in controllers.split(","):
            root, version = Path(mount) / controller, 1
        else:
            continue
        for base in dict.fromkeys((root / path.lstrip("/"), root)):
            if base.is_dir():
                yield base, version


def memory_limit(proc: str = PROC, mount: str = MOUNT) -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup; None without a limit."""
    for base, version in group_dirs("memory", proc, mount):
        if version == 2:
            names = ("memory.max", "memory.current")
        else:
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        try:
            limit, used = ((base / n).read_text().strip() for n in names)
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max", or v1's huge "no limit"
            return int(limit), int(used)
    return None


def cpu_quota(proc: str = PROC, mount: str = MOUNT) -> float | None:
    """The CPUs' worth of time the group may use (150 ms in each 100 ms: 1.5); None
    without a quota."""
    for base, version in group_dirs("cpu", proc, mount):
        try:
            if version == 2:
                quota, period = (base / "cpu.max").read_text().split()
            else:
                quota, period = (
                    (base / n).read_text().strip()
                    for n in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
                )
        except (OSError, ValueError):
            continue
        if quota.isdigit() and period.isdigit() and int(period) > 0:  # "max" (v2), -1 (v1)
            return int(quota) / int(period)
    return None


def cpu_usage_file(proc: str = PROC, mount: str = MOUNT) -> Path | None:
    """The file that counts the CPU time of every process in the group (v2's ``cpu.stat``,
    v1's ``cpuacct.usage``), for ``cpu_usage_s``."""
    for base, version in group_dirs("cpuacct", proc, mount):
        f = base / ("cpu.stat" if version == 2 else "cpuacct.usage")
        if f.is_file():
            return f
    return None


def cpu_stat_file(proc: str = PROC, mount: str = MOUNT) -> Path | None:
    """The file that counts the group's quota periods and those in which the quota ran out
    (``cpu.stat`` of the cpu controller, v2 or v1), for ``cpu_throttling``."""
    for base, _ in group_dirs("cpu", proc, mount):
        if "nr_throttled" in _stat(base / "cpu.stat"):
            return base / "cpu.stat"
    return None


def _stat(f: Path) -> dict[str, int]:
    try:
        lines = f.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, _, v in (line.partition(" ") for line in lines) if v.isdigit()}


def cpu_usage_s(f: Path) -> float:
    """Seconds of CPU the group's processes have used, from ``cpu_usage_file``'s file."""
    if f.name == "cpu.stat":
        return _stat(f)["usage_usec"] / 1e6
    return int(f.read_text()) / 1e9


def cpu_throttling(f: Path) -> tuple[int, int]:
    """(Quota periods so far, those in which the group was throttled) from
    ``cpu_stat_file``'s file."""
    stat = _stat(f)
    return stat["nr_periods"], stat["nr_throttled"]
