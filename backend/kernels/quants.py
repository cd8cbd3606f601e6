"""Vectorized PyTorch dequantizers for the GGUF tensor types Bevy loads.

A quantized GGUF tensor is stored row by row; each row (GGUF ``ne[0]``, the last numpy
dimension) is cut into fixed-size blocks laid out back to back, so the whole tensor is just
``n_blocks x bytes_per_block`` bytes. Block layouts (little-endian, ``f16`` = IEEE half):

* ``Q8_0`` (32 values, 34 bytes): ``d: f16``, ``qs: int8[32]``; ``x = qs * d``.
* ``Q4_0`` (32 values, 18 bytes): ``d: f16``, ``qs: u8[16]``; the low nibbles are values
  0-15 and the high nibbles values 16-31; ``x = (nibble - 8) * d``.
* ``Q4_1`` (32 values, 20 bytes): ``d: f16``, ``m: f16``, ``qs: u8[16]`` as in Q4_0;
  ``x = d * nibble + m``.
* ``Q4_K`` (256 values, 144 bytes): ``d: f16``, ``dmin: f16``, ``scales: u8[12]`` holding
  eight 6-bit scales and eight 6-bit mins, ``qs: u8[128]``. Each 32-byte chunk of ``qs``
  holds two 32-value sub-blocks: low nibbles first, then high nibbles;
  ``x = (d * scale) * q - (dmin * min)``.
* ``Q5_K`` (256 values, 176 bytes): as Q4_K with ``qh: u8[32]`` before ``qs``; bit ``i`` of
  ``qh[l]`` is the fifth bit of value ``l`` of sub-block ``i``.
* ``Q5_0`` (32 values, 22 bytes): ``d: f16``, ``qh: u32`` (bit ``i``: the fifth bit of value
  ``i``), ``qs: u8[16]`` as in Q4_0; ``x = (q - 16) * d``.
* ``Q5_1`` (32 values, 24 bytes): ``d: f16``, ``m: f16``, ``qh``, ``qs`` as Q5_0;
  ``x = d * q + m``.
* ``IQ4_NL`` (32 values, 18 bytes): ``d: f16``, ``qs: u8[16]`` as in Q4_0, each nibble an
  index into a fixed table of 16 non-uniform levels; ``x = d * level``.
* ``IQ4_XS`` (256 values, 136 bytes): ``d: f16``, ``scales_h: u16`` (2 bits per sub-block),
  ``scales_l: u8[4]`` (a nibble per sub-block), ``qs: u8[128]``: eight 32-value sub-blocks
  of 16 bytes (low nibbles, then high) indexing IQ4_NL's levels; a sub-block's scale is
  ``(l | h << 4) - 32`` and ``x = (d * scale) * level``.
* ``MXFP4`` (32 values, 17 bytes): ``e: u8`` (an E8M0 power of two, halved), ``qs: u8[16]``
  as in Q4_0, each nibble an FP4 (E2M1) value, doubled; ``x = 2^(e-128) * value``.
* ``Q2_K`` (256 values, 84 bytes): ``scales: u8[16]`` (low nibble a scale, high nibble a
  min, one pair per 16 values), ``qs: u8[64]``, ``d: f16``, ``dmin: f16``. Each 32-byte
  half of ``qs`` holds four 32-value groups in its bit pairs 0-1, 2-3, 4-5, 6-7;
  ``x = (d * scale) * q - (dmin * min)``.
* ``Q3_K`` (256 values, 110 bytes): ``hmask: u8[32]``, ``qs: u8[64]`` (2-bit values laid
  out as Q2_K's), ``scales: u8[12]`` (sixteen 6-bit scales: low nibbles in bytes 0-7, top
  bit pairs in bytes 8-11), ``d: f16``. Bit ``j`` of ``hmask[l]`` belongs to value
  ``32j + l``; a clear bit lowers the 2-bit value by 4; ``x = (d * (scale - 32)) * q``.
* ``Q6_K`` (256 values, 210 bytes): ``ql: u8[128]``, ``qh: u8[64]``, ``scales: int8[16]``,
  ``d: f16``. Each 128-value half uses 64 bytes of ``ql`` (low nibbles = values 0-63, high
  nibbles = 64-127) and 32 bytes of ``qh`` (bit pair ``2k`` = top bits of values
  ``32k..32k+31``); ``x = (d * scale) * (q - 32)`` with one scale per 16 values.

The results match ``gguf.quants.dequantize`` bit for bit in float32: every product and sum
is done in float32 in the same order as that reference (two separate rounded operations,
never a fused multiply-add), so a model dequantized here behaves exactly like one
dequantized by the gguf package. The work stays on the device of the input bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from backend.kernels import fastquant

__all__ = ["SUPPORTED", "QType", "block_shape", "dequantize", "tensor_nbytes"]

# Listed in the order error messages name them.
_SUPPORTED_ORDER: tuple[QType, ...] = (
    QType.F32,
    QType.F16,
    QType.BF16,
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
SUPPORTED: frozenset[QType] = frozenset(_SUPPORTED_ORDER)

# Plain float types are reinterpreted, not decoded.
_FLOAT_TYPES: dict[QType, torch.dtype] = {
    QType.F32: torch.float32,
    QType.F16: torch.float16,
    QType.BF16: torch.bfloat16,
}


def _as_qtype(qtype: QType | int) -> QType:
    try:
        return QType(qtype)
    except ValueError:
        raise ValueError(f"unknown GGML quant type {qtype!r}") from None


def _unsupported(qtype: QType) -> ValueError:
    names = ", ".join(t.name for t in _SUPPORTED_ORDER)
    return ValueError(f"unsupported quant type {qtype.name}; supported: {names}")


def block_shape(qtype: QType) -> tuple[int, int]:
    """(elements per block, bytes per block) of ``qtype``.

    Works for every type gguf knows, not just ``SUPPORTED``: sizes are a property of the
    file layout, which a loader needs even for tensors it cannot dequantize.
    """
    qtype = _as_qtype(qtype)
    try:
        elems, nbytes = GGML_QUANT_SIZES[qtype]
    except KeyError:
        raise ValueError(f"no block size known for quant type {qtype.name}") from None
    return int(elems), int(nbytes)


def tensor_nbytes(qtype: QType, shape: tuple[int, ...]) -> int:
    """Bytes a ``qtype`` tensor of numpy-order ``shape`` occupies in a GGUF file.

    Raises ``ValueError`` when the shape is empty or negative, or its last dimension (GGUF
    ``ne[0]``, the one blocks run along) is not a multiple of the block size.
    """
    qtype = _as_qtype(qtype)
    shape = tuple(int(n) for n in shape)
    if not shape:
        raise ValueError(f"{qtype.name} tensor shape must have at least one dimension")
    if any(n < 0 for n in shape):
        raise ValueError(f"{qtype.name} tensor shape {shape} has a negative dimension")
    elems, nbytes = block_shape(qtype)
    if shape[-1] % elems != 0:
        raise ValueError(
            f"{qtype.name} tensor shape {shape}: last dimension {shape[-1]} is not a multiple "
            f"of the block size {elems}"
        )
    return math.prod(shape[:-1]) * (shape[-1] // elems) * nbytes


# --- field helpers ---------------------------------------------------------------------------


def _field(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``start:stop`` of every block reinterpreted as ``dtype``: [n_blocks, k].

    The column is copied out first (small next to the values) because a dtype view needs
    the bytes aligned in storage, which a strided column of an arbitrary buffer need not be.
    """
    column = blocks[:, start:stop].clone(memory_format=torch.contiguous_format)
    return column.view(dtype)


