"""benchmarks/link_reads.py: both ways of reading finish every expert of an order that
repeats experts, at each depth, and the Fetcher's queue depth is put back afterwards."""

from __future__ import annotations

import random

import pytest

from backend.engine import aio, fetcher
from backend.engine.store import SSDStore
from backend.kernels.quants import QType
from backend.models.gguf_export import write_gguf
from backend.models.loader import inspect_model, load_model
from benchmarks.link_reads import fetcher_reads, loop_reads
from tests.helpers.tiny import make_tiny


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("link_reads")
    path = write_gguf(
        load_model(make_tiny("mixtral", folder / "hf")), folder / "q8.gguf", QType.Q8_0
    )
    reads = aio.open_reads(1)
    if reads is None:
        pytest.skip("native AIO is Linux (x86-64, arm64) only")
    reads.close()
    experts = inspect_model(path).experts
    with SSDStore(experts) as s:
        if not s.direct:
            pytest.skip("this filesystem does not support O_DIRECT")
        yield s, [e for layer in experts for e in layer]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_expert_is_read_at_each_depth(store, depth: int) -> None:
    s, refs = store
    order = [random.Random(depth).randrange(len(refs)) for _ in range(3 * len(refs))]
    for early in (False, True):
        assert loop_reads(s, refs, order, depth, 0.0001, early) > 0
    saved = fetcher.QUEUED_EXPERTS
    # the C loop where it builds (else Python's again), its landings taken by this thread
    # or by the link's own
    for native, caller in ((True, True), (True, False), (False, True)):
        assert fetcher_reads(s, refs, order, depth, 0.0001, native, caller) > 0
    assert saved == fetcher.QUEUED_EXPERTS
