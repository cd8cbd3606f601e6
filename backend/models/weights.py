"""Where a model's weights live: dense tensors by canonical name, routed experts by (layer, expert).

Canonical names follow GGUF (``token_embd``, ``blk.3.attn_q``, ``blk.3.attn_q.bias``, ...);
each family maps its Hugging Face names onto them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch

from backend.formats.tensors import MappedFiles, TensorRef

# One expert's dequantized weights: gate [I, D], up [I, D], down [D, I].
ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ExpertRef:
    """A routed expert: a separately fetchable unit of three byte ranges in the model file."""

    layer: int
    expert: int
    gate: TensorRef
    up: TensorRef
    down: TensorRef

    @property
    def parts(self) -> tuple[TensorRef, TensorRef, TensorRef]:
        return (self.gate, self.up, self.down)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


class DenseWeights(MutableMapping[str, torch.Tensor]):
    """The dense tensors by canonical name. A weight that a few-row kernel already reads
    from its stored blocks (``FusedWeight``) may be held in those blocks alone
    (``keep_blocks``): reading it (a prompt's BLAS product, a fallback) decodes a float32
    copy for that call, the values the loader would otherwise have kept. That spares the
    float copy: 4 bytes a value where Q4_1 holds 0.625 and Q8_0 1.06 (the demo's embedding
    and attention, 0.2 GiB). Decoding reads none of them this way: tests count it."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        # name -> a tensor, or (blocks, qtype, shape) of a weight held in its blocks
        self._d: dict[str, torch.Tensor | tuple] = dict(tensors or {})
        self.decoded = 0  # weights decoded from blocks so far (a counter for tests)

    def keep_blocks(self, name: str, raw: torch.Tensor, qtype, shape: tuple[int, int]) -> None:
        """Hold ``name`` as its blocks ``raw`` (which must decode to the tensor held now)."""
        self._d[name] = (raw, qtype, tuple(shape))

    def in_blocks(self, name: str) -> bool:
        return isinstance(self._d.get(name), tuple)

    def blocks(self, name: str) -> tuple:
        """(blocks, qtype, shape) of a weight held in blocks."""
        v = self._d[name]
        if not isinstance(v, tuple):
            raise KeyError(f"{name} is not held in blocks")
        return v

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._d[name]
        if not isinstance(v, tuple):
            return v
        from backend.kernels.quants import dequantize

        self.decoded += 1
        raw, qtype, shape = v
        return dequantize(raw, qtype, shape)

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a 2-D weight (an embedding lookup): of one held in blocks only
        those rows are decoded (each row is whole blocks, decoded as in the whole)."""
        v = self._d[name]
        if not isinstance(v, tuple):
            return v[ids]
        from backend.kernels.quants import dequantize

        raw, qtype, (n, k) = v
        picked = raw.view(n, -1)[ids.reshape(-1)]
        return dequantize(picked, qtype, (picked.shape[0], k)).view(*ids.shape, k)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._d[name] = value

    def __delitem__(self, name: str) -> None:
        del self._d[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, name: object) -> bool:
        return name in self._d

    def held(self) -> list[torch.Tensor]:
        """What it holds: tensors, and the blocks of weights held in blocks."""
        return [v[0] if isinstance(v, tuple) else v for v in self._d.values()]


Layout = tuple[int, int, int]  # byte offsets of gate, up, down inside an expert's buffer


def packed_layout(ref: ExpertRef) -> Layout:
    """Gate, up, down back to back."""
    return 0, ref.gate.nbytes, ref.gate.nbytes + ref.up.nbytes


def dequantize_slot(
    slot_row: torch.Tensor, ref: ExpertRef, layout: Layout, dtype: torch.dtype = torch.float32
) -> ExpertWeights:
    """Gate, up, down of ``ref`` decoded from a buffer filled with ``layout``, on its device.

    Like ``dequantize``, float-typed parts already in ``dtype`` may be views of the buffer:
    use them only while the buffer (a pinned cache slot) keeps its contents.
    """
    from backend.kernels.quants import dequantize

    flat = slot_row.reshape(-1)
    out = [
        dequantize(flat[o : o + p.nbytes], p.qtype, p.shape, dtype)
        for p, o in zip(ref.parts, layout, strict=True)
    ]
    return out[0], out[1], out[2]


class StoredExpert:
    """An expert applied straight from its stored bytes (the block types of
    ``native.EXPERT_TYPES``) by the native kernel (``native.expert_mlp``, what the
    engine's native backend runs), for up to ``native.EXPERT_MAX_ROWS`` rows unless the
    kernel takes any (``native.any_rows``, the engine's rule); more rows (a prompt) go
    through its dequantized weights, where BLAS is the faster product.
    ``Transformer.moe`` calls it on its rows."""

    def __init__(self, parts: tuple, dequantized, act: str = "silu") -> None:
        self.parts = parts  # ((raw bytes, qtype, shape) of gate, up, down)
        self._dequantized = dequantized  # () -> ExpertWeights
        self.act = act

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """down(act(gate(x)) * up(x)) by the kernel; None past its rows (the caller then
        multiplies ``weights()``)."""
        from backend.kernels import native

        if x.shape[0] > native.EXPERT_MAX_ROWS and not native.any_rows(q for _, q, _ in self.parts):
            return None
        return native.expert_mlp(self.parts, x, self.act)

    def weights(self) -> ExpertWeights:
        return self._dequantized()


class ResidentExperts:
    """All experts readable from memory-mapped files.

    The plain (non-offloading) path. With ``native`` (where the C kernels build, on the
    CPU in float32), experts in the kernels' block types (``native.EXPERT_TYPES``) are
    applied from their mapped bytes (``StoredExpert``), as the engine applies them; others are dequantized on use and kept
    in an LRU bounded by ``budget_bytes``, because dequantizing every expert on every token
    dominates otherwise.
    """

    def __init__(
        self,
        files: MappedFiles,
        experts: list[list[ExpertRef]],
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int,
        native: bool = False,
        act: str | None = "silu",
    ) -> None:
        self.files = files
        self.experts = experts
        self.dtype = dtype
        self.device = device
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        self._bytes = 0
        # (``act``: the experts' activation where the kernels compute them, else None)
        self._native = (
            native and act is not None and device.type == "cpu" and dtype == torch.float32
        )
        self._act = act
        self._stored: dict[tuple[int, int], StoredExpert | None] = {}

    def stored(self, layer: int, expert: int) -> StoredExpert | None:
        """The expert as a ``StoredExpert`` where the native kernel takes it, else None."""
        key = (layer, expert)
        if not self._native:
            return None
        if key not in self._stored:
            from backend.kernels import native

            ref = self.experts[layer][expert]
            kinds = tuple((p.qtype, tuple(p.shape), p.nbytes) for p in ref.parts)
            ok = native.available() and native.mlp_types(kinds, self._act) is not None
            parts = tuple((self.files.bytes_of(p), p.qtype, tuple(p.shape)) for p in ref.parts)
            deq = lambda: self.get(layer, expert)  # noqa: E731
            self._stored[key] = StoredExpert(parts, deq, self._act) if ok else None
        return self._stored[key]

    @property
    def n_cached(self) -> int:
        """Experts held dequantized now."""
        return len(self._lru)

    def for_compute(self, layer: int, expert: int) -> ExpertWeights | StoredExpert:
        """What ``Transformer.moe`` applies: the stored expert where the kernel takes it,
        else its dequantized weights (``get``)."""
        return self.stored(layer, expert) or self.get(layer, expert)

    def raw(self, ref: ExpertRef) -> torch.Tensor:
        return torch.cat([self.files.bytes_of(p) for p in ref.parts])

    def get(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
            return hit
        ref = self.experts[layer][expert]
        weights = dequantize_slot(
            self.raw(ref).to(self.device), ref, packed_layout(ref), self.dtype
        )
        size = sum(w.numel() * w.element_size() for w in weights)
        if size <= self.budget_bytes:
            while self._bytes + size > self.budget_bytes:
                _, old = self._lru.popitem(last=False)
                self._bytes -= sum(w.numel() * w.element_size() for w in old)
            self._lru[key] = weights
            self._bytes += size
        return weights
