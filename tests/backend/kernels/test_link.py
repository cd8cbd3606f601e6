"""The link's read loop in C: priority order, exact bytes, the pread fallback, closing."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.kernels import link

pytestmark = pytest.mark.skipif(
    link.library() is None, reason="the link's loop is built on Linux with a C compiler"
)

N = 4096


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    data = os.urandom(16 * N)
    path = tmp_path / "experts.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def opened(depth: int) -> link.Link:
    got = link.open_link(depth)
    if got is None:
        pytest.skip("the kernel refused an AIO context here")
    return got


def take_all(lk: link.Link, n: int) -> list[tuple[int, float, float, list[int]]]:
    landed: list = []
    while len(landed) < n:
        got = lk.wait()
        assert got is not None, f"closed after {len(landed)} of {n} fetches"
        landed += got
    return landed


def test_fetches_start_by_priority_then_submission(data_file) -> None:
    """Priorities of different lengths order as Python's tuples do; equal ones go first
    submitted, first started. With one fetch in flight, fetches land in start order."""
    fd, _ = data_file
    buf = ctypes.create_string_buffer(N)
    priorities = [(5,), (5, 1), (2, 9, 9), (2, 9), (7,), (2, 9), (-3, 4), (5, 0, 0, 1)]
    lk = opened(1)
    try:
        for tag, p in enumerate(priorities):  # all waiting before the loop takes one
            assert lk.submit(p, tag, [(fd, ctypes.addressof(buf), N, 0)])
        assert lk.queued == len(priorities)
        lk.start()
        order = [tag for tag, *_ in take_all(lk, len(priorities))]
    finally:
        lk.close()
        assert lk.wait() is None
        lk.free()
    assert order == sorted(range(len(priorities)), key=lambda t: (priorities[t], t))


def test_every_read_lands_exactly_with_its_times(data_file) -> None:
    fd, data = data_file
    bufs = [ctypes.create_string_buffer(3 * N) for _ in range(5)]
    lk = opened(2)
    lk.start()
    before = time.perf_counter()
    try:
        for tag, b in enumerate(bufs):
            # three parts of a fetch at three places in the file, the last one short
            reads = [
                (fd, ctypes.addressof(b), N, (3 * tag) * N),
                (fd, ctypes.addressof(b) + N, N, (3 * tag + 1) * N),
                (fd, ctypes.addressof(b) + 2 * N, N, 16 * N - N // 2),
            ]
            assert lk.submit((0, tag), tag, reads)
        landed = take_all(lk, len(bufs))
    finally:
        lk.close()
        lk.free()
    after = time.perf_counter()
    assert sorted(tag for tag, *_ in landed) == list(range(5))
    assert lk.batched
    for tag, start, end, results in landed:
        assert before <= start <= end <= after  # time.perf_counter's clock
        assert results == [N, N, N // 2, 0]
        got = bufs[tag].raw
        assert got[:N] == data[3 * tag * N : (3 * tag + 1) * N]
        assert got[N : 2 * N] == data[(3 * tag + 1) * N : (3 * tag + 2) * N]
        assert got[2 * N : 2 * N + N // 2] == data[-(N // 2) :]


def test_a_refused_queue_falls_back_to_pread_without_losing_a_fetch(data_file, tmp_path) -> None:
    """A read the kernel will not queue (a closed descriptor) fails the queue: the loop
    lets what was queued land, reads those fetches again with pread and goes on with pread.
    The bad read's fetch gets its error; every other lands whole."""
    fd, data = data_file
    closed = os.open(tmp_path / "gone", os.O_CREAT | os.O_RDONLY)
    os.close(closed)
    bufs = [ctypes.create_string_buffer(N) for _ in range(6)]
    lk = opened(2)
    lk.start()
    try:
        for tag, b in enumerate(bufs):
            bad = tag == 2
            assert lk.submit(
                (tag,), tag, [(closed if bad else fd, ctypes.addressof(b), N, tag * N)]
            )
        landed = {tag: results for tag, _, _, results in take_all(lk, len(bufs))}
    finally:
        lk.close()
        lk.free()
    assert not lk.batched
    assert landed[2][0] == -errno.EBADF
    for tag in (0, 1, 3, 4, 5):
        assert landed[tag][0] == N and bufs[tag].raw == data[tag * N : (tag + 1) * N]


