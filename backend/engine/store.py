"""The expert store: where routed experts live while they are not in the device cache.

A *slot* is one row of the expert cache. It holds an expert's stored bytes exactly as
they sit in the model file (quantized, not dequantized), so a fetch is a plain byte
copy and the cache holds 4-8x more experts than it would dequantized. ``layout(ref)``
says where gate, up and down start inside the slot; ``dequantize_slot`` decodes them.

Two tiers share one interface:

* ``SSDStore`` ("ssd") reads each part straight from the model file with O_DIRECT. The
  paper's point is that the link is the bottleneck, so every fetch must really cross it:
  through the page cache a re-fetched expert would come back from RAM and benchmarks
  would measure memory, not the SSD; and a multi-GB model would also evict everything
  else the desktop has cached. O_DIRECT needs the buffer, offset and length aligned, so
  each part's enclosing aligned range is read directly into the slot (no bounce copy):
  ``[pad | gate-range | pad | up-range | pad | down-range]``.
* ``HostStore`` ("host") reads every expert into one (pinned) host tensor at start-up;
  a fetch is a host-to-device copy. This models "experts in RAM, cache on the GPU".

``read_into`` releases the GIL while bytes move (``os.preadv`` / ``Tensor.copy_``), so the
fetcher thread overlaps with the compute thread.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from backend.formats.tensors import TensorRef
from backend.models.weights import ExpertRef, Layout, dequantize_slot, packed_layout

__all__ = [
    "ALIGN",
    "TIERS",
    "ExpertStore",
    "HostStore",
    "SSDStore",
    "dequantize_slot",
    "open_store",
]

# O_DIRECT wants buffer, offset and length aligned to the device's logical block size;
# 4096 covers every common SSD and filesystem (and is the page size).
ALIGN = 4096
TIERS = ("ssd", "host")


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _aligned_range(part: TensorRef) -> tuple[int, int]:
    """(start, length) of the smallest ALIGN-aligned file range enclosing ``part``."""
    start = part.offset - part.offset % ALIGN
    return start, _round_up(part.offset + part.nbytes) - start


HUGE_PAGE = 2 << 20


def _huge_page_buffer(size: int) -> torch.Tensor | None:
    """``size`` bytes of private anonymous memory, 2 MiB-aligned, that the kernel may back
    with transparent huge pages (Linux ``madvise``); None where that is not offered.

    With 4 KiB pages each O_DIRECT read of an expert pins hundreds of pages, and the link
    thread's kernel time for that is taken from the compute running beside it; a huge
    page pins a part's bytes at once. Measured: ``docs/performance.md``."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or size < HUGE_PAGE:
        return None
    try:
        mem = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mem.madvise(advice)
    except (OSError, ValueError, AttributeError):
        return None
    raw = torch.frombuffer(mem, dtype=torch.uint8)  # keeps ``mem`` mapped while in use
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + size]


def _pinnable(pin_memory: bool) -> bool:
    # Pinning needs a CUDA context; on CPU-only machines an unpinned tensor behaves the same.
    return pin_memory and torch.cuda.is_available()


class ExpertStore(ABC):
    """Routed experts that are not on the device; ``read_into`` copies one into a slot."""

    tier: str
    slot_bytes: int  # a multiple of ALIGN, enough for any expert's layout

    @abstractmethod
    def layout(self, ref: ExpertRef) -> Layout:
        """Byte offsets of gate, up and down inside a slot filled by ``read_into(ref, ...)``."""

    @abstractmethod
    def read_into(self, ref: ExpertRef, slot: torch.Tensor) -> int:
        """Fill ``slot`` (uint8, >= slot_bytes) with ``ref``; return bytes read from the medium."""

    @abstractmethod
    def close(self) -> None:
        """Release files and memory; the store is unusable afterwards."""

    def alloc_slots(self, n: int, pin_memory: bool = False) -> torch.Tensor:
        """A [n, slot_bytes] uint8 CPU tensor whose rows start ALIGN-aligned (O_DIRECT-ready),
        in huge pages where the system offers them (unpinned only)."""
        size = n * self.slot_bytes
        if not _pinnable(pin_memory):
            huge = _huge_page_buffer(size)
            if huge is not None:
                return huge.view(n, self.slot_bytes)
        raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=_pinnable(pin_memory))
        skip = -raw.data_ptr() % ALIGN
        # The view keeps the over-allocated storage alive.
        return raw[skip : skip + size].view(n, self.slot_bytes)

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flat_slot(store: ExpertStore, slot: torch.Tensor) -> torch.Tensor:
    if slot.dtype != torch.uint8 or not slot.is_contiguous():
        raise ValueError(f"a slot must be a contiguous uint8 tensor, got {slot.dtype}")
    if slot.numel() < store.slot_bytes:
        raise ValueError(f"slot has {slot.numel()} bytes; this store needs {store.slot_bytes}")
    return slot.reshape(-1)


