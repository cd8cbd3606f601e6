"""Few-row kernels for dense weights (decoding, CPU, float32).

CPU BLAS handles products of a few rows with a wide matrix badly, and the float32 copies
of quantized weights read 4-6x more bytes than their blocks. ``FusedWeight`` gives a dense
weight a few-row kernel: weights stored in blocks (attention projections, q/k/v stacked
into one; the LM head) run straight from those blocks on ``backend.kernels.native``'s
kernels where they build, Q4_0 / Q4_1 otherwise on ``qmatmul``'s per-row graphs; other
weights run on their float32 tensor in one pass for all rows. The graphs are traced once
per row bucket and compiled by Inductor like the expert kernels (``qmatmul._Compiled``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from backend.kernels import native
from backend.kernels.qmatmul import FUSABLE, MAX_ROWS, ROW_BUCKETS, _Compiled, _linear, pad_rows
from backend.kernels.quants import QType, block_shape

log = logging.getLogger(__name__)


def block_kernel(qtype: QType) -> bool:
    """Whether a few-row kernel reads a dense weight of ``qtype`` from its stored blocks:
    Q4_0 / Q4_1 always (the native kernel, else a compiled graph), the other types of
    ``native.EXPERT_TYPES`` (Q8_0, the K-quants, IQ4_XS, Q5_0) where the native kernels
    build."""
    return qtype in FUSABLE or (qtype in native.EXPERT_TYPES and native.available())


class FusedWeight:
    """A dense weight [n, k] with kernels for products with few rows (decoding).

    A weight stored in a block type that a kernel reads (``block_kernel``) is kept in its
    blocks: 4-6x fewer bytes to read per product than its float32 copy, which the model
    then need not hold at all (``DenseWeights.keep_blocks``). Other weights use the
    float32 tensor itself: CPU BLAS handles a few rows against a wide matrix badly, and the
    compiled graph reads the matrix once for all rows. Weights of one type and width may
    be stacked along n (q, k, v: one call). Measured costs: ``docs/performance.md``."""

    def __init__(self, data: torch.Tensor, qtype: QType, shape: tuple[int, int]) -> None:
        n, k = shape
        if qtype == QType.F32:
            if data.dtype != torch.float32 or tuple(data.shape) != (n, k):
                raise ValueError(
                    f"expected a float32 [{n}, {k}] tensor, got {data.dtype} {tuple(data.shape)}"
                )
            self.data = data.contiguous()  # the model's own float copy: no extra memory
        else:
            width, block_bytes = block_shape(qtype)
            if not block_kernel(qtype) or k % width:
                raise ValueError(f"no fused kernel for a {qtype.name} weight of shape {shape}")
            if data.dtype != torch.uint8 or data.numel() != n * k // width * block_bytes:
                raise ValueError(
                    f"{data.numel()} bytes do not hold a {qtype.name} weight of shape {shape}"
                )
            data = data if data.dim() == 1 else data.reshape(-1)
            # Own memory (not the file's map, whose pages may be dropped), at an even
            # address: the scales' f16 view needs one. A stacked weight is already a copy.
            self.data = data if data._base is None and data.data_ptr() % 2 == 0 else data.clone()
        self.qtype, self.shape = qtype, (n, k)

    @classmethod
    def stacked(
        cls, parts: list[tuple[torch.Tensor, QType, tuple[int, int]]]
    ) -> FusedWeight | None:
        """Quantized weights of one type and width stacked along n, or None if they differ
        or have no fused kernel."""
        qtypes, widths = {q for _, q, _ in parts}, {s[1] for _, _, s in parts}
        if len(qtypes) != 1 or len(widths) != 1:
            return None
        qtype, k = qtypes.pop(), widths.pop()
        if qtype == QType.F32 or not block_kernel(qtype) or k % block_shape(qtype)[0]:
            return None
        n = sum(s[0] for _, _, s in parts)
        return cls(torch.cat([r.reshape(-1) for r, _, _ in parts]), qtype, (n, k))


def _float_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, k] @ w.T with one reduction per row, which Inductor fuses into one pass over w."""
    return torch.stack([(w * x[i]).sum(-1) for i in range(x.shape[0])])


