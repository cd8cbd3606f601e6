"""A paced link (``link_rate``, ``bevy bench --link-rate``): the C loop lands each expert no
sooner than a link of that speed would carry it, one after another, with the same bytes;
where the C loop does not run, a paced link is refused rather than left unpaced."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
import torch

from backend.engine.fetcher import Fetcher
from backend.engine.store import SSDStore, dequantize_slot
from backend.engine.telemetry import Telemetry
from backend.formats.tensors import MappedFiles
from backend.kernels import link
from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import inspect_model, load_model
from tests.helpers.tiny import make_tiny


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, disk_dir: Path):
    hf = make_tiny("mixtral", tmp_path_factory.mktemp("paced") / "hf")
    path = write_gguf(load_model(hf), disk_dir / "q8.gguf", QType.Q8_0)
    s = SSDStore(inspect_model(path).experts)
    if not s.direct:
        s.close()
        pytest.skip("this filesystem does not support O_DIRECT")
    with s:
        yield s, [e for layer in inspect_model(path).experts for e in layer]


@pytest.mark.skipif(link.library() is None, reason="no C loop here")
def test_each_expert_lands_no_sooner_than_the_paced_link_carries_it(store) -> None:
    s, refs = store
    probe = link.open_link(1)
    if probe is None:
        pytest.skip("the kernel refused an AIO context here")
    probe.free()
    refs = refs[:12]
    nbytes = [sum(p.nbytes for p in r.parts) for r in refs]
    rate = int(sum(nbytes) / 0.3)  # the twelve take at least 0.3 s on this link
    slots = s.alloc_slots(len(refs)).fill_(0xAB)
    telemetry, done = Telemetry(), queue.Queue()
    fetcher = Fetcher(s, slots, telemetry, lambda k, lay, e: done.put((k, e)), link_rate=rate)
    files = MappedFiles()
    try:
        for i, ref in enumerate(refs):
            fetcher.submit((0, i), (ref.layer, ref.expert), ref, i)
        landed = [done.get(timeout=30) for _ in refs]
        assert all(e is None for _, e in landed)
        assert sorted(k for k, _ in landed) == sorted((r.layer, r.expert) for r in refs)
        for i, ref in enumerate(refs):  # the bytes are the reads', exactly
            got = dequantize_slot(slots[i], ref, s.layout(ref), torch.float32)
            for w, part in zip(got, ref.parts, strict=True):
                assert torch.equal(w, files.load(part))
    finally:
        fetcher.close()
        files.close()
    spans = sorted((e.start, e.end) for e in telemetry.link)
    assert len(spans) == len(refs)
    # One after another at the rate (each read's bytes are at least its parts' own, the
    # aligned ranges a little more): from the first start, the k-th landing comes no
    # sooner than the first k experts' bytes take at the rate.
    t0 = spans[0][0]
    ends = sorted(end for _, end in spans)
    smallest = sorted(nbytes)
    for k, end in enumerate(ends, 1):
        assert end - t0 >= sum(smallest[:k]) / rate * 0.999


def test_a_paced_link_without_the_c_loop_is_refused(store) -> None:
    s, _ = store
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="paced link needs the link's loop in C"):
        Fetcher(s, s.alloc_slots(2), Telemetry(), lambda *a: None, native=False, link_rate=10**9)
    assert {t.name for t in threading.enumerate()} == before  # no link thread left behind
