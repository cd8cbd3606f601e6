"""Byte-addressed tensors: every weight is a (file, offset, length, type, shape) record.

Both GGUF files and safetensors folders are reduced to ``TensorRef``s, so the rest of
the engine reads one kind of thing, and a routed expert is just a few byte ranges that
the expert store can fetch on its own (with O_DIRECT, into a cache slot).
"""

from __future__ import annotations

import mmap
import threading
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.kernels.quants import QType, dequantize, tensor_nbytes


@dataclass(frozen=True)
class TensorRef:
    path: Path
    offset: int  # absolute byte offset in `path`
    nbytes: int
    qtype: QType
    shape: tuple[int, ...]  # row-major; the last dim is GGUF's ne[0]

    def __post_init__(self) -> None:
        if tensor_nbytes(self.qtype, self.shape) != self.nbytes:
            raise ValueError(
                f"{self.shape} {self.qtype.name} needs {tensor_nbytes(self.qtype, self.shape)} bytes, not {self.nbytes}"
            )

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class MappedFiles:
    """Read-only (copy-on-write) memory maps of the model files, opened once each."""

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[mmap.mmap, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def bytes_of(self, ref: TensorRef) -> torch.Tensor:
        """The raw bytes of ``ref`` as a uint8 CPU tensor viewing the map (no copy)."""
        with self._lock:
            entry = self._maps.get(ref.path)
            if entry is None:
                with open(ref.path, "rb") as f:
                    # ACCESS_COPY gives a writable buffer torch accepts; the file is never written.
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                entry = (mm, torch.frombuffer(mm, dtype=torch.uint8))
                self._maps[ref.path] = entry
        return entry[1][ref.offset : ref.offset + ref.nbytes]

    def load(
        self, ref: TensorRef, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        raw = self.bytes_of(ref)
        if ref.qtype in (QType.F32, QType.F16, QType.BF16):
            # Float tensors: view then copy, so the result never aliases the map.
            return dequantize(raw, ref.qtype, ref.shape, dtype).to(device, copy=True)
        return dequantize(raw.to(device), ref.qtype, ref.shape, dtype)

    def release(self) -> None:
        """Drop the pages read so far from this process's resident set (what loading the
        dense weights touched, and copied out): they count against the process until the
        map is gone, and the file stays in the page cache, where the kernel may reclaim
        it. A later read of the map reads the file again; nothing is ever written to it,
        so that reads the same bytes."""
        with self._lock:
            for mm, _ in self._maps.values():
                if hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                    with suppress(OSError):  # (memory locked, say): the pages just stay
                        mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
