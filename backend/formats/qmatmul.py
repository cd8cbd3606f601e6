"""A routed expert's MLP computed straight from its quantized blocks (CPU, few rows).

Decoding tokens reach each expert one or two rows at a time. Dequantizing the whole
expert for them (three float32 matrices written and read back, ~10 MB for a demo
expert) costs several times the arithmetic. Here one compiled (Inductor) graph reads the
Q4_1 / Q4_0 blocks and folds each block's scale into a dot product::

    Q4_1: y[m, n] = sum_b (d[n, b] * q[n, b, :]) . x[m, b, :]  +  sum_b m[n, b] * sum(x[m, b, :])
    Q4_0: y[m, n] = sum_b (d[n, b] * (q[n, b, :] - 8)) . x[m, b, :]

The float32 sums run in another order than dequantize-then-matmul, so results agree to
float32 rounding (~1e-6 relative), not bit for bit. Each output row is reduced on its own
(the tests check that a row comes out the same alone and in a batch), so a request's
output does not depend on its batch-mates.

The cost grows with the rows (the blocks are unpacked per row), so callers use it only
up to ``MAX_ROWS`` rows; above that, dequantizing once and calling BLAS is faster. On the
2-core CPU this was measured on, a demo expert took about 0.3 ms (1 row), 0.5 ms (2),
0.8 ms (4) and 1.5 ms (8), against ~2.1 ms to dequantize it and multiply.

Like ``fastquant`` it needs a C++ compiler at run time; ``BEVY_COMPILE=0`` or a failed
compile leaves callers on the dequantizing path.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

log = logging.getLogger(__name__)

MAX_ROWS = 8
# Distinct (block types, shape) graphs per process. They share one code object, and
# Dynamo keeps 8 compiled variants per code object (each kind has a one-row and a
# many-row variant); past that, experts of other kinds take the dequantizing path.
MAX_KINDS = 3
FUSABLE = (QType.Q4_0, QType.Q4_1)

# (raw block bytes, qtype, (rows, cols)) of gate, up, down
Part = tuple[torch.Tensor, QType, tuple[int, int]]


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[..., start : start + 2].contiguous().view(torch.float16).to(torch.float32)[..., 0]


def _linear(x: torch.Tensor, raw: torch.Tensor, q4_1: bool, n: int, k: int) -> torch.Tensor:
    """x [M, k] @ W.T for W [n, k] stored as Q4_1 (20-byte) or Q4_0 (18-byte) blocks."""
    nb = k // 32
    b = raw.view(n, nb, 20 if q4_1 else 18)
    qs = b[..., 4:] if q4_1 else b[..., 2:]  # [n, nb, 16]: low nibbles 0..15, high 16..31
    lo, hi = (qs & 0x0F).to(torch.float32), (qs >> 4).to(torch.float32)
    if not q4_1:
        lo, hi = lo - 8.0, hi - 8.0
    d = _f16(b, 0)[..., None]  # [n, nb, 1]
    xb = x.view(x.shape[0], 1, nb, 2, 16)
    # One reduction over all of k (blocks x values): no horizontal sum per block.
    y = ((lo * d)[None] * xb[:, :, :, 0] + (hi * d)[None] * xb[:, :, :, 1]).sum((-1, -2))
    if q4_1:
        y = y + (_f16(b, 2)[None] * xb.sum((-1, -2))).sum(-1)
    return y  # [M, n]


def _mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    kinds: tuple[bool, bool, bool],
    inner: int,
    hidden: int,
) -> torch.Tensor:
    g = _linear(x, gate, kinds[0], inner, hidden)
    u = _linear(x, up, kinds[1], inner, hidden)
    return _linear(F.silu(g) * u, down, kinds[2], hidden, inner)


class _Fused:
    """One compiled graph per (block types, shape); rows are the only dynamic size.

    The graph runs under a C++ wrapper, which releases the GIL while it computes: the
    link thread then never waits for a kernel to finish before it can start the next read.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fns: dict[tuple, object] = {}
        self.failed = os.environ.get("BEVY_COMPILE", "1") == "0"

    def usable(self, parts: tuple[Part, Part, Part], x: torch.Tensor) -> bool:
        if self.failed or x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        (_, qg, (inner, hidden)), (_, qu, su), (_, qd, sd) = parts
        return (
            qg in FUSABLE
            and qu in FUSABLE
            and qd in FUSABLE
            and su == (inner, hidden)
            and sd == (hidden, inner)
            and hidden % 32 == 0
            and inner % 32 == 0
            and x.shape[-1] == hidden
            and x.dim() == 2
            and x.is_contiguous()
            and all(
                raw.dtype == torch.uint8
                and raw.is_contiguous()
                and raw.numel() == rows * cols // 32 * (20 if q == QType.Q4_1 else 18)
                for raw, q, (rows, cols) in parts
            )
        )

    def _compiled(self, key: tuple):
        fn = self.fns.get(key)
        if fn is None:
            with self.lock:
                fn = self.fns.get(key)
                if fn is None:
                    if len(self.fns) >= MAX_KINDS:
                        return None
                    kinds, inner, hidden = key

                    def mlp(x, gate, up, down):
                        return _mlp(x, gate, up, down, kinds, inner, hidden)

                    fn = self.fns[key] = torch.compile(
                        mlp, dynamic=True, options={"cpp_wrapper": True}
                    )
        return fn

    def __call__(self, parts: tuple[Part, Part, Part], x: torch.Tensor) -> torch.Tensor | None:
        if not self.usable(parts, x):
            return None
        (g, qg, (inner, hidden)), (u, qu, _), (d, qd, _) = parts
        key = ((qg == QType.Q4_1, qu == QType.Q4_1, qd == QType.Q4_1), inner, hidden)
        try:
            fn = self._compiled(key)
            return None if fn is None else fn(x, g, u, d)
        except Exception as exc:  # no C++ compiler, an Inductor limitation: dequantize instead
            self.failed = True
            log.warning("fused quantized expert MLP unavailable, dequantizing: %s", exc)
            return None


_FUSED = _Fused()


def expert_mlp(parts: tuple[Part, Part, Part], x: torch.Tensor) -> torch.Tensor | None:
    """down(silu(gate(x)) * up(x)) from quantized blocks, or None where the caller must
    dequantize (a block type without a fused kernel, too many rows, no compiler)."""
    if x.shape[0] > MAX_ROWS:
        return None
    return _FUSED(parts, x)


@torch.inference_mode()
def warm_up(parts: tuple[Part, Part, Part]) -> bool:
    """Compile ahead, in inference mode as the engine runs (one row and several rows
    specialize separately), so no request waits for it. True if ready."""
    hidden = parts[0][2][1]
    return all(expert_mlp(parts, torch.zeros(rows, hidden)) is not None for rows in (1, 2))