def _f16_field(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The f16 values in bytes ``start:stop`` of every block, widened (exactly) to float32."""
    return _field(blocks, start, stop, torch.float16).to(torch.float32)


def _nibbles_as_float(qs: torch.Tensor) -> torch.Tensor:
    """[..., L] bytes -> float32 [..., 2, L]: all low nibbles, then all high nibbles.

    Converting each half straight into its slot of the float32 result skips a uint8
    intermediate; on CPU this measured fastest for the 32-wide K-quant sub-blocks.
    """
    out = torch.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=torch.float32, device=qs.device)
    out.select(-2, 0).copy_(qs & 0x0F)
    out.select(-2, 1).copy_(qs >> 4)
    return out


def _k_factors(blocks: torch.Tensor) -> torch.Tensor:
    """Per-sub-block factors of a Q4_K/Q5_K block: float32 [n_blocks, 2, 8] holding
    ``d * scale`` at ``[:, 0]`` and ``dmin * min`` at ``[:, 1]``, rounded as the reference.

    The 12 packed bytes are three little-endian 32-bit words: word 0 holds scales 0-3
    (low 6 bits of each byte) and the top 2 bits of scales 4-7 (bits 6-7), word 1 the same
    for the mins, word 2 the low 4 bits of scales 4-7 (low nibbles) and mins 4-7 (high
    nibbles). Working on whole words unpacks four bytes per operation; the masks also
    drop any sign bits the int32 shifts bring in. Like every dtype view here this assumes
    a little-endian host, which all platforms PyTorch ships for are.
    """
    words = _field(blocks, 4, 16, torch.int32)
    low = words[:, 0:2] & 0x3F3F3F3F
    top = (words[:, 0:2] >> 2) & 0x30303030
    mixed = words[:, 2:3]
    high = torch.cat([mixed & 0x0F0F0F0F, (mixed >> 4) & 0x0F0F0F0F], dim=1) | top
    # [n, kind, part] words -> [n, kind, 8] bytes: kind 0 = scales, 1 = mins.
    packed = torch.stack([low, high], dim=2).view(torch.uint8)
    d_dmin = _f16_field(blocks, 0, 4).unsqueeze(-1)
    return d_dmin * packed.to(torch.float32)


# --- per-type block decoders: uint8 [n_blocks, block_bytes] -> float32 [n_blocks, ...] ------


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0, 2)
    # Same element size, so the int8 view needs no copy even on a strided slice.
    return blocks[:, 2:].view(torch.int8).to(torch.float32).mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0, 2)
    qs = blocks[:, 2:]
    out = torch.empty((n, 2, 16), dtype=torch.float32, device=blocks.device)
    # Nibbles are 0..15, so recentring them in int8 is exact (the reference does the same)
    # and cheaper than a float32 pass; each half is multiplied straight into its slot.
    torch.mul((qs & 0x0F).view(torch.int8).sub_(8), d, out=out[:, 0])
    torch.mul((qs >> 4).view(torch.int8).sub_(8), d, out=out[:, 1])
    return out.view(n, 32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0, 2)
    m = _f16_field(blocks, 2, 4)
    qs = blocks[:, 4:]
    # Multiplying each nibble half straight into its slot of the result (the uint8 operand
    # widens exactly) measured fastest for these 16-wide halves.
    out = torch.empty((n, 2, 16), dtype=torch.float32, device=blocks.device)
    torch.mul(qs & 0x0F, d, out=out[:, 0])
    torch.mul(qs >> 4, d, out=out[:, 1])
    # Reference order: (d * q) + m, two roundings.
    return out.view(n, 32).add_(m)


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1's ``qh``: bit ``i`` of the 32-bit word at ``start``, as 16 or 0 for each of
    the block's 32 values: uint8 [n_blocks, 32]."""
    qh = _field(blocks, start, start + 4, torch.int32)
    shifts = torch.arange(32, dtype=torch.int32, device=blocks.device).view(1, 32)
    return (((qh >> shifts) & 1) << 4).to(torch.uint8)  # & 1 drops the sign bit's spread


def _five_bit(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """A Q5_0/Q5_1 block's 32 values 0..31: uint8 [n_blocks, 32]."""
    q = _fifth_bits(blocks, qh_at)
    qs = blocks[:, qh_at + 4 :]
    q[:, :16].bitwise_or_(qs & 0x0F)
    q[:, 16:].bitwise_or_(qs >> 4)
    return q


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0, 2)
    # 0..31 fits int8, so recentring there is exact, as the reference does.
    return _five_bit(blocks, 2).view(torch.int8).sub_(16).to(torch.float32).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0, 2)
    m = _f16_field(blocks, 2, 4)
    # Reference order: (d * q) + m, two roundings.
    return _five_bit(blocks, 4).to(torch.float32).mul_(d).add_(m)


