"""What the SSD gives the link: expert reads queued through native AIO, time per expert.

Reads random experts of the demo MoE (O_DIRECT, each expert's three parts queued in one
``io_submit``) two ways, each at several queue depths (experts in flight) and with a
handling time per landed expert (busy Python on the reading thread, as the link's checks,
telemetry and the engine's wake-up take):

- ``loop``: a bare AIO loop that waits for the oldest expert's reads, then either
  handles the landed experts before queuing the next (``late``, the link before 6260566)
  or queues the next first (``early``, as the link does now);
- ``fetcher``: the engine's own ``Fetcher`` at each depth (``QUEUED_EXPERTS`` patched),
  the handling time spent in its completion callback: with its loop in C
  (``backend/kernels/link.c``, where it builds; the reads go on meanwhile), the landed
  experts taken by the submitting thread as the engine's thread takes them (``fetcher
  C``, ``caller_takes``) or by a Python thread of the link's (``C thread``, as before
  9e6f727), and with its loop in Python (``fetcher py``, the link's Python thread
  queuing the reads and taking what lands).

``--python-load`` adds a thread running pure Python beside the reads, as the engine's
Python holds the GIL between its native calls (the GIL's switch interval is the engine's,
``short_switch_interval``).

    python benchmarks/link_reads.py [--experts 1200] [--depths 1,2,3,4]
        [--handle-ms 0,0.17] [--rounds 2] [--python-load]

Prints milliseconds per expert, each configuration's median over rounds. The disk's own
speed swings from minute to minute: compare figures of one run only. Run nothing else
meanwhile. The demo MoE is built on first use.
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine import aio, fetcher  # noqa: E402
from backend.engine.loop import short_switch_interval  # noqa: E402
from backend.engine.store import SSDStore  # noqa: E402
from backend.engine.telemetry import Telemetry  # noqa: E402
from backend.kernels import link as native_link  # noqa: E402
from backend.models.loader import inspect_model  # noqa: E402

KINDS = ("loop late", "loop early", "fetcher py", "C thread", "fetcher C")


def spin(seconds: float) -> None:
    """Busy Python for ``seconds`` (holding the GIL, as the link's handling does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def loop_reads(
    store: SSDStore, refs: list, order: list[int], depth: int, handle_s: float, early: bool
) -> float:
    """Seconds per expert through a bare AIO loop ``depth`` experts deep."""
    reads = aio.open_reads(3 * (depth + 1))
    slots = store.alloc_slots(2 * depth + 1)
    free = list(range(len(slots)))
    flights: dict[int, list[int]] = {}  # seq -> [reads left, slot]
    nxt = done = 0

    def fill(limit: int) -> None:
        nonlocal nxt
        while nxt < len(order) and len(flights) < limit:
            slot = free.pop()
            parts = store.direct_reads(refs[order[nxt]], slots[slot])
            flights[nxt] = [len(parts), slot]
            reads.submit([aio.Read(nxt * 4 + i, *p) for i, p in enumerate(parts)])
            nxt += 1

    t0 = time.perf_counter()
    try:
        while done < len(order):
            fill(depth)
            for tag, _ in reads.wait(flights[next(iter(flights))][0]):
                flights[tag // 4][0] -= 1
            landed = [seq for seq, f in flights.items() if not f[0]]
            if early:  # the landed experts still hold their slots: the next take others
                fill(depth + len(landed))
            for seq in landed:
                free.append(flights.pop(seq)[1])
                done += 1
                spin(handle_s)
        return (time.perf_counter() - t0) / len(order)
    finally:
        reads.close()


def fetcher_reads(
    store: SSDStore,
    refs: list,
    order: list[int],
    depth: int,
    handle_s: float,
    native: bool,
    caller_takes: bool = True,
) -> float:
    """Seconds per expert through the engine's ``Fetcher`` with ``depth`` experts queued,
    its loop in C (``native``; the landed fetches taken by this thread, ``caller_takes``,
    or by the link's) or in Python."""
    saved, fetcher.QUEUED_EXPERTS = fetcher.QUEUED_EXPERTS, depth
    slots = store.alloc_slots(2 * depth + 2)
    landed: queue.Queue = queue.Queue()

    def done(key, layout, err) -> None:
        spin(handle_s)
        landed.put((key, err))

    link = fetcher.Fetcher(
        store, slots, Telemetry(), done, native=native, caller_takes=caller_takes
    )
    try:
        if not link.batched:
            raise SystemExit("native AIO is not available here")
        # As the engine does: a fetch is submitted when a slot is free, each into its own.
        free = list(range(len(slots)))
        by_key: dict[tuple[int, int], int] = {}
        t0 = time.perf_counter()
        submitted = finished = 0
        while finished < len(order):
            while submitted < len(order) and free:
                ref = refs[order[submitted]]
                key = (submitted, 0)  # unique per read, so the same expert may come again
                by_key[key] = slot = free.pop()
                link.submit((submitted,), key, ref, slot)
                submitted += 1
            deadline = time.monotonic() + 60
            while link.caller_takes and landed.empty() and time.monotonic() < deadline:
                link.take(1.0)
            key, err = landed.get(timeout=60)
            if err is not None:
                raise SystemExit(err)
            free.append(by_key.pop(key))
            finished += 1
        return (time.perf_counter() - t0) / len(order)
    finally:
        link.close()
        fetcher.QUEUED_EXPERTS = saved


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=1200, help="experts read per configuration")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--handle-ms", default="0,0.17")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--python-load", action="store_true")
    args = ap.parse_args(argv)
    experts = inspect_model(ensure_demo()).experts
    refs = [e for layer in experts for e in layer]
    store = SSDStore(experts)
    if not store.direct:
        raise SystemExit("this filesystem does not support O_DIRECT")
    short_switch_interval()
    stop = threading.Event()

    def python_load() -> None:
        while not stop.is_set():
            spin(0.01)

    if args.python_load:
        threading.Thread(target=python_load, daemon=True).start()
    rng = random.Random(0)
    configs = [
        (kind, depth, float(h))
        for h in args.handle_ms.split(",")
        for depth in map(int, args.depths.split(","))
        for kind in KINDS
        if kind not in ("fetcher C", "C thread") or native_link.library() is not None
    ]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    try:
        for _ in range(args.rounds):
            for kind, depth, h in configs:
                order = [rng.randrange(len(refs)) for _ in range(args.experts)]
                if kind.startswith("loop"):
                    s = loop_reads(store, refs, order, depth, h / 1e3, kind == "loop early")
                else:
                    native = kind != "fetcher py"
                    s = fetcher_reads(
                        store, refs, order, depth, h / 1e3, native, kind == "fetcher C"
                    )
                times[(kind, depth, h)].append(s * 1e3)
    finally:
        stop.set()
        store.close()
    print(f"{'handling ms':>11s} {'depth':>5s}" + "".join(f" {k:>10s}" for k in KINDS))
    for h in dict.fromkeys(c[2] for c in configs):
        for depth in dict.fromkeys(c[1] for c in configs):
            row = [
                f"{statistics.median(times[(k, depth, h)]):10.3f}"
                if (k, depth, h) in times
                else f"{'-':>10s}"
                for k in KINDS
            ]
            print(f"{h:11.2f} {depth:5d} " + " ".join(row))
    print("(ms per expert)")


if __name__ == "__main__":
    main()
