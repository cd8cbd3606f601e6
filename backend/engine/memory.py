"""What the process and the engine hold in memory, for the status bar, /v1/stats and
``bevy bench`` (the engine's own parts are counted by ``Engine.memory``)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import resource
import sys

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def rss_bytes() -> int:
    """The process's resident set now (Linux); elsewhere its peak so far, which is what
    the platform reports without extra packages."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def release_pages(t: torch.Tensor) -> bool:
    """Give the whole pages of CPU tensor ``t``'s bytes back to the system (Linux: they
    read as zeros if touched again); the pages it shares with a neighbour stay. False
    where the platform cannot do it now."""
    if sys.platform != "linux" or t.device.type != "cpu":
        return False
    start = -(-t.data_ptr() // _PAGE) * _PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _PAGE * _PAGE
    if end <= start:
        return True
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _DONTNEED) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def trim_heap() -> bool:
    """Return the C heap's free memory to the system (glibc ``malloc_trim``): freed blocks
    below its mmap threshold (a long prompt's activations) otherwise stay resident. False
    where the C library has no such call."""
    try:
        trim = _libc().malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc; no C library to open
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
