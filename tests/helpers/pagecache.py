"""Page-cache helpers for the store and link tests: is a file's page resident (mincore)?"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from backend.models.weights import ExpertRef


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (longest matching mount point)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fstype = line.split()[1:3]
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_pages(path: Path) -> set[int]:
    """Indices of ``path``'s pages that are in the page cache (mincore on a shared map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return {i for i, v in enumerate(vec) if v & 1}


def expert_pages(experts: list[list[ExpertRef]]) -> set[int]:
    page = mmap.PAGESIZE
    return {
        i
        for layer in experts
        for ref in layer
        for p in ref.parts
        for i in range(p.offset // page, (p.offset + p.nbytes - 1) // page + 1)
    }
