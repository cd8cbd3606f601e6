"""Q4_0 / Q4_1 weights packed by 16 rows (``native.pack``) and the kernels that read them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.kernels import native
from backend.kernels.quants import QType, dequantize
from tests.helpers.kernel_builds import VARIANTS, variant
from tests.helpers.qblocks import HIDDEN, INNER, random_blocks, random_expert, rounded_8bit

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no native Q4 kernels here (x86-64 with AVX2 and cc)"
)


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Each build of the kernels that this machine can run (``kernel_builds.VARIANTS``)."""
    return variant(request.param, tmp_path_factory)


def _packed(raw: torch.Tensor, qtype: QType, shape: tuple[int, int]) -> torch.Tensor:
    """A packed copy of ``raw``; every build packs these shapes."""
    out = raw.clone()
    assert native.pack(out, qtype, shape)
    return out


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
def test_packing_reorders_the_bytes_and_unpacking_restores_them(lib, monkeypatch, qtype):
    monkeypatch.setattr(native, "_lib", lib)
    n = 48
    raw = random_blocks(qtype, n, HIDDEN, seed=3)
    packed = _packed(raw, qtype, (n, HIDDEN))
    assert not torch.equal(packed, raw)
    assert torch.equal(packed.sort().values, raw.sort().values)  # the same bytes
    assert torch.equal(native.unpack(packed, qtype, (n, HIDDEN)), raw)


