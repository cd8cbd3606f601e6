"""Hugging Face model folders: config.json plus single or sharded *.safetensors.

The safetensors header is parsed directly (8-byte length + JSON), so each tensor becomes
a ``TensorRef`` with an absolute byte range, like GGUF tensors.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from backend.errors import ModelLoadError
from backend.formats.tensors import TensorRef
from backend.kernels.quants import QType

_DTYPES = {"F32": QType.F32, "F16": QType.F16, "BF16": QType.BF16}


@dataclass
class HFFolder:
    path: Path
    config: dict
    tensors: dict[str, TensorRef]


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists()


def _read_header(file: Path) -> dict[str, TensorRef]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(file, "truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ModelLoadError(file, "corrupt safetensors header length")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(file, f"corrupt safetensors header ({exc})") from None
    base = 8 + n
    refs: dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or "data_offsets" not in info or "shape" not in info:
            raise ModelLoadError(file, f"corrupt safetensors header entry for {name}")
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelLoadError(
                file,
                f"tensor {name} has unsupported dtype {info.get('dtype')} (supported: F32, F16, BF16)",
            )
        start, end = info["data_offsets"]
        if base + end > size:
            raise ModelLoadError(
                file, f"truncated safetensors file: tensor {name} ends past the end of the file"
            )
        try:
            refs[name] = TensorRef(file, base + start, end - start, dtype, tuple(info["shape"]))
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(file, f"tensor {name}: {exc}") from None
    return refs


def read_hf_folder(path: str | Path) -> HFFolder:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(path, "folder not found")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(path, "not a model folder (no config.json)")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(cfg_file, f"invalid JSON ({exc})") from None
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(index, f"invalid shard index ({exc})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = {}
    if not files:
        raise ModelLoadError(path, "no *.safetensors weights in the folder")
    tensors: dict[str, TensorRef] = {}
    for name in files:
        file = path / name
        if not file.exists():
            raise ModelLoadError(
                path, f"missing shard {name} (listed in model.safetensors.index.json)"
            )
        tensors.update(_read_header(file))
    missing = [t for t in weight_map if t not in tensors]
    if missing:
        raise ModelLoadError(
            path,
            f"shard index lists {len(missing)} tensors not found in the shards, e.g. {missing[0]}",
        )
    return HFFolder(path, config, tensors)
