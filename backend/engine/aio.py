"""Linux native AIO (``io_submit``/``io_getevents``) for the link's O_DIRECT reads, via ctypes.

An expert is three reads (gate, up, down) at three places in the file. One ``preadv`` at a
time gives the SSD a queue depth of 1 and wakes the link thread (which then needs a core
and the GIL) after every part. Here the link hands the kernel every part of the next few
experts in one system call and sleeps in one ``io_getevents`` until as many reads as the
oldest expert still needs have landed: the SSD sees several reads at once and the link
thread wakes about once per expert instead of three times (measured: ``docs/performance.md``).

Linux on x86-64 and arm64 only; ``open_reads`` returns None elsewhere, or where the kernel
refuses an AIO context (``fs.aio-max-nr`` exhausted, a sandbox), and callers read with
``preadv`` instead. The ctypes calls release the GIL while they run.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
from typing import NamedTuple

log = logging.getLogger(__name__)

# (io_setup, io_destroy, io_getevents, io_submit) system call numbers.
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0


class _IOCB(ctypes.Structure):
    # struct iocb of <linux/aio_abi.h>, little-endian field order.
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("key", ctypes.c_uint32),
        ("rw_flags", ctypes.c_int32),
        ("lio_opcode", ctypes.c_uint16),
        ("reqprio", ctypes.c_int16),
        ("fildes", ctypes.c_uint32),
        ("buf", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("reserved2", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class Read(NamedTuple):
    """Read ``length`` bytes of ``fd`` at ``offset`` into memory at ``address``; ``tag``
    comes back with the result. (A tuple: the link makes three for every expert.)"""

    tag: int
    fd: int
    address: int
    length: int
    offset: int


class Reads:
    """One AIO context: at most ``depth`` reads in flight. Not thread-safe (the link owns it)."""

    def __init__(self, depth: int, libc: ctypes.CDLL, numbers: tuple[int, int, int, int]) -> None:
        self.depth = depth
        self._libc = libc
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._ctx = ctypes.c_ulong(0)
        if self._call(self._setup, depth, ctypes.byref(self._ctx)) < 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self._iocbs = (_IOCB * depth)()
        self._ptrs = (ctypes.POINTER(_IOCB) * depth)(
            *(ctypes.pointer(self._iocbs[i]) for i in range(depth))
        )
        self._events = (_Event * depth)()
        self.in_flight = 0

    def _call(self, number: int, *args) -> int:
        return self._libc.syscall(number, *args)

    def submit(self, reads: list[Read]) -> None:
        """Queue ``reads``. On OSError some may be queued anyway (``in_flight`` counts them):
        drain with ``wait`` before reusing any buffer. The kernel copies each request."""
        if self.in_flight + len(reads) > self.depth:
            raise ValueError(f"{self.in_flight} + {len(reads)} reads exceed depth {self.depth}")
        for cb, r in zip(self._iocbs, reads, strict=False):
            ctypes.memset(ctypes.addressof(cb), 0, ctypes.sizeof(cb))
            cb.data, cb.lio_opcode, cb.fildes = r.tag, _IOCB_CMD_PREAD, r.fd
            cb.buf, cb.nbytes, cb.offset = r.address, r.length, r.offset
        n = self._call(self._submit, self._ctx, len(reads), self._ptrs)
        if n < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_submit failed: {os.strerror(err)}")
        # Reads that were queued must finish before their buffers are reused.
        self.in_flight += n
        if n < len(reads):
            raise OSError(errno.EAGAIN, f"io_submit queued {n} of {len(reads)} reads")

    def wait(self, at_least: int) -> list[tuple[int, int]]:
        """Block (GIL released) until ``at_least`` reads finish; return (tag, bytes read or
        -errno) for every read that finished."""
        if not self.in_flight:
            raise ValueError("no reads in flight: waiting would block forever")
        at_least = max(1, min(at_least, self.in_flight))
        while True:
            n = self._call(self._getevents, self._ctx, at_least, self.depth, self._events, None)
            if n >= 0:
                break
            if ctypes.get_errno() != errno.EINTR:
                raise OSError(ctypes.get_errno(), "io_getevents failed")
        self.in_flight -= n
        return [(int(self._events[i].data), int(self._events[i].res)) for i in range(n)]

    def close(self) -> None:
        """Wait for reads still in flight (their buffers may be reused next), then destroy
        the context. io_destroy itself blocks until no read can land any more, so even if
        waiting fails, once this returns no buffer is written to again."""
        try:
            while self.in_flight:
                self.wait(self.in_flight)
        finally:
            if self._ctx.value:
                self._call(self._destroy, self._ctx)
                self._ctx = ctypes.c_ulong(0)
            self.in_flight = 0


def open_reads(depth: int) -> Reads | None:
    """An AIO context for ``depth`` reads, or None where native AIO is unavailable."""
    numbers = _SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or numbers is None or sys.byteorder != "little":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return Reads(depth, libc, numbers)
    except (OSError, AttributeError) as exc:
        log.info("native AIO unavailable, reading experts with preadv: %s", exc)
        return None
