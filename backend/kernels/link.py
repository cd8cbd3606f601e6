"""The link's read loop in C (``link.c``), for the engine's ``Fetcher``.

The loop is a thread of its own that keeps the next experts' reads queued in the kernel
(Linux native AIO) and queues the next fetch, by priority, the moment one lands: the SSD
never waits for the interpreter. In Python that step needed the GIL, which the engine's
Python holds for up to a switch interval at a time: on two cores, with the engine busy,
the link then read each expert markedly slower than the SSD could (docs/performance.md,
"The link's loop in C"). The engine's thread takes the landed fetches (``Link.wait``)
between its steps, and waits there when it has nothing to run, for what needs the
interpreter: the results' checks, telemetry, the cache's bookkeeping.

Built on first use with the system C compiler into the cache directory, like the kernels
(``native.compiled``), on Linux only; ``open_link`` returns None elsewhere, where it cannot
be built, where the kernel refuses an AIO context, or with ``BEVY_NATIVE_LINK=0``, and the
``Fetcher`` runs its Python loop (``backend.engine.aio``) instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from backend.kernels.native import compiled

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
KEY = 4  # a priority's integers at most (link.h's LINK_KEY)
PARTS = 4  # reads per fetch at most (LINK_PARTS)
MAX_DEPTH = 16  # LINK_MAX_DEPTH
_WORDS = 3 + PARTS  # LINK_DONE_WORDS
# Below every integer a priority holds: a shorter priority sorts before a longer one that
# begins with it, as Python's tuples do.
_PAD = -(2**63)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The loop's library, built on first call; None where it cannot be (logged once)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if not sys.platform.startswith("linux"):
            return None
        if os.environ.get("BEVY_NATIVE_LINK", "1") == "0":
            log.info("the link's loop in C turned off by the environment")
            return None
        try:
            lib = compiled(
                "link",
                [HERE / "link.c"],
                [HERE / "link.h"],
                ("-O2", "-shared", "-fPIC", "-pthread"),
                None,
            )
        except OSError as exc:
            log.warning("the link's loop in C unavailable (%s); it runs in Python", exc)
            return None
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.bevy_link_open.argtypes, lib.bevy_link_open.restype = [i32], ptr
        lib.bevy_link_pace.argtypes, lib.bevy_link_pace.restype = [ptr, i64], None
        lib.bevy_link_start.argtypes, lib.bevy_link_start.restype = [ptr], i32
        lib.bevy_link_submit.argtypes = [ptr, ptr, i64, i32, ptr]
        lib.bevy_link_submit.restype = i32
        lib.bevy_link_wait.argtypes, lib.bevy_link_wait.restype = [ptr, ptr, i32, i64], i32
        lib.bevy_link_wake.argtypes, lib.bevy_link_wake.restype = [ptr], None
        lib.bevy_link_queued.argtypes, lib.bevy_link_queued.restype = [ptr], i32
        lib.bevy_link_batched.argtypes, lib.bevy_link_batched.restype = [ptr], i32
        lib.bevy_link_cpu_ns.argtypes, lib.bevy_link_cpu_ns.restype = [ptr], i64
        lib.bevy_link_close.argtypes, lib.bevy_link_close.restype = [ptr], None
        lib.bevy_link_free.argtypes, lib.bevy_link_free.restype = [ptr], None
        _lib = lib
        return lib


class Link:
    """One loop over an AIO context for ``depth`` fetches' reads. ``submit`` and ``wake``
    from any thread; ``wait`` from one thread at a time, which takes the landed fetches;
    ``close``, then ``free`` once no ``wait`` can still be called."""

    def __init__(self, lib: ctypes.CDLL, handle: int, depth: int) -> None:
        self._lib, self._h, self.depth = lib, handle, depth
        self._out = (ctypes.c_int64 * (_WORDS * 4 * depth))()
        # Held by every call but ``wait``: none reaches the loop once it is freed.
        self._guard = threading.Lock()
        self._batched = True

    def pace(self, bytes_per_s: int) -> None:
        """Before ``start``: land each fetch no sooner than a link of ``bytes_per_s`` would
        carry it, one fetch after another, without credit for time it sat idle (0: as the
        reads land). The reads are the same; their landings wait for the link's pace."""
        with self._guard:
            if self._h:
                self._lib.bevy_link_pace(self._h, max(0, int(bytes_per_s)))

    def start(self) -> None:
        rc = self._lib.bevy_link_start(self._h)
        if rc:
            raise OSError(-rc, f"starting the link's thread: {os.strerror(-rc)}")

    def submit(
        self, priority: Sequence[int], tag: int, reads: Sequence[tuple[int, int, int, int]]
    ) -> bool:
        """Queue a fetch: ``reads`` (fd, address, length, offset), at most ``PARTS``; the
        smallest ``priority`` (integers, compared as tuples) starts first, then the first
        submitted. False once the link is closing."""
        if len(priority) > KEY:
            raise ValueError(f"a priority of {len(priority)} integers (at most {KEY})")
        if not 1 <= len(reads) <= PARTS:
            raise ValueError(f"{len(reads)} reads for one fetch (1 to {PARTS})")
        key = (ctypes.c_int64 * KEY)(*priority, *[_PAD] * (KEY - len(priority)))
        flat = (ctypes.c_int64 * (4 * len(reads)))(*(v for r in reads for v in r))
        with self._guard:
            return (
                bool(self._h)
                and self._lib.bevy_link_submit(self._h, key, tag, len(reads), flat) == 0
            )

    def wait(
        self, timeout: float | None = None
    ) -> list[tuple[int, float, float, list[int]]] | None:
        """Wait (GIL released) until fetches land, ``wake`` is called or ``timeout``
        seconds pass (None: no limit; 0: take what has landed); then the landed ones, none
        if woken or timed out: each one's tag, when its reads were queued and when the
        last landed (``time.perf_counter`` seconds: the same clock) and each read's bytes
        or -errno. None once the link is closed and every landed fetch was taken."""
        if not self._h:  # freed (the caller keeps ``wait`` and ``free`` apart)
            return None
        out = self._out
        ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        n = self._lib.bevy_link_wait(self._h, out, len(out) // _WORDS, ns)
        if n < 0:
            return None
        landed = []
        for i in range(n):
            w = out[i * _WORDS : (i + 1) * _WORDS]
            landed.append((w[0], w[1] / 1e9, w[2] / 1e9, w[3:]))
        return landed

    def wake(self) -> None:
        """End the ``wait`` under way now (it returns what has landed, maybe nothing), or
        the next one at once."""
        with self._guard:
            if self._h:
                self._lib.bevy_link_wake(self._h)

    @property
    def queued(self) -> int:
        with self._guard:
            return self._lib.bevy_link_queued(self._h) if self._h else 0

    @property
    def batched(self) -> bool:
        """Whether the reads went through AIO (not through pread after a failure)."""
        with self._guard:
            return bool(self._lib.bevy_link_batched(self._h)) if self._h else self._batched

    def cpu_s(self) -> float | None:
        """The loop thread's CPU seconds so far; None before it starts or once it ended."""
        with self._guard:
            ns = self._lib.bevy_link_cpu_ns(self._h) if self._h else -1
        return None if ns < 0 else ns / 1e9

    def close(self) -> None:
        """Take no more fetches; the queued reads land (``wait`` reports them) and the
        thread ends. Fetches submitted and never started are not reported: their slots
        were never written."""
        with self._guard:
            if self._h:
                self._lib.bevy_link_close(self._h)

    def free(self) -> None:
        """After ``close``, once ``wait`` is no longer called: the AIO context and memory."""
        with self._guard:
            h, self._h = self._h, None
            if h:
                self._batched = bool(self._lib.bevy_link_batched(h))
                self._lib.bevy_link_free(h)


def open_link(depth: int) -> Link | None:
    """A loop for ``depth`` fetches in flight (not yet started), or None where there is none
    (see the module's docstring)."""
    lib = library()
    if lib is None:
        return None
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth {depth} (1 to {MAX_DEPTH})")
    handle = lib.bevy_link_open(depth)
    if not handle:
        log.info("the link's loop in C unavailable: the kernel refused an AIO context")
        return None
    return Link(lib, handle, depth)