# The levels IQ4_NL and IQ4_XS index, and MXFP4's E2M1 values doubled (the halved
# exponent makes up for it), as llama.cpp defines them.
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_FP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _levels(table: tuple[int, ...], qs: torch.Tensor) -> torch.Tensor:
    """[..., L] bytes -> float32 [..., 2, L]: ``table`` at each low nibble, then at each
    high nibble."""
    index = torch.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=torch.int64, device=qs.device)
    index.select(-2, 0).copy_(qs & 0x0F)
    index.select(-2, 1).copy_(qs >> 4)
    return torch.tensor(table, dtype=torch.float32, device=qs.device)[index]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0, 2)
    return _levels(_IQ4_LEVELS, blocks[:, 2:]).view(n, 32).mul_(d)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0, 2)
    high = _field(blocks, 2, 4, torch.int16).to(torch.int32)  # & 3 below drops the sign
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device).view(1, 8)
    low = blocks[:, 4:8]
    low = torch.stack([low & 0x0F, low >> 4], dim=-1).view(n, 8).to(torch.int32)
    scale = (low | (((high >> shifts) & 0x03) << 4)) - 32
    dl = (d * scale.to(torch.float32)).unsqueeze(-1)
    values = _levels(_IQ4_LEVELS, blocks[:, 8:].view(n, 8, 16)).view(n, 8, 32)
    return (dl * values).view(n, 256)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    e = blocks[:, 0:1].to(torch.int32)
    # E8M0, halved, as float32 bits: a normal power of two for e >= 2, below that the
    # subnormals 2^-127 and 2^-128 (ggml_e8m0_to_fp32_half).
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    return _levels(_FP4_VALUES, blocks[:, 1:]).view(n, 32).mul_(d)


