"""The link with queued reads (native AIO): exact bytes, no page cache, and fallbacks, in
the C loop (``backend.kernels.link``) and in the Python one (``native=False``)."""

from __future__ import annotations

import errno
import os
import queue
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from backend.engine import aio
from backend.engine.fetcher import QUEUED_EXPERTS, Fetcher
from backend.engine.store import ALIGN, SSDStore, dequantize_slot
from backend.engine.telemetry import Telemetry
from backend.formats.tensors import MappedFiles
from backend.kernels import link
from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import inspect_model, load_model
from tests.helpers.pagecache import evict, expert_pages, resident_pages
from tests.helpers.tiny import make_tiny


def _aio_available() -> bool:
    reads = aio.open_reads(1)
    if reads is None:
        return False
    reads.close()
    return True


needs_aio = pytest.mark.skipif(
    not _aio_available(), reason="native AIO is Linux (x86-64, arm64) only"
)
# Both loops where the C one builds; the Python one alone elsewhere.
LOOPS = pytest.mark.parametrize(
    "native",
    [
        pytest.param(
            True,
            id="c-loop",
            marks=pytest.mark.skipif(link.library() is None, reason="no C loop here"),
        ),
        pytest.param(False, id="python-loop"),
    ],
)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("mixtral", tmp_path_factory.mktemp("link") / "hf")


@pytest.fixture
def model_file(tiny_hf: Path, disk_dir: Path) -> Path:
    return write_gguf(load_model(tiny_hf), disk_dir / "q8.gguf", QType.Q8_0)


def open_direct(path: Path) -> SSDStore:
    store = SSDStore(inspect_model(path).experts)
    if not store.direct:
        store.close()
        pytest.skip("this filesystem does not support O_DIRECT")
    return store


def fetch_all(
    store: SSDStore,
    path: Path,
    n_slots: int = 5,
    check: bool = True,
    use_aio: bool = True,
    native: bool = True,
) -> tuple[Fetcher, Telemetry, int]:
    """Fetch every expert through a Fetcher, ``n_slots`` at a time, checking each slot's
    bytes against the file (through the page cache) if ``check``; returns the (closed)
    fetcher, its telemetry and the number of experts."""
    refs = [e for layer in inspect_model(path).experts for e in layer]
    slots = store.alloc_slots(n_slots)
    telemetry = Telemetry()
    done: queue.Queue = queue.Queue()
    fetcher = Fetcher(
        store,
        slots,
        telemetry,
        lambda k, lay, err: done.put((k, lay, err)),
        use_aio=use_aio,
        native=native,
    )
    files = MappedFiles()
    try:
        for first in range(0, len(refs), n_slots):
            batch = refs[first : first + n_slots]
            slots.fill_(0xAB)  # stale bytes must not survive a read
            for i, ref in enumerate(batch):
                fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
            results = {}
            for _ in batch:
                key, layout, err = done.get(timeout=30)
                assert err is None, err
                results[key] = layout
            for i, ref in enumerate(batch if check else []):
                layout = results[(ref.layer, ref.expert)]
                assert layout == store.layout(ref)
                got = dequantize_slot(slots[i], ref, layout, torch.float32)
                for w, part in zip(got, ref.parts, strict=True):
                    assert torch.equal(w, files.load(part))
    finally:
        fetcher.close()
        files.close()
    return fetcher, telemetry, len(refs)