def _layout(raw: torch.Tensor, qtype: QType, n: int, k: int) -> torch.Tensor:
    """The packed layout written out in torch (as ``bevy_q4_pack`` documents it): per
    group of 16 rows and per block, the 16 rows' f16 d, then Q4_1's 16 m, then the quant
    bytes in four runs of 64, run j holding bytes 4j .. 4j + 3 of each row in row order."""
    bs, hs = (20, 4) if qtype == QType.Q4_1 else (18, 2)
    nb = k // 32
    # [group, block, row, byte]
    blocks = raw.view(n // 16, 16, nb, bs).permute(0, 2, 1, 3)
    scales = [blocks[..., 2 * i : 2 * i + 2].reshape(n // 16, nb, 32) for i in range(hs // 2)]
    words = blocks[..., hs:].reshape(n // 16, nb, 16, 4, 4).transpose(2, 3)
    return torch.cat([*scales, words.reshape(n // 16, nb, 256)], dim=-1).reshape(-1)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
@pytest.mark.parametrize("k", [32, HIDDEN, INNER, 576])
def test_packing_gives_the_documented_layout(lib, monkeypatch, qtype, k):
    """Against the layout written out in torch, for rows of one block and more (an odd
    number of them too): the vector moves land every byte where the kernels read it."""
    monkeypatch.setattr(native, "_lib", lib)
    n = 48
    raw = random_blocks(qtype, n, k, seed=k)
    assert torch.equal(_packed(raw, qtype, (n, k)), _layout(raw, qtype, n, k))


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
def test_packing_on_any_number_of_threads_gives_the_same_bytes(lib, monkeypatch, qtype):
    """The groups of 16 rows are shared out on torch's threads: one thread, a split with
    a remainder (5 groups on 2 or 3 threads), and more threads than groups."""
    monkeypatch.setattr(native, "_lib", lib)
    n = 80
    raw = random_blocks(qtype, n, HIDDEN, seed=5)
    threads = torch.get_num_threads()
    got = {}
    try:
        for t in (1, 2, 3, 8):
            torch.set_num_threads(t)
            got[t] = _packed(raw, qtype, (n, HIDDEN))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(p, got[1]) for p in got.values())
    assert torch.equal(native.unpack(got[8], qtype, (n, HIDDEN)), raw)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0])
def test_what_does_not_pack_is_left_as_it_was(lib, monkeypatch, qtype):
    monkeypatch.setattr(native, "_lib", lib)
    n = 40 if qtype == QType.Q4_1 else 48  # 40 rows: not whole groups of 16
    raw = random_blocks(qtype, n, HIDDEN, seed=4)
    kept = raw.clone()
    assert not native.pack(raw, qtype, (n, HIDDEN))
    assert torch.equal(raw, kept)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
# 1-8 rows each take their own compiled case; 9 and 17 take more than one pass of 8
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 9, 17])
def test_packed_linear_is_x_rounded_to_8_bits_times_the_weights_and_batch_free(
    lib, monkeypatch, qtype, rows
):
    """The packed kernels read x rounded to 8 bits per block of 32 (as ggml's CPU kernels
    do): the product is that of x so rounded, to float's error, and far from x's own."""
    monkeypatch.setattr(native, "_lib", lib)
    n = 4160  # over 4096 columns: 128 chunks whose edges fall inside groups unless rounded
    raw = random_blocks(qtype, n, HIDDEN, seed=rows)
    packed = _packed(raw, qtype, (n, HIDDEN))
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    got = native.linear(packed, qtype, (n, HIDDEN), x, packed=True)
    w = dequantize(raw, qtype, (n, HIDDEN))
    ref = F.linear(rounded_8bit(x), w)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    unrounded = (F.linear(x, w) - ref).abs().max().item()
    assert 1e-4 * ref.abs().max().item() < unrounded < 3e-2 * ref.abs().max().item()
    for lo, hi in ((0, 1), (rows - 1, rows), (1, rows)):
        assert torch.equal(
            native.linear(packed, qtype, (n, HIDDEN), x[lo:hi], packed=True), got[lo:hi]
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)  # the columns shared out otherwise
    try:
        assert torch.equal(native.linear(packed, qtype, (n, HIDDEN), x, packed=True), got)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("down", [QType.Q4_0, QType.Q8_0])
def test_packed_expert_mlp_rounds_what_packed_parts_read(lib, monkeypatch, down):
    """An expert with packed Q4_1 gate and up (and a packed Q4_0 down, or a Q8_0 one as
    stored) is the expert on x rounded to 8 bits (and, for a packed down, on its input
    rounded too), and each row is the same alone."""
    monkeypatch.setattr(native, "_lib", lib)
    parts = random_expert((QType.Q4_1, QType.Q4_1, down), seed=9)
    packed = tuple(_packed(raw, q, s) if q != QType.Q8_0 else raw for raw, q, s in parts)
    flags = (True, True, down != QType.Q8_0)
    stored = tuple((p, q, s) for p, (_, q, s) in zip(packed, parts, strict=True))
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    gate, up, dn = (dequantize(raw, q, s) for raw, q, s in parts)
    xr = rounded_8bit(x)
    h = F.silu(F.linear(xr, gate)) * F.linear(xr, up)
    want = F.linear(rounded_8bit(h) if flags[2] else h, dn)
    got = native.expert_mlp(stored, x, "silu", flags)
    assert got.shape == (5, HIDDEN) and INNER % 16 == 0
    # (h from the kernels and from torch may differ in its last bits, and so round to
    # another integer now and then: a looser bound than a single product's)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    for i in range(5):
        assert torch.equal(native.expert_mlp(stored, x[i : i + 1], "silu", flags)[0], got[i])


@pytest.fixture(scope="module", params=["-mno-avx512f", "-mno-avx512vnni"])
def other_build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The library built for AVX2 alone, or AVX-512 without VNNI."""
    if native.library() is None:
        pytest.skip("no native kernels here")
    return native.build(tmp_path_factory.mktemp("isa"), extra_flags=(request.param,))


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
def test_every_instruction_set_gives_the_same_bits(other_build, monkeypatch, qtype):
    """Integer products are exact and each lane's float operations are the same in the
    AVX2, AVX-512 and AVX-512 VNNI kernels, so they agree bit for bit: a slot's tokens
    do not depend on the CPU (without VNNI here, the second build is this one again)."""
    n = 64
    raw = random_blocks(qtype, n, HIDDEN, seed=11)
    packed = _packed(raw, qtype, (n, HIDDEN))
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(11))
    got = native.linear(packed, qtype, (n, HIDDEN), x, packed=True)
    monkeypatch.setattr(native, "_lib", other_build)
    assert torch.equal(native.linear(packed, qtype, (n, HIDDEN), x, packed=True), got)
