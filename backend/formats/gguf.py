"""GGUF reading: metadata as plain Python values and tensors as ``TensorRef``s."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf

from backend.errors import ModelLoadError
from backend.formats.quants import SUPPORTED, QType
from backend.formats.tensors import TensorRef

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


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF header; raise ``ModelLoadError`` naming the file for anything wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(path, "file not found")
    if not is_gguf(path):
        raise ModelLoadError(path, "not a GGUF file (bad magic)")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises many types on corrupt headers
        raise ModelLoadError(path, f"truncated or corrupt GGUF header ({exc})") from None
    metadata: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception as exc:
            raise ModelLoadError(path, f"corrupt metadata value {key!r} ({exc})") from None
    tensors: dict[str, TensorRef] = {}
    for t in reader.tensors:
        qtype = QType(int(t.tensor_type))
        if qtype not in SUPPORTED:
            raise ModelLoadError(
                path,
                f"tensor {t.name} uses unsupported quant type {qtype.name} "
                f"(supported: {', '.join(sorted(q.name for q in SUPPORTED))})",
            )
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(
                path, f"truncated GGUF: tensor {t.name} ends at byte {end}, file has {size}"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorRef(path, int(t.data_offset), int(t.n_bytes), qtype, shape)
    return GGUFFile(path, metadata, tensors)
