"""What the process and the engine hold in memory, for the status bar, /v1/stats and
``bevy bench`` (the engine's own parts are counted by ``Engine.memory``)."""

from __future__ import annotations

import os
import resource
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """The process's resident set now (Linux); elsewhere its peak so far, which is what
    the platform reports without extra packages."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
