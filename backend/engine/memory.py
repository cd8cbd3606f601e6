"""What the process and the engine hold in memory, for the status bar, /v1/stats and
``bevy bench`` (the engine's own parts are counted by ``Engine.memory``)."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# glibc's mallopt parameter, and the size from which it maps each allocation on its own
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 << 10


def give_back_large_frees() -> bool:
    """Have glibc map every allocation of 128 KiB or more on its own, so that freeing it
    returns its pages at once. By default glibc raises that threshold to the largest block
    freed so far (up to 32 MiB), after which a prompt's megabyte-sized scratch tensors and
    grown KV buffers come from the heap and stay resident when freed, as the next, larger,
    ones cannot reuse them (measured: ``docs/performance.md``). Process-wide; True if set
    (on glibc, unless ``MALLOC_MMAP_THRESHOLD_`` chose otherwise)."""
    if platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    """The process's resident set now (Linux); elsewhere its peak so far, which is what
    the platform reports without extra packages."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
