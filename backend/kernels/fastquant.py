"""Compiled decoders (torch.compile, Inductor) for the block types experts are stored in.

On the CPU, eager dequantization is several passes over memory (mask, shift, widen,
multiply, add), and it dominates compute when experts stay quantized in the cache. Inductor
fuses the passes into one loop that reads the blocks and writes the floats once. The
kernels do the same float32 operations in the same order as the eager decoders in
``quants`` (``d * q`` and ``+ m`` rounded separately), so their results are bit-identical;
the tests compare them with ``torch.equal``.

The kernels run under Inductor's C++ wrapper, which releases the GIL while they run, so
the link thread is not held up by a decode in progress.

Compiling takes seconds per block count and needs a C++ compiler at run time, so it is
used only on the CPU, for tensors of at least ``MIN_BLOCKS`` blocks, for a bounded number
of shapes, and never again after a compile failed; the eager decoders cover everything
else. ``BEVY_COMPILE=0`` turns it off. So do the native kernels, where they build: they
multiply experts and dense weights from their blocks, so a whole weight is decoded only
for a prompt's products past their rows, where an eager decode (about 0.9 ms for a demo
expert's matrix, against 0.27 ms compiled) costs less than Inductor's resident memory
(about 115 MB) and its compiles at start.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as QType

log = logging.getLogger(__name__)

MIN_BLOCKS = 8192  # 262,144 values; one matrix of a demo expert is 27,648 blocks
MAX_SHAPES = 6  # distinct (type, block count) pairs compiled; each costs seconds


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    qs = blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).view(torch.int8) - 8
    return q.to(torch.float32) * _f16(blocks, 0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    qs = blocks[:, 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.float32)
    return q * _f16(blocks, 0) + _f16(blocks, 2)


# Q8_0 is a single widening multiply that eager already does in one pass (compiled was
# slower); the K-quants' scale unpacking is not worth a compile at their sizes.
KERNELS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
}


def _native_kernels() -> bool:
    # (imported here: native imports quants, which imports this module)
    from backend.kernels import native

    return native.available()


class _Compiled:
    """Process-wide compiled kernels; thread-safe (compiles happen under one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fns: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.ready: set[tuple] = set()
        self.failed = os.environ.get("BEVY_COMPILE", "1") == "0"

    def decode(self, qtype: QType, blocks: torch.Tensor) -> torch.Tensor | None:
        """float32 [n_blocks, values per block], or None where the eager decoder must run."""
        if (
            self.failed
            or qtype not in KERNELS
            or blocks.shape[0] < MIN_BLOCKS
            or blocks.device.type != "cpu"
            or _native_kernels()
        ):
            return None
        key = (qtype, tuple(blocks.shape), blocks.stride())
        if key in self.ready:
            return self.fns[qtype](blocks)
        with self.lock:
            if self.failed or (key not in self.ready and len(self.ready) >= MAX_SHAPES):
                return None
            fn = self.fns.get(qtype)
            if fn is None:
                fn = self.fns[qtype] = torch.compile(
                    KERNELS[qtype], dynamic=False, options={"cpp_wrapper": True}
                )
            try:
                out = fn(blocks)
            except Exception as exc:  # no C++ compiler, an Inductor limitation: stay eager
                self.failed = True
                log.warning("compiled dequantization unavailable, using eager: %s", exc)
                return None
            self.ready.add(key)
            return out


_COMPILED = _Compiled()


def decode(qtype: QType, blocks: torch.Tensor) -> torch.Tensor | None:
    return _COMPILED.decode(qtype, blocks)


def warm_up(qtype: QType, n_blocks: int, block_bytes: int) -> bool:
    """Compile ahead for a shape (model load), so no request waits for it. True if ready."""
    return decode(qtype, torch.zeros((n_blocks, block_bytes), dtype=torch.uint8)) is not None
