"""The link: one thread that moves experts from the store into cache slots, by priority.

On CPU (and MPS's unified memory) the store reads straight into the slot. On CUDA it
reads into pinned staging memory, then copies to the device slot on a dedicated copy
stream, so copies overlap kernels on the compute stream. Every busy interval is recorded.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from backend.models.weights import ExpertRef, dequantize_slot
from backend.telemetry import Telemetry

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
    ) -> None:
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
        self._thread = threading.Thread(target=self._run, name="bevy-link", daemon=True)
        self._thread.start()

    def submit(
        self,
        priority: tuple,
        key: tuple[int, int],
        ref: ExpertRef,
        slot: int,
        prefetch: bool = False,
    ) -> None:
        with self._cv:
            heapq.heappush(self._heap, (priority, next(self._seq), key, ref, slot, prefetch))
            self._cv.notify()

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._heap)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # Decoding on the link runs beside compute: one intra-op thread here leaves the
        # other cores to compute instead of oversubscribing them (the setting is per thread).
        torch.set_num_threads(1)
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed:
                    # Unstarted fetches are reported as failed so their slots are freed.
                    pending, self._heap = self._heap, []
                    for item in pending:
                        self.on_done(item[2], None, "engine shutting down")
                    return
                _, _, key, ref, slot, prefetch = heapq.heappop(self._heap)
            start = time.perf_counter()
            try:
                layout = self._fetch(ref, slot)
            except Exception as exc:  # an I/O error fails this fetch, not the link
                self.on_done(key, None, f"reading expert {key} failed: {exc}")
                continue
            self.telemetry.record_link(start, time.perf_counter(), key, ref.nbytes, prefetch)
            self.on_done(key, layout, None)

    def _fetch(self, ref: ExpertRef, slot: int) -> tuple[int, int, int]:
        layout = self.store.layout(ref)
        if self.decode is not None:
            return self._fetch_decoded(ref, slot, layout)
        if not self._cuda:
            self.store.read_into(ref, self.slots[slot])
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
        row = self.slots[slot]
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