def _open_direct(path: Path) -> tuple[int, bool]:
    """An fd on ``path`` that bypasses the page cache, and whether bypassing worked."""
    if not hasattr(os, "O_DIRECT"):
        fd = os.open(path, os.O_RDONLY)
        if sys.platform == "darwin":
            import fcntl

            # macOS has no O_DIRECT; F_NOCACHE is its equivalent (and needs no alignment).
            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
            return fd, True
        return fd, False
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError as exc:
        # Some filesystems (older tmpfs, some FUSE) refuse O_DIRECT at open time.
        if exc.errno != errno.EINVAL:
            raise
    fd = os.open(path, os.O_RDONLY)
    # Readahead would pull neighbouring bytes into the cache that FADV_DONTNEED never drops.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd, False


class SSDStore(ExpertStore):
    """Experts read from the model file(s) on every fetch, bypassing the page cache."""

    tier = "ssd"

    def __init__(self, experts: list[list[ExpertRef]]) -> None:
        paths = sorted({p.path for layer in experts for e in layer for p in e.parts})
        self._fds: dict[Path, int] = {}
        self._sizes: dict[Path, int] = {}
        self._direct: dict[Path, bool] = {}
        try:
            for path in paths:
                fd, direct = _open_direct(path)
                self._fds[path] = fd
                self._direct[path] = direct
                self._sizes[path] = os.fstat(fd).st_size
        except BaseException:
            self.close()
            raise
        # False if any file fell back to buffered reads (+ FADV_DONTNEED after each read).
        self.direct = all(self._direct.values())
        # Each expert's reads (fd, position in the slot, length, file start) and layout,
        # worked out on its first fetch: the link asks for them on every fetch.
        self._plans: dict[tuple[int, int], tuple[tuple, Layout]] = {}
        self.slot_bytes = max(
            (sum(_aligned_range(p)[1] for p in e.parts) for layer in experts for e in layer),
            default=0,
        )

    def layout(self, ref: ExpertRef) -> Layout:
        return self._plan(ref)[1]

    def _plan(self, ref: ExpertRef) -> tuple[tuple, Layout]:
        plan = self._plans.get((ref.layer, ref.expert))
        if plan is None:
            ranges = self._ranges(ref)
            gate, up, down = (pos + part.offset - start for part, start, _, pos in ranges)
            reads = tuple((self._fds[p.path], pos, n, start) for p, start, n, pos in ranges)
            plan = self._plans[(ref.layer, ref.expert)] = (reads, (gate, up, down))
        return plan

    def _ranges(self, ref: ExpertRef) -> list[tuple[TensorRef, int, int, int]]:
        """(part, file start, length, position in the slot) of each aligned read."""
        out = []
        pos = 0
        for part in ref.parts:
            start, length = _aligned_range(part)
            out.append((part, start, length, pos))
            pos += length
        return out

    def _check_slot(self, slot: torch.Tensor) -> torch.Tensor:
        flat = _flat_slot(self, slot)
        if flat.device.type != "cpu":
            raise ValueError("SSDStore reads into CPU (pinned staging) slots only")
        if self.direct and flat.data_ptr() % ALIGN:
            raise ValueError(f"O_DIRECT needs a {ALIGN}-aligned slot; use alloc_slots()")
        return flat

    def read_into(self, ref: ExpertRef, slot: torch.Tensor) -> int:
        view = memoryview(self._check_slot(slot).numpy())
        return sum(
            self._read(part, start, view[pos : pos + length])
            for part, start, length, pos in self._ranges(ref)
        )

    def direct_reads(self, ref: ExpertRef, slot: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """(fd, address, length, file offset) of the reads that fill ``slot`` with ``ref``,
        for a caller that queues them itself (``backend.engine.aio``); then call ``finish_reads``.
        The slot must stay alive until they complete."""
        return self.reads_at(ref, self.slot_address(slot))

    def slot_address(self, slot: torch.Tensor) -> int:
        """The address of ``slot`` for ``reads_at``, once it is checked to take reads."""
        return self._check_slot(slot).data_ptr()

    def reads_at(self, ref: ExpertRef, address: int) -> list[tuple[int, int, int, int]]:
        """``direct_reads`` into the slot at ``address`` (from ``slot_address``)."""
        return [(fd, address + pos, n, start) for fd, pos, n, start in self._plan(ref)[0]]

    def finish_reads(self, ref: ExpertRef, slot: torch.Tensor, results: list[int]) -> int:
        """Check queued reads' results (bytes read, or -errno): a short read is completed
        (or zero-filled at the end of the file) the way ``read_into`` does it, the only
        case that touches ``slot``."""
        reads = self._plan(ref)[0]
        if all(got == r[2] for got, r in zip(results, reads, strict=True)):
            return sum(results)  # the usual case: every read whole
        total = 0
        for (part, start, length, pos), got in zip(self._ranges(ref), results, strict=True):
            if got < 0:
                raise OSError(-got, f"reading {part.path} at {start}: {os.strerror(-got)}")
            if got < length:  # rare (end of file): the usual whole read needs no view
                if self._direct[part.path] and start + got < self._sizes[part.path]:
                    got -= got % ALIGN  # O_DIRECT resumes at an aligned offset only
                # Resume where the kernel stopped (end of file: zero-fill), with the checks.
                view = memoryview(self._check_slot(slot).numpy())
                got = self._read(part, start, view[pos : pos + length], got)
            total += got
        return total

    def _read(self, part: TensorRef, start: int, into: memoryview, got: int = 0) -> int:
        """Fill ``into`` with the file's bytes from ``start`` (the first ``got`` are already
        there); past the end of the file it is zero-filled."""
        fd = self._fds[part.path]
        size = self._sizes[part.path]
        length = len(into)
        while got < length and start + got < size:
            # preadv fills the slot in place and releases the GIL during the syscall.
            n = os.preadv(fd, [into[got:]], start + got)
            if n == 0:
                break
            # At end of file an O_DIRECT read comes back short and unaligned; it stops there.
            got += n
        if start + got < part.offset + part.nbytes:
            raise OSError(errno.EIO, f"short read of {part.path} at {part.offset}")
        if got < length:
            into[got:] = bytes(length - got)
        if not self._direct[part.path]:
            # No O_DIRECT here: at least do not let expert bytes pile up in the page cache.
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        return got

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


class HostStore(ExpertStore):
    """Every expert read once into one host tensor (pinned where CUDA exists), back to back."""

    tier = "host"

    def __init__(self, experts: list[list[ExpertRef]], pin_memory: bool = False) -> None:
        refs = [e for layer in experts for e in layer]
        self._start: dict[tuple[int, int], int] = {}
        pos = 0
        for ref in refs:
            self._start[(ref.layer, ref.expert)] = pos
            pos += ref.nbytes
        self.slot_bytes = _round_up(max((r.nbytes for r in refs), default=0))
        self._data = torch.empty(pos, dtype=torch.uint8, pin_memory=_pinnable(pin_memory))
        view = memoryview(self._data.numpy())
        # (file offset, destination) per part, read per file in offset order so the
        # disk sees one forward sweep and readahead works.
        jobs: dict[Path, list[tuple[int, int, int]]] = {}
        for ref in refs:
            dst = self._start[(ref.layer, ref.expert)]
            for part in ref.parts:
                jobs.setdefault(part.path, []).append((part.offset, part.nbytes, dst))
                dst += part.nbytes
        for path, parts in jobs.items():
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset, nbytes, dst in sorted(parts):
                    got = 0
                    while got < nbytes:
                        n = os.preadv(fd, [view[dst + got : dst + nbytes]], offset + got)
                        if n == 0:
                            raise OSError(errno.EIO, f"{path} ends before byte {offset + nbytes}")
                        got += n
            finally:
                os.close(fd)

    def layout(self, ref: ExpertRef) -> Layout:
        return packed_layout(ref)

    def raw(self, ref: ExpertRef) -> torch.Tensor:
        """The expert's stored bytes (a view, no copy): a fetcher may copy it asynchronously."""
        start = self._start[(ref.layer, ref.expert)]
        return self._data[start : start + ref.nbytes]

    def read_into(self, ref: ExpertRef, slot: torch.Tensor) -> int:
        """Copy the expert into ``slot``; any device works (a device slot is one H2D copy)."""
        flat = _flat_slot(self, slot)
        src = self.raw(ref)
        flat[: ref.nbytes].copy_(src)  # torch drops the GIL inside the copy
        return ref.nbytes

    def close(self) -> None:
        self._data = torch.empty(0, dtype=torch.uint8)
        self._start.clear()


def open_store(tier: str, experts: list[list[ExpertRef]], pin_memory: bool = False) -> ExpertStore:
    """The store for ``tier`` ("ssd" or "host"); ``pin_memory`` applies to the host tier."""
    if tier == "ssd":
        return SSDStore(experts)
    if tier == "host":
        return HostStore(experts, pin_memory)
    raise ValueError(f"unknown expert store tier {tier!r} (expected one of {', '.join(TIERS)})")