@needs_aio
def test_queued_reads_land_every_expert_exactly(
    model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    experts = inspect_model(model_file).experts
    last = experts[-1][-1].down
    # The last expert's aligned range runs past the end of the file: a short read.
    assert -(-(last.offset + last.nbytes) // ALIGN) * ALIGN > model_file.stat().st_size
    real_submit, sizes = aio.Reads.submit, []

    def spy(self: aio.Reads, reads: list[aio.Read]) -> None:
        sizes.append(len(reads))
        real_submit(self, reads)

    monkeypatch.setattr(aio.Reads, "submit", spy)
    with open_direct(model_file) as store:
        fetcher, telemetry, n = fetch_all(store, model_file, native=False)
    assert fetcher.batched
    # Several experts' parts really were queued together (not one read at a time).
    assert max(sizes) == 3 * QUEUED_EXPERTS and sum(sizes) == 3 * n
    assert len(telemetry.link) == n == telemetry.fetched


@needs_aio
@pytest.mark.skipif(link.library() is None, reason="no C loop here")
def test_the_c_loop_lands_every_expert_exactly(model_file: Path) -> None:
    with open_direct(model_file) as store:
        fetcher, telemetry, n = fetch_all(store, model_file)
    assert fetcher._native is not None and fetcher.batched
    assert len(telemetry.link) == n == telemetry.fetched
    # Busy intervals as the C loop timed them: in order, never overlapping.
    spans = [(e.start, e.end) for e in telemetry.link]
    assert all(a <= b for a, b in spans)
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:], strict=False))


@needs_aio
def test_the_next_reads_are_queued_before_a_landed_expert_is_reported(model_file: Path) -> None:
    """Handling a landed expert is Python, slower while the engine's Python holds the
    GIL: the SSD gets the next expert's reads first, so it is not left with fewer."""
    refs = [e for layer in inspect_model(model_file).experts for e in layer]
    batch = refs[: QUEUED_EXPERTS + 1]
    with open_direct(model_file) as store:
        slots = store.alloc_slots(len(batch))
        seen: queue.Queue = queue.Queue()
        fetcher: Fetcher

        def done(key, layout, err) -> None:
            seen.put((key, err, {f.key for f in fetcher._flights.values()}))

        fetcher = Fetcher(store, slots, Telemetry(), done, native=False)
        try:
            # Every fetch is waiting before the link takes the first one (the condition's
            # lock is reentrant: submit takes it again).
            with fetcher._cv:
                for i, ref in enumerate(batch):
                    fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
            reports = [seen.get(timeout=30) for _ in batch]
        finally:
            fetcher.close()
    assert fetcher.batched
    assert all(err is None for _, err, _ in reports)
    first_key, _, queued = reports[0]
    last = (batch[-1].layer, batch[-1].expert)
    assert first_key != last and last in queued


@needs_aio
@LOOPS
def test_queued_reads_bypass_the_page_cache(model_file: Path, native: bool) -> None:
    experts = inspect_model(model_file).experts
    wanted = expert_pages(experts)
    evict(model_file)
    if resident_pages(model_file) & wanted:
        pytest.skip("the kernel did not honour POSIX_FADV_DONTNEED here")
    with open_direct(model_file) as store:
        fetcher, _, _ = fetch_all(store, model_file, check=False, native=native)
    assert fetcher.batched
    assert not resident_pages(model_file) & wanted, "queued reads went through the page cache"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux's")
def test_without_native_aio_the_link_reads_part_by_part(model_file: Path) -> None:
    with open_direct(model_file) as store:
        fetcher, telemetry, n = fetch_all(store, model_file, use_aio=False)
    assert not fetcher.batched
    assert telemetry.fetched == n


