"""The compiled decoders equal the eager ones (and the gguf reference) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from backend.kernels import fastquant, native
from backend.kernels.quants import _DECODERS, QType, block_shape, dequantize


def _blocks(qtype: QType, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    _, bb = block_shape(qtype)
    raw = torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)
    n_scales = 2 if qtype == QType.Q4_1 else 1  # d (and m): finite, realistic magnitudes
    scales = (torch.randn((n, n_scales), generator=g) * 0.02).half()
    raw[:, : 2 * n_scales] = scales.view(torch.uint8).view(n, 2 * n_scales)
    return raw


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernels off, as on a machine where they do not build (where they do,
    nothing is compiled: see the next test)."""
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_lib", None)


def test_nothing_is_compiled_where_the_native_kernels_build() -> None:
    if not native.available():
        pytest.skip("no native kernels here")
    blocks = _blocks(QType.Q4_1, fastquant.MIN_BLOCKS, seed=3)
    assert fastquant._Compiled().decode(QType.Q4_1, blocks) is None


@pytest.mark.usefixtures("no_native")
@pytest.mark.parametrize("qtype", sorted(fastquant.KERNELS, key=int))
def test_compiled_equals_eager_and_reference(qtype: QType) -> None:
    blocks = _blocks(qtype, fastquant.MIN_BLOCKS, seed=int(qtype))
    fast = fastquant.decode(qtype, blocks)
    assert fast is not None, "the compiled path did not run (no C++ compiler?)"
    eager = _DECODERS[qtype](blocks).reshape(fast.shape)
    assert torch.equal(fast, eager)
    shape = (fastquant.MIN_BLOCKS // 8, 256)
    ref = gguf_dequantize(blocks.numpy().reshape(-1), qtype).reshape(shape)
    got = dequantize(blocks.reshape(-1), qtype, shape)  # routed through the compiled path
    assert np.array_equal(got.numpy(), ref)


def test_small_tensors_stay_eager() -> None:
    assert fastquant.decode(QType.Q4_1, _blocks(QType.Q4_1, 64, seed=1)) is None


@pytest.mark.usefixtures("no_native")
def test_a_failed_compile_falls_back_to_eager_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_blocks: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no compiler")

    compiled = fastquant._Compiled()
    compiled.failed = False
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    blocks = _blocks(QType.Q4_1, fastquant.MIN_BLOCKS, seed=2)
    assert compiled.decode(QType.Q4_1, blocks) is None
    assert compiled.failed
    assert compiled.decode(QType.Q4_1, blocks) is None
