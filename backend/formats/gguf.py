"""GGUF reading: metadata as plain Python values and tensors as ``TensorRef``s."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backend.errors import ModelLoadError
from backend.formats.tensors import TensorRef
from backend.kernels.quants import SUPPORTED, QType, tensor_nbytes

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, object]
    tensors: dict[str, TensorRef]

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: object = None) -> object:
        """``key`` under the architecture prefix: get("block_count") -> "<arch>.block_count"."""
        return self.metadata.get(f"{self.arch}.{key}", default)


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NP = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Sequential little-endian reads over a memory map, with bounds checks."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> object:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise EOFError(f"header ends early at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise EOFError(f"string runs past the end of the file at byte {self.pos}")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if item in _NP:
                width = np.dtype(_NP[item]).itemsize
                if self.pos + n * width > len(self.buf):
                    raise EOFError(f"array runs past the end of the file at byte {self.pos}")
                arr = np.frombuffer(self.buf, dtype=_NP[item], count=n, offset=self.pos)
                self.pos += n * width
                return arr.tolist()
            return [self.value(item) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype} at byte {self.pos}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF header; raise ``ModelLoadError`` naming the file for anything wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(path, "file not found")
    if not is_gguf(path):
        raise ModelLoadError(path, "not a GGUF file (bad magic)")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ModelLoadError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
        align = metadata.get("general.alignment", 32)
        if type(align) is not int or align <= 0:
            raise ValueError(f"general.alignment must be a positive integer, got {align!r}")
        data_start = -(-cur.pos // align) * align
    except (EOFError, ValueError, struct.error) as exc:
        raise ModelLoadError(path, f"truncated or corrupt GGUF header ({exc})") from None
    finally:
        buf.close()
    size = path.stat().st_size
    tensors: dict[str, TensorRef] = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = QType(type_id)
        except ValueError:
            raise ModelLoadError(path, f"tensor {name} has unknown type id {type_id}") from None
        if qtype not in SUPPORTED:
            supported = ", ".join(q.name for q in sorted(SUPPORTED))
            raise ModelLoadError(
                path,
                f"tensor {name} uses unsupported quant type {qtype.name} (supported: {supported})",
            )
        shape = tuple(int(d) for d in reversed(dims))
        try:
            nbytes = tensor_nbytes(qtype, shape)
        except ValueError as exc:
            raise ModelLoadError(path, f"tensor {name}: {exc}") from None
        start = data_start + offset
        if start + nbytes > size:
            raise ModelLoadError(
                path,
                f"truncated GGUF: tensor {name} ends at byte {start + nbytes}, the file has {size}",
            )
        tensors[name] = TensorRef(path, start, nbytes, qtype, shape)
    return GGUFFile(path, metadata, tensors)
