"""backend.kernels.quants against gguf-py's numpy dequantizer, the reference we must equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants

from backend.kernels.quants import SUPPORTED, QType, block_shape, dequantize, tensor_nbytes

# Types gguf-py can quantize; random floats round-tripped through it give realistic blocks.
QUANTIZABLE = (QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.MXFP4)
BLOCK_TYPES = (
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
    QType.Q2_K,
    QType.Q3_K,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
    QType.IQ4_NL,
    QType.IQ4_XS,
    QType.MXFP4,
)
# Byte offsets of the f16 scale fields inside one block. Random bytes there could be
# NaN/Inf, which never compare equal, so the tests overwrite them with finite values.
F16_FIELDS: dict[QType, tuple[int, ...]] = {
    QType.Q8_0: (0,),
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
    QType.MXFP4: (),  # its scale is a byte: every value is a finite power of two
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}
# All multiples of 256 so every type can use them; includes a 3-D expert-style stack.
SHAPES = [(256,), (3, 512), (4, 8, 256), (2, 1, 768)]


def _oracle(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """gguf-py's float32 dequantization of the flat bytes ``raw``."""
    values = gguf_quants.dequantize(raw.reshape(*shape[:-1], -1), qtype)
    assert values.dtype == np.float32 and values.shape == shape
    return torch.from_numpy(np.ascontiguousarray(values))