@needs_aio
def test_a_failing_queue_falls_back_without_losing_a_fetch(
    model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_submit = aio.Reads.submit
    calls = []

    def flaky(self: aio.Reads, reads: list[aio.Read]) -> None:
        calls.append(len(reads))
        if len(calls) == 3:
            # Queue the reads, then fail as a partial submission does: they are in flight.
            real_submit(self, reads)
            raise OSError(errno.EAGAIN, "simulated")
        real_submit(self, reads)

    monkeypatch.setattr(aio.Reads, "submit", flaky)
    with open_direct(model_file) as store:
        fetcher, telemetry, n = fetch_all(store, model_file, native=False)
    assert len(calls) == 3  # the third call failed; every later fetch used preadv
    assert not fetcher.batched
    assert telemetry.fetched == n


@needs_aio
def test_finish_reads_completes_short_reads_and_reports_errors(model_file: Path) -> None:
    with open_direct(model_file) as store:
        ref = inspect_model(model_file).experts[0][0]
        # Zeroed: an expert's reads may not cover the whole slot (its padding stays as is).
        want = store.alloc_slots(1)[0].zero_()
        store.read_into(ref, want)
        slot = store.alloc_slots(1)[0].zero_()
        reads = store.direct_reads(ref, slot)
        assert [r[1] % ALIGN for r in reads] == [0, 0, 0]
        # Only the first aligned block of each part "arrived": the rest is read on finish.
        for fd, address, _, offset in reads:
            os.preadv(fd, [memoryview(slot.numpy())[address - slot.data_ptr() :][:ALIGN]], offset)
        total = store.finish_reads(ref, slot, [ALIGN, ALIGN, ALIGN])
        assert total == sum(r[2] for r in reads)
        assert torch.equal(slot, want)
        with pytest.raises(OSError, match="Input/output error"):
            store.finish_reads(ref, slot, [reads[0][2], -errno.EIO, reads[2][2]])


@needs_aio
def test_reads_context_returns_each_tag_and_drains_on_close(model_file: Path) -> None:
    data = model_file.read_bytes()
    fd = os.open(model_file, os.O_RDONLY | os.O_DIRECT)
    n = 2 * ALIGN
    raw = torch.empty(4 * n + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    buf = raw[skip : skip + 4 * n]  # O_DIRECT wants an aligned buffer
    base = buf.data_ptr()
    ctx = aio.open_reads(4)
    assert ctx is not None
    try:
        ctx.submit([aio.Read(10 + i, fd, base + i * n, n, i * n) for i in range(4)])
        assert ctx.in_flight == 4
        got = dict(ctx.wait(4))
        assert got == {10 + i: n for i in range(4)} and ctx.in_flight == 0
        assert bytes(buf.numpy()) == data[: 4 * n]
        with pytest.raises(ValueError, match="exceed depth"):
            ctx.submit([aio.Read(i, fd, base, n, 0) for i in range(5)])
        ctx.submit([aio.Read(1, fd, base, n, 0)])
    finally:
        ctx.close()  # waits for the read still in flight
        os.close(fd)
    assert ctx.in_flight == 0


@needs_aio
def test_a_failing_wait_falls_back_without_losing_a_fetch(
    model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_wait, calls = aio.Reads.wait, []

    def flaky(self: aio.Reads, at_least: int) -> list[tuple[int, int]]:
        calls.append(at_least)
        if len(calls) == 2:
            raise OSError(errno.EINTR, "simulated")  # reads are still in flight
        return real_wait(self, at_least)

    monkeypatch.setattr(aio.Reads, "wait", flaky)
    with open_direct(model_file) as store:
        fetcher, telemetry, n = fetch_all(store, model_file, native=False)
    assert not fetcher.batched
    assert telemetry.fetched == n


@needs_aio
@LOOPS
def test_a_bad_read_fails_only_its_fetch(
    model_file: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    refs = [e for layer in inspect_model(model_file).experts for e in layer][:6]
    bad = (refs[2].layer, refs[2].expert)
    with open_direct(model_file) as store:
        real_finish = store.finish_reads

        def finish(ref, slot, results):
            if (ref.layer, ref.expert) == bad:
                results = [results[0], -errno.EIO, results[2]]
            return real_finish(ref, slot, results)

        monkeypatch.setattr(store, "finish_reads", finish)
        done: queue.Queue = queue.Queue()
        fetcher = Fetcher(
            store,
            store.alloc_slots(6),
            Telemetry(),
            lambda k, lay, e: done.put((k, e)),
            native=native,
        )
        try:
            for i, ref in enumerate(refs):
                fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
            errors = dict(done.get(timeout=30) for _ in refs)
        finally:
            fetcher.close()
    assert fetcher.batched  # a bad read is that fetch's error, not the link's
    assert {k for k, e in errors.items() if e} == {bad}
    assert "Input/output error" in errors[bad]


@needs_aio
@LOOPS
def test_closing_with_reads_queued_reports_every_fetch(model_file: Path, native: bool) -> None:
    refs = [e for layer in inspect_model(model_file).experts for e in layer][:8]
    with open_direct(model_file) as store:
        done: queue.Queue = queue.Queue()
        fetcher = Fetcher(
            store,
            store.alloc_slots(8),
            Telemetry(),
            lambda k, lay, e: done.put((k, e)),
            native=native,
        )
        for i, ref in enumerate(refs):
            fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
        fetcher.close()
        assert not fetcher._thread.is_alive()
        reported = dict(done.get(timeout=1) for _ in refs)
    assert set(reported) == {(r.layer, r.expert) for r in refs}
    # Reads already queued land; the rest are reported as not done.
    assert all(e is None or "shutting down" in e for e in reported.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread CPU clocks: Linux")
@LOOPS
def test_the_links_cpu_time_is_read_from_its_own_thread(model_file: Path, native: bool) -> None:
    """``cpu_s`` (``bevy bench``'s link CPU a fetch) is the link thread's CPU clock, read
    from another thread: it grows as the link reads, and says nothing once it ended."""
    refs = [e for layer in inspect_model(model_file).experts for e in layer][:4]
    with open_direct(model_file) as store:
        done: queue.Queue = queue.Queue()
        fetcher = Fetcher(
            store, store.alloc_slots(4), Telemetry(), lambda k, lay, e: done.put(e), native=native
        )
        try:
            before = fetcher.cpu_s()
            for i, ref in enumerate(refs):
                fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
            assert [done.get(timeout=30) for _ in refs] == [None] * 4
            after = fetcher.cpu_s()
            # this thread's own work is not the link's: the idle link's clock stands still
            spin = time.thread_time()
            while time.thread_time() - spin < 0.2:
                pass
            idle = fetcher.cpu_s()
        finally:
            fetcher.close()
    assert before is not None and after is not None and after > before
    assert idle is not None and idle - after < 0.05
    assert fetcher.cpu_s() is None


@needs_aio
@pytest.mark.skipif(link.library() is None, reason="no C loop here")
def test_the_caller_takes_the_landed_experts_on_its_own_thread(model_file: Path) -> None:
    """``caller_takes`` (the engine's link): no Python thread of the link's; ``take``
    reports each landed expert, exactly, on the calling thread, waiting until one lands,
    until ``wake`` or its timeout; closing reports what landed and abandons the rest."""
    refs = [e for layer in inspect_model(model_file).experts for e in layer][:8]
    reports: list[tuple[tuple[int, int], str | None, int]] = []
    telemetry = Telemetry()
    files = MappedFiles()
    with open_direct(model_file) as store:
        slots = store.alloc_slots(len(refs)).fill_(0xAB)
        fetcher = Fetcher(
            store,
            slots,
            telemetry,
            lambda k, lay, e: reports.append((k, e, threading.get_ident())),
            caller_takes=True,
        )
        try:
            assert fetcher.caller_takes and fetcher._thread is None
            for i, ref in enumerate(refs[:4]):
                fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
            deadline = time.monotonic() + 30
            while len(reports) < 4 and time.monotonic() < deadline:
                fetcher.take(1.0)
            assert sorted(k for k, _, _ in reports) == [(r.layer, r.expert) for r in refs[:4]]
            for i, ref in enumerate(refs[:4]):
                got = dequantize_slot(slots[i], ref, store.layout(ref), torch.float32)
                for w, part in zip(got, ref.parts, strict=True):
                    assert torch.equal(w, files.load(part))
            assert fetcher.cpu_s() is not None  # the C loop's own clock
            timer = threading.Timer(0.1, fetcher.wake)
            timer.start()
            t0 = time.monotonic()
            assert fetcher.take(30) == 0  # woken with nothing landed
            assert time.monotonic() - t0 < 10
            timer.join()
            for i, ref in enumerate(refs[4:], 4):
                fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
        finally:
            fetcher.close()
            files.close()
    assert {t for _, _, t in reports} == {threading.get_ident()}
    errors = {k: e for k, e, _ in reports}
    assert len(reports) == len(errors) == len(refs)  # each fetch reported once
    assert all(e is None or "shutting down" in e for e in errors.values())
    assert telemetry.fetched == sum(e is None for e in errors.values())
    assert fetcher.take(0) == 0 and fetcher.cpu_s() is None