def test_closing_lands_the_reads_in_flight_and_starts_no_more(data_file) -> None:
    """Every fetch the loop started lands and is reported (its slot may be reused after);
    the ones still waiting stay unstarted, for the caller to report."""
    fd, _ = data_file
    buf = ctypes.create_string_buffer(N)
    lk = opened(1)
    for tag in range(50):
        assert lk.submit((tag,), tag, [(fd, ctypes.addressof(buf), N, 0)])
    lk.start()
    landed = take_all(lk, 1)
    lk.close()
    while (got := lk.wait()) is not None:
        landed += got
    assert not lk.submit((0,), 99, [(fd, ctypes.addressof(buf), N, 0)])
    assert lk.cpu_s() is None  # its thread ended
    # started in priority order, each landed whole; the rest never started
    assert [tag for tag, *_ in landed] == list(range(len(landed)))
    assert all(results[0] == N for *_, results in landed)
    assert lk.queued == 50 - len(landed)
    lk.free()
    assert lk.queued == 0 and not lk.submit((0,), 9, [(fd, 0, N, 0)])


def test_closed_before_it_starts_nothing_lands(data_file) -> None:
    fd, _ = data_file
    buf = ctypes.create_string_buffer(N)
    lk = opened(2)
    assert lk.submit((0,), 0, [(fd, ctypes.addressof(buf), N, 0)])
    lk.close()
    assert lk.wait() is None and lk.queued == 1
    lk.free()


def test_what_a_fetch_may_ask_is_checked(data_file) -> None:
    fd, _ = data_file
    lk = opened(1)
    try:
        with pytest.raises(ValueError, match="at most 4"):
            lk.submit((1, 2, 3, 4, 5), 0, [(fd, 0, N, 0)])
        with pytest.raises(ValueError, match="reads for one fetch"):
            lk.submit((0,), 0, [(fd, 0, N, 0)] * 5)
        with pytest.raises(ValueError, match="depth"):
            link.open_link(link.MAX_DEPTH + 1)
    finally:
        lk.close()
        lk.free()


def test_the_loops_cpu_clock_counts_its_own_thread(data_file) -> None:
    fd, _ = data_file
    buf = ctypes.create_string_buffer(N)
    lk = opened(2)
    assert lk.cpu_s() is None  # not started
    lk.start()
    try:
        for tag in range(200):
            assert lk.submit((0,), tag, [(fd, ctypes.addressof(buf), N, 0)])
        take_all(lk, 200)
        spent = lk.cpu_s()
        spin = time.thread_time()
        while time.thread_time() - spin < 0.2:  # this thread's CPU is not the loop's
            pass
        idle = lk.cpu_s()
    finally:
        lk.close()
        lk.free()
    assert spent is not None and spent > 0
    assert idle is not None and idle - spent < 0.05


def test_a_wait_ends_when_woken_or_timed_out(data_file) -> None:
    """The engine waits in the link while it has nothing to run: a message for it
    (``wake``, from another thread) ends the wait at once, as does a timeout; a wake
    with no wait under way ends the next one."""
    fd, data = data_file
    buf = ctypes.create_string_buffer(N)
    lk = opened(1)
    lk.start()
    try:
        t0 = time.perf_counter()
        assert lk.wait(0) == [] and lk.wait(0.05) == []
        assert time.perf_counter() - t0 >= 0.05
        timer = threading.Timer(0.1, lk.wake)
        timer.start()
        t0 = time.perf_counter()
        assert lk.wait(30) == []  # woken, nothing landed
        woken_after = time.perf_counter() - t0
        timer.join()
        lk.wake()
        t0 = time.perf_counter()
        assert lk.wait() == []  # no limit, but woken before it began
        assert time.perf_counter() - t0 < 1
        assert lk.submit((0,), 7, [(fd, ctypes.addressof(buf), N, N)])
        landed: list = []
        while not landed:
            landed = lk.wait(30)
        assert [(tag, res[0]) for tag, _, _, res in landed] == [(7, N)]
        assert buf.raw == data[N : 2 * N]
    finally:
        lk.close()
        lk.free()
    assert 0.05 < woken_after < 10
    assert lk.wait(0) is None  # freed: nothing to wait on