def _random_blocks(qtype: QType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random block bytes (every bit pattern of the quants) with finite random f16 scales."""
    raw = rng.integers(0, 256, tensor_nbytes(qtype, shape), dtype=np.uint8)
    blocks = raw.reshape(-1, block_shape(qtype)[1])
    for offset in F16_FIELDS[qtype]:
        scales = rng.standard_normal(blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def _random_floats(qtype: QType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Bytes of random floats stored as ``qtype`` (only for F32/F16 and QUANTIZABLE)."""
    data = (rng.standard_normal(shape) * 3).astype(np.float32)
    if qtype == QType.F32:
        stored = data
    elif qtype == QType.F16:
        stored = data.astype(np.float16)
    else:
        stored = gguf_quants.quantize(data, qtype)
    return np.ascontiguousarray(stored).view(np.uint8).reshape(-1)


def _check(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> None:
    expected = _oracle(raw, qtype, shape)
    got = dequantize(torch.from_numpy(raw.copy()), qtype, shape)
    assert got.dtype == torch.float32
    assert got.shape == shape
    assert torch.equal(got, expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_random_blocks_match_gguf(qtype: QType, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng([int(qtype), *shape])
    _check(_random_blocks(qtype, shape, rng), qtype, shape)


@pytest.mark.parametrize("shape", [*SHAPES, (5, 96), (1, 32)])
@pytest.mark.parametrize("qtype", (QType.F32, QType.F16, *QUANTIZABLE), ids=lambda q: q.name)
def test_quantized_floats_match_gguf(qtype: QType, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng([100 + int(qtype), *shape])
    _check(_random_floats(qtype, shape, rng), qtype, shape)


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 7)])
@pytest.mark.parametrize("qtype", (QType.F32, QType.F16, QType.BF16), ids=lambda q: q.name)
def test_float_types_take_any_row_length(qtype: QType, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng([200 + int(qtype), *shape])
    _check(_random_floats(qtype, shape, rng), qtype, shape)


def test_zero_element_tensor() -> None:
    got = dequantize(torch.empty(0, dtype=torch.uint8), QType.Q4_K, (0, 256))
    assert got.shape == (0, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda q: q.name)
def test_output_dtype_is_cast_of_float32_result(qtype: QType, dtype: torch.dtype) -> None:
    shape = (4, 8, 256)
    rng = np.random.default_rng([300 + int(qtype)])
    if qtype in F16_FIELDS:
        raw = _random_blocks(qtype, shape, rng)
    else:
        raw = _random_floats(qtype, shape, rng)
    got = dequantize(torch.from_numpy(raw), qtype, shape, dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got, _oracle(raw, qtype, shape).to(dtype))


@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda q: q.name)
def test_raw_may_be_misaligned_and_any_shape(qtype: QType) -> None:
    # A tensor sliced out of a memory-mapped file can start at any byte, and the GGUF
    # reader hands out [rows, row_bytes] arrays; neither may change the result.
    shape = (256,)
    rng = np.random.default_rng([400 + int(qtype)])
    if qtype in F16_FIELDS:
        raw = _random_blocks(qtype, shape, rng)
    else:
        raw = _random_floats(qtype, shape, rng)
    buffer = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buffer[1:] = torch.from_numpy(raw)
    expected = _oracle(raw, qtype, shape)
    assert torch.equal(dequantize(buffer[1:], qtype, shape), expected)
    assert torch.equal(dequantize(buffer[1:].view(1, -1), qtype, shape), expected)


def test_same_dtype_float_input_is_not_copied() -> None:
    raw = torch.arange(12, dtype=torch.float32).view(torch.uint8)
    got = dequantize(raw, QType.F32, (3, 4))
    assert got.data_ptr() == raw.data_ptr()
    assert torch.equal(got, torch.arange(12, dtype=torch.float32).view(3, 4))


def _accelerators() -> list[str]:
    devices = []
    if torch.cuda.is_available():
        devices.append("cuda")
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


@pytest.mark.skipif(not _accelerators(), reason="no CUDA or MPS device")
@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda q: q.name)
def test_accelerator_matches_and_stays_on_device(qtype: QType) -> None:
    shape = (4, 8, 256)
    rng = np.random.default_rng([500 + int(qtype)])
    if qtype in F16_FIELDS:
        raw = _random_blocks(qtype, shape, rng)
    else:
        raw = _random_floats(qtype, shape, rng)
    expected = _oracle(raw, qtype, shape)
    for device in _accelerators():
        got = dequantize(torch.from_numpy(raw).to(device), qtype, shape)
        assert got.device.type == device
        assert torch.equal(got.cpu(), expected)


# --- sizes and errors ------------------------------------------------------------------------


def test_supported_set() -> None:
    assert {QType.F32, QType.F16, QType.BF16, *BLOCK_TYPES} == SUPPORTED


@pytest.mark.parametrize(
    ("qtype", "expected"),
    [
        (QType.F32, (1, 4)),
        (QType.F16, (1, 2)),
        (QType.BF16, (1, 2)),
        (QType.Q8_0, (32, 34)),
        (QType.Q4_0, (32, 18)),
        (QType.Q4_1, (32, 20)),
        (QType.Q4_K, (256, 144)),
        (QType.Q5_K, (256, 176)),
        (QType.Q6_K, (256, 210)),
        (QType.Q5_0, (32, 22)),
        (QType.Q5_1, (32, 24)),
        (QType.IQ4_NL, (32, 18)),
        (QType.IQ4_XS, (256, 136)),
        (QType.MXFP4, (32, 17)),
        (QType.Q2_K, (256, 84)),
        (QType.Q3_K, (256, 110)),
        (QType.IQ3_XXS, (256, 98)),  # sizes are known even for types we cannot decode
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_block_shape(qtype: QType, expected: tuple[int, int]) -> None:
    assert block_shape(qtype) == expected


@pytest.mark.parametrize(
    ("qtype", "shape", "expected"),
    [
        (QType.F32, (3, 5), 60),
        (QType.F16, (7,), 14),
        (QType.BF16, (2, 3, 4), 48),
        (QType.Q8_0, (4, 8, 256), 4 * 8 * 8 * 34),
        (QType.Q4_0, (64,), 2 * 18),
        (QType.Q4_1, (1536, 576), 1536 * 18 * 20),
        (QType.Q4_K, (1536, 2048), 1536 * 8 * 144),
        (QType.Q5_K, (2, 512), 2 * 2 * 176),
        (QType.Q6_K, (256,), 210),
        (QType.Q4_K, (0, 256), 0),
    ],
)
def test_tensor_nbytes(qtype: QType, shape: tuple[int, ...], expected: int) -> None:
    assert tensor_nbytes(qtype, shape) == expected


def test_tensor_nbytes_matches_gguf_byte_shape() -> None:
    for qtype in SUPPORTED:
        shape = (3, 4, 512)
        byte_shape = gguf_quants.quant_shape_to_byte_shape(shape, qtype)
        assert tensor_nbytes(qtype, shape) == int(np.prod(byte_shape))


def test_unsupported_type_is_named() -> None:
    raw = torch.zeros(tensor_nbytes(QType.IQ3_XXS, (256,)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"unsupported quant type IQ3_XXS; supported: F32, F16, "):
        dequantize(raw, QType.IQ3_XXS, (256,))


def test_unknown_type_number() -> None:
    with pytest.raises(ValueError, match="unknown GGML quant type"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 9999, (1,))  # type: ignore[arg-type]


@pytest.mark.parametrize("delta", [-1, 1, -144])
def test_wrong_byte_count(delta: int) -> None:
    raw = torch.zeros(tensor_nbytes(QType.Q4_K, (2, 256)) + delta, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q4_K tensor of shape \(2, 256\) needs 288 bytes"):
        dequantize(raw, QType.Q4_K, (2, 256))


@pytest.mark.parametrize(("qtype", "shape"), [(QType.Q4_K, (2, 100)), (QType.Q8_0, (48,))])
def test_row_not_a_multiple_of_block(qtype: QType, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        tensor_nbytes(qtype, shape)
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        dequantize(torch.zeros(1024, dtype=torch.uint8), qtype, shape)


def test_bad_shapes_and_raw_dtype() -> None:
    with pytest.raises(ValueError, match="at least one dimension"):
        tensor_nbytes(QType.F32, ())
    with pytest.raises(ValueError, match="negative"):
        tensor_nbytes(QType.F32, (-1, 4))
    with pytest.raises(ValueError, match="must be a uint8 tensor"):
        dequantize(torch.zeros(4, dtype=torch.int8), QType.F32, (1,))
    with pytest.raises(ValueError, match="floating-point"):
        dequantize(torch.zeros(4, dtype=torch.uint8), QType.F32, (1,), dtype=torch.int32)
