"""The link: one thread that moves experts from the store into cache slots, by priority.

On CPU (and MPS's unified memory) the store reads straight into the slot. From an SSD
store on Linux the link keeps the next few experts' part reads queued in the kernel at
once (native AIO): the SSD sees several reads, and the next expert's reads are queued
before the one that landed is handled. Where the C loop builds (``backend.kernels.link``)
a thread of its own queues them without the GIL, and the landed experts are taken by the
link's Python thread, or by the caller's (``caller_takes``: the engine's, between its
steps); else the link thread does both in Python (``backend.engine.aio``).
On CUDA it reads into pinned staging memory, then copies to the device slot on a
dedicated copy stream, so copies overlap kernels on the compute stream. Every
busy interval is recorded (intervals never overlap: with reads queued together, an
expert's interval starts when the previous one ended).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field

import torch

from backend.engine import aio
from backend.engine.telemetry import Telemetry
from backend.kernels import link as native_link
from backend.models.weights import ExpertRef, dequantize_slot

log = logging.getLogger(__name__)

# Experts whose reads the link queues at once (native AIO). More keeps the SSD busier but
# a fetch that arrives later with a higher priority waits behind more of them.
QUEUED_EXPERTS = 2


@dataclass
class _Flight:
    """An expert whose reads are queued in the kernel."""

    key: tuple[int, int]
    ref: ExpertRef
    slot: int
    prefetch: bool
    start: float
    results: list[int] = field(default_factory=lambda: [0, 0, 0])
    left: int = 3


Done = Callable[[tuple[int, int], tuple[int, int, int] | None, str | None], None]


class Fetcher:
    """``decode``: for slots holding dequantized weights, the dtype to decode into; the
    decoding is then part of the fetch (link time), done on the slot's device."""

    def __init__(
        self,
        store,
        slots: torch.Tensor,
        telemetry: Telemetry,
        on_done: Done,
        decode: torch.dtype | None = None,
        use_aio: bool = True,
        native: bool = True,
        caller_takes: bool = False,
        link_rate: int = 0,
    ) -> None:
        """``use_aio``: queue reads through native AIO where the store reads with O_DIRECT;
        ``native``: with the C loop where it builds (else the Python one); ``caller_takes``:
        with the C loop, no Python thread of the link's: the caller takes the landed
        fetches (``take``; ``on_done`` is then called on its thread); ``link_rate``: bytes a
        second of a paced link (the C loop's ``Link.pace``; 0: the store's own pace)."""
        self.store = store
        self.slots = slots
        self.telemetry = telemetry
        self.on_done = on_done
        self.decode = decode
        self._heap: list[tuple[tuple, int, tuple[int, int], ExpertRef, int, bool]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._cuda = slots.device.type == "cuda"
        if self._cuda or decode is not None:
            self._staging = store.alloc_slots(1, pin_memory=self._cuda)[0]
        if self._cuda:
            self._stream = torch.cuda.Stream(device=slots.device)
        # Each slot as a view, and where queued reads go: taken once, not on every fetch.
        self._rows = slots.unbind(0)
        self._aio = None
        self._native: native_link.Link | None = None
        if use_aio and not self._cuda and decode is None and getattr(store, "direct", False):
            self._addresses = [store.slot_address(row) for row in self._rows]
            self._native = native_link.open_link(QUEUED_EXPERTS) if native else None
            if self._native is None:
                self._aio = aio.open_reads(3 * QUEUED_EXPERTS)
        if link_rate and self._native is None:
            if self._aio is not None:
                self._aio.close()
            raise ValueError(
                "a paced link needs the link's loop in C: Linux native AIO, an O_DIRECT "
                "SSD store, the CPU's stored slots"
            )
        self._flights: dict[int, _Flight] = {}
        # The C loop's fetches not reported yet, by tag: key, ref, slot, prefetch, reads.
        self._submitted: dict[int, tuple[tuple[int, int], ExpertRef, int, bool, int]] = {}
        self._last_end = 0.0
        # Where the caller takes the landed fetches: held while it does, and to end.
        self._taking = threading.Lock()
        self._thread: threading.Thread | None = None
        if self._native is None or not caller_takes:
            self._thread = threading.Thread(target=self._run, name="bevy-link", daemon=True)
            self._thread.start()
        if self._native is not None:
            self._native.pace(link_rate)
            try:
                self._native.start()
            except OSError:
                self.close()
                raise

    def submit(
        self,
        priority: tuple,
        key: tuple[int, int],
        ref: ExpertRef,
        slot: int,
        prefetch: bool = False,
    ) -> None:
        if self._native is not None:
            self._submit_native(priority, key, ref, slot, prefetch)
            return
        with self._cv:
            heapq.heappush(self._heap, (priority, next(self._seq), key, ref, slot, prefetch))
            self._cv.notify()

    def _submit_native(
        self, priority: tuple, key: tuple[int, int], ref: ExpertRef, slot: int, prefetch: bool
    ) -> None:
        tag = next(self._seq)
        try:
            parts = self.store.reads_at(ref, self._addresses[slot])
        except Exception as exc:
            self.on_done(key, None, f"reading expert {key} failed: {exc}")
            return
        # Known before the loop can land it: whoever takes it looks it up by its tag.
        with self._cv:
            self._submitted[tag] = (key, ref, slot, prefetch, len(parts))
        if self._native.submit(priority, tag, parts):
            return
        with self._cv:  # closing: reported here unless ``_abandon`` took it
            taken = self._submitted.pop(tag, None) is None
        if not taken:
            self.on_done(key, None, "engine shutting down")

    @property
    def caller_takes(self) -> bool:
        """Whether the landed fetches wait for the caller's ``take``."""
        return self._thread is None

    def take(self, timeout: float = 0.0) -> int:
        """Where the caller takes the landed fetches: report them (``on_done``, here),
        first waiting up to ``timeout`` seconds for one to land, or until ``wake``. How
        many were reported; 0 elsewhere (the link's thread reports them)."""
        if self._thread is not None:
            return 0
        with self._taking:
            landed = self._native.wait(timeout)
            for fetch in landed or ():
                self._landed(*fetch)
        return len(landed or ())

    def wake(self) -> None:
        """End a ``take`` waiting now, or the next one at once (any thread)."""
        if self._thread is None:
            self._native.wake()

    @property
    def queued(self) -> int:
        if self._native is not None:
            return self._native.queued
        with self._cv:
            return len(self._heap)

    @property
    def batched(self) -> bool:
        """Whether reads are queued in the kernel several at a time (native AIO) and
        never fell back to one part at a time."""
        if self._native is not None:
            return self._native.batched
        return self._aio is not None

    def cpu_s(self) -> float | None:
        """CPU seconds the link thread has used so far, user and system (reads queued,
        pages faulted in, bookkeeping); None once it has ended or where the platform
        does not say (``time.pthread_getcpuclockid``). Where the caller takes the landed
        fetches, the C loop's alone: the rest is the caller's."""
        if self._thread is None:
            return self._native.cpu_s()
        if not self._thread.is_alive():  # an ended thread's id names no clock
            return None
        try:
            own = time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError):  # no such call here, or no clock for it
            return None
        if self._native is None:
            return own
        loop = self._native.cpu_s()  # the C loop's thread: reads queued and waited for
        return None if loop is None else own + loop

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._native is not None:
            self._native.close()  # the queued reads land, for the link's thread to take
        if self._thread is None:  # or for the caller: taken here, the rest abandoned
            while self.take(0):
                pass
            with self._taking:
                self._abandon("engine shutting down")
                self._native.free()
            return
        self._thread.join(timeout=10)
        if self._native is not None and not self._thread.is_alive():
            self._native.free()

    def _run(self) -> None:
        # Decoding on the link runs beside compute: one intra-op thread here leaves the
        # other cores to compute instead of oversubscribing them (the setting is per thread).
        torch.set_num_threads(1)
        reason = "engine shutting down"
        try:
            if self._native is not None:
                self._take_landed()
            else:
                self._loop()
        except BaseException as exc:
            log.exception("the link thread stopped")
            reason = f"the link stopped: {exc}"
            raise
        finally:
            self._abandon(reason)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._flights and not self._closed:
                    self._cv.wait()
                if self._closed and not self._flights:
                    return
                batch = self._next_batch()
            if self._aio is None:
                if batch:
                    self._fetch_now(*batch[0][2:])
                continue
            if batch:
                self._queue(batch)
            if self._flights and self._aio is not None:
                self._land()

    def _take_landed(self) -> None:
        """The C loop's landed fetches, each reported as ``_land`` reports its own."""
        while (landed := self._native.wait()) is not None:
            for fetch in landed:
                self._landed(*fetch)

    def _landed(self, tag: int, start: float, end: float, results: list[int]) -> None:
        with self._cv:
            key, ref, slot, prefetch, n = self._submitted.pop(tag)
        try:
            self.store.finish_reads(ref, self._rows[slot], results[:n])
            layout = self.store.layout(ref)
        except Exception as exc:
            self.on_done(key, None, f"reading expert {key} failed: {exc}")
            return
        self.telemetry.record_link(max(start, self._last_end), end, key, ref.nbytes, prefetch)
        self._last_end = end
        self.on_done(key, layout, None)

    def _abandon(self, reason: str) -> None:
        """Report every fetch not done as failed, so that its slot is freed and no job
        waits for it; queued reads are stopped first (their slots are then safe to reuse)."""
        if self._aio is not None:  # kept (closed): ``batched`` still tells how it read
            with suppress(OSError):
                self._aio.close()
        if self._native is not None:
            # Closed, its thread ended: no read of it can land any more.
            self._native.close()
        with self._cv:
            self._closed = True
            pending, self._heap = self._heap, []
            submitted, self._submitted = self._submitted, {}
        flights, self._flights = self._flights, {}
        for f in flights.values():
            self.on_done(f.key, None, reason)
        for item in pending:
            self.on_done(item[2], None, reason)
        for key, *_ in submitted.values():
            self.on_done(key, None, reason)

    def _next_batch(self) -> list:
        """The fetches to start now, highest priority first (call holding ``_cv``)."""
        batch = []
        limit = QUEUED_EXPERTS if self._aio is not None else 1
        while self._heap and not self._closed and len(self._flights) + len(batch) < limit:
            batch.append(heapq.heappop(self._heap))
        return batch

    def _queue(self, batch: list) -> None:
        """Queue the batch's reads in the kernel in one call."""
        reads = []
        now = time.perf_counter()
        for _, seq, key, ref, slot, prefetch in batch:
            try:
                parts = self.store.reads_at(ref, self._addresses[slot])
            except Exception as exc:
                self.on_done(key, None, f"reading expert {key} failed: {exc}")
                continue
            self._flights[seq] = _Flight(key, ref, slot, prefetch, now)
            reads.extend(aio.Read(seq * 4 + i, *part) for i, part in enumerate(parts))
        if not reads:
            return
        try:
            self._aio.submit(reads)
        except Exception as exc:
            self._fall_back(exc)

    def _land(self) -> None:
        """Wait for the oldest queued expert's reads (other experts' reads that land
        meanwhile count too); report every expert whose reads have all landed."""
        try:
            events = self._aio.wait(next(iter(self._flights.values())).left)
        except Exception as exc:
            self._fall_back(exc)
            return
        for tag, result in events:
            flight = self._flights[tag // 4]
            flight.results[tag % 4] = result
            flight.left -= 1
        landed = [
            self._flights.pop(seq) for seq in [s for s, f in self._flights.items() if not f.left]
        ]
        # The next reads go to the SSD before the landed experts are handled: handling
        # them (checks, telemetry, waking the engine) is Python, a fifth of a millisecond
        # and more while the engine's Python holds the GIL, and the SSD would meanwhile
        # work on one expert's reads instead of two (measured: docs/performance.md).
        with self._cv:
            batch = self._next_batch()
        if batch:
            self._queue(batch)
        for f in landed:
            try:
                self.store.finish_reads(f.ref, self._rows[f.slot], f.results)
                layout = self.store.layout(f.ref)
            except Exception as exc:
                self.on_done(f.key, None, f"reading expert {f.key} failed: {exc}")
                continue
            end = time.perf_counter()
            self.telemetry.record_link(
                max(f.start, self._last_end), end, f.key, f.ref.nbytes, f.prefetch
            )
            self._last_end = end
            self.on_done(f.key, layout, None)

    def _fall_back(self, exc: Exception) -> None:
        """Native AIO failed: stop the queued reads, redo them with preadv, stop using AIO."""
        log.warning("queued expert reads failed (%s); reading one part at a time", exc)
        reads, self._aio = self._aio, None
        # close() destroys the context even if draining fails, and io_destroy returns only
        # once no read can still land: the slots are safe to read into again.
        with suppress(OSError):
            reads.close()
        flights, self._flights = self._flights, {}
        for f in flights.values():
            self._fetch_now(f.key, f.ref, f.slot, f.prefetch)

    def _fetch_now(self, key: tuple[int, int], ref: ExpertRef, slot: int, prefetch: bool) -> None:
        start = time.perf_counter()
        try:
            layout = self._fetch(ref, slot)
        except Exception as exc:  # an I/O error fails this fetch, not the link
            self.on_done(key, None, f"reading expert {key} failed: {exc}")
            return
        end = time.perf_counter()
        self.telemetry.record_link(max(start, self._last_end), end, key, ref.nbytes, prefetch)
        self._last_end = end
        self.on_done(key, layout, None)

    def _fetch(self, ref: ExpertRef, slot: int) -> tuple[int, int, int]:
        layout = self.store.layout(ref)
        if self.decode is not None:
            return self._fetch_decoded(ref, slot, layout)
        if not self._cuda:
            self.store.read_into(ref, self._rows[slot])
            return layout
        self.store.read_into(ref, self._staging)
        with torch.cuda.stream(self._stream):
            self.slots[slot].copy_(self._staging, non_blocking=True)
        # The staging buffer is reused next fetch and the slot must be complete before
        # compute reads it: wait for this copy (only this thread blocks).
        self._stream.synchronize()
        return layout

    def _fetch_decoded(
        self, ref: ExpertRef, slot: int, layout: tuple[int, int, int]
    ) -> tuple[int, int, int]:
        self.store.read_into(ref, self._staging)
        row = self._rows[slot]
        offsets = []
        start = 0
        with torch.cuda.stream(self._stream) if self._cuda else nullcontext():
            raw = self._staging.to(row.device, non_blocking=True) if self._cuda else self._staging
            for part, weights in zip(
                ref.parts, dequantize_slot(raw, ref, layout, self.decode), strict=True
            ):
                n = weights.numel()
                row[start : start + n].view(part.shape).copy_(weights)
                offsets.append(start)
                start += n
        if self._cuda:
            self._stream.synchronize()
        return offsets[0], offsets[1], offsets[2]