def _q4_rows(x: torch.Tensor, raw: torch.Tensor, q4_1: bool) -> torch.Tensor:
    """x [M, k] @ W.T for W [n, k] in Q4 blocks (n follows from the byte count)."""
    k = x.shape[1]
    n = raw.numel() // (k // 32 * (20 if q4_1 else 18))
    return _linear(x, raw, q4_1, n, k)


# One kernel per weight type; ``_Compiled`` keeps a graph per shape (weight, row bucket).
_KERNELS = {
    QType.F32: _Compiled(_float_rows),
    QType.Q4_0: _Compiled(lambda x, raw: _q4_rows(x, raw, False)),
    QType.Q4_1: _Compiled(lambda x, raw: _q4_rows(x, raw, True)),
}


# Without the native kernels, dense products with up to this many rows (decoding batches)
# run through the compiled graphs in chunks of ``MAX_ROWS``: a row's result is then the
# same in any such batch. More rows (prefill) go to BLAS, which is faster there.
DENSE_MAX_ROWS = 64


class _Dense:
    """A kernel that fails (no C++ compiler, an Inductor limitation) leaves that kind of
    weight (type, shape) to BLAS; the others keep theirs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.broken: set[tuple] = set()
        self.failed = os.environ.get("BEVY_COMPILE", "1") == "0"

    def __call__(self, w: FusedWeight, x: torch.Tensor) -> torch.Tensor | None:
        if (
            x.dim() != 2
            or x.shape[1] != w.shape[1]
            or x.device.type != "cpu"
            or x.dtype != torch.float32
        ):
            return None
        # The native kernels (where they build) take any number of rows, each alone.
        out = native.linear(w.data, w.qtype, w.shape, x)
        if out is not None or w.qtype not in _KERNELS:
            return out
        if self.failed or x.shape[0] > DENSE_MAX_ROWS:
            return None
        key = (w.qtype, w.shape)
        if key in self.broken:
            return None
        fn = _KERNELS[w.qtype]
        try:
            with torch.inference_mode():
                outs = [
                    fn(pad_rows(x[i : i + MAX_ROWS]), w.data)[: min(MAX_ROWS, x.shape[0] - i)]
                    for i in range(0, x.shape[0], MAX_ROWS)
                ]
                return outs[0] if len(outs) == 1 else torch.cat(outs)
        except Exception as exc:  # no C++ compiler, an Inductor limitation: BLAS instead
            with self.lock:
                first = not self.broken
                self.broken.add(key)
            if first:
                log.warning("compiled dense kernel unavailable, using BLAS: %s", exc)
            return None


_DENSE = _Dense()


def dense_linear(w: FusedWeight, x: torch.Tensor) -> torch.Tensor | None:
    """x [M, k] @ W.T by ``w``'s few-row kernel (the native kernels, any number of rows;
    else the compiled graphs, up to ``DENSE_MAX_ROWS``), or None where the caller must use
    BLAS on the weight's float values (not a float32 CPU tensor, too many rows for the
    graphs, no compiler). Each row is reduced on its own, so a row's result does not
    depend on its batch-mates. (A prompt's rows go to BLAS, ``Transformer.linear``: past
    about 128 rows it beats the native kernels even counting the weight's decoding.)"""
    return _DENSE(w, x)


@torch.inference_mode()
def warm_up_dense(w: FusedWeight) -> bool:
    """Compile every row bucket ``dense_linear`` will take for ``w``. True if ready."""
    return all(dense_linear(w, torch.zeros(m, w.shape[1])) is not None for m in ROW_BUCKETS)


ROWWISE_BLOCK = 1024  # rows of a long prompt ``rowwise`` takes at a time


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (SiLU, sigmoid, softplus) of ``x`` with each element's bits independent of
    the tensor's size. Torch's CPU loops round an element by its vectorized or its scalar
    path, and which elements fall to the scalar tail (and to each thread's) depends on
    how many there are: a row would get other bits batched with other rows. The result
    in float64 rounds to the same float32 either way."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return fn(x)
    if x.dim() < 2 or x.shape[0] <= ROWWISE_BLOCK:
        return fn(x.double()).float()
    # A long prompt a block of rows at a time: its float64 copy stays small.
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], ROWWISE_BLOCK):
        out[i : i + ROWWISE_BLOCK] = fn(x[i : i + ROWWISE_BLOCK].double())
    return out
