"""The expert store: exact bytes in every slot, O_DIRECT really bypasses the cache, no GIL."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from backend.engine.store import ALIGN, TIERS, SSDStore, dequantize_slot, open_store
from backend.formats.tensors import MappedFiles
from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import inspect_model, load_model
from backend.models.weights import ExpertRef
from tests.helpers.pagecache import evict, expert_pages, fs_type, resident_pages
from tests.helpers.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[3]
LINUX = sys.platform.startswith("linux")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("mixtral", tmp_path_factory.mktemp("store") / "hf")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf: Path) -> Path:
    return write_gguf(load_model(tiny_hf), tiny_hf.parent / "q8.gguf", QType.Q8_0)


def all_refs(path: Path) -> list[list[ExpertRef]]:
    experts = inspect_model(path).experts
    assert sum(map(len, experts)) > 0
    return experts


def flat(experts: list[list[ExpertRef]]) -> list[ExpertRef]:
    return [e for layer in experts for e in layer]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_every_expert_matches_the_file(
    tier: str, source: str, tiny_gguf: Path, tiny_hf: Path
) -> None:
    experts = all_refs(tiny_gguf if source == "gguf" else tiny_hf)
    if source == "gguf":
        # The last expert's aligned range runs past end of file: the short-read path runs.
        last = flat(experts)[-1].down
        assert -(-(last.offset + last.nbytes) // ALIGN) * ALIGN > tiny_gguf.stat().st_size
    files = MappedFiles()
    with open_store(tier, experts) as store:
        assert store.tier == tier
        slot = store.alloc_slots(1)[0]
        for ref in flat(experts):
            slot.fill_(0xAB)  # stale bytes must not survive a read
            assert store.read_into(ref, slot) >= ref.nbytes
            got = dequantize_slot(slot, ref, store.layout(ref), torch.float32)
            for w, part in zip(got, ref.parts, strict=True):
                assert w.shape == part.shape
                assert torch.equal(w, files.load(part))
    files.close()


@pytest.mark.parametrize("tier", TIERS)
def test_layout_fits_the_slot_and_slots_are_aligned(tier: str, tiny_gguf: Path) -> None:
    experts = all_refs(tiny_gguf)
    with open_store(tier, experts) as store:
        assert store.slot_bytes % ALIGN == 0
        for ref in flat(experts):
            offsets = store.layout(ref)
            assert offsets == store.layout(ref)
            ends = [o + p.nbytes for o, p in zip(offsets, ref.parts, strict=True)]
            assert offsets[0] >= 0 and ends[0] <= offsets[1] and ends[1] <= offsets[2]
            assert ends[2] <= store.slot_bytes
            if tier == "ssd":
                # Each part lands where its aligned file range puts it: no bounce copy.
                assert all(
                    o % ALIGN == p.offset % ALIGN for o, p in zip(offsets, ref.parts, strict=True)
                )
        slots = store.alloc_slots(3)
        assert slots.shape == (3, store.slot_bytes) and slots.dtype == torch.uint8
        assert all(row.data_ptr() % ALIGN == 0 for row in slots)
        with pytest.raises(ValueError, match="bytes"):
            store.read_into(flat(experts)[0], slots[0, : store.slot_bytes - 1])


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (Linux /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="this kernel has no transparent huge pages",
)
def test_big_slot_pools_ask_for_huge_pages(tiny_gguf: Path) -> None:
    """Slot pools of 2 MiB or more are 2 MiB-aligned and advised MADV_HUGEPAGE ("hg"), so
    O_DIRECT reads pin few pages; small ones stay ordinary tensors. Reads still land."""
    experts = all_refs(tiny_gguf)
    with SSDStore(experts) as store:
        n = -(-(4 << 20) // store.slot_bytes)
        big = store.alloc_slots(n)
        assert big.shape == (n, store.slot_bytes)
        assert big.data_ptr() % (2 << 20) == 0
        assert "hg" in _vm_flags(big.data_ptr())
        small = store.alloc_slots(1)
        assert small.data_ptr() % ALIGN == 0
        ref = flat(experts)[1]
        store.read_into(ref, big[n - 1])
        want = store.alloc_slots(1)[0]
        store.read_into(ref, want)
        for o, p in zip(store.layout(ref), ref.parts, strict=True):
            assert torch.equal(big[n - 1, o : o + p.nbytes], want[o : o + p.nbytes])


def test_unaligned_slot_is_refused_by_o_direct(tiny_gguf: Path) -> None:
    experts = all_refs(tiny_gguf)
    with SSDStore(experts) as store:
        if not store.direct:
            pytest.skip("this filesystem has no O_DIRECT")
        unaligned = store.alloc_slots(2).view(-1)[1 : 1 + store.slot_bytes]
        with pytest.raises(ValueError, match="aligned"):
            store.read_into(flat(experts)[0], unaligned)
        with pytest.raises(ValueError, match="aligned"):
            store.slot_address(unaligned)  # the link's check, once per slot


def test_the_links_reads_at_a_slot_address_are_the_direct_reads(tiny_gguf: Path) -> None:
    """The link asks each slot's address once (``slot_address``) and each expert's reads
    by address on every fetch (``reads_at``): the same reads as ``direct_reads``, every
    expert, every slot; and a whole result needs no slot (the short-read path does)."""
    experts = flat(all_refs(tiny_gguf))
    with SSDStore(all_refs(tiny_gguf)) as store:
        if not store.direct:
            pytest.skip("this filesystem has no O_DIRECT")
        slots = store.alloc_slots(3)
        for i, ref in enumerate(experts):
            slot = slots[i % 3]
            want = store.direct_reads(ref, slot)
            assert store.reads_at(ref, store.slot_address(slot)) == want
            assert [start for *_, start in want] == [p.offset - p.offset % ALIGN for p in ref.parts]
            assert store.finish_reads(ref, None, [n for _, _, n, _ in want]) == sum(
                n for _, _, n, _ in want
            )


def test_unknown_tier() -> None:
    with pytest.raises(ValueError, match="unknown expert store tier 'nvme'"):
        open_store("nvme", [])


# --- page cache -------------------------------------------------------------------------


def read_all(path: Path, experts: list[list[ExpertRef]]) -> SSDStore:
    store = SSDStore(experts)
    slot = store.alloc_slots(1)[0]
    for ref in flat(experts):
        store.read_into(ref, slot)
    return store


@pytest.mark.skipif(not LINUX, reason="mincore page-cache accounting is checked on Linux")
def test_o_direct_reads_bypass_the_page_cache(tiny_hf: Path, disk_dir: Path) -> None:
    path = write_gguf(load_model(tiny_hf), disk_dir / "q8.gguf", QType.Q8_0)
    experts = all_refs(path)  # reads the header through the cache, before the eviction
    wanted = expert_pages(experts)
    evict(path)
    if resident_pages(path) & wanted:
        pytest.skip("the kernel did not honour POSIX_FADV_DONTNEED here")
    store = read_all(path, experts)
    store.close()
    if not store.direct:
        pytest.skip(f"{fs_type(path.resolve())} does not support O_DIRECT")
    assert not resident_pages(path) & wanted, "O_DIRECT reads went through the page cache"
    # Control: a buffered read of the same file does show up, so mincore sees the cache.
    path.read_bytes()
    assert wanted <= resident_pages(path)


@pytest.mark.skipif(not LINUX, reason="mincore page-cache accounting is checked on Linux")
def test_buffered_fallback_drops_what_it_read(
    tiny_hf: Path, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(load_model(tiny_hf), disk_dir / "q8.gguf", QType.Q8_0)
    experts = all_refs(path)
    evict(path)
    real_open = os.open

    def no_direct(p: os.PathLike, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    store = read_all(path, experts)
    monkeypatch.undo()
    assert store.direct is False
    store.close()
    assert not resident_pages(path) & expert_pages(experts)


# --- GIL ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_reads_run_alongside_python_compute(tier: str, tiny_gguf: Path) -> None:
    """Reads leave the interpreter to other threads: a pure-Python busy loop moves on
    while a read is under way. The reader goes on (up to 20 s) until it has seen the loop
    move during one of its reads, so the test waits for that instead of assuming a speed;
    reads that kept the interpreter lock throughout would never see it and fail."""
    refs = flat(all_refs(tiny_gguf))
    with open_store(tier, all_refs(tiny_gguf)) as store:
        slots = store.alloc_slots(2)
        reads = 4 * len(refs)
        done = [0]
        work = [0]
        during = [0]  # reads in which the loop moved
        errors: list[BaseException] = []

        def reader() -> None:
            deadline = time.perf_counter() + 20
            try:
                while done[0] < reads or (not during[0] and time.perf_counter() < deadline):
                    before = work[0]
                    store.read_into(refs[done[0] % len(refs)], slots[done[0] % 2])
                    during[0] += work[0] > before
                    done[0] += 1
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=reader)
        thread.start()
        while thread.is_alive():
            work[0] += 1  # pure-Python compute holding the GIL between bytecodes
        thread.join(timeout=5)
    assert not errors and not thread.is_alive()
    assert done[0] >= reads
    assert during[0] > 0


# --- the demo MoE -------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_experts_through_o_direct() -> None:
    from backend.demo.build import ensure_demo

    path = ensure_demo(quiet=True)
    experts = inspect_model(path).experts
    refs = flat(experts)[::19]  # ~50 experts spread over every layer
    evict(path)
    files = MappedFiles()
    with SSDStore(experts) as store:
        slots = store.alloc_slots(len(refs))
        start = time.perf_counter()
        nbytes = sum(store.read_into(r, s) for r, s in zip(refs, slots, strict=True))
        seconds = time.perf_counter() - start
        for ref, slot in zip(refs, slots, strict=True):
            got = dequantize_slot(slot, ref, store.layout(ref), torch.float32)
            for w, part in zip(got, ref.parts, strict=True):
                assert torch.equal(w, files.load(part))
    files.close()
    assert nbytes >= sum(r.nbytes for r in refs)
    print(f"SSDStore: {len(refs)} experts, {nbytes / seconds / 1e6:.0f} MB/s")