def _bit_pairs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's ``qs`` [n, 64] -> its 256 2-bit values as uint8 [n, 16, 16]: each
    32-byte half gives four 32-value groups, from its bit pairs low to high."""
    n = qs.shape[0]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.view(n, 2, 1, 32) >> shifts) & 0x03).view(n, 16, 16)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16_field(blocks, 80, 82), _f16_field(blocks, 82, 84)
    scales = blocks[:, :16]
    dl = (d * (scales & 0x0F).to(torch.float32)).unsqueeze(-1)
    ml = (dmin * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    # Reference order: (d * scale) * q - (dmin * min), two roundings.
    return _bit_pairs(blocks[:, 16:80]).to(torch.float32).mul_(dl).sub_(ml).view(n, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 108, 110)
    low = blocks[:, 96:104].view(n, 1, 8) >> torch.tensor(
        (0, 4), dtype=torch.uint8, device=blocks.device
    ).view(1, 2, 1)
    top = blocks[:, 104:108].view(n, 1, 4) >> torch.arange(
        0, 8, 2, dtype=torch.uint8, device=blocks.device
    ).view(1, 4, 1)
    # Scales are 0..63, so the int8 view is exact and recentring cannot overflow.
    scale = ((low.reshape(n, 16) & 0x0F) | ((top.reshape(n, 16) & 0x03) << 4)).view(torch.int8)
    dl = (d * scale.sub_(32).to(torch.float32)).unsqueeze(-1)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    high = ((blocks[:, :32].view(n, 1, 32) >> shifts) & 1).view(n, 16, 16)
    # A clear hmask bit subtracts 4: q in -4..3, exact in int8.
    q = _bit_pairs(blocks[:, 32:96]).view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)
    return q.to(torch.float32).mul_(dl).view(n, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    factors = _k_factors(blocks).unsqueeze(-1)
    q = _nibbles_as_float(blocks[:, 16:].view(n, 4, 32)).view(n, 8, 32)
    # Reference order: (d * scale) * q - (dmin * min).
    return q.mul_(factors[:, 0]).sub_(factors[:, 1])


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    factors = _k_factors(blocks).unsqueeze(-1)
    qs = blocks[:, 48:].view(n, 4, 32)
    # Sub-block i takes bit i of each qh byte as its fifth bit (worth 16). Sub-blocks
    # 2j and 2j+1 then get the low and high nibbles of qs chunk j OR-ed in below it.
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    q = (((blocks[:, 16:48].unsqueeze(1) >> shifts) & 1) << 4).view(n, 4, 2, 32)
    q[:, :, 0].bitwise_or_(qs & 0x0F)
    q[:, :, 1].bitwise_or_(qs >> 4)
    q = q.view(n, 8, 32).to(torch.float32)
    return q.mul_(factors[:, 0]).sub_(factors[:, 1])


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 208, 210)
    scale = (d * blocks[:, 192:208].view(torch.int8).to(torch.float32)).unsqueeze(-1)
    ql = blocks[:, :128].view(n, 2, 64)
    # Bit pair k of qh byte l holds the top 2 bits of value 32k + l of a 128-value half,
    # so viewed as [half, 2, 64] it lines up with ql's low nibbles (values 0-63 of the
    # half) and high nibbles (values 64-127).
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    q = (((blocks[:, 128:192].view(n, 2, 1, 32) >> shifts) & 0x03) << 4).view(n, 2, 2, 64)
    q[:, :, 0].bitwise_or_(ql & 0x0F)
    q[:, :, 1].bitwise_or_(ql >> 4)
    # Values are 0..63, so the int8 view is exact and recentring cannot overflow.
    q = q.view(torch.int8).sub_(32)
    return q.view(n, 16, 16).to(torch.float32).mul_(scale)


_DECODERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
    QType.MXFP4: _mxfp4,
}


def _reinterpret(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return flat.view(dtype)
    except RuntimeError:
        # The bytes sit at an offset that is not a multiple of the element size.
        return flat.clone().view(dtype)


def dequantize(
    raw: torch.Tensor,
    qtype: QType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode the GGUF bytes ``raw`` of a ``qtype`` tensor into a ``shape`` tensor of ``dtype``.

    ``raw`` is a uint8 tensor of any shape holding exactly ``tensor_nbytes(qtype, shape)``
    bytes; ``shape`` is in numpy (row-major) order. The result lives on ``raw.device``.
    Values are computed in float32 and equal ``gguf.quants.dequantize`` exactly, then cast
    to ``dtype``. For F32/F16/BF16 input already in ``dtype`` the result is a view that shares
    memory with ``raw`` (no copy), so callers must not modify it in place.
    """
    qtype = _as_qtype(qtype)
    if qtype not in SUPPORTED:
        raise _unsupported(qtype)
    if not dtype.is_floating_point:
        raise ValueError(f"output dtype must be a floating-point dtype, got {dtype}")
    if raw.dtype != torch.uint8:
        raise ValueError(f"{qtype.name} raw data must be a uint8 tensor, got {raw.dtype}")
    expected = tensor_nbytes(qtype, shape)
    if raw.numel() != expected:
        raise ValueError(
            f"{qtype.name} tensor of shape {tuple(shape)} needs {expected} bytes, got {raw.numel()}"
        )
    shape = tuple(int(n) for n in shape)
    flat = raw.reshape(-1)

    float_dtype = _FLOAT_TYPES.get(qtype)
    if float_dtype is not None:
        # Widening f16/bf16 to float32 is exact, so casting straight to ``dtype`` rounds
        # once, exactly as casting the float32 reference would.
        return _reinterpret(flat, float_dtype).view(shape).to(dtype)

    _, block_bytes = block_shape(qtype)
    blocks = flat.view(-1, block_bytes)
    values = fastquant.decode(qtype, blocks)
    if values is None:
        values = _DECODERS[qtype](blocks)
    return values.view(shape).to(dtype)
