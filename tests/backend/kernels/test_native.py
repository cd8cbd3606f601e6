"""The hand-written Q4 kernels: each instruction-set variant, the build cache, fallback."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from backend.kernels import native, qmatmul
from backend.kernels.quants import QType, dequantize
from tests.helpers.kernel_builds import VARIANTS, variant
from tests.helpers.qblocks import (
    HIDDEN,
    INNER,
    ROUNDING,
    expert_reference,
    random_blocks,
    random_expert,
    rounded_8bit,
)

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no native Q4 kernels here (x86-64 with AVX2 and cc)"
)


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Each build of the kernels that this machine can run (``kernel_builds.VARIANTS``)."""
    return variant(request.param, tmp_path_factory)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
# 1-8 rows each take their own compiled case; 9 and 17 take more than one pass of 8
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 9, 17])
def test_linear_equals_dequantize_then_matmul(lib, monkeypatch, qtype: QType, rows: int):
    monkeypatch.setattr(native, "_lib", lib)
    n = 291  # column chunks of 32 and 33: the last column of some is computed alone
    raw = random_blocks(qtype, n, HIDDEN, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    got = native.linear(raw, qtype, (n, HIDDEN), x)
    ref = F.linear(x, dequantize(raw, qtype, (n, HIDDEN)))
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for lo, hi in ((0, 1), (rows - 1, rows), (1, rows)):
        assert torch.equal(native.linear(raw, qtype, (n, HIDDEN), x[lo:hi]), got[lo:hi])


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
def test_every_row_count_and_leftover_column(lib, monkeypatch, qtype: QType):
    """47 columns in one chunk: each row count 1-8 takes its weight rows 8, 4 or 2 at a
    time and 7, 3 or 1 columns one at a time after; every row is the same alone, and
    close to dequantize-then-matmul."""
    monkeypatch.setattr(native, "_lib", lib)
    n = 47
    raw = random_blocks(qtype, n, HIDDEN, seed=47)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(47))
    ref = F.linear(x, dequantize(raw, qtype, (n, HIDDEN)))
    alone = torch.cat([native.linear(raw, qtype, (n, HIDDEN), x[i : i + 1]) for i in range(8)])
    assert (alone - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for rows in range(2, 9):
        assert torch.equal(native.linear(raw, qtype, (n, HIDDEN), x[:rows]), alone[:rows])


# 1-8 rows one pass each, 12 and 40 several; from 128 (PACK_FROM_ROWS) the parts are
# multiplied from packed copies
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 12, 40, 130])
def test_expert_mlp_is_the_expert_on_inputs_rounded_to_8_bits(lib, monkeypatch, rows: int):
    """A Q4_0 / Q4_1 expert as stored is multiplied in integers, as the packed kernels
    multiply (and ggml's): its input and inner activation rounded to 8 bits per block of
    32. Close to that rounded product, far from the unrounded one, each row the same
    alone, and the same bits as the expert packed."""
    monkeypatch.setattr(native, "_lib", lib)
    parts = random_expert((QType.Q4_0, QType.Q4_1, QType.Q4_0), seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    got = native.expert_mlp(parts, x)
    ref = expert_reference(parts, x)
    assert got.shape == (rows, HIDDEN)
    # (h from the kernel and from torch may differ in its last bits, and so round to
    # another integer now and then: a looser bound than a single product's)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    unrounded = (expert_reference(parts, x, rounded=False) - ref).abs().max().item()
    assert unrounded > 1e-3 * ref.abs().max().item()
    for i in range(rows):
        assert torch.equal(native.expert_mlp(parts, x[i : i + 1])[0], got[i])
    packed = tuple((raw.clone(), q, s) for raw, q, s in parts)
    assert all(native.pack(*part) for part in packed)
    assert torch.equal(native.expert_mlp(packed, x, "silu", (True,) * 3), got)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_stored_rounded_kernel_is_the_packed_kernel_bit_for_bit(lib, monkeypatch, qtype, rows):
    """The expert kernels' Q4_0 / Q4_1 product as stored (``bevy_q4_linear``'s codes 11
    and 12) gives the packed kernel's bits, the leftover columns past the last eight
    (44 = 5 x 8 + 4, one chunk) included, and is x rounded times the weights."""
    monkeypatch.setattr(native, "_lib", lib)
    n = 48  # packs; 44 of its rows for the leftover columns
    raw = random_blocks(qtype, n, HIDDEN, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    code = 11 + native.EXPERT_TYPES[qtype][2]
    got = {}
    for cols in (n, 44):
        part = raw[: cols * HIDDEN // 32 * native.EXPERT_TYPES[qtype][1]]
        y = torch.empty(rows, cols)
        args = (code, x.data_ptr(), y.data_ptr(), rows, cols, HIDDEN, 2)
        assert lib.bevy_q4_linear(part.data_ptr(), *args) == 0
        ref = F.linear(rounded_8bit(x), dequantize(part, qtype, (cols, HIDDEN)))
        assert (y - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        got[cols] = y
    assert torch.equal(got[44], got[n][:, :44])
    packed = raw.clone()
    assert native.pack(packed, qtype, (n, HIDDEN))
    assert torch.equal(native.linear(packed, qtype, (n, HIDDEN), x, packed=True), got[n])


@pytest.mark.parametrize(
    "qtype",
    [QType.Q5_0, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.IQ4_XS],
)
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_k_quant_linear_equals_dequantize_then_matmul(lib, monkeypatch, qtype: QType, rows: int):
    """K-quant super-blocks of 256 weights (Q4_K and Q5_K: 8 sub-blocks with 6-bit scales
    and mins, Q5_K with a fifth bit per weight; Q6_K: 16 int8 scales; Q3_K: 16 packed
    6-bit scales over 2 bits and a high-bit mask), IQ4_XS's (16 non-linear values per
    nibble), Q5_0 and Q8_0 blocks straight from their bytes, each row on its own."""
    monkeypatch.setattr(native, "_lib", lib)
    n, k = 291, 512
    raw = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = native.linear(raw, qtype, (n, k), x)
    ref = F.linear(x, dequantize(raw, qtype, (n, k)))
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for lo, hi in ((0, 1), (rows - 1, rows), (1, rows)):
        assert torch.equal(native.linear(raw, qtype, (n, k), x[lo:hi]), got[lo:hi])
    assert native.linear(raw[: raw.numel() // 2], qtype, (n, k), x) is None
    if qtype not in (QType.Q5_0, QType.Q8_0):  # a K-quant row is whole super-blocks of 256
        assert native.linear(raw, qtype, (n * 4, k // 4), x[:, : k // 4]) is None


@pytest.mark.parametrize(
    "qtypes",
    [
        (QType.Q4_K, QType.Q4_K, QType.Q6_K),  # as Q4_K_M files store half their experts
        (QType.Q5_K, QType.Q5_K, QType.Q6_K),  # Q5_K_M
        (QType.Q8_0, QType.Q4_K, QType.Q5_K),
        (QType.Q3_K, QType.Q3_K, QType.Q5_K),  # Q3_K_M
        (QType.IQ4_XS, QType.IQ4_XS, QType.IQ4_XS),
        (QType.Q4_K, QType.Q4_K, QType.Q5_0),  # Gemma 4's Q4_K_M: 704-wide down rows
    ],
)
@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_k_quant_expert_mlp_equals_dequantize_then_matmul(
    lib, monkeypatch, qtypes, rows: int, act: str
):
    """SiLU-gated, and GELU-gated as Gemma 4's experts are."""
    monkeypatch.setattr(native, "_lib", lib)
    inner, hidden = 512, 256
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    parts = tuple(
        (random_blocks(q, *shape, seed=rows + i), q, shape)
        for i, (q, shape) in enumerate(zip(qtypes, shapes, strict=True))
    )
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
    got = native.expert_mlp(parts, x, act)
    g, u, d = (dequantize(raw, q, s) for raw, q, s in parts)
    fn = F.silu if act == "silu" else lambda t: F.gelu(t, approximate="tanh")
    ref = F.linear(fn(F.linear(x, g)) * F.linear(x, u), d)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for i in range(rows):
        assert torch.equal(native.expert_mlp(parts, x[i : i + 1], act)[0], got[i])
    other = native.expert_mlp(parts, x, "gelu" if act == "silu" else "silu")
    assert (other - got).abs().max().item() > 1e-4 * ref.abs().max().item()  # (it counts)


@pytest.mark.parametrize(
    "qtypes, inner, hidden",
    [
        ((QType.Q4_1, QType.Q4_0, QType.Q4_1), 288, 160),
        # the K-quant kernels, compiled per row count, over the same column chunks
        ((QType.Q4_K, QType.Q5_K, QType.Q4_K), 1280, 512),
    ],
)
def test_wide_expert_on_several_threads_and_on_one(lib, monkeypatch, qtypes, inner, hidden):
    """Shapes that split into many column chunks (the demo's are 1536 x 576): the same
    result, bit for bit, on one thread as on two, close to dequantize-then-matmul."""
    monkeypatch.setattr(native, "_lib", lib)
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    parts = tuple(
        (random_blocks(q, *shape, seed=i), q, shape)
        for i, (q, shape) in enumerate(zip(qtypes, shapes, strict=True))
    )
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = native.expert_mlp(parts, x)
        torch.set_num_threads(1)
        one = native.expert_mlp(parts, x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    ref = expert_reference(parts, x)
    bound = 1e-4 if any(q in ROUNDING for q in qtypes) else 1e-5  # (see above)
    assert (two - ref).abs().max().item() <= bound * ref.abs().max().item()


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
def test_rows_with_a_large_mean_stay_accurate(lib, monkeypatch, qtype: QType):
    """Against float64 on the same weights, within float32 rounding of the sum of |w x|:
    no term much larger than the result is added and taken away again."""
    monkeypatch.setattr(native, "_lib", lib)
    n, k = 64, 4096
    raw = random_blocks(qtype, n, k, seed=9)
    x = 3.0 + torch.randn(2, k, generator=torch.Generator().manual_seed(9))
    got = native.linear(raw, qtype, (n, k), x).double()
    w = dequantize(raw, qtype, (n, k)).double()
    ref = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    assert ((got - ref).abs() / scale).max().item() <= 2e-6


def test_no_byte_past_the_weights_is_read(lib, monkeypatch):
    """Weights that end where the readable memory ends (an inaccessible page follows):
    a read past them would crash the test process."""
    monkeypatch.setattr(native, "_lib", lib)
    n = 40
    raw = random_blocks(QType.Q4_0, n, HIDDEN, seed=4)
    page = mmap.PAGESIZE
    size = -(-raw.numel() // page) * page
    mem = mmap.mmap(-1, size + page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + size, page, 0) == 0  # PROT_NONE after the weights
    arr = np.frombuffer(mem, dtype=np.uint8, count=size)
    at = size - raw.numel()
    arr[at:] = raw.numpy()
    tail = torch.from_numpy(arr[at:])
    x = torch.randn(3, HIDDEN)
    got = native.linear(tail, QType.Q4_0, (n, HIDDEN), x)
    assert torch.equal(got, native.linear(raw, QType.Q4_0, (n, HIDDEN), x))


def _moe_case(seed: int, rows: int, k: int):
    """Experts of mixed block types, routing of ``rows`` rows to ``k`` distinct experts
    each (one expert takes every row: more than a pass of 8), and the kernels' arguments."""
    gen = torch.Generator().manual_seed(seed)
    kinds = [(QType.Q4_1,) * 3, (QType.Q4_0,) * 3, (QType.Q4_0, QType.Q4_1, QType.Q4_1)]
    experts = [random_expert(kinds[e % 3], seed=seed * 10 + e) for e in range(6)]
    ids = torch.stack(
        [
            torch.cat([torch.tensor([0]), 1 + torch.randperm(5, generator=gen)[: k - 1]])
            for _ in range(rows)
        ]
    )
    w = torch.rand(rows, k, generator=gen)
    x = torch.randn(rows, HIDDEN, generator=gen)
    by_expert: dict[int, list[int]] = {}
    for i, e in enumerate(ids.flatten().tolist()):
        by_expert.setdefault(e, []).append(i)
    order = sorted(by_expert)
    weights = [raw.data_ptr() for e in order for raw, _, _ in experts[e]]
    types = [
        native.mlp_types(tuple((q, s, raw.numel()) for raw, q, s in experts[e])) for e in order
    ]
    counts = [len(by_expert[e]) for e in order]
    routes = [i for e in order for i in by_expert[e]]
    return experts, ids, w, x, order, (weights, types, counts, routes)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("sum_rows", [11, 7, 0])
def test_moe_is_each_expert_alone_scaled_and_added_in_order(
    lib, monkeypatch, sum_rows: int, threads: int
):
    """``moe`` gives the same bits as the per-expert path it replaces: each expert on its
    rows (``expert_mlp``), times the route weight, index_add_ in expert order; the rows
    past ``sum_rows`` get each route's product on its own instead. On 2 threads the six
    experts are shared out whole among the threads; on 1 and 4 (fewer than two experts
    per thread) each expert's columns are."""
    monkeypatch.setattr(native, "_lib", lib)
    rows, k = 11, 3
    experts, ids, w, x, order, args = _moe_case(sum_rows, rows, k)
    assert len(order) == 6
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y, parts = native.moe(*args, x, w, INNER, HIDDEN, sum_rows)
    finally:
        torch.set_num_threads(before)
    want = torch.zeros(rows, HIDDEN)
    products = []
    for e in order:
        r, slot = (ids == e).nonzero(as_tuple=True)  # rows ascending
        out = native.expert_mlp(experts[e], x[r]) * w[r, slot, None]
        want.index_add_(0, r, out)
        products += list(zip(r.tolist(), out, strict=True))
    assert y.shape == (sum_rows, HIDDEN) and torch.equal(y, want[:sum_rows])
    assert parts.shape[0] == (len(products) if sum_rows < rows else 0)
    for j, (row, product) in enumerate(products):
        if row >= sum_rows:
            assert torch.equal(parts[j], product)


@pytest.mark.parametrize(("rows", "threads"), [(600, 2), (600, 4), (200, 4), (40, 2)])
def test_an_experts_rows_cut_into_pieces_give_the_same_bits(
    lib, monkeypatch, rows: int, threads: int
):
    """One expert with many rows (a long prompt's part of a layer): its rows are cut into
    pieces the threads take whole (600 rows on 2 and 4 threads, pieces of 150 and 75, the
    latter below the packing's row count), or its columns are shared (200 rows on 4, 40
    on 2: too few for pieces); every row's product is the expert's alone, bit for bit."""
    monkeypatch.setattr(native, "_lib", lib)
    experts, ids, w, x, order, (weights, types, counts, routes) = _moe_case(3, rows, 2)
    assert order[0] == 0 and counts[0] == rows  # expert 0 takes every row
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y, _ = native.moe(weights[:3], types[:1], counts[:1], routes[:rows], x, w, INNER, HIDDEN)
    finally:
        torch.set_num_threads(before)
    r, slot = (ids == 0).nonzero(as_tuple=True)
    assert torch.equal(r, torch.arange(rows))
    assert torch.equal(y, native.expert_mlp(experts[0], x) * w[r, slot, None])


def test_moe_goes_on_from_the_sums_it_is_given(lib, monkeypatch):
    """A call given sums (``into``) adds to them in order, as continuing the per-expert
    path would: the six experts applied as the first two, then the other four, with the
    second call going on from the first's sums, give the bits of one call for all six
    (a prompt applying its experts in two runs, ``scheduler.split``)."""
    monkeypatch.setattr(native, "_lib", lib)
    rows, k = 11, 3
    # ``experts`` owns the blocks the addresses in ``weights`` point into
    experts, _, w, x, order, (weights, types, counts, routes) = _moe_case(rows, rows, k)
    assert len(experts) == len(order) == 6
    whole, _ = native.moe(weights, types, counts, routes, x, w, INNER, HIDDEN)
    cut = sum(counts[:2])
    first, _ = native.moe(weights[:6], types[:2], counts[:2], routes[:cut], x, w, INNER, HIDDEN)
    kept = first.clone()
    rest = weights[6:], types[2:], counts[2:], routes[cut:]
    y, _ = native.moe(*rest, x, w, INNER, HIDDEN, into=first)
    assert y is first and torch.equal(y, whole)
    assert not torch.equal(kept, whole)  # the first call's sums were only part of it
    with pytest.raises(ValueError, match="sums to add to"):
        native.moe(*rest, x, w, INNER, HIDDEN, into=first[:5])
    with pytest.raises(ValueError, match="sums to add to"):
        native.moe(*rest, x, w, INNER, HIDDEN, into=first.double())


def test_moe_refuses_arguments_that_do_not_agree():
    experts, ids, w, x, order, (weights, types, counts, routes) = _moe_case(1, 3, 2)
    with pytest.raises(ValueError):
        native.moe(weights, types, counts, [*routes[:-1], w.numel()], x, w, INNER, HIDDEN)
    with pytest.raises(ValueError):
        native.moe(weights, types, counts, [-1, *routes[1:]], x, w, INNER, HIDDEN)
    with pytest.raises(ValueError):
        native.moe(weights, types, [*counts[:-1], counts[-1] + 1], routes, x, w, INNER, HIDDEN)
    with pytest.raises(ValueError):
        native.moe(weights, types, counts, routes, x, w, INNER, HIDDEN, sum_rows=4)
    assert native.moe(weights, types, counts, routes, x.double(), w, INNER, HIDDEN) is None
    assert native.mlp_types(((QType.Q8_0, (INNER, HIDDEN), 0),) * 3) is None


def test_arguments_it_does_not_take_are_refused():
    parts = random_expert((QType.Q4_1,) * 3)
    assert native.expert_mlp(parts, torch.randn(2, HIDDEN + 32)) is None  # wrong width
    assert native.expert_mlp(parts, torch.randn(2, HIDDEN, dtype=torch.float64)) is None
    swapped = (parts[0], parts[1], (parts[2][0], QType.Q4_1, (INNER, HIDDEN)))
    assert native.expert_mlp(swapped, torch.randn(2, HIDDEN)) is None
    raw = random_blocks(QType.Q4_1, 64, HIDDEN, seed=0)
    assert native.linear(raw, QType.Q8_0, (64, HIDDEN), torch.randn(1, HIDDEN)) is None
    assert native.linear(raw, QType.Q4_1, (65, HIDDEN), torch.randn(1, HIDDEN)) is None
    assert native.linear(raw, QType.Q4_1, (64, HIDDEN), torch.randn(0, HIDDEN)).shape == (0, 64)


def test_a_build_is_reused_and_a_failed_one_leaves_the_graphs(tmp_path, monkeypatch):
    first = native.build(tmp_path)
    (built,) = tmp_path.glob("native_q4-*.so")
    stamp = built.stat().st_mtime_ns
    native.build(tmp_path)
    assert built.stat().st_mtime_ns == stamp and len(list(tmp_path.glob("*"))) == 1
    assert first is not None

    # No compiler: library() says so once and the graphs (or dequantizing) take over.
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("BEVY_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    assert native.library() is None and not native.available()
    parts = random_expert((QType.Q4_1,) * 3)
    x = torch.randn(1, HIDDEN)
    assert native.expert_mlp(parts, x) is None
    assert qmatmul.expert_mlp(parts, x) is not None  # the compiled graphs
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("BEVY_NATIVE", "0")
    monkeypatch.delenv("CC")
    assert native.library() is None


def test_every_source_and_header_goes_into_the_build(tmp_path):
    """The library is built from all of the package's C files, and its cache key changes
    with any of them, headers included, so an edit to one is never served a stale build.
    Another tree's kernels: a directory's ``*.c`` and ``*.h``, or one C file alone."""
    srcs, headers = native.sources()
    others = set(native.NOT_KERNELS)  # the link's loop: a library of its own
    assert {p.name for p in srcs} == {p.name for p in native.HERE.glob("*.c")} - others
    assert {p.name for p in headers} == {p.name for p in native.HERE.glob("*.h")} - others
    for p in (*srcs, *headers, *(native.HERE / n for n in others)):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    copied = native.sources(tmp_path)
    assert [p.name for p in copied[0]] == sorted(p.name for p in srcs)
    files = [*copied[0], *copied[1]]
    key = native.build_key(files, native.FLAGS, "cc")
    for p in files:
        before = p.read_bytes()
        p.write_bytes(before + b"\n")
        assert native.build_key(files, native.FLAGS, "cc") != key, p.name
        p.write_bytes(before)
    assert native.build_key(files, native.FLAGS, "cc") == key
    one = tmp_path / "old.c"
    one.write_text("int x;\n")
    assert native.sources(one) == ([one], [])
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="no C sources"):
        native.sources(tmp_path / "empty")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_q8_linear_equals_dequantize_then_matmul(lib, monkeypatch, rows: int):
    """Q8_0 weights (the LM head): within 1e-5 of dequantize-then-matmul, and each row the
    same alone as in its batch (more than 8 rows take several passes)."""
    monkeypatch.setattr(native, "_lib", lib)
    n = 291
    raw = random_blocks(QType.Q8_0, n, HIDDEN, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    got = native.linear(raw, QType.Q8_0, (n, HIDDEN), x)
    ref = F.linear(x, dequantize(raw, QType.Q8_0, (n, HIDDEN)))
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for lo, hi in ((0, 1), (rows - 1, rows), (1, rows)):
        assert torch.equal(native.linear(raw, QType.Q8_0, (n, HIDDEN), x[lo:hi]), got[lo:hi])
    # Bytes that do not hold such a weight, or rows of another width: not taken.
    assert native.linear(raw[:-1], QType.Q8_0, (n, HIDDEN), x) is None
    assert native.linear(raw, QType.Q8_0, (n, HIDDEN), torch.randn(1, HIDDEN + 32)) is None


def _attention_ref(q, caches, lens, k, v, scale):
    """Float64 softmax attention of each row's query heads over its cache plus its new
    key and value, rounded to the cache's dtype as it stores them (query head h reads kv
    head h // (H / G))."""
    T, H, dh = q.shape
    G = k.shape[1]
    outs = []
    for r in range(T):
        kv = caches[r][0].dtype
        kk = torch.cat([caches[r][0][:, : lens[r]], k[r][:, None].to(kv)], 1).double()
        vv = torch.cat([caches[r][1][:, : lens[r]], v[r][:, None].to(kv)], 1).double()
        kk, vv = kk.repeat_interleave(H // G, 0), vv.repeat_interleave(H // G, 0)
        att = (torch.einsum("hd,hsd->hs", q[r].double(), kk) * scale).softmax(-1)
        outs.append(torch.einsum("hs,hsd->hd", att, vv).reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dh"), [(9, 3, 64), (4, 4, 128), (16, 2, 32), (32, 4, 64)]
)
def test_attention_equals_softmax_reference(lib, monkeypatch, heads, kv_heads, dh, kv):
    """Decoding attention: rows whose caches end on both sides of the kernel's chunks of
    256 positions (an empty cache too), peaked and flat scores, caches of float32 and of
    float16, one to eight query heads a kv head (more than one of the kernel's passes).
    Within 1e-5 of a float64 reference on the same keys and values; each row's new key
    and value land at its position (in float16 rounded as torch rounds); each row is the
    same bits alone as in its batch, and on one thread as on two."""
    monkeypatch.setattr(native, "_lib", lib)
    gen = torch.Generator().manual_seed(heads * dh)
    lens = [0, 1, 255, 256, 257, 700]
    T = len(lens)
    caches = [
        (
            torch.randn(kv_heads, n + 9, dh, generator=gen).to(kv),
            torch.randn(kv_heads, n + 9, dh, generator=gen).to(kv),
        )
        for n in lens
    ]
    before = [(kb.clone(), vb.clone()) for kb, vb in caches]
    q = torch.randn(T, heads, dh, generator=gen) * torch.tensor([1, 8, 1, 30, 1, 4])[:, None, None]
    k = torch.randn(T, kv_heads, dh, generator=gen)
    v = torch.randn(T, kv_heads, dh, generator=gen)
    scale = dh**-0.5
    got = native.attention(q, k, v, caches, lens, scale)
    ref = _attention_ref(q, before, lens, k, v, scale)
    assert got.shape == (T, heads * dh)
    assert (got.double() - ref).abs().max().item() <= 1e-5
    for r, n in enumerate(lens):
        assert torch.equal(caches[r][0][:, n], k[r].to(kv))
        assert torch.equal(caches[r][1][:, n], v[r].to(kv))
        assert torch.equal(caches[r][0][:, :n], before[r][0][:, :n])  # the rest untouched
        assert torch.equal(caches[r][0][:, n + 1 :], before[r][0][:, n + 1 :])
        alone = native.attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], [caches[r]], [n], scale)
        assert torch.equal(alone[0], got[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = native.attention(q, k, v, caches, lens, scale)
        torch.set_num_threads(1)
        assert torch.equal(native.attention(q, k, v, caches, lens, scale), two)
    finally:
        torch.set_num_threads(threads)


def test_attention_refuses_what_it_does_not_take():
    """Head widths off the kernel's vectors, too many query heads per kv head, a position
    past the buffer, one cache for two rows, values sharing the keys' buffer, other
    dtypes (caches of float64, or of two dtypes): None, buffers untouched."""

    def bufs(dh: int = 64, dtype: torch.dtype = torch.float32) -> list:
        return [
            (torch.zeros(2, 8, dh, dtype=dtype), torch.zeros(2, 8, dh, dtype=dtype))
            for _ in range(2)
        ]

    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    assert native.attention(q, k, v, bufs(), [3, 3], 0.125) is not None
    zeros, narrow, wide = bufs(), bufs(40), bufs(dtype=torch.float64)
    mixed = [bufs()[0], bufs(dtype=torch.float16)[0]]
    q40, k40, v40 = torch.randn(2, 4, 40), torch.randn(2, 2, 40), torch.randn(2, 2, 40)
    shared = torch.zeros(2, 8, 64)
    cases = [
        (q40, k40, v40, narrow, [3, 3]),  # 40 wide: not a multiple of 16
        (torch.randn(2, 34, 64), k, v, zeros, [3, 3]),  # 17 query heads per kv head
        (q, k, v, zeros, [3, 8]),  # position 8 of an 8-position buffer
        (q, k, v, [zeros[0], zeros[0]], [3, 4]),  # two rows, one sequence
        (q, k, v, [(shared, shared), zeros[1]], [3, 3]),  # values over the keys
        (q.double(), k.double(), v.double(), zeros, [3, 3]),
        (q, k, v, zeros[:1], [3, 3]),
        (q, k, v, wide, [3, 3]),
        (q, k, v, mixed, [3, 3]),  # a float32 cache beside a float16 one
    ]
    for args in cases:
        assert native.attention(*args, 0.125) is None
    assert all(not c.any() for pair in [*zeros, *narrow, *wide, *mixed] for c in pair)
    assert not shared.any()


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("tqkv", "to"), [(QType.Q4_1, QType.Q4_0), (QType.Q4_0, QType.Q8_0)])
def test_attention_block_equals_its_ops(lib, monkeypatch, interleaved, tqkv, to, kv):
    """The whole decoding block (norm, q/k/v, RoPE of adjacent pairs or of halves, KV
    write, attention, output projection, residual, then the FFN's norm, router logits and
    top-k routing) against the same steps in torch on dequantized weights, float64
    attention: within 1e-4. Each row alone is the same bits as in its batch."""
    monkeypatch.setattr(native, "_lib", lib)
    H, G, dh, D = 6, 2, 32, 96
    gen = torch.Generator().manual_seed(7)
    wqkv = random_blocks(tqkv, (H + 2 * G) * dh, D, seed=1)
    wo = random_blocks(to, D, H * dh, seed=2)
    norm_w = torch.rand(D, generator=gen) + 0.5
    pos = [0, 5, 300]
    freqs = torch.arange(400).float()[:, None] * (1e4 ** (-torch.arange(0, dh, 2).float() / dh))
    cos, sin = freqs.cos(), freqs.sin()
    caches = [
        (
            torch.randn(G, p + 3, dh, generator=gen).to(kv),
            torch.randn(G, p + 3, dh, generator=gen).to(kv),
        )
        for p in pos
    ]
    before = [(kb.clone(), vb.clone()) for kb, vb in caches]
    h = torch.randn(len(pos), D, generator=gen)

    def weights(ffn=None, topk=None, heads=(H, G, dh)) -> native.BlockWeights:
        return native.BlockWeights(
            norm_w, 1e-5, (wqkv, tqkv), (wo, to), heads, interleaved, ffn, topk
        )

    ffn = (torch.rand(D, generator=gen) + 0.5, torch.randn(5, D, generator=gen))
    blk = weights(ffn, (2, False))
    assert blk.ok
    got, x_got, logits, ids, w = native.attention_block(h, blk, (cos, sin), caches, pos)

    x = norm_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    qkv = F.linear(x, dequantize(wqkv, tqkv, ((H + 2 * G) * dh, D)))
    heads = qkv.view(len(pos), H + 2 * G, dh)
    c, s = cos[pos][:, None], sin[pos][:, None]
    if interleaved:
        x1, x2 = heads[..., 0::2], heads[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    else:
        x1, x2 = heads[..., : dh // 2], heads[..., dh // 2 :]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    q, k, v = rot[:, :H], rot[:, H : H + G], heads[:, H + G :]
    att = _attention_ref(q, before, pos, k, v, dh**-0.5).float()
    ref = h + F.linear(att, dequantize(wo, to, (D, H * dh)))
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    x_ref = ffn[0] * (got * torch.rsqrt(got.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert (x_got - x_ref).abs().max().item() <= 1e-5 * x_ref.abs().max().item()
    assert (logits - x_got @ ffn[1].T).abs().max().item() <= 1e-5 * logits.abs().max().item()
    w_ref, ids_ref = logits.softmax(-1).topk(2, -1)
    assert torch.equal(ids, ids_ref) and ids.dtype == torch.int64
    assert (w - w_ref).abs().max().item() <= 1e-6
    for r, p in enumerate(pos):
        # In float16 within a float16 step (2^-10 of the largest) of torch's key and value.
        for stored, want in ((caches[r][0][:, p], k[r]), (caches[r][1][:, p], v[r])):
            bound = 1e-5 if kv == torch.float32 else 2**-10 * want.abs().max().item()
            assert (stored.float() - want).abs().max().item() <= bound
        alone = native.attention_block(h[r : r + 1], blk, (cos, sin), [caches[r]], [p])
        for a, b in zip(alone, (got, x_got, logits, ids, w), strict=True):
            assert torch.equal(a[0], b[r])
    # Normalized top-k weights (sum 1), and of equal logits the lower expert first: a
    # router whose rows 1 and 3 are the same, and larger than the rest.
    tied = ffn[1].clone()
    tied[1] = tied[3] = tied[1].abs() * 0.5 * x_got[0].sign()
    *_, t_logits, t_ids, t_w = native.attention_block(
        h[:1], weights((ffn[0], tied), (3, True)), (cos, sin), [caches[0]], [pos[0]]
    )
    assert t_ids[0, :2].tolist() == [1, 3]
    top = t_logits.softmax(-1).topk(3, -1)
    assert torch.equal(t_ids[0, 2], top.indices[0, 2])
    assert (t_w - top.values / top.values.sum(-1, keepdim=True)).abs().max().item() <= 1e-6
    # Without the FFN's weights: the block alone, the same bits. A router the kernel does
    # not take (float64): the norm still, no logits and no routing.
    plain = native.attention_block(h, weights(), (cos, sin), caches, pos)
    assert torch.equal(plain[0], got) and plain[1:] == (None,) * 4
    wide = native.attention_block(
        h, weights((ffn[0], ffn[1].double()), (2, False)), (cos, sin), caches, pos
    )
    assert torch.equal(wide[1], x_got) and wide[2:] == (None,) * 3
    # A table too short for a position, or weights of another shape: not taken.
    assert native.attention_block(h, blk, (cos[:100], sin[:100]), caches, pos) is None
    assert not weights(heads=(H, G, 2 * dh)).ok
    assert native.attention_block(h, weights(heads=(H, G, 2 * dh)), (cos, sin), caches, pos) is None
